"""`helm test` checks of a vigil release (stdlib only; runs in the vigil image).

Argument: a JSON object {"collector": URL|null, "agent": URL|null, "access": [...]}: the
collector's /healthz must answer 200 "ok", an agent's /metrics must carry vigil_agent_* series,
and each access entry ({"group", "resource", "verb", "namespace", "name"}) must be allowed to
this pod's ServiceAccount (the controller's), asked with a SelfSubjectAccessReview.
"""

import json
import ssl
import sys
import urllib.request

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
API = "https://kubernetes.default.svc"


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def allowed(entry: dict) -> bool:
    with open(f"{SA}/token") as handle:
        token = handle.read().strip()
    attrs = {
        k: entry[k] for k in ("group", "resource", "verb", "namespace", "name") if entry.get(k)
    }
    if "/" in attrs["resource"]:
        attrs["resource"], attrs["subresource"] = attrs["resource"].split("/", 1)
    body = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attrs},
    }
    request = urllib.request.Request(
        f"{API}/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    context = ssl.create_default_context(cafile=f"{SA}/ca.crt")
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return bool(json.loads(response.read())["status"].get("allowed"))


def say(line: str) -> None:
    sys.stdout.write(line + "\n")


def main() -> int:
    spec = json.loads(sys.argv[1])
    failures = []
    if spec.get("collector"):
        status, body = get(spec["collector"] + "/healthz")
        ok = status == 200 and json.loads(body).get("status") == "ok"
        say(f"collector /healthz: {status} {body.strip()}")
        if not ok:
            failures.append("collector not healthy")
    if spec.get("agent"):
        status, body = get(spec["agent"] + "/metrics")
        ok = status == 200 and "vigil_agent_queue_depth" in body
        say(f"agent /metrics: {status}, {len(body.splitlines())} lines")
        if not ok:
            failures.append("agent /metrics lacks vigil_agent_* series")
    for entry in spec.get("access", []):
        verdict = allowed(entry)
        where = entry.get("namespace") or "(cluster)"
        say(f"controller may {entry['verb']} {entry['resource']} in {where}: {verdict}")
        if not verdict:
            failures.append(f"controller cannot {entry['verb']} {entry['resource']}")
    for failure in failures:
        say(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
