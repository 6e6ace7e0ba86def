"""The user's path, end to end: install pagefleet from manifests/, apply an example
ModelDeployment, wait for Available, call it through its Service with the OpenAI
client, load it until it scales out, watch it scale back in, roll a change with a
client running (zero failed requests), uninstall.

Runs against the emulated cluster (e2e/emulator.py: real operator and real
`pagefleet serve` processes) or, with KUBECONFIG set, a real cluster. The stages
share one cluster and run in order; a stage that fails leaves the later ones failing
with it. Every wait is a bounded poll for a condition, never a timing assertion.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from e2e.cluster import Cluster
from pagefleet.operator import crd, resources

REPO = Path(__file__).resolve().parents[1]
OP_NS = "pagefleet-system"
NS = "pagefleet-e2e"
NAME = "e2e-chat"
SERVED = "demo-chat"
OPERATOR_SA = f"system:serviceaccount:{OP_NS}:pagefleet-operator"
STATE: dict[str, Any] = {}


def model_deployment() -> dict[str, Any]:
    """manifests/examples/autoscaling.yaml, shrunk to the CPU demo model: one sequence
    per step so that load queues up, and short intervals and windows."""
    docs = [d for d in yaml.safe_load_all((REPO / "manifests/examples/autoscaling.yaml").read_text()) if d]
    mdep = next(d for d in docs if d["kind"] == crd.KIND)
    mdep["metadata"] = {"name": NAME, "namespace": NS, "labels": mdep["metadata"].get("labels", {})}
    spec = mdep["spec"]
    spec["model"] = "/opt/pagefleet/models/demo"   # baked into the server image
    spec["servedModelName"] = SERVED
    spec["engine"] = {"maxModelLen": 512, "maxNumSeqs": 1, "maxNumBatchedTokens": 512,
                      "enablePrefixCaching": True,
                      "extraArgs": ["--kv-cache-memory", str(32 * 1024 * 1024), "--log-stats-interval", "2"]}
    # Concurrency (running + waiting) per replica against one sequence per replica.
    spec["autoscaling"].update(minReplicas=1, maxReplicas=2, metric="concurrency", target=1,
                               intervalSeconds=1, scaleUpStabilizationSeconds=0,
                               scaleDownStabilizationSeconds=8)
    spec["resources"] = {"gpus": 0, "cpu": "500m", "memory": "1Gi", "ephemeralStorage": "1Gi"}
    return mdep


def apply(cluster: Cluster, objs: list[dict[str, Any]]) -> str:
    return cluster.kubectl("apply", *cluster.apply_flags, "-f", "-",
                           stdin=yaml.safe_dump_all(objs, sort_keys=False))


def mdep_path() -> str:
    return f"/apis/{crd.API_VERSION}/namespaces/{NS}/{crd.PLURAL}/{NAME}"


def deployment(cluster: Cluster) -> dict[str, Any] | None:
    return cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}")


def server_pods(cluster: Cluster) -> list[dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in resources.selector_labels(NAME).items())
    pods = cluster.items(f"/api/v1/namespaces/{NS}/pods?labelSelector={selector}")
    want = resources.selector_labels(NAME)
    return [p for p in pods if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in want.items())]


def condition(obj: dict[str, Any] | None, type_: str) -> str | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c.get("status")
    return None


def chat_body(max_tokens: int, text: str = "Say something about paged attention.") -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


class Load:
    """`threads` clients sending chat completions back to back through the Service
    until stopped; every non-200 answer or transport error is a failure."""

    def __init__(self, cluster: Cluster, threads: int, max_tokens: int) -> None:
        self.url = cluster.service_url(NS, NAME) + "/v1/chat/completions"
        self.max_tokens = max_tokens
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                try:
                    r = client.post(self.url, json=chat_body(self.max_tokens, f"client {i} request {n}"))
                    good = r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
                    why = f"HTTP {r.status_code}: {r.text[:300]}"
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    good, why = False, repr(e)
                with self.lock:
                    if good:
                        self.ok += 1
                    else:
                        self.failures.append(why)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


# ------------------------------------------------------------------ stages

def test_install_from_manifests(cluster: Cluster) -> None:
    out = cluster.kubectl("apply", *cluster.apply_flags, "-f", str(REPO / "manifests"))
    for what in ("customresourcedefinition.apiextensions.k8s.io/modeldeployments.pagefleet.dev",
                 f"namespace/{OP_NS}", "deployment.apps/pagefleet-operator",
                 "clusterrole.rbac.authorization.k8s.io/pagefleet-operator"):
        assert what in out, out
    cluster.wait_for(lambda: ((cluster.get(f"/apis/apps/v1/namespaces/{OP_NS}/deployments/pagefleet-operator")
                               or {}).get("status") or {}).get("readyReplicas"), "the operator to be ready")
    apply(cluster, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}])


def test_example_becomes_available_and_serves(cluster: Cluster) -> None:
    apply(cluster, [model_deployment()])
    mdep = cluster.wait_for(lambda: (lambda o: o if condition(o, "Available") == "True" else None)(
        cluster.get(mdep_path())), "the ModelDeployment to be Available")
    dep = deployment(cluster)
    assert dep is not None
    # The operator owns its children, and the pods run the server image's ENTRYPOINT args.
    owner = dep["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (crd.KIND, NAME, mdep["metadata"]["uid"])
    assert mdep["status"]["endpoint"] == f"http://{NAME}.{NS}.svc:{resources.PORT}/v1"
    svc = cluster.get(f"/api/v1/namespaces/{NS}/services/{NAME}")
    assert svc is not None and svc["spec"]["selector"] == resources.selector_labels(NAME)

    # The official client, through the operator-made Service.
    client = openai.OpenAI(base_url=cluster.service_url(NS, NAME) + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED]
    reply = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hello!"}],
                                           max_tokens=12, temperature=0)
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None

    # Every vLLM metric the shipped alerts and dashboard query is one the server exports.
    metrics = httpx.get(cluster.service_url(NS, NAME) + "/metrics", timeout=30).text
    exported = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line and not line.startswith("#")}
    from tests.deploy.test_chart import metric_names

    queried: set[str] = set()
    rule = yaml.safe_load((REPO / "manifests/monitoring/prometheusrule.yaml").read_text())
    queried |= {n for g in rule["spec"]["groups"] for r in g["rules"] for n in metric_names(r["expr"])}
    dash = json.loads(yaml.safe_load((REPO / "manifests/monitoring/grafana-dashboard.yaml").read_text())
                      ["data"]["pagefleet.json"])
    queried |= {n for p in dash["panels"] for t in p["targets"] for n in metric_names(t["expr"])}
    missing = {n for n in queried if n.startswith(("vllm:", "http_"))} - exported
    assert not missing, f"alerts/dashboard query metrics the server does not export: {missing}"


def test_scales_up_under_load(cluster: Cluster) -> None:
    with Load(cluster, threads=5, max_tokens=48) as load:
        cluster.wait_for(lambda: ((deployment(cluster) or {}).get("spec") or {}).get("replicas") == 2,
                         "the operator to scale the Deployment to 2")
        cluster.wait_for(lambda: ((deployment(cluster) or {}).get("status") or {}).get("readyReplicas") == 2,
                         "2 ready replicas")
        # Both replicas serve: the Service spreads requests over both endpoints.
        cluster.wait_for(lambda: (cluster.get(mdep_path()) or {}).get("status", {}).get("readyReplicas") == 2,
                         "status.readyReplicas == 2")
    assert not load.failures, load.failures[:5]
    assert load.ok > 0
    events = cluster.items(f"/api/v1/namespaces/{NS}/events")
    scaled = [e for e in events if e.get("reason") == "Scaled" and e["involvedObject"]["name"] == NAME]
    assert scaled, [e.get("reason") for e in events]
    STATE["scaled_up_events"] = len(scaled)


def test_scales_back_down_after_the_window(cluster: Cluster) -> None:
    cluster.wait_for(lambda: ((deployment(cluster) or {}).get("spec") or {}).get("replicas") == 1,
                     "the operator to scale back to 1 after the stabilization window")
    cluster.wait_for(lambda: len(server_pods(cluster)) == 1 and
                     ((deployment(cluster) or {}).get("status") or {}).get("replicas") == 1,
                     "the extra pod to go away")
    mdep = cluster.get(mdep_path())
    assert mdep is not None and mdep["status"]["desiredReplicas"] == 1
    # The operator never writes the CR's spec (GitOps tools see no drift).
    assert mdep["spec"].get("replicas") == model_deployment()["spec"].get("replicas")
    assert mdep["spec"]["autoscaling"] == model_deployment()["spec"]["autoscaling"]


def test_rolling_change_has_no_failed_requests(cluster: Cluster) -> None:
    before = {p["metadata"]["name"] for p in server_pods(cluster)}
    old_template = (deployment(cluster) or {})["spec"]["template"]
    with Load(cluster, threads=1, max_tokens=8) as load:
        cluster.wait_for(lambda: load.ok >= 2, "the client to get answers before the change")
        cluster.kubectl("-n", NS, "patch", f"{crd.PLURAL}.{crd.GROUP}", NAME, "--type=merge", "-p",
                        json.dumps({"spec": {"env": [{"name": "E2E_ROLLOUT", "value": "2"}]}}))

        def rolled() -> bool:
            dep = deployment(cluster) or {}
            st, want = dep.get("status") or {}, (dep.get("spec") or {}).get("replicas")
            pods = server_pods(cluster)
            return (dep.get("spec", {}).get("template") != old_template
                    and st.get("updatedReplicas") == st.get("replicas") == st.get("readyReplicas") == want
                    and len(pods) == want and not before & {p["metadata"]["name"] for p in pods})
        cluster.wait_for(rolled, "the rollout to replace every pod")
        served = load.ok
        cluster.wait_for(lambda: load.ok >= served + 2, "the client to get answers from the new pod")
    assert not load.failures, f"{len(load.failures)} failed requests during the rollout: {load.failures[:5]}"
    new_env = deployment(cluster)["spec"]["template"]["spec"]["containers"][0]["env"]  # type: ignore[index]
    assert {"name": "E2E_ROLLOUT", "value": "2"} in new_env
    if cluster.emulated:
        # The old server drained and exited cleanly on SIGTERM.
        kubelet = cluster.kubelet  # type: ignore[attr-defined]
        old_runs = cluster.wait_for(lambda: [r for r in kubelet.finished if r.name in before],
                                    "the old pods' processes to be reaped")
        assert all(r.exit_codes and r.exit_codes[-1] == 0 for r in old_runs), \
            [(r.name, r.exit_codes) for r in old_runs]


def test_uninstall(cluster: Cluster) -> None:
    cluster.kubectl("-n", NS, "delete", f"{crd.PLURAL}.{crd.GROUP}", NAME, "--wait=false")
    cluster.wait_for(lambda: cluster.get(mdep_path()) is None and deployment(cluster) is None
                     and cluster.get(f"/api/v1/namespaces/{NS}/services/{NAME}") is None,
                     "the ModelDeployment and its children to be deleted")
    cluster.wait_for(lambda: not server_pods(cluster), "the server pods to go away")


def test_operator_stayed_within_its_rbac(cluster: Cluster) -> None:
    """Emulated cluster: every operator call, its exit included, was checked against the
    ClusterRole from manifests/rbac.yaml; none was denied, and the grants were all used."""
    if not cluster.emulated:
        pytest.skip("RBAC is enforced by the real API server here")
    # Uninstall the operator the way that lets it exit cleanly: its Deployment first
    # (on SIGTERM kopf takes itself out of the peering), then the RBAC and the rest.
    cluster.kubectl("-n", OP_NS, "delete", "deployment.apps/pagefleet-operator", "--wait=false")
    cluster.wait_for(lambda: not cluster.items(f"/api/v1/namespaces/{OP_NS}/pods"),
                     "the operator pod to exit")
    api = cluster.api_server  # type: ignore[attr-defined]
    denied = [d for d in api.denied if d[0] == OPERATOR_SA]
    assert not denied, denied
    used = {(g, r, v) for u, v, g, r in api.used if u == OPERATOR_SA}
    rules = yaml.safe_load_all((REPO / "manifests/rbac.yaml").read_text())
    role = next(d for d in rules if d and d["kind"] == "ClusterRole")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    unused = granted - used
    # Peering `list`/`watch`, deletes of children that were already gone, reads of a
    # model cache PVC (this example has none) and patches of a Service or PDB that never
    # drifted are conditional, and so are InferencePools (only where the Gateway API
    # Inference Extension is installed and a ModelDeployment asks for one; this cluster
    # has no such CRD); everything else the chart grants, the operator used.
    optional = {("kopf.dev", "clusterkopfpeerings", v) for v in ("patch", "list", "watch")} | \
               {("inference.networking.k8s.io", "inferencepools", v)
                for v in ("get", "list", "create", "patch", "delete")} | \
               {("", "persistentvolumeclaims", "get")} | \
               {("", "services", "patch"), ("policy", "poddisruptionbudgets", "patch")} | \
               {(g, r, "delete") for g, r in (("apps", "deployments"), ("", "services"),
                                              ("policy", "poddisruptionbudgets"))} | \
               {(g, r, "get") for g, r in (("apps", "deployments"), ("", "services"),
                                           ("policy", "poddisruptionbudgets"))}
    assert unused <= optional, f"granted but never used: {sorted(unused - optional)}"
    cluster.kubectl("delete", *cluster.apply_flags[:0], "-f", str(REPO / "manifests"), "--wait=false", check=False)
