"""Every Kubernetes API request vigil makes has a deadline: an API server that accepts the
connection and never answers (an overloaded apiserver, a half-open connection through a load
balancer) must not hold the controller, or the Lease it has to renew, forever."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.recovery.k8s.cluster import Cluster, running
from tests.recovery.k8s.test_recovery import NS, executor
from vigil.recovery import kubernetes as kube

DEADLINE_S = 0.3


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An HTTP address that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()


def _api(url: str) -> kube.Api:
    configuration = client.Configuration()
    configuration.host = url
    configuration.retries = False  # as `kube.connect` builds it
    return kube.Api(client.ApiClient(configuration), request_timeout_s=DEADLINE_S)


def test_a_request_the_api_server_never_answers_ends_at_its_deadline(silent_server: str) -> None:
    api = _api(silent_server)
    calls: list[Callable[[], object]] = [
        lambda: api.pods(NS, "train"),
        lambda: api.get_custom(kube.JOBSET, NS, "train"),
        lambda: api.patch_custom(kube.JOBSET, NS, "train", {"metadata": {}}),
        lambda: api.evict(NS, "train-workers-0-0"),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(kube.ApiUnavailableError, match=r"did not answer \(deadline 0\.3 s\)"):
            call()
        assert time.monotonic() - started < 4 * DEADLINE_S  # one attempt, not urllib3's four


def test_a_lease_the_api_server_never_answers_for_raises_instead_of_waiting(
    silent_server: str,
) -> None:
    lease = kube.Lease(api=_api(silent_server), namespace=NS)
    started = time.monotonic()
    with pytest.raises(kube.ApiUnavailableError):
        lease.acquire()
    assert time.monotonic() - started < 4 * DEADLINE_S


def test_a_poll_the_api_server_does_not_answer_is_skipped_and_the_next_one_reads_the_job(
    silent_server: str,
) -> None:
    with running(NS, nodes=4, replicas=4) as (cluster, _):
        ex = executor(cluster)
        answering = ex.api
        ex.api = _api(silent_server)
        started = time.monotonic()
        assert ex.poll() == [] and ex.unanswered_polls == 1
        assert time.monotonic() - started < 4 * DEADLINE_S
        ex.api = answering
        reads = _pod_lists(cluster)
        assert ex.poll() == [] and ex.unanswered_polls == 1  # the job runs: no exits
        assert _pod_lists(cluster) > reads


def _pod_lists(cluster: Cluster) -> int:
    return sum(1 for c in cluster.calls() if c.method == "GET" and c.path.endswith("/pods"))


def test_connect_leaves_retries_to_the_controller(tmp_path: Path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    api_client = kube.connect(str(config))
    assert api_client.configuration.retries is False
    api = kube.Api(api_client, request_timeout_s=DEADLINE_S)
    with pytest.raises(kube.ApiUnavailableError, match="did not answer"):
        api.nodes()  # nothing listens on port 1: refused at once, not retried


def test_a_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="request_timeout_s must be > 0, got 0"):
        kube.Api(client.ApiClient(client.Configuration()), request_timeout_s=0)
