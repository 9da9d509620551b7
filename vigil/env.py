"""Every VIGIL_* environment variable vigil reads, declared once, each with why it exists.

Settings classes (`vigil.settings`) read most of these through pydantic-settings' `VIGIL_` prefix;
the names below are the single list users and docs refer to. Nothing here reads the environment at
import time.
"""

from __future__ import annotations

import enum


class EnvVar(enum.StrEnum):
    # Where the SDK writes JSONL files when no collector is configured, for `vigil analyze`.
    OUTPUT_DIR = "VIGIL_OUTPUT_DIR"
    # The collector's base URL for the SDK and agent; unset means "write files locally".
    COLLECTOR_URL = "VIGIL_COLLECTOR_URL"
    # Bearer token the SDK/agent present to a collector that requires one.
    TOKEN = "VIGIL_TOKEN"
    # Where vigil keeps its own state (SQLite store, spool) when no path is given.
    DATA_DIR = "VIGIL_DATA_DIR"
    # Log level for the CLI entry point (DEBUG, INFO, WARNING, ...).
    LOG_LEVEL = "VIGIL_LOG_LEVEL"
    # Log format for the CLI entry point: "plain" for people, "json" for log pipelines.
    LOG_FORMAT = "VIGIL_LOG_FORMAT"
    # Allows insecure conveniences (no auth on non-loopback binds) on a developer's machine.
    DEV_MODE = "VIGIL_DEV_MODE"
    # Fault injection spec for the bundled trainer, shared by tests, demos and benchmarks.
    FAULTS = "VIGIL_FAULTS"
    # Set by `vigil run`: the (simulated) node a rank runs on.
    NODE = "VIGIL_NODE"
    # Set by `vigil run`: the job id, so every rank reports under the same job.
    JOB = "VIGIL_JOB"
    # Root of the SDK's per-run progress folders (pages, stacks, spools) that the node agent reads;
    # ranks and agent must agree on it, and a node without /dev/shm (or a test) needs another.
    PROGRESS_DIR = "VIGIL_PROGRESS_DIR"
    # Names this run's progress folder (<root>/<job>/<run>/) when the launcher sets it, so two runs
    # of one job on a node never share pages; else torchrun's run id or MASTER_ADDR:PORT decides.
    RUN_ID = "VIGIL_RUN_ID"
    # The Kubernetes pod a training process runs in, reported with its rank (RankInfo.pod) and
    # recorded in its run's manifest; else the downward API's POD_NAME; unset outside Kubernetes.
    POD = "VIGIL_POD"
    # Where per-step in-memory snapshots live (node shared memory; default /dev/shm).
    SNAPSHOT_DIR = "VIGIL_SNAPSHOT_DIR"
    # Set by `vigil run` for each rank's `sh` wrapper: the file it leaves "<exit code> <time>" in,
    # so a restarted controller that cannot wait() on its predecessor's children learns how and
    # when they ended.
    EXIT_FILE = "VIGIL_EXIT_FILE"
    # Tests only: the `vigil run` controller kills itself at this stage (planned, stopped, placed,
    # launched, recorded), so a test can check that a replaced controller resumes exactly once.
    CONTROLLER_DIE_AT = "VIGIL_CONTROLLER_DIE_AT"
    # Restart attempt number a supervisor gives the trainer's ranks: keys the per-attempt store
    # prefix (restarted gloo workers cannot reuse an earlier attempt's keys) and which faults fire.
    RESTART_COUNT = "VIGIL_RESTART_COUNT"
    # "1" when the supervisor hosts the rendezvous TCPStore at MASTER_ADDR:MASTER_PORT, so that
    # rank 0 connects as a client instead of starting the store server itself.
    STORE_HOSTED = "VIGIL_STORE_HOSTED"
    # The collector's bind address; loopback unless tokens are set (or dev mode).
    COLLECTOR_HOST = "VIGIL_COLLECTOR_HOST"
    # The collector's port.
    COLLECTOR_PORT = "VIGIL_COLLECTOR_PORT"
    # The collector's store: sqlite:///PATH or postgresql+psycopg://...; default under DATA_DIR.
    STORE_URL = "VIGIL_STORE_URL"
    # Comma-separated bearer tokens allowed to ingest batches into the collector.
    INGEST_TOKENS = "VIGIL_INGEST_TOKENS"
    # Comma-separated bearer tokens allowed to read the collector's query API.
    READ_TOKENS = "VIGIL_READ_TOKENS"
    # Largest batch body the collector accepts (bytes); bounds one sender's memory cost.
    MAX_BATCH_BYTES = "VIGIL_MAX_BATCH_BYTES"
    # Most records one batch may carry.
    MAX_BATCH_RECORDS = "VIGIL_MAX_BATCH_RECORDS"
    # Largest Kineto trace upload (bytes).
    MAX_TRACE_BYTES = "VIGIL_MAX_TRACE_BYTES"
    # Age (seconds) after which raw samples, heartbeats and collective events expire.
    RAW_RETENTION_S = "VIGIL_RAW_RETENTION_S"
    # Width (seconds) of the sample rollups that serve long ranges after raw expiry.
    ROLLUP_BUCKET_S = "VIGIL_ROLLUP_BUCKET_S"
    # How often (seconds) the collector runs rollups and retention.
    MAINTENANCE_INTERVAL_S = "VIGIL_MAINTENANCE_INTERVAL_S"
    # How often (seconds) the collector ticks the streaming analyzer for hang detection.
    ANALYZER_TICK_S = "VIGIL_ANALYZER_TICK_S"
    # Most bytes one batch may inflate to after zstd decompression.
    MAX_BATCH_INFLATED_BYTES = "VIGIL_MAX_BATCH_INFLATED_BYTES"
    # The largest world size a job may declare; ranks must lie below their job's world size.
    MAX_WORLD_SIZE = "VIGIL_MAX_WORLD_SIZE"
    # Batches queued for the streaming analyzer before new ones are stored but not analysed.
    ANALYZER_MAX_PENDING = "VIGIL_ANALYZER_MAX_PENDING"
    # Records (step rows included) those queued batches may hold together, the same way.
    ANALYZER_MAX_PENDING_RECORDS = "VIGIL_ANALYZER_MAX_PENDING_RECORDS"
    # "0" writes every ingested batch in its own transaction (default "1": concurrent batches
    # share one, see collector/commits.py).
    INGEST_GROUP_COMMIT = "VIGIL_INGEST_GROUP_COMMIT"
    # Seconds a request may take to send its headers before the collector closes it.
    HEADER_TIMEOUT_S = "VIGIL_HEADER_TIMEOUT_S"
    # Connections and in-flight requests the collector serves at once (then 503).
    MAX_CONNECTIONS = "VIGIL_MAX_CONNECTIONS"
    # With auth on, "1" serves /metrics without a token (the default), "0" needs the read scope.
    METRICS_PUBLIC = "VIGIL_METRICS_PUBLIC"
    # With auth on, "1" serves /docs and /openapi.json without a token; default needs read.
    DOCS_PUBLIC = "VIGIL_DOCS_PUBLIC"
    # Grafana service-account token `vigil dashboards push` uploads with (kept out of argv).
    GRAFANA_TOKEN = "VIGIL_GRAFANA_TOKEN"
    # The kubelet's pod-resources socket the node agent reads to attribute each GPU to its pod
    # (default /var/lib/kubelet/pod-resources/kubelet.sock; the Helm chart mounts it read-only).
    POD_RESOURCES_SOCKET = "VIGIL_POD_RESOURCES_SOCKET"
