"""Drift detection against an API server that stores objects its own way.

kube-apiserver drops `readOnly: false` (a Go `bool,omitempty`) and writes quantities
back canonical (`0.5` -> `500m`, `1.5Gi` -> `1536Mi`). The operator must not take
that for a hand edit: a Deployment that always looks drifted is re-applied every
round and never scraped, autoscaled or remediated. The emulator (harness.Emulator)
stores objects the way the API server does, so these tests run the real reconcile
and evaluate steps against it.
"""

from __future__ import annotations

from typing import Any

import pytest

from pagefleet.operator import controller, quantity, resources
from pagefleet.operator.spec import parse_spec
from tests.operator.harness import Cluster


# Canonical forms from the Kubernetes Quantity documentation and apimachinery's rules.
@pytest.mark.parametrize(("typed", "stored"), [
    ("0.5", "500m"), ("1.5", "1500m"), ("1000m", "1"), ("2000", "2k"), ("8", "8"), (4, "4"),
    ("1.5Gi", "1536Mi"), ("2048Mi", "2Gi"), ("16Gi", "16Gi"), ("1024Mi", "1Gi"), ("0.5Ki", "512"),
    ("1Ki", "1Ki"), ("1.5G", "1500M"), ("100M", "100M"), ("1e3", "1e3"), ("12e2", "1200"),
    ("0", "0"), ("0.1n", "1n"), (".5", "500m"), ("0.3Ki", "307200m"),
])
def test_quantity_canonical(typed: Any, stored: str) -> None:
    assert quantity.canonical(typed) == stored
    assert quantity.canonical(stored) == stored, "canonical is a fixed point"


def _spec() -> dict[str, Any]:
    return {"model": "m",
            "resources": {"gpus": 1, "cpu": "0.5", "memory": "1.5Gi", "shmSize": "2048Mi",
                          "ephemeralStorage": "51200Mi"},
            "modelCache": {"claimName": "cache", "readOnly": False},
            "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1.5Gi"}}],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch", "readOnly": False}],
            "env": [{"name": "EMPTY", "value": ""}],
            "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3}}


def test_rendered_template_is_the_stored_form() -> None:
    """What the operator sends is what the API server stores: nothing to drift."""
    body = {"apiVersion": "pagefleet.dev/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": _spec()}
    dep = resources.deployment(parse_spec(body), 1, ["ReadWriteMany"])
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["requests"]["cpu"] == "500m"
    assert c["resources"]["limits"]["memory"] == "1536Mi"
    assert all("readOnly" not in m for m in c["volumeMounts"])
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"] == {"claimName": "cache"}
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "2Gi"
    assert next(v for v in pod["volumes"] if v["name"] == "scratch")["emptyDir"]["sizeLimit"] == "1536Mi"
    assert {"name": "EMPTY"} in c["env"]


def test_template_applied_by_an_older_operator_is_not_drift() -> None:
    """A Deployment whose last-applied record still says `readOnly: false` and `0.5`
    (rendered before the stored form) is in sync with its stored self."""
    body = {"apiVersion": "pagefleet.dev/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": _spec()}
    spec = parse_spec(body)
    old = resources.deployment(spec, 1, ["ReadWriteMany"])
    c = old["spec"]["template"]["spec"]["containers"][0]
    c["resources"]["requests"]["cpu"] = "0.5"
    next(m for m in c["volumeMounts"] if m["name"] == "model-cache")["readOnly"] = False
    live = resources.stored_form(resources.with_last_applied(old))
    assert resources.in_sync(live, old)
    assert not controller._drifted(live, spec.spec_hash)
    frozen = resources.frozen_template(live, spec.spec_hash)
    assert frozen is not None and frozen == resources.stored_template(frozen)


@pytest.mark.asyncio(loop_scope="session")
async def test_reconcile_then_evaluate_sees_no_drift(cluster: Cluster) -> None:
    """reconcile, then evaluations: no Deployment patch, a metrics round each time
    (MetricsAvailable in the status), and a status change of the Deployment is no
    edit to repair."""
    ns = "drift"
    await cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "cache"},
                         "spec": {"accessModes": ["ReadWriteMany"]}}, ns)
    cr = await cluster.apply({"apiVersion": "pagefleet.dev/v1alpha1", "kind": "ModelDeployment",
                              "metadata": {"name": "m"}, "spec": _spec()}, ns)
    st, settings = controller.State(), controller.Settings()
    await controller.reconcile(cluster.kube, cr, st, settings, fresh=True)
    stored = await cluster.get("Deployment", ns, "m")
    assert stored is not None
    c = stored["spec"]["template"]["spec"]["containers"][0]
    # The emulator stores like kube-apiserver (else this test could not catch the bug).
    assert c["resources"]["requests"]["cpu"] == "500m"
    versions = len(cluster.history("Deployment", ns, "m"))

    for _ in range(3):
        await controller.evaluate(cluster.kube, cr, st, settings, pods=[])
    assert len(cluster.history("Deployment", ns, "m")) == versions, "evaluate re-applied the Deployment"
    live = await cluster.get("Deployment", ns, "m")
    assert live is not None
    assert not controller._drifted(live, live["metadata"]["annotations"][resources.TEMPLATE_HASH])
    body = await cluster.get("ModelDeployment", ns, "m")
    assert body is not None
    types = {cond["type"] for cond in body["status"]["conditions"]}
    assert "MetricsAvailable" in types, "evaluate never got to its metrics round"

    live["status"] = {"replicas": 1, "readyReplicas": 1}
    assert not await controller.repair(cluster.kube, body, st, settings, live, deleted=False)
    assert [e["reason"] for e in await cluster.events(ns, "m")] == ["Created"]
