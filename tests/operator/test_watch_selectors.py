"""The operator's LIST+WATCH of its children carry the managed-by label selector, so
the API server sends only the operator's own Pods, Deployments, Services and PDBs
(kopf's `labels=` on a handler filters on the client, after streaming everything)."""

from __future__ import annotations

import pytest

from pagefleet.operator import resources
from tests.operator.harness import Cluster

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHILDREN = {"pods", "deployments", "services", "poddisruptionbudgets"}
SELECTOR = f"app.kubernetes.io/managed-by={resources.MANAGER}"


async def test_child_watches_are_filtered_by_the_api_server(cluster: Cluster, operator: str) -> None:
    def child_reads() -> list[tuple[str, str]]:
        return [(r.resource.plural, r.params.get("labelSelector", ""))
                for r in list(cluster.emulator._requests)  # kmock keeps every request
                if r.resource is not None and r.resource.plural in CHILDREN and r.method.name == "GET"
                and r.name is None and r.namespace is None]

    async def all_watched() -> bool:
        return {plural for plural, _ in child_reads()} == CHILDREN
    await cluster.wait_for(all_watched, "the operator's watches of its children")
    unfiltered = [(plural, sel) for plural, sel in child_reads() if SELECTOR not in sel.split(",")]
    assert not unfiltered, unfiltered
