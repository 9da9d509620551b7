"""The node agent: one per host, beside the training processes.

Each poll it reads every local rank's progress page (`<progress_dir>/<job>/<run>/`), feeds the
watchdog (a rank's process is gone once the lock it holds on its rank's file is free:
`rundir.page_alive`, valid across PID namespaces), and on a suspected hang collects the rank's
stacks (py-spy, faulthandler fallback; only for a pid it can see) and collective ring buffer and
ships them as evidence (a `hang` Finding whose evidence note holds the stacks, the ring's
CollectiveEvents and a Heartbeat); the stacks are also saved with the run they came from
(`stacks_dir`). It removes run folders whose processes are gone after `page_ttl_s`
(`rundir.expire`). Each sample interval it samples NVML (or the host) and queues
`Sample` records attributed to the rank using each device. It serves Prometheus /metrics and ships
through the same queue/flusher/shipper as the SDK (spooling while the collector is away); on the
flusher thread it also replays the spools exited ranks and `vigil diag` runs left behind
(`orphans.py`). With a collector it also delivers the control requests posted there for its
ranks into their pages and reports their acknowledgements (`control_poll.py`).

Owns its thread(s), its HTTP server and its output; never writes to a training process except
through the page's control block.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from vigil import api, outbox, schema, sender
from vigil.agent import (
    config,
    control_poll,
    exporter,
    orphans,
    progress,
    relay,
    rundir,
    sampler,
    sinks,
    stacks,
    watchdog,
)

log = logging.getLogger(__name__)
_MAX_STACK_NOTE = 64 * 1024


@dataclasses.dataclass
class _Tracked:
    reader: progress.PageReader
    last: progress.PageSnapshot | None = None
    hung: bool = False
    exit_seen: bool = False
    # The pod its run's manifest names (the SDK's $VIGIL_POD / $POD_NAME), "" when none.
    pod: str = ""


# The pid fallback for pages without a lock file (`rundir.page_alive`); tests replace it.
_alive = rundir.pid_alive


class Agent:
    def __init__(
        self,
        cfg: config.AgentConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        host: sampler.HostSampler | None = None,
        gpus: sampler.NvmlSampler | bool | None = True,
        capture: Callable[..., stacks.Stacks] = stacks.capture,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self._wall = wall_clock
        self._capture = capture
        self.host = host or sampler.HostSampler()
        self.gpus = sampler.open_nvml(enabled=cfg.use_nvml) if gpus is True else gpus or None
        self.watchdog = watchdog.Watchdog(
            hang_factor=cfg.hang_factor,
            min_hang_s=cfg.min_hang_s,
            startup_grace_s=cfg.startup_grace_s,
        )
        self.queue = sinks.RecordQueue(100_000)
        self.shipper: outbox.Outbox | None = None
        self.orphans: orphans.OrphanSpools | None = None
        self.flusher = sinks.Flusher(
            queue=self.queue,
            sink=self._make_sink(),
            interval_s=1.0,
            tick=self._ship_tick,
            on_error=lambda exc: log.warning("agent flush failed: %r", exc),
            name="vigil-agent-ship",
        )
        self._tracked: dict[Path, _Tracked] = {}
        self._readings: list[sampler.Reading] = []
        self._owners: dict[str, sampler.Owner] = {}
        self.hangs_detected = 0
        self.suspects: list[watchdog.HangSuspect] = []
        self.registry = CollectorRegistry()
        self.registry.register(exporter.AgentCollector(self.view))
        self._server: Any = None
        self.relay: relay.RelayServer | None = None  # once started, with a relay_port
        self._stop = threading.Event()
        self.control = self._make_control()

    def _make_sink(self) -> sinks.Sink:
        cfg = self.cfg
        if cfg.collector:
            spool = cfg.spool_dir or cfg.progress_dir / f"agent-{cfg.node}.spool"
            ship_cfg = config.ShipperConfig(
                collector_url=cfg.collector,
                spool_dir=spool,
                token=cfg.token,
                spool_max_bytes=cfg.spool_max_bytes,
                max_server_errors=cfg.max_server_errors,
            )
            self.shipper = outbox.Outbox(ship_cfg, source=f"{cfg.node}/agent")
            if cfg.replay_orphans:
                self.orphans = orphans.OrphanSpools(
                    cfg.progress_dir,
                    cfg=ship_cfg,
                    sender=self.shipper.sender,
                    skip=self.shipper.spool.directory,
                    replay_dirs=cfg.replay_dirs,
                )
            return self.shipper
        out = cfg.output_dir or Path("vigil-output")
        return sinks.JsonlSink(out / "_agent" / f"agent-{cfg.node}.jsonl")

    def _make_control(self) -> control_poll.ControlPoller | None:
        """With a collector: the control requests for this node's ranks (`control_poll`)."""
        if not self.cfg.collector:
            return None
        cfg = sender.SenderConfig(collector_url=self.cfg.collector, token=self.cfg.token)
        return control_poll.ControlPoller(
            cfg=cfg, node=self.cfg.node, pages=self._control_pages, clock=self._clock
        )

    def _control_pages(self) -> list[tuple[str, int, progress.PageReader]]:
        """The live local ranks' pages a control request may go to."""
        return [
            (t.last.job, t.last.rank, t.reader)
            for t in self._tracked.values()
            if t.last is not None and not t.exit_seen
        ]

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> int:
        """Start shipping and the /metrics server; return the bound port."""
        self.flusher.start()
        self._server, _ = start_http_server(
            self.cfg.metrics_port, addr=self.cfg.metrics_host, registry=self.registry
        )
        port = int(self._server.server_port)
        log.info(
            "vigil agent on %s: /metrics at http://%s:%d",
            self.cfg.node,
            self.cfg.metrics_host,
            port,
        )
        if self.cfg.relay_port is not None and self.cfg.collector:
            self.relay = relay.RelayServer(
                self.cfg.collector,
                self.cfg.relay_host,
                self.cfg.relay_port,
                window_s=self.cfg.relay_window_s,
            )
            log.info(
                "vigil agent on %s: relaying to %s at %s%s",
                self.cfg.node,
                self.cfg.collector,
                self.relay.url,
                api.INGEST_PATH,
            )
        return port

    def run(self, stop: threading.Event | None = None) -> None:
        """Poll until `stop` is set."""
        stop = stop or self._stop
        next_sample = 0.0
        while not stop.is_set():
            now = self._clock()
            if now >= next_sample:
                self.sample()
                next_sample = now + self.cfg.sample_interval_s
            self.poll()
            if self.control is not None:
                self.control.tick()
            stop.wait(self.cfg.poll_interval_s)

    def stop(self) -> None:
        """Stop serving and shipping; waits at most `shutdown_timeout_s` for the collector."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self.relay is not None:
            self.relay.close()  # senders still waiting are answered first
        if self.shipper is not None:
            self.shipper.finish_by(time.monotonic() + self.cfg.shutdown_timeout_s)
        self.flusher.stop(timeout_s=self.cfg.shutdown_timeout_s)
        if self.orphans is not None:
            self.orphans.close()
        if self.control is not None:
            self.control.close()
        for tracked in self._tracked.values():
            tracked.reader.close()
        if self.gpus is not None:
            self.gpus.close()

    def _ship_tick(self) -> None:
        """The flusher's periodic work before it ships the queue: replay exited ranks' spools."""
        if self.orphans is not None:
            self.orphans.tick()

    # -- one poll -------------------------------------------------------------------------
    def poll(self) -> list[watchdog.HangSuspect]:
        """Read every page, feed the watchdog, handle new suspicions; returns them."""
        self._discover()
        found = []
        now = self._clock()
        for path, tracked in list(self._tracked.items()):
            try:
                snap = tracked.reader.snapshot()
            except (OSError, ValueError, TimeoutError) as exc:
                log.info("dropping page %s: %s", path, exc)
                tracked.reader.close()
                del self._tracked[path]
                continue
            tracked.last = snap
            if not rundir.page_alive(path, pid=snap.pid, pid_ns=snap.pid_ns, alive=_alive):
                self._exited(path, tracked, snap)
                continue
            suspect = self.watchdog.observe(snap, now)
            tracked.hung = suspect is not None or (
                tracked.hung
                and snap.progress_mono_s <= now - self.watchdog.threshold_s(snap.job, snap.rank)
            )
            if suspect is not None:
                found.append(suspect)
                self._handle_hang(suspect, tracked)
        self._expire_runs()
        return found

    def _expire_runs(self) -> None:
        """Remove the run folders whose processes are gone (after page_ttl_s; spools replayed)."""
        try:
            rundir.expire(
                self.cfg.progress_dir, ttl_s=self.cfg.page_ttl_s, now_s=self._wall(), alive=_alive
            )
        except OSError as exc:
            log.warning("cannot expire progress folders under %s: %s", self.cfg.progress_dir, exc)

    def _exited(self, path: Path, tracked: _Tracked, snap: progress.PageSnapshot) -> None:
        """A rank's process is gone: report a crash once, delete the page after its TTL."""
        if snap.state is not schema.RankState.FINISHED and not tracked.exit_seen:
            log.warning(
                "rank %d of %s (pid %d) exited without finishing, at step %d in %s #%d %s",
                snap.rank,
                snap.job,
                snap.pid,
                snap.last_step,
                snap.last_group,
                snap.last_seq,
                snap.last_op,
            )
            events = tracked.reader.events()
            self.queue.extend(events)
            self.queue.put(_heartbeat(snap))
            self.queue.put(_crash(snap, self.cfg.node, len(events)))
            self.flusher.flush_soon()
        tracked.exit_seen = True
        tracked.hung = False
        if self._wall() - snap.progress_wall_s >= self.cfg.page_ttl_s:
            tracked.reader.close()
            del self._tracked[path]
            self.watchdog.forget(snap.job, snap.rank)
            for leftover in (path, path.with_suffix(rundir.STACKS_SUFFIX)):
                leftover.unlink(missing_ok=True)
            lock = rundir.lock_path(path)
            if rundir.lock_held(lock) is False:  # never a lock a new process of the rank holds
                lock.unlink(missing_ok=True)
            log.info("removed the page of exited rank %d of %s", snap.rank, snap.job)

    def _discover(self) -> None:
        for path in progress.discover(self.cfg.progress_dir):
            if path not in self._tracked:
                try:
                    pod = rundir.read_manifest(path.parent).get("pod") or ""
                    self._tracked[path] = _Tracked(progress.PageReader(path), pod=pod)
                except (OSError, ValueError) as exc:
                    log.debug("skipping %s: %s", path, exc)

    def _handle_hang(self, suspect: watchdog.HangSuspect, tracked: _Tracked) -> None:
        snap = suspect.snapshot
        self.hangs_detected += 1
        self.suspects.append(suspect)
        log.warning(
            "rank %d of %s: no progress for %.1f s (threshold %.1f s), %s in %s #%d %s",
            snap.rank,
            snap.job,
            suspect.stalled_s,
            suspect.threshold_s,
            snap.state,
            snap.last_group,
            snap.last_seq,
            snap.last_op,
        )
        stacks_file = snap.path.with_suffix(rundir.STACKS_SUFFIX)
        # A pid from the training pod's PID namespace names another process here (or none):
        # py-spy or SIGUSR1 go only to the process the page's pid really is.
        pid = rundir.local_pid(snap.pid, snap.pid_ns)
        if pid is None:
            log.warning(
                "rank %d of %s runs in another PID namespace (%s, pid %d there) that this agent "
                "cannot see into: no stack dump (the SDK's own hang dump lands in %s)",
                snap.rank,
                snap.job,
                snap.pid_ns,
                snap.pid,
                stacks_file,
            )
            dump = stacks.Stacks("none", "")
        else:
            dump = self._capture(
                pid,
                stacks_file=stacks_file if stacks_file.exists() else None,
                timeout_s=self.cfg.stack_timeout_s,
            )
        self._save_stacks(snap, dump)
        events = tracked.reader.events()
        self.queue.extend(events)
        self.queue.put(_heartbeat(snap))
        self.queue.put(_finding(snap, suspect, dump, self.cfg.node, len(events)))
        self.flusher.flush_soon()

    def _save_stacks(self, snap: progress.PageSnapshot, dump: stacks.Stacks) -> Path | None:
        """Keep the dump with the run it came from (`stacks_dir`); where it went, if anywhere."""
        out = stacks_dir(snap.path.parent, snap.job, agent_output=self.cfg.output_dir)
        run = snap.path.parent.name
        try:
            out.mkdir(parents=True, exist_ok=True)
            # The rank's number last: `vigil analyze` reads it from there (analyzer/stacks.py).
            path = out / f"stacks-{run}-{int(self._wall())}-{dump.method}-rank-{snap.rank:05d}.txt"
            path.write_text(dump.text)
        except OSError as exc:
            log.warning("cannot save stacks of rank %d in %s: %s", snap.rank, out, exc)
            return None
        log.info("stacks of rank %d of %s (run %s) saved in %s", snap.rank, snap.job, run, path)
        return path

    # -- sampling -------------------------------------------------------------------------
    def sample(self) -> None:
        readings = self.host.sample()
        if self.gpus is not None:
            try:
                readings += self.gpus.sample()
                seen = [t for t in self._tracked.values() if t.last is not None]
                pages = [t.last for t in seen if t.last is not None]
                # The pod join matches a run with its pod: by the pod the SDK recorded, else by
                # the folder's name (a pod's VIGIL_RUN_ID; a long one is shortened there).
                ranks = [
                    sampler.Owner(
                        p.job, p.rank, run=t.pod or p.path.parent.name, local_rank=p.local_rank
                    )
                    for t, p in zip(seen, pages, strict=True)
                ]
                pids = {p.pid: owner for p, owner in zip(pages, ranks, strict=True)}
                self._owners = self.gpus.owners(pids, ranks)
            except Exception as exc:
                log.warning("NVML sampling failed: %r", exc)
        self._readings = readings
        now = time.time()
        for r in readings:
            owner = self._owners.get(r.device)
            self.queue.put(
                schema.Sample(
                    node=self.cfg.node,
                    time_s=now,
                    metric=r.metric,
                    value=r.value,
                    device=r.device,
                    job_id=owner.job if owner else "",
                    rank=owner.rank if owner else -1,
                    pod=owner.pod if owner else "",
                )
            )

    def view(self) -> exporter.AgentView:
        now = self._clock()
        ranks = [
            exporter.RankView(t.last, max(0.0, now - t.last.progress_mono_s), t.hung)
            for t in list(self._tracked.values())
            if t.last is not None
        ]
        stats = self.shipper.stats if self.shipper else sender.SenderStats()
        spool = self.shipper.spool if self.shipper else None
        return exporter.AgentView(
            node=self.cfg.node,
            ranks=ranks,
            readings=list(self._readings),
            owners=dict(self._owners),
            queue_depth=len(self.queue),
            dropped_records=self.queue.dropped + (spool.dropped_records if spool else 0),
            ship_errors=stats.ship_errors,
            shipped_batches=stats.shipped_batches,
            spool_bytes=spool.size_bytes() if spool else 0,
            hangs_detected=self.hangs_detected,
            quarantined_batches=stats.quarantined_batches,
            replayed_spools=self.orphans.replayed_spools if self.orphans else 0,
            relayed_frames=self.relay.stats.frames if self.relay else 0,
            relay_requests=self.relay.stats.requests if self.relay else 0,
        )


def stacks_dir(run_folder: Path, job: str, *, agent_output: Path | None) -> Path:
    """Where the agent keeps a hung rank's stacks: beside the run's own JSON lines
    (`<its output_dir>/<job>/stacks`, named in the run's manifest, read by `vigil analyze`);
    for a run that writes none, under the agent's `--output-dir` (`<job>/<run>/stacks`), else
    in the run's progress folder (removed with it; the hang finding carries them too)."""
    named = rundir.read_manifest(run_folder).get("output_dir")
    if named:
        return Path(named) / "stacks"
    if agent_output is not None:
        return agent_output / job / run_folder.name / "stacks"
    return run_folder / "stacks"


def _heartbeat(snap: progress.PageSnapshot) -> schema.Heartbeat:
    return schema.Heartbeat(
        job_id=snap.job,
        rank=snap.rank,
        time_s=snap.progress_wall_s,
        last_step=snap.last_step,
        last_group=snap.last_group,
        last_seq=snap.last_seq,
        last_op=snap.last_op,
        state=snap.state,
        checkpoints=snap.checkpoints,
        between_steps=snap.between_steps,
        compiling=snap.compiling,
    )


def _crash(snap: progress.PageSnapshot, node: str, num_events: int) -> schema.Finding:
    where = f"{snap.state} in {snap.last_group} #{snap.last_seq} {snap.last_op}".strip()
    return schema.Finding(
        finding_id=f"agent-crash-{snap.job}-r{snap.rank}-{snap.pid}",
        kind=schema.FindingKind.CRASH,
        job_id=snap.job,
        subjects=schema.Subjects(ranks=[snap.rank], nodes=[node]),
        step_start=snap.last_step,
        step_end=snap.last_step,
        summary=(
            f"rank {snap.rank} (pid {snap.pid}) exited without finishing at step "
            f"{snap.last_step}; last: {where}; {num_events} ring events attached"
        ),
        confidence=0.9,
        detected_s=time.time(),
        trace_end_s=snap.progress_wall_s,
    )


def _finding(
    snap: progress.PageSnapshot,
    suspect: watchdog.HangSuspect,
    dump: stacks.Stacks,
    node: str,
    num_events: int,
) -> schema.Finding:
    where = f"{snap.state} in {snap.last_group} #{snap.last_seq} {snap.last_op}".strip()
    return schema.Finding(
        finding_id=f"agent-hang-{snap.job}-r{snap.rank}-{int(snap.progress_wall_s * 1000)}",
        kind=schema.FindingKind.HANG,
        job_id=snap.job,
        subjects=schema.Subjects(ranks=[snap.rank], nodes=[node]),
        step_start=snap.last_step,
        step_end=snap.last_step,
        summary=(
            f"rank {snap.rank} made no progress for {suspect.stalled_s:.1f} s "
            f"(threshold {suspect.threshold_s:.1f} s); last: {where}; "
            f"{num_events} ring events attached; stacks by {dump.method}"
        ),
        evidence=[
            schema.Evidence(
                metric="progress_age_s",
                observed=suspect.stalled_s,
                baseline=suspect.threshold_s,
                unit="s",
                note=dump.text[:_MAX_STACK_NOTE],
            )
        ],
        confidence=0.6,
        detected_s=time.time(),
        trace_start_s=max(0.0, snap.progress_wall_s - suspect.threshold_s),
        trace_end_s=snap.progress_wall_s + suspect.stalled_s,
    )
