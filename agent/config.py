"""Typed configuration of the SDK session and the node agent.

Keyword-only dataclasses that validate in `__post_init__` and raise ValueError naming what to
change. Pure data: no I/O, no torch, no threads.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from vigil import schema, sender
from vigil.agent import rundir
from vigil.env import EnvVar

# The progress root when $VIGIL_PROGRESS_DIR is unset (rundir.py says why /dev/shm).
DEFAULT_PROGRESS_DIR = rundir.DEFAULT_ROOT
# 4096 collective events cover several steps of a deep FSDP/TP model (hundreds of collectives per
# step) at ~200 bytes each: under 1 MiB of shared memory per rank.
DEFAULT_RING_CAPACITY = 4096
# The core sender's defaults (vigil.sender says why): 64 MiB of spool, 5 5xx before quarantine.
DEFAULT_SPOOL_MAX_BYTES = sender.DEFAULT_SPOOL_MAX_BYTES
DEFAULT_MAX_SERVER_ERRORS = sender.DEFAULT_MAX_SERVER_ERRORS
# Total, not per request: what a process's exit may wait for a collector that does not answer
# (one POST's timeout); what is not delivered by then stays spooled for the node agent.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _paths(obj: object, *names: str) -> None:
    """Accept str / PathLike for path fields of a frozen dataclass: store them as Path."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not isinstance(value, Path):
            object.__setattr__(obj, name, Path(value))


# How batches travel to the collector: the core sender's config, under the SDK's name.
ShipperConfig = sender.SenderConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class SdkConfig:
    """Everything one training process's SDK session needs; built by `vigil.agent.init`."""

    job: str
    rank: int
    world_size: int
    local_rank: int = 0
    node: str = "localhost"
    # The Kubernetes pod the process runs in ($VIGIL_POD, else the downward API's $POD_NAME).
    pod: str = dataclasses.field(default_factory=lambda: default_pod())
    collector: str | None = None
    token: str | None = None
    output_dir: Path | None = None
    # With a collector, also write the JSON lines under output_dir (a local copy that
    # `vigil analyze` reads); without one they are always written.
    also_jsonl: bool = False
    # The progress root ($VIGIL_PROGRESS_DIR, else /dev/shm/vigil); this run's folder in it is
    # <progress_dir>/<job>/<run_id>, with run_id "" worked out from the launcher's environment.
    progress_dir: Path = dataclasses.field(default_factory=rundir.progress_root)
    run_id: str = ""
    spool_dir: Path | None = None
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    # The most shutdown() (or the exit hook) waits for the collector, in all.
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    max_server_errors: int = DEFAULT_MAX_SERVER_ERRORS
    model_shape: schema.ModelShape | None = None
    flops_per_token: float | None = None
    # Count the first step's FLOPs with torch.utils.flop_counter when no shape/flops are given.
    measure_flops: bool = False
    peak_flops: float | None = None
    # Measure the CPU's GEMM peak (~0.2 s at init) when no device peak is known.
    measure_cpu_peak: bool = True
    ring_capacity: int = DEFAULT_RING_CAPACITY
    # Heartbeats and file flushes once a second: the analyzer's hang detection works in seconds.
    flush_interval_s: float = 1.0
    # Records waiting for the background thread; past this the oldest are dropped and counted.
    max_queued_records: int = 100_000
    time_collectives: bool = True
    # SIGUSR1 dumps all Python thread stacks with faulthandler (0 disables).
    stack_signal: int = 10
    # On SIGTERM (torchrun stopping a failed rank's survivors, an eviction, a preemption) the
    # rank says so (`terminated`) before the signal ends it, where nothing else handles SIGTERM
    # (`terminate.py`); without it a stopped rank reads as one killed outright.
    last_word_on_sigterm: bool = True
    # The SDK's own hang suspicion: no progress for factor x the slowest recent step, at least
    # min_hang_s, dumps the ring buffer and stacks to the output files.
    hang_factor: float = 5.0
    min_hang_s: float = 30.0

    def __post_init__(self) -> None:
        _paths(self, "output_dir", "progress_dir", "spool_dir")
        _require(bool(self.job) and len(self.job) <= 256, "job must be a 1..256 character name")
        _require(
            "/" not in self.job and self.job not in (".", ".."),
            f"job {self.job!r} must not contain '/' (it names a folder)",
        )
        _require(
            not self.run_id or rundir.is_plain(self.run_id),
            f"run_id {self.run_id!r} must be a plain folder name ([A-Za-z0-9._-])",
        )
        if self.run_id and rundir.safe_name(self.run_id) != self.run_id:
            # Longer than a folder name may be (a long pod name): shortened with a stable hash.
            object.__setattr__(self, "run_id", rundir.safe_name(self.run_id))
        _require(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        _require(
            0 <= self.rank < self.world_size,
            f"rank {self.rank} must be in [0, world_size={self.world_size})",
        )
        _require(self.local_rank >= 0, "local_rank must be >= 0")
        _require(bool(self.node), "node must be a non-empty name")
        if self.collector is not None:
            _require(
                self.collector.startswith(("http://", "https://")),
                f"collector {self.collector!r} must be an http:// or https:// URL",
            )
        _require(self.ring_capacity >= 16, "ring_capacity must be >= 16 events")
        _require(self.flush_interval_s > 0, "flush_interval_s must be > 0")
        _require(self.max_queued_records >= 100, "max_queued_records must be >= 100")
        _require(self.spool_max_bytes > 0, "spool_max_bytes must be > 0")
        _require(self.shutdown_timeout_s > 0, "shutdown_timeout_s must be > 0 (seconds in all)")
        _require(self.max_server_errors >= 1, "max_server_errors must be >= 1")
        for name in ("flops_per_token", "peak_flops"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{name} must be > 0 when given, got {value}")
        _require(self.hang_factor > 1, "hang_factor must be > 1")
        _require(self.min_hang_s > 0, "min_hang_s must be > 0")
        _require(self.stack_signal >= 0, "stack_signal must be a signal number or 0")

    @property
    def rank_tag(self) -> str:
        return f"rank-{self.rank:05d}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """The node agent daemon's settings (`vigil agent`)."""

    node: str
    # The same root as the ranks': $VIGIL_PROGRESS_DIR, else /dev/shm/vigil.
    progress_dir: Path = dataclasses.field(default_factory=rundir.progress_root)
    output_dir: Path | None = None
    collector: str | None = None
    token: str | None = None
    spool_dir: Path | None = None
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    max_server_errors: int = DEFAULT_MAX_SERVER_ERRORS
    # The agent replays the spools that exited ranks left under progress_dir (at least once:
    # the collector dedupes batch ids); False leaves them alone.
    replay_orphans: bool = True
    # Other senders' spool folders on this node replayed the same way once their process is
    # gone: `vigil agent` names `vigil diag`'s (vigil.spool.diag_dir) and its fallback siblings.
    replay_dirs: tuple[Path, ...] = ()
    metrics_host: str = "127.0.0.1"
    # 9464 is the port OpenTelemetry's Prometheus exporter convention reserves for node agents.
    metrics_port: int = 9464
    # One sample a second: dcgm-exporter's 30 s default hides throttling and XID bursts.
    sample_interval_s: float = 1.0
    poll_interval_s: float = 0.5
    # A rank is hung after hang_factor x its slowest recent step without progress, and never
    # sooner than min_hang_s; before its first step it gets startup_grace_s.
    hang_factor: float = 5.0
    min_hang_s: float = 30.0
    startup_grace_s: float = 600.0
    # py-spy needs ptrace; 20 s covers a big process, and a stuck py-spy must not stall the agent.
    stack_timeout_s: float = 20.0
    use_nvml: bool = True
    # Pages of exited processes are exported for 10 minutes (a dashboard shows how a job ended),
    # then deleted from /dev/shm so a node running many jobs does not fill its RAM disk; a run's
    # folder goes once its processes are gone, its spools replayed and this long has passed.
    page_ttl_s: float = 600.0
    # The relay (`relay.py`): with a port (0: any free one) and a collector, this node's SDKs
    # may ship through the agent, which forwards their frames several per request.
    relay_port: int | None = None
    relay_host: str = "127.0.0.1"
    relay_window_s: float = 1.0

    def __post_init__(self) -> None:
        _paths(self, "output_dir", "progress_dir", "spool_dir")
        object.__setattr__(self, "replay_dirs", tuple(Path(p) for p in self.replay_dirs))
        _require(self.page_ttl_s >= 0, "page_ttl_s must be >= 0")
        _require(self.shutdown_timeout_s > 0, "shutdown_timeout_s must be > 0 (seconds in all)")
        _require(self.max_server_errors >= 1, "max_server_errors must be >= 1")
        _require(bool(self.node), "node must be a non-empty name")
        _require(0 <= self.metrics_port <= 65535, "metrics_port must be 0..65535")
        _require(self.sample_interval_s > 0, "sample_interval_s must be > 0")
        _require(self.poll_interval_s > 0, "poll_interval_s must be > 0")
        _require(self.hang_factor > 1, "hang_factor must be > 1")
        _require(self.min_hang_s > 0, "min_hang_s must be > 0")
        _require(self.startup_grace_s > 0, "startup_grace_s must be > 0")
        _require(self.stack_timeout_s > 0, "stack_timeout_s must be > 0")
        _require(self.relay_window_s > 0, "relay_window_s must be > 0")
        if self.relay_port is not None:
            _require(0 <= self.relay_port <= 65535, "relay_port must be 0..65535")
            _require(self.collector is not None, "the relay needs a collector to relay to")
        if self.collector is not None:
            _require(
                self.collector.startswith(("http://", "https://")),
                f"collector {self.collector!r} must be an http:// or https:// URL",
            )


def default_pod() -> str:
    """The pod this process runs in, "" outside Kubernetes."""
    # VIGIL_POD: set explicitly; POD_NAME: Kubernetes' downward API (metadata.name).
    return (os.environ.get(EnvVar.POD) or os.environ.get("POD_NAME") or "").strip()


def default_node() -> str:
    """This host's name, as ranks and the agent report it."""
    # VIGIL_NODE: set by `vigil run` for simulated nodes; NODE_NAME: Kubernetes' downward API.
    return (
        os.environ.get(EnvVar.NODE)
        or os.environ.get("NODE_NAME")
        or os.uname().nodename
        or "localhost"
    )
