"""spec.rollout against the API emulator: the real reconcile applies a strategy change
to the Deployment without touching its pod template (no pod restarts), and a surge
that a single-node model cache PVC can never take is refused as InvalidSpec instead of
deployed to stall."""

from __future__ import annotations

from typing import Any

import pytest

from pagefleet.operator import controller, crd, resources
from tests.operator.harness import Cluster

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _cr(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": name},
            "spec": {"model": "m", "modelCache": {"claimName": "cache"}, **spec}}


async def _pvc(cluster: Cluster, ns: str, modes: list[str]) -> None:
    await cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "cache"},
                         "spec": {"accessModes": modes}}, ns)


def _condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


async def test_a_strategy_change_patches_the_deployment_but_not_its_template(cluster: Cluster) -> None:
    ns = "rollout-change"
    await _pvc(cluster, ns, ["ReadWriteMany"])
    cr = await cluster.apply(_cr("m", {"replicas": 3}), ns)
    st, settings = controller.State(), controller.Settings()
    await controller.reconcile(cluster.kube, cr, st, settings, fresh=True)
    before = await cluster.get("Deployment", ns, "m")
    assert before is not None
    assert before["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}

    # A full GPU pool: no room for a surge pod.
    await cluster.patch(crd.KIND, ns, "m", {"spec": {"rollout": {"maxSurge": 0, "maxUnavailable": "34%"}}})
    await controller.reconcile(cluster.kube, cr, st, settings, fresh=True)
    after = await cluster.get("Deployment", ns, "m")
    assert after is not None
    assert after["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": "34%", "maxSurge": 0}
    # Same template, same hash: Kubernetes starts no rollout, no pod restarts.
    assert after["spec"]["template"] == before["spec"]["template"]
    hash_ = before["metadata"]["annotations"][resources.TEMPLATE_HASH]
    assert after["metadata"]["annotations"][resources.TEMPLATE_HASH] == hash_
    body = await cluster.get(crd.KIND, ns, "m")
    assert body is not None
    assert body["status"]["templateHash"] == hash_ and body["status"]["observedGeneration"] == 2
    assert not controller._drifted(after, hash_), "the new strategy is what the operator applied"


async def test_a_surge_with_a_readwriteonce_cache_is_invalid_spec(cluster: Cluster) -> None:
    ns = "rollout-rwo"
    await _pvc(cluster, ns, ["ReadWriteOnce"])
    cr = await cluster.apply(_cr("m", {"rollout": {"maxSurge": 1}}), ns)
    st, settings = controller.State(), controller.Settings()
    await controller.reconcile(cluster.kube, cr, st, settings, fresh=True)
    assert await cluster.get("Deployment", ns, "m") is None, "nothing is deployed that would stall"
    body = await cluster.get(crd.KIND, ns, "m")
    assert body is not None
    stalled = _condition(body, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "InvalidSpec")
    assert stalled["message"].startswith("spec.rollout.maxSurge: must be 0")
    assert "PVC cache is ReadWriteOnce" in stalled["message"]
    assert [e["reason"] for e in await cluster.events(ns, "m")] == ["InvalidSpec"]

    # Fixing the spec recovers: no surge, two pods replaced at a time.
    await cluster.patch(crd.KIND, ns, "m", {"spec": {"rollout": {"maxSurge": 0, "maxUnavailable": 2}}})
    await controller.reconcile(cluster.kube, cr, st, settings, fresh=True)
    dep = await cluster.get("Deployment", ns, "m")
    assert dep is not None
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 2, "maxSurge": 0}
    body = await cluster.get(crd.KIND, ns, "m")
    assert body is not None and _condition(body, "Stalled")["status"] == "False"
