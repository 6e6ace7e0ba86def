"""Issue 12 against the real operator process and the API emulator: a child the API
server refuses, a name that is no Service name, drift of the children, scrapes that
fail, the pod cache, OOM remediation. The tests play the controllers and kubelet the
emulator lacks (pods, their statuses, /metrics servers)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from pagefleet.operator import crd, names, status
from pagefleet.server.config import CUDA_OOM_EXIT_CODE
from tests.operator.harness import Cluster, MetricsServer, free_port, load_example, pod_from_template

pytestmark = pytest.mark.asyncio(loop_scope="session")
KIND = crd.KIND


def short_qa(name: str, **spec: Any) -> dict[str, Any]:
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == KIND)
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return doc


def cond(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return status.get_condition((obj or {}).get("status"), type_) or {}


@pytest_asyncio.fixture(loop_scope="session", autouse=True)
async def one_at_a_time(cluster: Cluster) -> AsyncIterator[None]:
    """Delete each test's ModelDeployments afterwards: the emulator (and the test's
    /metrics servers) share one event loop with the test, and a pile of fleets
    evaluated every second would slow it down."""
    yield
    for (res, ns, name), obj in list(cluster.emulator.objects.items()):
        if res.plural == crd.PLURAL and not obj.deleted:
            await cluster.delete(KIND, ns, name)

            async def gone(ns: str = ns, name: str = name) -> bool:
                return await cluster.get(KIND, ns, name) is None
            await cluster.wait_for(gone, f"{ns}/{name} deleted")


async def events(cluster: Cluster, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in await cluster.events(ns, name) if e["reason"] == reason]


async def test_a_refused_child_is_degraded_and_never_reported_current(cluster: Cluster, operator: str) -> None:
    """Finding 2: the API server rejects the Service; the periodic evaluation must not
    then write observedGeneration = generation and Degraded=False."""
    ns = "refused"
    message = 'Service "qwen-short" is invalid: spec.ports[0].port: Invalid value: 8000: quota exceeded'
    # Every create of the Service is refused, retries too: the emulator drops what a
    # reaction refused, as a real API server keeps nothing it refuses. kmock stores the
    # object for a moment first, so reads of it answer 404 throughout.
    cluster.emulator[f"post /api/v1/namespaces/{ns}/services"] << 422 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 422, "message": message}
    cluster.emulator[f"get /api/v1/namespaces/{ns}/services/qwen-short"] << 404 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "message": "not found"}
    doc = short_qa("qwen-short", autoscaling={"intervalSeconds": 1})
    await cluster.apply(doc, ns)
    md = await cluster.wait_condition(ns, "qwen-short", "Degraded", "True")
    degraded = cond(md, "Degraded")
    assert degraded["reason"] == "ApplyFailed" and message in degraded["message"]
    assert cond(md, "Stalled")["status"] == "True" and cond(md, "Ready")["status"] == "False"
    evs = await cluster.wait_for(lambda: events(cluster, ns, "qwen-short", "ApplyFailed"), "an ApplyFailed Event")
    assert all(message in e["message"] and e["type"] == "Warning" for e in evs), evs
    # Let several evaluations run (interval 1 s; the Deployment itself was applied).
    await cluster.wait_object("Deployment", ns, "qwen-short")
    await cluster.wait_for(evaluations(cluster, ns, "qwen-short", 3), "three more evaluations")
    for version in cluster.history(KIND, ns, "qwen-short"):
        st = version.get("status") or {}
        assert st.get("observedGeneration") != 1, "generation 1 was never fully applied"
        if st.get("conditions"):
            assert status.get_condition(st, "Degraded")["status"] == "True", st["conditions"]
    assert not [o for o in await cluster.kube.list(cluster.path("Service", ns))
                if o["metadata"]["name"] == "qwen-short"]   # nothing refused is kept


def deployment_reads(cluster: Cluster, ns: str, name: str) -> int:
    """GETs of the Deployment: each evaluation reads it once (the status is written
    only when something in it changed)."""
    path = f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"
    return sum(1 for r in cluster.emulator if r.method.value == "GET" and r.url.path == path)


def evaluations(cluster: Cluster, ns: str, name: str, n: int) -> Any:
    start = deployment_reads(cluster, ns, name)

    async def probe() -> bool:
        return deployment_reads(cluster, ns, name) >= start + n
    return probe


async def test_a_name_that_is_no_service_name_gets_valid_children(cluster: Cluster, operator: str) -> None:
    """Finding 3: `qwen2.5-7b` is a valid ModelDeployment name, not a Service name."""
    ns = "names"
    await cluster.apply(short_qa("qwen2.5-7b"), ns)
    child = names.child_name("qwen2.5-7b")
    assert child != "qwen2.5-7b" and "." not in child
    svc = await cluster.wait_object("Service", ns, child)
    await cluster.wait_object("Deployment", ns, child)
    await cluster.wait_object("PodDisruptionBudget", ns, child)
    assert svc["metadata"]["ownerReferences"][0]["name"] == "qwen2.5-7b"
    md = await cluster.wait_object(KIND, ns, "qwen2.5-7b", lambda o: "endpoint" in (o.get("status") or {}))
    assert md["status"]["endpoint"] == f"http://{child}.{ns}.svc:8000/v1"
    assert md["status"]["selector"].endswith(f"pagefleet.dev/model-deployment={child}")


async def test_drifted_children_are_repaired(cluster: Cluster, operator: str) -> None:
    """Finding 9: a deleted Service or PDB, or a hand-edited Deployment, is put back
    without waiting for a CR change or an operator restart."""
    ns = "drift"
    await cluster.apply(short_qa("qwen-short"), ns)
    dep = await cluster.wait_object("Deployment", ns, "qwen-short")
    await cluster.wait_object("Service", ns, "qwen-short")
    await cluster.wait_object("PodDisruptionBudget", ns, "qwen-short")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]

    assert await cluster.delete("Service", ns, "qwen-short")
    await cluster.wait_object("Service", ns, "qwen-short", what="the Service recreated")
    assert await cluster.delete("PodDisruptionBudget", ns, "qwen-short")
    await cluster.wait_object("PodDisruptionBudget", ns, "qwen-short", what="the PDB recreated")
    edited = dict(dep["spec"]["template"]["spec"]["containers"][0], args=[*args, "--max-num-seqs", "1"])
    await cluster.patch("Deployment", ns, "qwen-short", {"spec": {"template": {"spec": {"containers": [edited]}}}})
    await cluster.wait_object("Deployment", ns, "qwen-short",
                              lambda d: d["spec"]["template"]["spec"]["containers"][0]["args"] == args,
                              "the hand-edited args restored")
    repaired = await cluster.wait_for(lambda: events(cluster, ns, "qwen-short", "Repaired"), "Repaired Events")
    assert any("Service" in e["message"] for e in repaired)


async def test_failing_scrapes_are_reported_and_held(cluster: Cluster, operator: str) -> None:
    """Finding 5: every scrape fails (what a default-deny NetworkPolicy does): a
    MetricsAvailable=False condition and a Warning Event, no `waitingRequests: 0`."""
    ns = "blocked"
    doc = short_qa("qwen-short", replicas=None,
                   autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3, "intervalSeconds": 1})
    doc["spec"].pop("replicas")
    await cluster.apply(doc, ns)
    dep = await cluster.wait_object("Deployment", ns, "qwen-short")
    await cluster.apply(pod_from_template(dep, 0, free_port()), ns)     # nothing listens there
    md = await cluster.wait_condition(ns, "qwen-short", "MetricsAvailable", "False")
    c = cond(md, "MetricsAvailable")
    assert c["reason"] == "ScrapeFailed" and "port 8000" in c["message"] and "networkPolicy" in c["message"]
    assert "waitingRequests" not in md["status"] and "runningRequests" not in md["status"]
    (event,) = await cluster.wait_for(lambda: events(cluster, ns, "qwen-short", "MetricsUnavailable"),
                                      "a MetricsUnavailable Event")
    assert event["type"] == "Warning"
    assert (await cluster.get("Deployment", ns, "qwen-short"))["spec"]["replicas"] == 1, "held"


@pytest_asyncio.fixture(loop_scope="session")
async def metrics_server() -> AsyncIterator[MetricsServer]:
    server = await MetricsServer(model="qwen2.5-7b").start()
    try:
        yield server
    finally:
        await server.stop()


async def test_pods_come_from_a_watch_not_a_list_per_round(cluster: Cluster, operator: str,
                                                           metrics_server: MetricsServer) -> None:
    """Finding 10: no pod LIST per ModelDeployment per interval."""
    ns = "cache"
    doc = short_qa("qwen-short", autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 1,
                                              "intervalSeconds": 1})
    doc["spec"].pop("replicas")
    await cluster.apply(doc, ns)
    dep = await cluster.wait_object("Deployment", ns, "qwen-short")
    metrics_server.waiting = 2
    await cluster.apply(pod_from_template(dep, 0, metrics_server.port), ns)
    await cluster.wait_object(KIND, ns, "qwen-short",
                              lambda o: (o.get("status") or {}).get("waitingRequests") == 2, "the pod scraped")
    lists = len(list(cluster.emulator["list v1/pods"]))
    await cluster.wait_for(evaluations(cluster, ns, "qwen-short", 3), "three more evaluations")
    assert len(list(cluster.emulator["list v1/pods"])) == lists, "an evaluation listed the pods"
    md = await cluster.get(KIND, ns, "qwen-short")
    assert cond(md, "MetricsAvailable")["status"] == "True"
    assert md["status"]["runningRequests"] == 3 and md["status"]["metricValue"] == 5   # concurrency


def oom_status(container: str, finished_at: float, exit_code: int = CUDA_OOM_EXIT_CODE,
               reason: str = "Error") -> dict[str, Any]:
    return {"containerStatuses": [{"name": container, "ready": False, "restartCount": 1,
                                   "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                   "lastState": {"terminated": {"exitCode": exit_code, "reason": reason,
                                                                "finishedAt": status.to_iso(finished_at)}}}]}


async def test_oom_remediation_lowers_the_utilization_and_a_spec_change_resets_it(
        cluster: Cluster, operator: str) -> None:
    """Seed 002: pods that OOM twice (maxOOMs 2) within the window: the operator runs
    them with gpu-memory-utilization 0.9 - 0.05, in status only, and rolls them."""
    ns = "oom"
    doc = short_qa("qwen-short", autoscaling={"intervalSeconds": 1},
                   oomRemediation={"maxOOMs": 2, "windowSeconds": 600})
    await cluster.apply(doc, ns)
    dep = await cluster.wait_object("Deployment", ns, "qwen-short")
    now = time.time()
    for i, (code, reason) in enumerate(((CUDA_OOM_EXIT_CODE, "Error"), (137, "OOMKilled"))):
        p = pod_from_template(dep, i, free_port(), ready=False)
        p["status"].update(oom_status("server", now - 10 + i, code, reason))
        await cluster.apply(p, ns)

    def lowered(d: dict[str, Any]) -> bool:
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[-2:] == ["--gpu-memory-utilization", "0.85"]
    await cluster.wait_object("Deployment", ns, "qwen-short", lowered, "args with the lowered utilization")
    md = await cluster.wait_condition(ns, "qwen-short", "OOMRemediation", "True")
    assert md["status"]["oomRemediation"]["gpuMemoryUtilization"] == 0.85
    assert md["spec"] == doc["spec"], "the operator never writes the spec"
    (event,) = await cluster.wait_for(lambda: events(cluster, ns, "qwen-short", "OOMRemediation"), "an Event")
    assert "0.9 -> 0.85" in event["message"] and "CudaOutOfMemory" in event["message"]
    # A change of the spec starts over from the spec's value.
    await cluster.patch(KIND, ns, "qwen-short", {"spec": {"engine": {"maxModelLen": 2048}}})
    await cluster.wait_object("Deployment", ns, "qwen-short",
                              lambda d: "2048" in d["spec"]["template"]["spec"]["containers"][0]["args"]
                              and not lowered(d), "the remediation reset by the spec change")
    dep = await cluster.get("Deployment", ns, "qwen-short")
    new_hash = dep["metadata"]["annotations"]["pagefleet.dev/template-hash"]
    await cluster.wait_object(KIND, ns, "qwen-short", lambda o: (o.get("status") or {}).get(
        "oomRemediation", {}).get("specHash") == new_hash, "the remediation state of the new spec")
    md = await cluster.get(KIND, ns, "qwen-short")
    assert "gpuMemoryUtilization" not in md["status"]["oomRemediation"], "old pods' OOMs do not count again"
    assert cond(md, "OOMRemediation")["status"] == "False"
    assert not any("2048" in v["spec"]["template"]["spec"]["containers"][0]["args"] and lowered(v)
                   for v in cluster.history("Deployment", ns, "qwen-short"))
