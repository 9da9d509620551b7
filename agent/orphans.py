"""The node agent's replay of spools that exited ranks (and `vigil diag` runs) left behind.

A rank that exits while the collector is away leaves its last batches (the FINISHED heartbeat
among them) in `<progress_dir>/<job>/<run>/<rank>.spool` (its run folder stays until they are
sent: `rundir.py`); a `vigil diag` run leaves its results in
`vigil.spool.diag_dir(data_dir)`. Once per agent flush `OrphanSpools` lists those folders (and
the siblings a sender falls back to while its folder is claimed) and hands them to the core's
`outbox.Orphans`, which claims the ones whose owner is gone and sends their batches through the
agent's own sender, oldest first, until each is empty; then the folder is removed (kept while it
holds quarantined batches). A claimed spool stays locked by this agent until then, so no other
agent (or diag run) replays it; an agent that dies mid-replay frees it for the next one.

Runs on the agent's flusher thread; never touches a spool whose owner is alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vigil import outbox, sender, spool


def rank_spools(progress_dir: Path) -> list[Path]:
    """The ranks' spool folders under the progress root (`<root>/<job>/<run>/<rank>.spool`)."""
    root = Path(progress_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"*/*/*{spool.SPOOL_SUFFIX}") if p.is_dir())


class OrphanSpools(outbox.Orphans):
    def __init__(
        self,
        progress_dir: Path,
        *,
        cfg: sender.SenderConfig,
        sender: sender.Sender,
        skip: Path | None = None,
        replay_dirs: Sequence[Path] = (),
        proc_root: Path = spool.PROC_ROOT,
    ) -> None:
        self.progress_dir = Path(progress_dir)
        self.replay_dirs = tuple(Path(p) for p in replay_dirs)
        super().__init__(self._find, cfg=cfg, shared_sender=sender, skip=skip, proc_root=proc_root)

    def _find(self) -> list[Path]:
        found = rank_spools(self.progress_dir)
        for directory in self.replay_dirs:
            found += spool.siblings(directory)
        return found
