"""helm/vigil renders, lints and validates in every tested values set, and what it renders works.

Helm's own engine (helm-python-sdk) renders the chart offline for the defaults and each
helm/vigil/ci/*-values.yaml; every core object is checked against Kubernetes' OpenAPI schemas
(kubernetes-validate --strict, the oldest and newest supported versions) and the monitoring objects
against the prometheus-operator CRDs. The unit checks below read the rendered objects the way the
cluster would use them: selectors, probes, RBAC, the dashboards and rules shipped, the commands'
flags (parsed by the real `vigil agent` parser).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

import vigil
from tests.helm import chart
from vigil.agent import cli as agent_cli
from vigil.env import EnvVar

DASHBOARDS = chart.ROOT / "dashboards"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}
RBAC = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}


@functools.cache
def _objects(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(chart.render(chart.VALUE_SETS[name]))


def objects(name: str, kind: str | None = None) -> list[dict[str, Any]]:
    return [o for o in _objects(name) if kind is None or o["kind"] == kind]


def one(name: str, kind: str, component: str | None = None) -> dict[str, Any]:
    (found,) = [
        o
        for o in objects(name, kind)
        if component is None
        or o["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    return found


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]
    return spec


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


VALUE_SET_NAMES = sorted(chart.VALUE_SETS)


def test_the_ci_matrix_is_complete() -> None:
    assert VALUE_SET_NAMES == [
        "agent-only",
        "air-gapped",
        "controller-act",
        "default",
        "monitoring-off",
        "postgres-external",
        "sqlite-single",
    ]


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_helm_lint_strict_finds_nothing(name: str) -> None:
    assert chart.lint(chart.VALUE_SETS[name]) == []


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_every_rendered_object_validates_strictly(name: str) -> None:
    checked = {"kubernetes": 0, "crd": 0}
    for obj in objects(name):
        checked[chart.validate(obj)] += 1
    assert checked["kubernetes"] >= 5
    if name != "monitoring-off":
        assert checked["crd"] >= 2  # a ServiceMonitor (agent) and the PrometheusRule at least


def test_validation_catches_what_the_api_server_would_refuse_or_drop() -> None:
    ds = json.loads(json.dumps(one("default", "DaemonSet")))
    pod_spec(ds)["containers"][0]["livenessprobe"] = {"httpGet": {"path": "/metrics"}}
    with pytest.raises(Exception, match="livenessprobe"):
        chart.validate(ds)
    sm = json.loads(json.dumps(objects("default", "ServiceMonitor")[0]))
    sm["spec"]["endpoints"][0]["intervall"] = "5s"  # the CRD would silently prune it
    with pytest.raises(Exception, match="intervall"):
        chart.validate(sm)


BAD_VALUES = [
    ({"colector": {"enabled": True}}, "additional properties 'colector' not allowed"),
    ({"agent": {"hostPID": True}}, "additional properties 'hostPID' not allowed"),
    ({"collector": {"replicas": 2}}, "/collector/replicas': value must be 1"),
    ({"collector": {"store": {"type": "postgres"}}}, "postgres/existingSecret': minLength"),
    ({"collector": {"store": {"type": "mysql"}}}, "value must be one of 'sqlite', 'postgres'"),
    (
        {"controller": {"recovery": {"mode": "yolo"}}},
        "value must be one of 'observe', 'advise', 'act'",
    ),
    ({"controller": {"recovery": {"breaker": {"maxFraction": 2}}}}, "breaker/maxFraction"),
    ({"agent": {"progressDir": "/tmp/vigil"}}, "/agent/progressDir"),
    ({"image": {"digest": "latest"}}, "/image/digest"),
    ({"collector": {"port": 70000}}, "/collector/port"),
    ({"agent": {"relay": {"port": 0}}}, "/agent/relay/port"),
    ({"monitoring": {"serviceMonitor": {"interval": "often"}}}, "/monitoring/serviceMonitor"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES)
def test_bad_values_are_refused_with_the_key_named(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.render(values)
    assert message in str(refused.value)


def test_postgres_allows_several_collectors() -> None:
    (deployment,) = [o for o in objects("postgres-external", "Deployment")]
    assert deployment["spec"]["replicas"] == 3


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_selectors_match_what_they_select(name: str) -> None:
    rendered = objects(name)
    pods = [o["spec"]["template"]["metadata"]["labels"] for o in rendered if o["kind"] in WORKLOADS]
    for workload in (o for o in rendered if o["kind"] in WORKLOADS):
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
        others = [p for p in pods if p is not labels and selector.items() <= p.items()]
        assert others == [], f"{workload['metadata']['name']} selects another workload's pods"
    services = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Service"}
    for service in services.values():
        selected = [p for p in pods if service["spec"]["selector"].items() <= p.items()]
        assert len(selected) == 1, service["metadata"]["name"]
    for monitor in (o for o in rendered if o["kind"] == "ServiceMonitor"):
        wanted = monitor["spec"]["selector"]["matchLabels"].items()
        (service,) = [s for s in services.values() if wanted <= s["metadata"]["labels"].items()]
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
        # The scrape job name the alert rules expect: up{job="vigil-agent"} / "vigil-collector".
        job = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
        assert job == "vigil-" + service["metadata"]["labels"]["app.kubernetes.io/component"]
    for ingress in (o for o in rendered if o["kind"] == "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["port"]["name"] in {
                    p["name"] for p in services[backend["name"]]["spec"]["ports"]
                }


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_every_container_has_resources_and_the_servers_have_probes(name: str) -> None:
    for obj in objects(name):
        if obj["kind"] not in WORKLOADS | {"Pod"}:
            continue
        for container in pod_spec(obj)["containers"]:
            assert container["resources"]["requests"], obj["metadata"]["name"]
            assert container["resources"]["limits"]["memory"], obj["metadata"]["name"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            if obj["kind"] == "Pod" or container["name"] == "controller":
                continue
            ports = {p["name"] for p in container["ports"]}
            path = "/healthz" if container["name"] == "collector" else "/metrics"
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"]["path"] == path
                assert container[probe]["httpGet"]["port"] in ports


def _rbac(name: str) -> list[dict[str, Any]]:
    return [o for o in objects(name) if o["kind"] in RBAC]


@pytest.mark.parametrize("name", [n for n in VALUE_SET_NAMES if n != "controller-act"])
def test_no_rbac_and_no_api_token_without_the_controller(name: str) -> None:
    assert _rbac(name) == []
    for obj in objects(name):
        if obj["kind"] in WORKLOADS | {"Pod"}:
            assert pod_spec(obj)["automountServiceAccountToken"] is False


def test_the_controller_gets_exactly_the_permissions_it_needs() -> None:
    rbac = _rbac("controller-act")
    (cluster_role,) = [o for o in rbac if o["kind"] == "ClusterRole"]
    assert cluster_role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}
    ]
    roles = {
        (o["metadata"]["namespace"], o["metadata"]["name"]) for o in rbac if o["kind"] == "Role"
    }
    # Read access where its jobs run; write access only in the allow-listed namespace.
    assert roles == {
        ("training", "vigil-controller-observe"),
        ("research", "vigil-controller-observe"),
        ("training", "vigil-controller-act"),
    }
    for role in (o for o in rbac if o["kind"] in {"Role", "ClusterRole"}):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            assert not {"delete", "deletecollection", "update", "escalate", "bind"} & set(
                rule["verbs"]
            )
    for binding in (o for o in rbac if o["kind"] in {"RoleBinding", "ClusterRoleBinding"}):
        assert binding["roleRef"]["name"] == binding["metadata"]["name"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "vigil-controller", "namespace": chart.NAMESPACE}
        ]
    # Observe mode never gets to change a node or a pod.
    observe = {"controller": {"enabled": True, "jobs": [{"jobset": "j", "namespace": "t"}]}}
    rendered = [o for o in chart.render(observe) if o["kind"] in RBAC]
    verbs = {v for o in rendered if "rules" in o for r in o["rules"] for v in r["verbs"]}
    resources = {x for o in rendered if "rules" in o for r in o["rules"] for x in r["resources"]}
    assert "pods/eviction" not in resources and "pods/exec" not in resources
    assert [r["verbs"] for o in rendered if o["kind"] == "ClusterRole" for r in o["rules"]] == [
        ["get", "list"]
    ]
    assert verbs <= {"get", "list", "create", "patch"}  # create/patch: its Lease, its journal


def test_controller_needs_a_job_to_watch() -> None:
    with pytest.raises(helm.HelmValuesError, match="jobs"):
        chart.render({"controller": {"enabled": True}})
    with pytest.raises(helm.HelmValuesError, match="oneOf"):
        chart.render(
            {
                "controller": {
                    "enabled": True,
                    "jobs": [{"jobset": "a", "trainjob": "b", "namespace": "t"}],
                }
            }
        )


def test_the_controller_commands_are_what_vigil_controller_accepts() -> None:
    k8s_cli = pytest.importorskip(
        "vigil.recovery.k8s_cli", reason="`vigil controller --kubernetes` is not in this checkout"
    )
    parser = argparse.ArgumentParser(exit_on_error=False)
    k8s_cli._configure(parser)
    parsed = {}
    for ctl in objects("controller-act", "Deployment"):
        if ctl["metadata"]["labels"]["app.kubernetes.io/component"] != "controller":
            continue
        container = pod_spec(ctl)["containers"][0]
        assert container["args"][0] == "controller"
        args = parser.parse_args(container["args"][1:])
        parsed[args.jobset or args.trainjob] = args
        assert "VIGIL_TOKEN" in env_of(container)
    # Each controller's own Lease (one per job, so jobs sharing a namespace never block each
    # other) is one its Role lets it take over, and only its own.
    rbac = _rbac("controller-act")
    for target, args in parsed.items():
        assert args.lease_name == f"vigil-controller-{target}"
        lease = {"group": "coordination.k8s.io", "resource": "leases", "namespace": args.namespace}
        assert _granted(rbac, {**lease, "verb": "patch", "name": args.lease_name})
        assert not _granted(rbac, {**lease, "verb": "patch", "name": "vigil-controller"})
    llama, bert = parsed["llama-pretrain"], parsed["bert-finetune"]
    assert (llama.namespace, llama.ranks_per_pod, llama.mode) == ("training", 8, "act")
    assert llama.allow_namespace == ["training"] and bert.allow_namespace == ["training"]
    assert (bert.trainjob, bert.namespace, bert.max_restarts) == ("bert-finetune", "research", 2)
    assert (llama.breaker_max_nodes, llama.breaker_max_fraction, llama.breaker_window) == (
        1,
        0.05,
        7200.0,
    )
    assert llama.collector == f"http://vigil-collector.{chart.NAMESPACE}.svc:8470"


def _granted(rbac: list[dict[str, Any]], entry: dict[str, str]) -> bool:
    """Would these Roles/ClusterRoles let the controller do `entry` (Kubernetes RBAC rules)?"""
    for role in (o for o in rbac if o["kind"] in {"Role", "ClusterRole"}):
        namespace = role["metadata"].get("namespace")
        if role["kind"] == "Role" and namespace != entry.get("namespace"):
            continue
        for rule in role["rules"]:
            names = rule.get("resourceNames")
            if (
                entry["group"] in rule["apiGroups"]
                and entry["resource"] in rule["resources"]
                and entry["verb"] in rule["verbs"]
                and (not names or entry.get("name") in names)
            ):
                return True
    return False


def test_helm_test_checks_health_metrics_and_each_controller_permission() -> None:
    for name in VALUE_SET_NAMES:
        (pod,) = objects(name, "Pod")
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        container = pod["spec"]["containers"][0]
        spec = json.loads(container["args"][0])
        assert container["command"] == ["python3", "/test/helm_test.py"]
        values = chart.VALUE_SETS[name]
        if values.get("collector", {}).get("enabled", True):
            assert spec["collector"] == f"http://vigil-collector.{chart.NAMESPACE}.svc:8470"
        else:
            assert spec["collector"] is None
        assert spec["agent"] == f"http://vigil-agent.{chart.NAMESPACE}.svc:9464"
        (script,) = [o for o in objects(name, "ConfigMap") if o["metadata"]["name"] == "vigil-test"]
        assert (
            script["data"]["helm_test.py"] == (chart.CHART / "files" / "helm_test.py").read_text()
        )
    (pod,) = objects("controller-act", "Pod")
    access = json.loads(pod["spec"]["containers"][0]["args"][0])["access"]
    assert pod["spec"]["serviceAccountName"] == "vigil-controller"
    verbs = {(a["resource"], a["verb"]) for a in access}
    assert {("nodes", "patch"), ("pods/eviction", "create"), ("jobsets", "patch")} <= verbs
    assert {("leases", "create"), ("leases", "patch"), ("jobs", "create")} <= verbs
    assert {a["namespace"] for a in access if a["resource"] == "pods/eviction"} == {"training"}
    rbac = _rbac("controller-act")
    assert [a for a in access if not _granted(rbac, a)] == []
    # ... and the evaluator does refuse what the chart does not grant.
    assert not _granted(rbac, {"group": "", "resource": "pods", "verb": "delete", "namespace": "x"})


def test_host_pid_and_ptrace_only_when_stack_dumps_are_asked_for() -> None:
    for name in VALUE_SET_NAMES:
        asked = chart.VALUE_SETS[name].get("agent", {}).get("stackDumps", {}).get("enabled", False)
        for obj in objects(name):
            if obj["kind"] not in WORKLOADS | {"Pod"}:
                continue
            spec = pod_spec(obj)
            is_agent = obj["kind"] == "DaemonSet"
            assert spec.get("hostPID", False) is (asked and is_agent), (name, obj["kind"])
            for container in spec["containers"]:
                added = container["securityContext"]["capabilities"].get("add", [])
                assert ("SYS_PTRACE" in added) is (asked and is_agent)
                assert set(added) <= {"SYS_PTRACE", "DAC_OVERRIDE"}
                assert not container["securityContext"].get("privileged", False)
    assert {"agent-only", "controller-act"} == {
        n for n in VALUE_SET_NAMES if pod_spec(one(n, "DaemonSet")).get("hostPID")
    }


def test_the_relay_listens_on_a_host_port_only_when_asked_for() -> None:
    for name in VALUE_SET_NAMES:
        asked = chart.VALUE_SETS[name].get("agent", {}).get("relay", {}).get("enabled", False)
        if not chart.VALUE_SETS[name].get("agent", {}).get("enabled", True):
            continue
        agent = pod_spec(one(name, "DaemonSet"))["containers"][0]
        ports = {p["name"]: p for p in agent["ports"]}
        args = _agent_parser().parse_args(agent["args"][1:])
        if asked:
            assert args.relay_port == 9465 and args.relay_host == "0.0.0.0"
            assert ports["relay"] == {
                "name": "relay", "containerPort": 9465, "hostPort": 9465, "protocol": "TCP"
            }  # fmt: skip
        else:
            assert args.relay_port is None and "relay" not in ports
        assert all("hostPort" not in p for n, p in ports.items() if n != "relay")
    assert [n for n in VALUE_SET_NAMES if "relay" in str(one(n, "DaemonSet"))] == [
        "postgres-external"
    ]
    with pytest.raises(
        helm.HelmRenderError, match=r"agent\.relay\.enabled needs collector\.enabled"
    ):
        chart.render({"collector": {"enabled": False}, "agent": {"relay": {"enabled": True}}})


def test_dashboard_configmaps_hold_exactly_the_committed_dashboards() -> None:
    committed = {p.name: p.read_text() for p in sorted(DASHBOARDS.glob("*.json"))}
    assert committed
    maps = [
        o for o in objects("default", "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]
    ]
    shipped: dict[str, str] = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "vigil"
        assert cm["metadata"]["namespace"] == chart.NAMESPACE
        shipped |= cm["data"]
    assert shipped == committed  # byte for byte, one ConfigMap per dashboard
    assert len(maps) == len(committed)
    # Another cluster's sidecar conventions, and the UI links pointed at the Ingress host.
    air = [
        o
        for o in objects("air-gapped", "ConfigMap")
        if "grafana_dashboard" in o["metadata"]["labels"]
    ]
    assert {o["metadata"]["namespace"] for o in air} == {"grafana"}
    pg = [
        o
        for o in objects("postgres-external", "ConfigMap")
        if "grafana_dashboard" in o["metadata"]["labels"]
    ]
    text = "".join(v for o in pg for v in o["data"].values())
    if "http://localhost:8470" in "".join(committed.values()):
        assert "http://localhost:8470" not in text and "https://vigil.example.com" in text
    for value in (json.loads(v) for o in pg for v in o["data"].values()):
        assert value["uid"]


def test_the_prometheus_rule_holds_exactly_the_committed_rules() -> None:
    committed = []
    for path in sorted((DASHBOARDS / "rules").glob("*.yml")):
        committed += yaml.safe_load(path.read_text())["groups"]
    (rule,) = objects("default", "PrometheusRule")
    assert rule["spec"]["groups"] == committed
    assert {"vigil-alerts", "vigil-job-aggregates"} <= {g["name"] for g in committed}
    (linked,) = objects("postgres-external", "PrometheusRule")
    links = [
        r["annotations"]["ui"]
        for g in linked["spec"]["groups"]
        for r in g["rules"]
        if "ui" in r.get("annotations", {})
    ]
    assert links and all(link.startswith("https://vigil.example.com/ui/") for link in links)


def test_monitoring_objects_follow_their_toggles_and_labels() -> None:
    kinds = chart.kinds(objects("monitoring-off"))
    assert "ServiceMonitor" not in kinds and "PrometheusRule" not in kinds
    assert not [
        o
        for o in objects("monitoring-off", "ConfigMap")
        if "grafana_dashboard" in o["metadata"]["labels"]
    ]
    for obj in objects("sqlite-single", "ServiceMonitor") + objects(
        "sqlite-single", "PrometheusRule"
    ):
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert {o["metadata"]["name"] for o in objects("agent-only", "ServiceMonitor")} == {
        "vigil-agent"
    }


def _agent_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    agent_cli._configure(parser)
    return parser


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_the_agent_and_collector_commands_are_what_vigil_accepts(name: str) -> None:
    declared = {v.value for v in EnvVar}
    agent = pod_spec(one(name, "DaemonSet"))["containers"][0]
    assert agent["command"] == ["vigil"] and agent["args"][0] == "agent"
    args = _agent_parser().parse_args(agent["args"][1:])
    assert args.metrics_host == "0.0.0.0" and args.metrics_port == 9464
    assert str(args.progress_dir) == "/dev/shm/vigil"
    env = env_of(agent)
    assert env["VIGIL_PROGRESS_DIR"] == "/dev/shm/vigil"
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert "/dev/shm/vigil" in mounts
    assert mounts["/var/lib/kubelet/pod-resources"]["readOnly"] is True
    assert env["VIGIL_POD_RESOURCES_SOCKET"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    volumes = {v["name"]: v for v in pod_spec(one(name, "DaemonSet"))["volumes"]}
    assert volumes["progress"]["hostPath"]["path"] == "/dev/shm/vigil"
    workloads = [o for o in objects(name) if o["kind"] in WORKLOADS]
    for container in (c for o in workloads for c in pod_spec(o)["containers"]):
        assert {n for n in env_of(container) if n.startswith("VIGIL_")} <= declared
    collectors = [
        o
        for o in workloads
        if o["metadata"]["labels"]["app.kubernetes.io/component"] == "collector"
    ]
    if not collectors:
        assert "VIGIL_COLLECTOR_URL" not in env and "VIGIL_TOKEN" not in env
        assert env["VIGIL_OUTPUT_DIR"] == "/var/lib/vigil/output"  # on the state hostPath
        assert objects(name, "Secret") == []  # no tokens without a collector to check them
        return
    (collector,) = collectors
    c = pod_spec(collector)["containers"][0]
    cenv = env_of(c)
    assert c["args"] == ["collector"]
    assert cenv["VIGIL_COLLECTOR_HOST"] == "0.0.0.0"
    # Tokens from the Secret: the collector refuses a network bind without them.
    secret = cenv["VIGIL_INGEST_TOKENS"]["secretKeyRef"]
    assert env["VIGIL_TOKEN"]["secretKeyRef"] == secret
    assert env["VIGIL_COLLECTOR_URL"] == f"http://vigil-collector.{chart.NAMESPACE}.svc:8470"


def test_sqlite_is_one_stateful_replica_with_its_volume_and_postgres_reads_a_secret() -> None:
    sts = one("sqlite-single", "StatefulSet")
    assert sts["spec"]["replicas"] == 1
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    env = env_of(pod_spec(sts)["containers"][0])
    assert env["VIGIL_STORE_URL"] == "sqlite:////var/lib/vigil/collector.sqlite3"
    (secret,) = objects("sqlite-single", "Secret")
    assert set(secret["data"]) == {"ingest-token", "read-token"}
    pg = one("postgres-external", "Deployment", "collector")
    env = env_of(pod_spec(pg)["containers"][0])
    assert env["VIGIL_STORE_URL"] == {"secretKeyRef": {"name": "vigil-postgres", "key": "url"}}
    assert env["VIGIL_READ_TOKENS"]["secretKeyRef"]["name"] == "vigil-tokens"
    assert objects("postgres-external", "Secret") == []  # the existing Secret is used


def test_air_gapped_images_come_from_the_mirror_by_digest_with_pull_secrets() -> None:
    digest = chart.VALUE_SETS["air-gapped"]["image"]["digest"]
    for obj in objects("air-gapped"):
        if obj["kind"] not in WORKLOADS | {"Pod"}:
            continue
        spec = pod_spec(obj)
        assert spec["imagePullSecrets"] == [{"name": "internal-registry"}]
        for container in spec["containers"]:
            assert container["image"] == f"registry.internal.example:5000/mirror/vigil@{digest}"
            assert container["imagePullPolicy"] == "Always"
    default = pod_spec(one("default", "DaemonSet"))["containers"][0]["image"]
    assert default == f"ghcr.io/vigil/vigil:{vigil.__version__}"


def test_chart_version_is_semver_and_app_version_is_vigils() -> None:
    meta = yaml.safe_load((chart.CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2"
    assert re.fullmatch(r"\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", meta["version"])
    assert meta["appVersion"] == vigil.__version__
    assert meta["kubeVersion"].startswith(">=1.27")
    for obj in objects("default"):
        labels = obj["metadata"]["labels"]
        assert labels["helm.sh/chart"] == f"vigil-{meta['version']}"
        assert labels["app.kubernetes.io/version"] == meta["appVersion"]


def test_every_default_value_has_its_place_in_the_strict_schema() -> None:
    schema = json.loads((chart.CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((chart.CHART / "values.yaml").read_text())
    missing: list[str] = []
    closed: list[str] = []

    def walk(values: Any, node: dict[str, Any], path: str) -> None:
        if not isinstance(values, dict) or "properties" not in node:
            return  # a leaf, or an open map (labels, annotations, affinity)
        if node.get("additionalProperties") is False:
            closed.append(path)
        for key, value in values.items():
            if key not in node["properties"]:
                missing.append(path + key)
            else:
                walk(value, node["properties"][key], path + key + ".")

    walk(defaults, schema, "")
    assert missing == []
    assert {"", "collector.", "agent.", "controller.recovery.", "monitoring.dashboards."} <= set(
        closed
    )


def test_agents_run_on_gpu_nodes_unless_the_selector_is_cleared() -> None:
    default = pod_spec(one("default", "DaemonSet"))
    assert default["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in default[
        "tolerations"
    ]
    assert "nodeSelector" not in pod_spec(one("agent-only", "DaemonSet"))
    assert "on every node" in chart.notes(chart.VALUE_SETS["agent-only"])


def test_notes_say_how_to_reach_the_ui_and_api() -> None:
    text = chart.notes({})
    assert f"kubectl -n {chart.NAMESPACE} port-forward svc/vigil-collector 8470:8470" in text
    assert "/ui/" in text and "/api/v1" in text and "helm test vigil" in text


def test_the_chart_reads_dashboards_through_its_symlink() -> None:
    link = chart.CHART / "files" / "dashboards"
    assert link.is_symlink() and link.resolve() == DASHBOARDS.resolve()
    assert Path(link, "rules").is_dir()


def _readme_section() -> str:
    text = (chart.ROOT / "README.md").read_text()
    return text.split("## Deploy on Kubernetes", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_install_line_and_training_pod_lines_are_valid() -> None:
    section = _readme_section()
    sets = re.findall(r"--set (\S+)", section)
    assert sets
    values = helm.parse_set_string(",".join(sets).replace("<registry>", "registry.example"))
    assert chart.render(values)  # the schema accepts the README's install line
    (pod,) = [b for b in re.findall(r"```yaml\n(.*?)```", section, re.S) if "containers:" in b]
    spec = yaml.safe_load(pod)
    env = {e["name"] for e in spec["containers"][0]["env"]}
    assert {n for n in env if n.startswith("VIGIL_")} <= {v.value for v in EnvVar}
    assert {"VIGIL_COLLECTOR_URL", "VIGIL_TOKEN", "VIGIL_RUN_ID", "NODE_NAME"} <= env
    assert spec["volumes"][0]["hostPath"]["path"] == chart.VALUE_SETS["default"].get(
        "agent", {}
    ).get("progressDir", "/dev/shm/vigil")
    for value in re.findall(r"^\| `([a-z][A-Za-z.]+)", section, re.M):
        node: Any = yaml.safe_load((chart.CHART / "values.yaml").read_text())
        for key in value.rstrip(".").split("."):
            assert key in node, f"README names {value}, values.yaml has no such key"
            node = node[key]


def test_advise_mode_gets_the_write_roles_and_needs_the_collector() -> None:
    """advise makes the same changes as act once a person approves them, so it needs the same
    Roles; approvals go through the collector's API, so it is refused without one."""
    values = {
        "controller": {
            "enabled": True,
            "jobs": [{"jobset": "j", "namespace": "t"}],
            "recovery": {"mode": "advise", "allowNamespaces": ["t"]},
        }
    }
    rendered = chart.render(values)
    roles = {o["metadata"]["name"] for o in rendered if o["kind"] == "Role"}
    assert roles == {"vigil-controller-observe", "vigil-controller-act"}
    (ctl,) = [
        o
        for o in rendered
        if o["kind"] == "Deployment"
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == "controller"
    ]
    assert "--mode=advise" in pod_spec(ctl)["containers"][0]["args"]
    with pytest.raises(helm.HelmRenderError, match="advise needs collector"):
        chart.render({**values, "collector": {"enabled": False}})
