"""Several operator replicas (issue 12, finding 1): two real `pagefleet operator`
processes with the chart's defaults (peering on, no --priority): exactly one acts,
and after it is killed the other takes over within the peering lifetime. Also: an
operator upgrade does not roll running fleets (finding 13)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml

from pagefleet.operator import crd
from tests.operator.harness import Cluster, load_example, operator_run, register_resources

pytestmark = pytest.mark.asyncio(loop_scope="session")
LIFETIME_S = 5
PEERING = "/apis/kopf.dev/v1/clusterkopfpeerings/pagefleet"


def register_peering(cluster: Cluster) -> None:
    for plural, kind, namespaced in (("clusterkopfpeerings", "ClusterKopfPeering", False),
                                     ("kopfpeerings", "KopfPeering", True)):
        cluster.emulator.resources[f"kopf.dev/v1/{plural}"] = kmock.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=namespaced,
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"})


def kubeconfig(cluster: Cluster, path: Path, token: str) -> Path:
    """The same API, but a user of its own: the emulator records who sent each request."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": cluster.url}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return path


def writes_by(cluster: Cluster, token: str) -> list[str]:
    """Every write the operator with `token` made, apart from its peering record."""
    out = []
    for r in cluster.emulator:
        if r.headers.get("Authorization") == f"Bearer {token}" and r.method.value in ("POST", "PATCH", "PUT", "DELETE"):
            if "/kopf.dev/" not in str(r.url):
                out.append(f"{r.method.value} {r.url.path}")
    return out


async def peers(cluster: Cluster) -> dict[str, Any]:
    return ((await cluster.kube.get(PEERING)) or {}).get("status") or {}


@contextlib.asynccontextmanager
async def two_replicas(cluster: Cluster, tmp_path: Path, first: str,
                       second: str) -> AsyncIterator[tuple[Any, Any]]:
    """Two operator runs with the chart's defaults (peering on, no --priority), each a
    user of its own: `first` in the peering before `second` starts."""
    flags = ("--peering-lifetime", str(LIFETIME_S))
    a_cfg = kubeconfig(cluster, tmp_path / "a.kubeconfig", first)
    b_cfg = kubeconfig(cluster, tmp_path / "b.kubeconfig", second)
    async with operator_run(cluster, tmp_path / "a.log", *flags,
                            env={"POD_NAME": first, "KUBECONFIG": str(a_cfg)}) as a:
        await cluster.wait_for(lambda: _has_peer(cluster, f"{first}/"), f"{first} in the peering")
        async with operator_run(cluster, tmp_path / "b.log", *flags,
                                env={"POD_NAME": second, "KUBECONFIG": str(b_cfg)}) as b:
            yield a, b


async def test_exactly_one_of_two_acts_and_the_other_takes_over(cluster: Cluster, tmp_path: Path) -> None:
    register_peering(cluster)
    ns = "ha"
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == crd.KIND)
    doc["spec"]["autoscaling"] = {"intervalSeconds": 1}   # the daemon acts every second
    async with two_replicas(cluster, tmp_path, "op-a", "op-b") as (a, b):
        status = await cluster.wait_for(lambda: _named(cluster, "op-a", "op-b"),
                                        "both replicas in the peering")
        prio = {k.split("/")[0]: v["priority"] for k, v in status.items()}
        assert prio["op-a"] > prio["op-b"], "distinct priorities, the first registered highest"
        # Peering is mandatory once the peering object exists: op-b starts paused and
        # stays so, since it sees op-a's higher priority (kopf logs only the resume).
        assert "Resuming operations" in a.log()

        await cluster.apply(doc, ns)
        await cluster.wait_object("Deployment", ns, "qwen-short")
        async def created_events() -> list[dict[str, Any]]:
            return [e for e in await cluster.events(ns, "qwen-short") if e["reason"] == "Created"]
        created = await cluster.wait_for(created_events, "the Created Event")
        assert [e["reportingInstance"].split("/")[0] for e in created] == ["op-a"]
        # op-a's daemon keeps acting: it carries each change of its Deployment into the
        # status. (Its rounds write nothing when nothing changed, by design, so a bare
        # count of writes depended on when the first round ran.)
        for ready in (1, 2):
            await cluster.patch("Deployment", ns, "qwen-short", {"status": {
                "replicas": 2, "updatedReplicas": 2, "readyReplicas": ready,
                "availableReplicas": ready}}, sub="status")
            await cluster.wait_object(
                crd.KIND, ns, "qwen-short",
                lambda o, ready=ready: (o.get("status") or {}).get("readyReplicas") == ready,
                f"op-a's daemon to report {ready} ready replica(s)")
        assert writes_by(cluster, "op-a"), "op-a acts"
        assert writes_by(cluster, "op-b") == [], "op-b must not act while op-a is alive"
        assert "Resuming operations" not in b.log()

        a.kill()   # no clean exit: its peering record stays until it expires
        await cluster.patch(crd.KIND, ns, "qwen-short", {"spec": {"engine": {"maxModelLen": 2048}}})

        # The bound: op-a's record lives LIFETIME_S after its last keep-alive (every
        # second with this lifetime); op-b then resumes and handles the change.
        await asyncio.wait_for(cluster.wait_object("Deployment", ns, "qwen-short", _args_with("2048"),
                                                   "op-b to apply the change", timeout=LIFETIME_S + 25),
                               LIFETIME_S + 30)
        assert "Resuming operations" in b.log()
        assert writes_by(cluster, "op-b")


async def test_a_deleted_peering_object_is_recreated(cluster: Cluster, tmp_path: Path) -> None:
    """The ClusterKopfPeering deleted while two replicas run (`kubectl delete -f` of the
    peering manifest, a cleanup script). kopf never creates it: its keep-alive PATCHes
    get a 404 it logs at debug level; the leader goes on acting, but its standby stays
    paused for good and no longer takes over when the leader dies. The operator
    recreates it, with both records, and says so; the leader alone keeps acting and the
    standby takes over again."""
    register_peering(cluster)
    ns = "heal"
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == crd.KIND)
    async with two_replicas(cluster, tmp_path, "heal-a", "heal-b") as (a, b):
        await cluster.wait_for(lambda: _named(cluster, "heal-a", "heal-b"), "both replicas in the peering")
        await cluster.apply(doc, ns)
        await cluster.wait_object("Deployment", ns, "qwen-short")

        assert await cluster.kube.delete(PEERING)
        status = await cluster.wait_for(lambda: _named(cluster, "heal-a", "heal-b"),
                                        "the peering object back, with both replicas in it")
        prio = {k.split("/")[0]: v["priority"] for k, v in status.items()}
        assert prio["heal-a"] > prio["heal-b"], "the priorities survive the recreation"
        assert "Recreated the ClusterKopfPeering 'pagefleet'" in a.log() + b.log()

        await cluster.patch(crd.KIND, ns, "qwen-short", {"spec": {"engine": {"maxModelLen": 2048}}})
        await cluster.wait_object("Deployment", ns, "qwen-short", _args_with("2048"), "the change applied")
        assert any(w.endswith("/deployments/qwen-short") for w in writes_by(cluster, "heal-a")), "heal-a acts"
        assert writes_by(cluster, "heal-b") == [], "heal-b must not act while heal-a is alive"
        assert "Resuming operations" not in b.log(), "heal-b never resumed next to heal-a"

        # Failover works again: the standby takes over from the killed leader.
        a.kill()
        await cluster.patch(crd.KIND, ns, "qwen-short", {"spec": {"engine": {"maxModelLen": 1024}}})
        await cluster.wait_object("Deployment", ns, "qwen-short", _args_with("1024"),
                                  "heal-b to take over and apply the change")
        assert writes_by(cluster, "heal-b")


def _args_with(value: str) -> Any:
    def check(d: dict[str, Any]) -> bool:
        return value in d["spec"]["template"]["spec"]["containers"][0]["args"]
    return check


async def _named(cluster: Cluster, *names: str) -> dict[str, Any] | None:
    """The peering status once it holds a record of each of `names` (pod names)."""
    status = await peers(cluster)
    return status if set(names) <= {k.split("/")[0] for k in status} else None


async def _has_peer(cluster: Cluster, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in await peers(cluster))


def sync(fn: Any) -> Any:
    """A plain predicate as the coroutine function Cluster.wait_for polls."""
    async def probe() -> Any:
        return fn()
    return probe


def _reads_of(cluster: Cluster, token: str, path: str) -> int:
    return sum(1 for r in cluster.emulator if r.headers.get("Authorization") == f"Bearer {token}"
               and r.method.value == "GET" and str(r.url.path).endswith(path))


async def test_an_operator_upgrade_does_not_roll_running_fleets(cluster: Cluster, tmp_path: Path) -> None:
    """Finding 13: pods keep the image (and template) they were rendered with until
    the ModelDeployment changes, whatever the new operator's --server-image."""
    ns = "upgrade"
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == crd.KIND)
    doc["spec"]["autoscaling"] = {"intervalSeconds": 1}
    async with operator_run(cluster, tmp_path / "v1.log", "--standalone", "--server-image", "reg/pagefleet:1"):
        await cluster.apply(doc, ns)
        dep = await cluster.wait_object("Deployment", ns, "qwen-short")
        md = await cluster.wait_object(crd.KIND, ns, "qwen-short",
                                       lambda o: "serverImage" in (o.get("status") or {}))
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/pagefleet:1"
    assert md["status"]["serverImage"] == "reg/pagefleet:1"
    versions = len(cluster.history("Deployment", ns, "qwen-short"))
    v2_cfg = kubeconfig(cluster, tmp_path / "v2.kubeconfig", "v2")
    async with operator_run(cluster, tmp_path / "v2.log", "--standalone", "--server-image", "reg/pagefleet:2",
                            env={"KUBECONFIG": str(v2_cfg)}):
        # Its resume handler and a few evaluations (each reads the Deployment and
        # checks it for drift).
        await cluster.wait_for(sync(lambda: _reads_of(cluster, "v2", f"/namespaces/{ns}/deployments/qwen-short") >= 3),
                               "the new operator's evaluations")
        dep = await cluster.get("Deployment", ns, "qwen-short")
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/pagefleet:1"
        assert len(cluster.history("Deployment", ns, "qwen-short")) == versions, "the resume did not touch it"
        # A change of the spec renders with the running operator's defaults.
        await cluster.patch(crd.KIND, ns, "qwen-short", {"spec": {"engine": {"maxNumSeqs": 64}}})
        dep = await cluster.wait_object("Deployment", ns, "qwen-short", lambda d: d["spec"]["template"]["spec"]
                                        ["containers"][0]["image"] == "reg/pagefleet:2", "the new image")
        md = await cluster.wait_object(crd.KIND, ns, "qwen-short",
                                       lambda o: o["status"].get("serverImage") == "reg/pagefleet:2")



# ------------------------------------------------------------ namespace patterns

@pytest_asyncio.fixture(loop_scope="session", scope="function")
async def ns_cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    """The e2e API server: it keeps Namespaces and streams their watch, which kopf
    needs for namespace patterns (the plain kmock emulator has no Namespaces)."""
    from e2e.emulator import ApiServer

    emulator = ApiServer()
    async with emulator, kmock.Server(emulator):
        register_resources(emulator)
        config = tmp_path_factory.mktemp("kube") / "config"
        c = Cluster(emulator, config)
        kubeconfig(c, config, "test")
        try:
            yield c
        finally:
            await c.kube.close()


async def _namespace(cluster: Cluster, name: str) -> None:
    await cluster.kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": name}})


async def _kopf_peers(cluster: Cluster, ns: str) -> set[str]:
    obj = await cluster.kube.get(f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/pagefleet") or {}
    return {k.split("/")[0] for k in (obj.get("status") or {})}


async def test_namespace_patterns_with_peering(ns_cluster: Cluster, tmp_path: Path) -> None:
    """The chart's `watchNamespaces: [pat-a, pat-*]` with peering on (the default).
    kopf peers in every namespace it serves, and with mandatory peering a served
    namespace without its KopfPeering pauses the whole operator: the operator makes and
    joins the object in every namespace the pattern matches, those created later too.
    Two replicas: one acts, in the named namespace, a matched one and a new one."""
    cluster = ns_cluster
    register_peering(cluster)
    for ns in ("pat-a", "pat-b", "other"):
        await _namespace(cluster, ns)
    flags = ("--namespace=pat-a", "--namespace=pat-*", "--peering-lifetime", str(LIFETIME_S))
    a_cfg = kubeconfig(cluster, tmp_path / "a.kubeconfig", "pat-op-a")
    b_cfg = kubeconfig(cluster, tmp_path / "b.kubeconfig", "pat-op-b")
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == crd.KIND)
    async with operator_run(cluster, tmp_path / "a.log", *flags,
                            env={"POD_NAME": "op-a", "KUBECONFIG": str(a_cfg)}):
        for ns in ("pat-a", "pat-b"):
            await cluster.wait_for(lambda ns=ns: _has(cluster, ns, "op-a"), f"op-a in the KopfPeering of {ns}")
        assert await cluster.kube.get("/apis/kopf.dev/v1/namespaces/other/kopfpeerings/pagefleet") is None
        assert await cluster.kube.get(PEERING) is None, "no ClusterKopfPeering: kopf peers per namespace"
        async with operator_run(cluster, tmp_path / "b.log", *flags,
                                env={"POD_NAME": "op-b", "KUBECONFIG": str(b_cfg)}):
            for ns in ("pat-a", "pat-b"):
                await cluster.wait_for(lambda ns=ns: _has(cluster, ns, "op-b"), f"op-b in the KopfPeering of {ns}")
            for ns in ("pat-a", "pat-b"):
                await cluster.apply(doc, ns)
                await cluster.wait_object("Deployment", ns, "qwen-short", timeout=30)
            # A namespace the pattern matches, created while both run.
            await _namespace(cluster, "pat-new")
            await cluster.wait_for(lambda: _has(cluster, "pat-new", "op-a", "op-b"),
                                   "both replicas in the KopfPeering of the new namespace")
            await cluster.apply(doc, "pat-new")
            await cluster.wait_object("Deployment", "pat-new", "qwen-short", timeout=30)
            assert writes_by(cluster, "pat-op-a"), "op-a acts"
            # op-b made no write in any namespace. (Whether kopf logs "Pausing operations"
            # for op-b depends on whether it ever resumed a namespace's toggle before
            # seeing op-a there: with the follower's watch the new namespace's object
            # holds both at once, so the log line is not a condition to wait for.)
            assert writes_by(cluster, "pat-op-b") == [], "op-b must not act while op-a is alive"


async def test_a_namespace_pattern_alone_peers_per_namespace(ns_cluster: Cluster, tmp_path: Path) -> None:
    """`watchNamespaces: [solo-*]`: no exact name left, yet kopf still peers per
    namespace (not through a ClusterKopfPeering, which it does not watch then)."""
    cluster = ns_cluster
    register_peering(cluster)
    await _namespace(cluster, "solo-b")
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == crd.KIND)
    async with operator_run(cluster, tmp_path / "op.log", "--namespace=solo-*", "--peering-lifetime",
                            str(LIFETIME_S), env={"POD_NAME": "op-solo"}) as op:
        await cluster.apply(doc, "solo-b")
        await cluster.wait_object("Deployment", "solo-b", "qwen-short", timeout=30)
        assert "op-solo" in await _kopf_peers(cluster, "solo-b")
        assert "ClusterKopfPeering" not in op.log()


async def _has(cluster: Cluster, ns: str, *who: str) -> bool:
    return set(who) <= await _kopf_peers(cluster, ns)


async def test_a_namespace_deleted_and_made_again_gets_its_peering_back(ns_cluster: Cluster, tmp_path: Path) -> None:
    """A matching namespace deleted (its KopfPeering with it) and created again by the
    same name, as CI and dev namespaces are: kopf serves it anew and, peering being
    mandatory, pauses the whole operator until its KopfPeering exists again; the
    operator makes it, and goes on acting in the namespace it never left."""
    cluster = ns_cluster
    register_peering(cluster)
    for ns in ("rc-a", "rc-b"):
        await _namespace(cluster, ns)
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == crd.KIND)
    async with operator_run(cluster, tmp_path / "op.log", "--namespace=rc-*", "--peering-lifetime",
                            str(LIFETIME_S), env={"POD_NAME": "op-rc"}):
        await cluster.apply(doc, "rc-a")
        await cluster.wait_object("Deployment", "rc-a", "qwen-short", timeout=30)
        assert "op-rc" in await _kopf_peers(cluster, "rc-b")
        # (the emulator has no namespace GC: the object goes by hand, as the GC would,
        # after the namespace and until it stays gone: a healer round that read it just
        # before may recreate it, which the API server refuses in a Terminating namespace)
        await cluster.kube.delete("/api/v1/namespaces/rc-b")
        await cluster.wait_for(lambda: _collected(cluster, "rc-b"), "rc-b gone")
        await _namespace(cluster, "rc-b")
        await cluster.wait_for(lambda: _has(cluster, "rc-b", "op-rc"), "the KopfPeering of the new rc-b")
        second = {**doc, "metadata": {**doc["metadata"], "name": "second"}}
        await cluster.apply(second, "rc-a")
        await cluster.wait_object("Deployment", "rc-a", "second", timeout=30)


async def _collected(cluster: Cluster, ns: str) -> bool:
    """The namespace controller's part: delete the deleted namespace's KopfPeering."""
    path = f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/pagefleet"
    await cluster.kube.delete(path)
    await asyncio.sleep(0.5)
    return await cluster.kube.get(path) is None
