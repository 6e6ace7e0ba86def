"""Scale from zero through the gateway (issue 13, must-hold 7), end to end: install
pagefleet with its gateway (manifests/ and manifests/gateway/), apply
manifests/examples/scale-to-zero.yaml shrunk to the CPU demo model, see it sit at 0
replicas, send requests through the gateway's Service (two at once: the emulator's
Service proxy spreads them over both gateway replicas, which share nothing), watch the
operator scale 0 -> 1 on the requests the gateway holds, get both answers, and see the
model go back to 0 after its idle window. No request fails; neither the operator nor
the gateway makes a call its RBAC does not grant.

Against the emulated cluster (real operator, gateway and server processes) or, with
KUBECONFIG set, a real cluster. Every wait is a bounded poll, never a timing assertion.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from e2e.cluster import Cluster
from e2e.test_user_path import condition
from pagefleet.operator import crd, resources

REPO = Path(__file__).resolve().parents[1]
OP_NS = "pagefleet-system"
NS = "pagefleet-e2e-zero"
NAME = "e2e-zero"
SERVED = "demo-on-demand"
GATEWAY = "pagefleet-gateway"
IDLE_S = 6
SAS = {f"system:serviceaccount:{OP_NS}:pagefleet-operator", f"system:serviceaccount:{OP_NS}:{GATEWAY}"}


def model_deployment(emulated: bool) -> dict[str, Any]:
    """manifests/examples/scale-to-zero.yaml on the CPU demo model, with a short idle
    window and interval."""
    doc = next(d for d in yaml.safe_load_all((REPO / "manifests/examples/scale-to-zero.yaml").read_text())
               if d and d["kind"] == crd.KIND)
    doc["metadata"] = {"name": NAME, "namespace": NS}
    spec = doc["spec"]
    spec["model"] = "/opt/pagefleet/models/demo"   # baked into the server image (the gateway's too)
    spec["servedModelName"] = SERVED
    spec["engine"] = {"maxModelLen": 512, "maxNumSeqs": 4,
                      "extraArgs": ["--kv-cache-memory", str(32 * 1024 * 1024)]}
    spec["autoscaling"].update(minReplicas=0, maxReplicas=1, intervalSeconds=1, scaleToZeroIdleSeconds=IDLE_S)
    spec["gateway"]["queueTimeoutSeconds"] = 600 if not emulated else 180
    if emulated:
        # The emulated node runs the gateway from this checkout, where the image's
        # /opt/pagefleet/models/demo is the demo model's build folder.
        from pagefleet.server.testing import demo_model_path

        spec["gateway"]["tokenizer"] = str(demo_model_path())
    spec["resources"] = {"gpus": 0, "cpu": "500m", "memory": "1Gi", "ephemeralStorage": "1Gi"}
    return doc


def deployment(cluster: Cluster) -> dict[str, Any] | None:
    return cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}")


def mdep(cluster: Cluster) -> dict[str, Any] | None:
    return cluster.get(f"/apis/{crd.API_VERSION}/namespaces/{NS}/{crd.PLURAL}/{NAME}")


def mdep_when(cluster: Cluster, check: Any) -> Any:
    """A poll for wait_for: the ModelDeployment once check(it) holds, else None."""
    def probe() -> dict[str, Any] | None:
        md = mdep(cluster)
        return md if md is not None and check(md) else None
    return probe


def replicas(cluster: Cluster) -> int | None:
    return ((deployment(cluster) or {}).get("spec") or {}).get("replicas")


def server_pods(cluster: Cluster) -> list[dict[str, Any]]:
    want = resources.selector_labels(NAME)
    return [p for p in cluster.items(f"/api/v1/namespaces/{NS}/pods")
            if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in want.items())]


def scaled(cluster: Cluster) -> list[str]:
    return [e["message"] for e in cluster.items(f"/api/v1/namespaces/{NS}/events")
            if e.get("reason") == "Scaled" and e["involvedObject"]["name"] == NAME]


def gateway_client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.service_url(OP_NS, GATEWAY) + "/v1", api_key="unused",
                         max_retries=0, timeout=600)


def test_install_with_the_gateway(cluster: Cluster) -> None:
    out = cluster.kubectl("apply", *cluster.apply_flags, "-f", str(REPO / "manifests"),
                          "-f", str(REPO / "manifests" / "gateway"))
    for what in (f"deployment.apps/{GATEWAY}", f"service/{GATEWAY}", f"clusterrole.rbac.authorization.k8s.io/{GATEWAY}"):
        assert what in out, out

    def ready(name: str, want: int) -> bool:
        dep = cluster.get(f"/apis/apps/v1/namespaces/{OP_NS}/deployments/{name}") or {}
        st = dep.get("status") or {}
        return st.get("readyReplicas") == want and st.get("updatedReplicas") == want == st.get("replicas")
    cluster.wait_for(lambda: ready("pagefleet-operator", 1), "the operator (with --gateway-service) to be ready")
    cluster.wait_for(lambda: ready(GATEWAY, 2), "both gateway replicas to be ready")
    cluster.kubectl("apply", *cluster.apply_flags, "-f", "-",
                    stdin=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}))


def test_a_model_at_zero_waits_for_its_first_request(cluster: Cluster) -> None:
    cluster.kubectl("apply", *cluster.apply_flags, "-f", "-", stdin=yaml.safe_dump(model_deployment(cluster.emulated)))
    cluster.wait_for(lambda: replicas(cluster) == 0, "the Deployment created at 0 replicas")
    md = cluster.wait_for(mdep_when(cluster, lambda o: condition(o, "Active") == "False"),
                          "Active=False (ScaledToZero): the operator reads the gateway")
    assert md["status"]["desiredReplicas"] == 0 and md["status"]["gatewayWaitingRequests"] == 0
    assert not server_pods(cluster)
    # The gateway lists the model while it has no replica.
    assert SERVED in [m.id for m in gateway_client(cluster).models.list().data]


def test_requests_wake_it_and_are_served(cluster: Cluster) -> None:
    client = gateway_client(cluster)

    def ask(i: int) -> str:
        reply = client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": f"wake up, request {i}"}],
            max_tokens=8, temperature=0)
        return reply.choices[0].message.content or ""

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ask, i) for i in range(2)]
        cluster.wait_for(mdep_when(cluster, lambda o: (o.get("status") or {}).get("gatewayWaitingRequests", 0) >= 1),
                         "the operator to see the requests the gateway holds")
        cluster.wait_for(lambda: replicas(cluster) == 1, "the operator to scale 0 -> 1")
        answers = [f.result(timeout=cluster.timeout) for f in futures]   # raises on any failed request
    assert all(answers), answers
    events = scaled(cluster)
    assert any(m.startswith("scaled 0 -> 1: ") and "waiting in the gateway" in m for m in events), events
    md = cluster.wait_for(mdep_when(cluster, lambda o: (o.get("status") or {}).get("readyReplicas") == 1),
                          "status.readyReplicas 1")
    assert condition(md, "Active") == "True"
    assert md["status"].get("lastRequestTime"), md["status"]


def test_idle_model_returns_to_zero(cluster: Cluster) -> None:
    cluster.wait_for(lambda: replicas(cluster) == 0, f"the model back at 0 after {IDLE_S}s idle")
    cluster.wait_for(lambda: not server_pods(cluster), "the server pod to go away")
    md = cluster.wait_for(mdep_when(cluster, lambda o: condition(o, "Active") == "False"),
                          "Active=False after scaling to zero")
    assert md["status"]["desiredReplicas"] == 0
    events = scaled(cluster)
    assert any(m.startswith("scaled 1 -> 0: idle for ") for m in events), events
    # The operator never wrote the CR's spec (GitOps tools see no drift).
    assert md["spec"]["autoscaling"] == model_deployment(cluster.emulated)["spec"]["autoscaling"]


def test_operator_and_gateway_stayed_within_their_rbac(cluster: Cluster) -> None:
    if not cluster.emulated:
        pytest.skip("RBAC is enforced by the real API server here")
    api = cluster.api_server  # type: ignore[attr-defined]
    denied = [d for d in api.denied if d[0] in SAS]
    assert not denied, denied
    # The gateway used every grant it has (list + watch of ModelDeployments and pods).
    gw = f"system:serviceaccount:{OP_NS}:{GATEWAY}"
    used = {(g, r, v) for u, v, g, r in api.used if u == gw}
    rules = [d for d in yaml.safe_load_all((REPO / "manifests/gateway/rbac.yaml").read_text())
             if d and d["kind"] == "ClusterRole" and d["metadata"]["name"] == GATEWAY]
    granted = {(g, r, v) for rule in rules[0]["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    assert granted == used, (granted, used)
    op = f"system:serviceaccount:{OP_NS}:pagefleet-operator"
    assert ("discovery.k8s.io", "list", "endpointslices") in {(g, v, r) for u, v, g, r in api.used if u == op}
    cluster.kubectl("-n", NS, "delete", f"{crd.PLURAL}.{crd.GROUP}", NAME, "--wait=false", check=False)
