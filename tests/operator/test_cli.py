"""`pagefleet operator`: namespace selection, liveness, peering (each test runs its
own operator process against the module's API emulator)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import kmock
import pytest

from pagefleet.operator import crd
from pagefleet.operator.cli import operator_parser
from pagefleet.server.cli import main as pagefleet_main
from tests.operator.harness import Cluster, load_example, operator_process

pytestmark = pytest.mark.asyncio(loop_scope="session")


def short_qa(name: str) -> dict:
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == crd.KIND)
    doc["metadata"]["name"] = name
    return doc


@pytest.mark.asyncio(loop_scope="session")
async def test_namespace_selection(cluster: Cluster, tmp_path: Path) -> None:
    await cluster.apply(short_qa("elsewhere"), "not-watched")
    async with operator_process(cluster, tmp_path / "op.log", "--standalone",
                                "--namespace", "team-a", "--namespace", "team-b") as liveness:
        await cluster.apply(short_qa("a"), "team-a")
        await cluster.apply(short_qa("b"), "team-b")
        await cluster.wait_object("Deployment", "team-a", "a")
        await cluster.wait_object("Deployment", "team-b", "b")
        # Both watched namespaces are served; the other one never is.
        await cluster.wait_condition("team-a", "a", "Progressing", "True")
        assert await cluster.get("Deployment", "not-watched", "elsewhere") is None
        elsewhere = await cluster.get(crd.KIND, "not-watched", "elsewhere")
        assert elsewhere is not None and "status" not in elsewhere and not elsewhere["metadata"].get("finalizers")
        async with aiohttp.ClientSession() as s, s.get(liveness) as r:
            assert r.status == 200


async def test_peering_object_is_created_and_kept_alive(cluster: Cluster, tmp_path: Path) -> None:
    for plural, kind, namespaced in (("clusterkopfpeerings", "ClusterKopfPeering", False),
                                     ("kopfpeerings", "KopfPeering", True)):
        cluster.emulator.resources[f"kopf.dev/v1/{plural}"] = kmock.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=namespaced,
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"})
    async with operator_process(cluster, tmp_path / "op.log", "--priority", "7"):
        async def peers() -> dict | None:
            obj = await cluster.kube.get("/apis/kopf.dev/v1/clusterkopfpeerings/pagefleet")
            status = (obj or {}).get("status") or {}
            return status or None
        status = await cluster.wait_for(peers, "a peer in ClusterKopfPeering/pagefleet")
        (peer,) = status.values()
        assert peer["priority"] == 7
        # Peering does not pause a lone operator: it still reconciles.
        await cluster.apply(short_qa("peered"), "peering")
        await cluster.wait_object("Deployment", "peering", "peered")


def test_operator_flags() -> None:
    args = operator_parser().parse_args(["-n", "a", "--namespace", "b", "--priority", "5"])
    assert (args.namespace, args.priority, args.standalone, args.peering) == (["a", "b"], 5, False, "pagefleet")
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert pagefleet_main(["operator", "-A", "-n", "x"]) == 2
    args = operator_parser().parse_args(["--gateway-service", "gw/pagefleet-gateway",
                                         "--gateway-service", "gw2/other:9000"])
    assert args.gateway_service == ["gw/pagefleet-gateway", "gw2/other:9000"]
    assert pagefleet_main(["operator", "--gateway-service", "no-namespace"]) == 2
