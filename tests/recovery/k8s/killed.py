"""Kill `vigil controller --kubernetes` at each stage of a recovery, start it again, count acts.

Shared by tests/recovery/k8s/test_killed_controller.py and bench/k8s_recovery.py. The controller
runs as the real CLI in a subprocess against the emulator (`cluster.Cluster`), its findings from
a stand-in collector (`StubCollector`: the findings endpoint and an ingest that accepts all and
keeps what was posted), and
is killed with `VIGIL_CONTROLLER_DIE_AT=<stage>`; the second run has no kill.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from kubernetes import client

from tests.recovery.k8s.cluster import JOBSET_API, Cluster, FakeJobSetController
from vigil import codec
from vigil.env import EnvVar
from vigil.schema import Evidence, Finding, FindingKind, Record, Subjects

STAGES = ("planned", "stopped", "placed", "launched", "recorded")


class StubCollector:
    """Serves one straggler finding for job "train" (stamped when fetched) and accepts posts."""

    def __init__(self, node: str) -> None:
        finding = Finding(
            finding_id=f"straggler-{node}",
            kind=FindingKind.STRAGGLER,
            job_id="train",
            subjects=Subjects(nodes=[node]),
            evidence=[Evidence(metric="slowdown", observed=2.0)],
            confidence=0.9,
        )
        self.first_served_s: float | None = None
        # Every record posted to the ingest (the controller's actions and findings).
        self.posted: list[Record] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                now = time.time()
                if outer.first_served_s is None:
                    outer.first_served_s = now
                row = msgspec.to_builtins(
                    msgspec.structs.replace(finding, detected_s=now, trace_start_s=now)
                )
                self._reply(200, json.dumps([row]).encode())

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with contextlib.suppress(codec.DecodeError):  # a post that is not a batch
                    outer.posted.extend(codec.decode_batch(body).records)
                self._reply(202, b"{}")

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def controller_command(kubeconfig: Path, collector: str, ns: str) -> list[str]:
    return [
        sys.executable, "-m", "vigil", "controller", "--kubernetes",
        "--jobset", "train", "--namespace", ns, "--kubeconfig", str(kubeconfig),
        "--mode", "act", "--allow-namespace", ns, "--collector", collector,
        "--poll-interval", "0.05", "--lease-identity", "controller-0",
    ]  # fmt: skip


@dataclass
class Outcome:
    stage: str
    first_exit: int
    second_exit: int
    restarts: int
    evictions: int
    quarantines: int
    pods_on_bad_node: int
    # Wall time of the second run (the recovery's remainder after the kill).
    second_run_s: float

    @property
    def exactly_once(self) -> bool:
        return (
            self.first_exit == 70
            and self.second_exit == 0
            and self.restarts == 1
            and self.evictions == 1
            and self.quarantines == 1
            and self.pods_on_bad_node == 0
        )


def killed_run(stage: str, ns: str, tmp: Path, *, replicas: int = 4, spares: int = 1) -> Outcome:
    """One recovery of a straggler on node-1 with the controller killed at `stage`."""
    cluster = Cluster()
    core = client.CoreV1Api(cluster.client("fake-jobset-controller"))
    custom = client.CustomObjectsApi(cluster.client("fake-jobset-controller"))
    from tests.recovery.k8s.cluster import jobset, node

    for i in range(replicas + spares):
        core.create_node(node(f"node-{i}"))
    custom.create_namespaced_custom_object(
        *JOBSET_API[:2], ns, JOBSET_API[2], jobset("train", ns, replicas=replicas)
    )
    fake = FakeJobSetController(cluster, ns).start()
    fake.finish_generation = 1
    stub = StubCollector("node-1")
    kubeconfig = tmp / f"kubeconfig-{stage}"
    kubeconfig.write_text(cluster.kubeconfig())
    env = {**os.environ, EnvVar.DATA_DIR.value: str(tmp / f"data-{stage}")}
    command = controller_command(kubeconfig, stub.url, ns)
    try:
        first = subprocess.run(
            command, env={**env, EnvVar.CONTROLLER_DIE_AT.value: stage},
            capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        start = time.time()
        second = subprocess.run(command, env=env, capture_output=True, timeout=120, check=False)
        second_s = time.time() - start
        if second.returncode != 0:
            sys.stderr.write(second.stderr.decode(errors="replace")[-3000:])
        vigil_writes = [
            c for c in cluster.calls() if c.write and c.agent != "fake-jobset-controller"
        ]
        js = custom.get_namespaced_custom_object(*JOBSET_API[:2], ns, JOBSET_API[2], "train")
        return Outcome(
            stage=stage,
            first_exit=first.returncode,
            second_exit=second.returncode,
            restarts=int(js["status"]["restarts"]),
            evictions=sum(1 for c in vigil_writes if c.subresource == "eviction"),
            quarantines=sum(1 for c in vigil_writes if c.path == "/api/v1/nodes/node-1"),
            pods_on_bad_node=sum(1 for g, _, n in fake.placed if g >= 1 and n == "node-1"),
            second_run_s=second_s,
        )
    finally:
        stub.close()
        fake.stop()
        cluster.close()
