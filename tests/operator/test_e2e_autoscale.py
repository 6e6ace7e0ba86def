"""Autoscaling end to end: the real operator, the API emulator, and pods whose
/metrics are real HTTP servers on loopback. The test plays the Deployment
controller (pods from the template, Deployment status)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from pagefleet.operator import crd
from tests.operator.harness import Cluster, MetricsServer, load_example, pod_from_template

pytestmark = pytest.mark.asyncio(loop_scope="session")

NS = "autoscale"
NAME = "qwen-autoscaled"
TARGET = 5
WINDOW_S = 5  # scaleDownStabilizationSeconds, short for the test; interval 1 s


@pytest_asyncio.fixture(loop_scope="session")
async def servers() -> AsyncIterator[list[MetricsServer]]:
    started = [await MetricsServer(model="qwen2.5-7b").start() for _ in range(4)]
    try:
        yield started
    finally:
        for s in started:
            await s.stop()


class DeploymentController:
    """Does what kube-controller-manager would: keeps one ready pod per replica
    (pod i serves /metrics from servers[i]) and reports the Deployment status."""

    def __init__(self, cluster: Cluster, servers: list[MetricsServer]) -> None:
        self.cluster, self.servers, self.pods = cluster, servers, 0

    async def sync(self) -> int:
        dep = await self.cluster.get("Deployment", NS, NAME)
        assert dep is not None
        want = dep["spec"]["replicas"]
        while self.pods < want:
            await self.cluster.apply(pod_from_template(dep, self.pods, self.servers[self.pods].port), NS)
            self.pods += 1
        while self.pods > want:
            self.pods -= 1
            await self.cluster.delete("Pod", NS, f"{NAME}-{self.pods}")
        await self.cluster.patch("Deployment", NS, NAME, {"status": {
            "replicas": want, "readyReplicas": want, "updatedReplicas": want, "availableReplicas": want}},
            sub="status")
        return want


def cr_statuses(cluster: Cluster) -> list[dict[str, Any]]:
    return [v.get("status") or {} for v in cluster.history(crd.KIND, NS, NAME)]


async def scaled_events(cluster: Cluster) -> list[str]:
    return [e["message"] for e in await cluster.events(NS, NAME) if e["reason"] == "Scaled"]


async def test_scales_up_at_once_and_down_after_the_window(
        cluster: Cluster, operator: str, servers: list[MetricsServer]) -> None:
    doc = next(d for d in load_example("autoscaling.yaml") if d["kind"] == crd.KIND)
    doc["spec"]["autoscaling"].update({"minReplicas": 1, "maxReplicas": 4, "metric": "waiting", "target": TARGET,
                                       "intervalSeconds": 1, "scaleDownStabilizationSeconds": WINDOW_S})
    doc["spec"]["servedModelName"] = "qwen2.5-7b"
    await cluster.apply(doc, NS)
    controller = DeploymentController(cluster, servers)

    await cluster.wait_object("Deployment", NS, NAME, lambda d: d["spec"]["replicas"] == 1, "1 replica")
    await controller.sync()
    await cluster.wait_condition(NS, NAME, "Available", "True")

    # 14 requests queue up on the only replica: ceil(14 / 5) = 3, at the next evaluation.
    servers[0].waiting = 14
    await cluster.wait_object("Deployment", NS, NAME, lambda d: d["spec"]["replicas"] == 3, "scale-up to 3")
    assert not any(s.get("waitingRequests") == 14 and s.get("desiredReplicas") == 1 for s in cr_statuses(cluster)), \
        "the first evaluation that saw the queue scaled up (no stabilization on the way up)"
    events = await cluster.wait_for(lambda: scaled_events(cluster), "a Scaled event")
    assert events == ["scaled 1 -> 3: 14 waiting, target 5 per replica"]
    md = await cluster.wait_object(crd.KIND, NS, NAME,
                                   lambda o: (o.get("status") or {}).get("desiredReplicas") == 3, "status 3")
    assert md["status"]["lastScaleTime"]
    assert md["spec"] == doc["spec"], "the operator never writes the CR's spec (no GitOps drift)"

    # The new replicas come up; the queue spreads over them and stays within tolerance.
    await controller.sync()
    servers[0].waiting, servers[1].waiting, servers[2].waiting = 5, 5, 4
    await cluster.wait_object(crd.KIND, NS, NAME, lambda o: (o.get("status") or {}).get("readyReplicas") == 3
                              and o["status"].get("waitingRequests") == 14, "3 ready, 14 waiting")

    # The queue drains. The recommendation drops to 1 but the window holds 3.
    seen_before_drain = len(cr_statuses(cluster))
    for s in servers:
        s.waiting = 0
    await cluster.wait_object("Deployment", NS, NAME, lambda d: d["spec"]["replicas"] == 1,
                              "scale-down to 1 after the window")
    after = cr_statuses(cluster)[seen_before_drain:]
    assert any(s.get("waitingRequests") == 0 and s.get("desiredReplicas") == 3 for s in after), \
        "the operator saw the empty queue and held 3 replicas during the stabilization window"
    events = await cluster.wait_for(
        lambda: _having(scaled_events(cluster), 2), "a second Scaled event")
    assert events[1].startswith("scaled 3 -> 1: 0 waiting, target 5 per replica")

    await controller.sync()
    md = await cluster.wait_object(crd.KIND, NS, NAME, lambda o: (o.get("status") or {}).get("replicas") == 1,
                                   "status.replicas 1")
    assert md["status"]["desiredReplicas"] == 1
    assert md["spec"] == doc["spec"]


async def _having(events_coro: Any, n: int) -> list[str] | None:
    events = await events_coro
    return events if len(events) >= n else None
