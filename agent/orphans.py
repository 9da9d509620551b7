"""The node agent's replay of spools that exited ranks left behind.

A rank that exits while the collector is away leaves its last batches (the FINISHED heartbeat
among them) in `<progress_dir>/<job>/<rank>.spool`. Once per agent flush this finds those
folders, claims the ones whose owner is gone (`spool.Spool.claim`: the owner's flock is free and
its pid has exited), and sends their batches through the agent's own `shipping.Sender`, oldest
first, until each is empty; then the folder is removed (kept while it holds quarantined
batches). A claimed spool stays locked by this agent until then, so no other agent replays it;
an agent that dies mid-replay frees it for the next one. Delivery is at least once: the
collector dedupes batch ids.

Runs on the agent's flusher thread; never touches a spool whose owner is alive.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vigil.agent import config, shipping, spool

log = logging.getLogger(__name__)


class OrphanSpools:
    def __init__(
        self,
        progress_dir: Path,
        *,
        cfg: config.ShipperConfig,
        sender: shipping.Sender,
        skip: Path | None = None,
        proc_root: Path = spool.PROC_ROOT,
    ) -> None:
        self.progress_dir = Path(progress_dir)
        self._cfg = cfg
        self._sender = sender
        self._skip = skip
        self._proc_root = proc_root
        self._claimed: dict[Path, shipping.Shipper] = {}
        self.replayed_spools = 0

    def tick(self) -> None:
        """Claim new orphans, then replay each claimed spool until the collector stops taking."""
        self._claim_new()
        for path, shipper in list(self._claimed.items()):
            if not shipper.replay():
                return  # the collector is away: the next tick tries again
            if len(shipper.spool) == 0:
                del self._claimed[path]
                shipper.spool.close_and_remove_if_empty()
                shipper.close()
                self.replayed_spools += 1
                log.info("replayed the spool %s of an exited process", path)

    def _claim_new(self) -> None:
        for path in spool.candidates(self.progress_dir):
            if path in self._claimed or path == self._skip:
                continue
            try:
                claimed = spool.Spool.claim(
                    path,
                    max_bytes=self._cfg.spool_max_bytes,
                    max_quarantined=self._cfg.max_quarantined_batches,
                    proc_root=self._proc_root,
                )
            except OSError as exc:
                log.debug("cannot claim spool %s: %s", path, exc)
                continue
            if claimed is None:
                continue
            if len(claimed) == 0:
                claimed.close_and_remove_if_empty()
                continue
            owner = claimed.previous_owner
            log.info(
                "replaying %d batches (%d bytes) that pid %d left in %s",
                len(claimed),
                claimed.size_bytes(),
                owner.pid if owner else -1,
                path,
            )
            self._claimed[path] = shipping.Shipper(self._cfg, sender=self._sender, spooled=claimed)

    @property
    def pending_batches(self) -> int:
        return sum(len(s.spool) for s in self._claimed.values())

    def close(self) -> None:
        """Release the claimed spools (what is left in them waits for the next agent)."""
        for shipper in self._claimed.values():
            shipper.close()
        self._claimed.clear()
