"""The chart's namespaced RBAC mode, enforced (issue 12, finding 13): the operator runs
as its ServiceAccount with only the Roles the chart renders for `rbac.namespaced=true`
(no ClusterRole), against an API server that authorizes every call (e2e/emulator.py's
ApiServer, which also enforces OwnerReferencesPermissionEnforcement: the children's
blockOwnerDeletion needs `update` on modeldeployments/finalizers), and reconciles
without a single denial."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kmock._internal import apps

from e2e.emulator import ADMIN_TOKEN, SA_PREFIX, ApiServer, write_kubeconfig
from pagefleet.operator import crd
from tests.deploy import render, tools
from tests.operator.harness import Cluster, load_example, operator_run

pytestmark = pytest.mark.asyncio(loop_scope="session")
NS = "team-a"
SA = f"{SA_PREFIX}{render.NAMESPACE}:pagefleet-operator"


@pytest_asyncio.fixture(loop_scope="session")
async def rbac_cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    api = ApiServer()
    async with api, apps.Server(api):
        url = str(api.url).rstrip("/")
        admin = write_kubeconfig(tmp_path_factory.mktemp("kube") / "admin", url, ADMIN_TOKEN)
        c = Cluster(api, admin)   # the admin token: not a ServiceAccount, never denied
        try:
            yield c
        finally:
            await c.kube.close()


async def _create(cluster: Cluster, obj: dict[str, Any]) -> None:
    kind, meta = obj["kind"], obj["metadata"]
    group_version = obj["apiVersion"]
    plural = {"CustomResourceDefinition": "customresourcedefinitions", "Role": "roles",
              "RoleBinding": "rolebindings"}[kind]
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    ns = f"/namespaces/{meta['namespace']}" if meta.get("namespace") else ""
    await cluster.kube.create(f"{base}{ns}/{plural}", obj)


async def test_namespaced_mode_needs_no_cluster_role(rbac_cluster: Cluster, tmp_path: Path) -> None:
    helm = tools.require("helm")
    objs = render.render({"rbac.namespaced": "true", "operator.watchNamespaces": "{team-a}"}, helm_path=helm)
    kinds = {o["kind"] for o in objs}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    for obj in objs:
        if obj["kind"] in ("CustomResourceDefinition", "Role", "RoleBinding"):
            await _create(rbac_cluster, obj)
    sa_config = write_kubeconfig(tmp_path / "sa", rbac_cluster.url, SA)
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == crd.KIND)
    args = ("--namespace", NS, "--peering-lifetime", "10")
    async with operator_run(rbac_cluster, tmp_path / "op.log", *args, env={"KUBECONFIG": str(sa_config)}):
        await rbac_cluster.apply(doc, NS)
        await rbac_cluster.wait_object("Deployment", NS, "qwen-short")
        await rbac_cluster.wait_object("Service", NS, "qwen-short")
        await rbac_cluster.wait_condition(NS, "qwen-short", "Reconciling", "True")
        # Peering in the namespace (KopfPeering) works with the Role alone.
        peering = await rbac_cluster.kube.get(f"/apis/kopf.dev/v1/namespaces/{NS}/kopfpeerings/pagefleet")
        assert peering is not None and peering.get("status")
        assert await rbac_cluster.delete(crd.KIND, NS, "qwen-short")
        await rbac_cluster.wait_for(_gone(rbac_cluster), "the ModelDeployment deleted by the operator's cleanup")
    denied = [d for d in rbac_cluster.emulator.denied if d[0] == SA]  # type: ignore[attr-defined]
    assert not denied, denied
    used = rbac_cluster.emulator.used  # type: ignore[attr-defined]
    assert (SA, "update", crd.GROUP, f"{crd.PLURAL}/finalizers") in used, "blockOwnerDeletion was not checked"


def _gone(cluster: Cluster) -> Any:
    async def probe() -> bool:
        return await cluster.get(crd.KIND, NS, "qwen-short") is None
    return probe

