"""Peering objects where the API refuses some (conditions the e2e emulator cannot
produce: a Terminating namespace's 403, a missing namespace's 404, forbidden
namespace listing), against a small fake API. The real-kopf tests are in test_ha."""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf
import pytest

from pagefleet.operator import handlers
from pagefleet.operator.kube import KubeError

pytestmark = pytest.mark.asyncio(loop_scope="session")
PEERINGS = "/apis/kopf.dev/v1/namespaces/{}/kopfpeerings"
DISCOVERY = {"kind": "APIResourceList", "groupVersion": "kopf.dev/v1",
             "resources": [{"name": "kopfpeerings"}, {"name": "clusterkopfpeerings"}]}


class FakeKube:
    """Namespaces (name -> phase), the peering objects, a namespace watch fed from
    `events`. Creating in a Terminating namespace is refused (403), in a missing one
    too (404 namespaces "x" not found), as a real API server does."""

    def __init__(self, namespaces: dict[str, str], crds: bool = True) -> None:
        self.namespaces = dict(namespaces)
        self.objects: dict[str, dict[str, Any]] = {}
        self.crds = crds
        self.lists = 0
        self.refusals: dict[str, int] = {}     # namespace -> creates refused
        self.list_error: KubeError | None = None
        self.watch_error: KubeError | None = None
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def ns(self, name: str, phase: str = "Active") -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "resourceVersion": "1"}
        if phase == "Terminating":
            meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
        return {"metadata": meta, "status": {"phase": phase}}

    async def request(self, method: str, path: str, body: Any = None, *, params: Any = None) -> dict[str, Any]:
        assert (method, path) == ("GET", "/api/v1/namespaces")
        self.lists += 1
        if self.list_error:
            raise self.list_error
        return {"metadata": {"resourceVersion": "1"},
                "items": [self.ns(n, p) for n, p in self.namespaces.items()]}

    async def watch(self, path: str, resource_version: str | None = None,
                    timeout_s: int = 300) -> AsyncIterator[dict[str, Any]]:
        if self.watch_error:
            raise self.watch_error
        while True:
            yield await self.events.get()

    async def get(self, path: str) -> dict[str, Any] | None:
        if path == "/apis/kopf.dev/v1":
            return DISCOVERY if self.crds else None
        return self.objects.get(path)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = body["metadata"].get("namespace")
        if not self.crds:
            raise KubeError(404, "POST", path, "the server could not find the requested resource")
        if ns not in self.namespaces:
            raise KubeError(404, "POST", path, f'namespaces "{ns}" not found')
        if self.namespaces[ns] == "Terminating":
            self.refusals[ns] = self.refusals.get(ns, 0) + 1
            raise KubeError(403, "POST", path, f'kopfpeerings "pagefleet" is forbidden: unable to create new '
                                               f'content in namespace {ns} because it is being terminated')
        self.objects[f"{path}/{body['metadata']['name']}"] = body
        return body

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        obj = self.objects.get(path)
        if obj is None:
            raise KubeError(404, "PATCH", path, "not found")
        obj.setdefault("status", {}).update(body["status"])
        return obj

    async def close(self) -> None:
        pass

    def has(self, ns: str) -> bool:
        return f"{PEERINGS.format(ns)}/pagefleet" in self.objects

    def add_namespace(self, name: str) -> None:
        self.namespaces[name] = "Active"
        self.events.put_nowait({"type": "ADDED", "object": self.ns(name)})


async def started(kube: FakeKube, namespaces: list[str],
                  caplog: pytest.LogCaptureFixture) -> tuple[kopf.OperatorSettings, kopf.Memo]:
    caplog.set_level(logging.INFO)
    settings = kopf.OperatorSettings()
    memo = kopf.Memo()
    memo["kube"] = kube
    memo["pf_peering"] = {"name": "pagefleet", "identity": "op-a/1", "priority": None, "lifetime": 30,
                          "namespaces": namespaces}
    await handlers.startup(settings=settings, memo=memo, logger=logging.getLogger("test.peering"))
    return settings, memo


async def until(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


def warnings_with(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "PEERING_RETRY_S", 0.05)


async def test_a_terminating_namespace_leaves_peering_mandatory(caplog: pytest.LogCaptureFixture, fast: None) -> None:
    """Finding 3: a matching namespace being deleted refuses the object (403). The
    replica still peers, mandatorily, with its own priority, in the others; the
    warning names the namespace (not "install the CRDs"); once the namespace is back
    (deleted and made again) the follower gives it its object."""
    kube = FakeKube({"team-a": "Active", "team-old": "Terminating", "default": "Active"})
    settings, memo = await started(kube, ["team-*"], caplog)
    try:
        assert settings.peering.mandatory
        assert settings.peering.priority < 0, "auto priority, not kopf's default 0"
        assert kube.has("team-a") and kube.objects[f"{PEERINGS.format('team-a')}/pagefleet"]["status"]["op-a/1"]
        assert not warnings_with(caplog, "install the kopf peering CRDs")
        assert "pf_peering_follower" in memo
        await until(lambda: kube.lists == 2, "the follower's LIST")  # then only its watch tells
        kube.namespaces["team-old"] = "Active"
        kube.events.put_nowait({"type": "MODIFIED", "object": kube.ns("team-old")})
        await until(lambda: kube.has("team-old"), "the follower's object in team-old")
        assert kube.lists == 2, "startup's LIST and the follower's: then the watch"
    finally:
        await handlers.cleanup(memo=memo)


async def test_a_refused_namespace_is_retried_by_name(caplog: pytest.LogCaptureFixture, fast: None) -> None:
    """The 403 is warned about once, by namespace, while the follower retries it."""
    kube = FakeKube({"team-a": "Active", "team-old": "Terminating"})
    settings, memo = await started(kube, ["team-*", "other"], caplog)
    try:
        # Terminating namespaces are not served by kopf: not even tried at startup.
        assert not warnings_with(caplog, "team-old")
        # One that turns Terminating after the LIST is tried, refused, and retried.
        await until(lambda: kube.lists == 2, "the follower's LIST")
        kube.namespaces["team-b"] = "Terminating"
        kube.events.put_nowait({"type": "ADDED", "object": kube.ns("team-b", "Active")})
        await until(lambda: len(warnings_with(caplog, "'team-b'")) == 1, "the warning about team-b")
        await until(lambda: kube.refusals.get("team-b", 0) >= 3, "several retries")
        assert len(warnings_with(caplog, "'team-b'")) == 1, warnings_with(caplog, "team-b")
        assert "being terminated" in warnings_with(caplog, "'team-b'")[0]
        kube.namespaces["team-b"] = "Active"
        await until(lambda: kube.has("team-b"), "team-b's object once it is accepted")
        assert settings.peering.mandatory
    finally:
        await handlers.cleanup(memo=memo)


async def test_a_listed_namespace_that_does_not_exist_yet(caplog: pytest.LogCaptureFixture, fast: None) -> None:
    """Finding 3: `--namespace=prod` next to a pattern, prod not there yet. kopf serves
    only what exists then, so no object is tried; prod gets it when it appears."""
    kube = FakeKube({"team-a": "Active"})
    settings, memo = await started(kube, ["prod", "team-*"], caplog)
    try:
        assert settings.peering.mandatory and settings.peering.priority < 0
        assert kube.has("team-a") and not warnings_with(caplog, "install")
        assert not warnings_with(caplog, "'prod'"), "not served yet, so not tried"
        await until(lambda: kube.lists == 2, "the follower's LIST")
        kube.add_namespace("prod")
        await until(lambda: kube.has("prod"), "prod's object")
        assert kube.lists == 2
    finally:
        await handlers.cleanup(memo=memo)


async def test_exact_names_only_get_their_objects_later(caplog: pytest.LogCaptureFixture, fast: None) -> None:
    """Exact names alone (kopf serves them whether they exist or not, and the operator
    may not read namespaces): a missing one is retried until it can have its object."""
    kube = FakeKube({"a": "Active"})
    settings, memo = await started(kube, ["a", "b"], caplog)
    try:
        assert settings.peering.mandatory and settings.peering.priority < 0
        assert kube.has("a") and not kube.has("b")
        assert len(warnings_with(caplog, "'b'")) == 1 and not warnings_with(caplog, "install")
        kube.namespaces["b"] = "Active"  # no watch: exact names need no namespace permissions
        await until(lambda: kube.has("b"), "b's object")
        assert kube.lists == 0
    finally:
        await handlers.cleanup(memo=memo)


async def test_missing_crds_mean_no_peering(caplog: pytest.LogCaptureFixture) -> None:
    kube = FakeKube({"team-a": "Active"}, crds=False)
    settings, memo = await started(kube, ["team-*"], caplog)
    try:
        assert not settings.peering.mandatory
        assert len(warnings_with(caplog, "install the kopf peering CRDs")) == 1
        assert "pf_peering_follower" not in memo
    finally:
        await handlers.cleanup(memo=memo)


async def test_forbidden_namespace_listing_is_warned_about_once(caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 5: where namespaces may not be listed, the follower (re-listing now and
    then) does not repeat its warning each time."""
    monkeypatch.setattr(handlers, "PEERING_FORBIDDEN_S", 0.02)
    monkeypatch.setattr(handlers, "PEERING_SCAN_S", 0.02)
    kube = FakeKube({"team-a": "Active", "fixed": "Active"})
    kube.list_error = KubeError(403, "GET", "/api/v1/namespaces", "namespaces is forbidden")
    settings, memo = await started(kube, ["team-*", "fixed"], caplog)
    try:
        await until(lambda: kube.lists >= 6, "a few LISTs")
        assert len(warnings_with(caplog, "Cannot list namespaces")) == 1, warnings_with(caplog, "Cannot list")
        assert kube.has("fixed"), "kopf's fallback: the exact names"
        kube.list_error = None
        await until(lambda: kube.has("team-a"), "team-a once listing works")
    finally:
        await handlers.cleanup(memo=memo)


async def test_the_healer_recreates_a_deleted_object_with_the_live_peers(caplog: pytest.LogCaptureFixture) -> None:
    """A peering object deleted while the operator runs comes back in one write with the
    peers alive in its last known state (renewed, so the leader's record cannot lapse
    before its next keep-alive) and without the dead ones. A namespace that refuses it
    (being deleted) is warned about by name and left to the follower; nothing raises.
    The real-kopf test is test_ha's test_a_deleted_peering_object_is_recreated."""
    caplog.set_level(logging.INFO)
    kube = FakeKube({"a": "Active", "old": "Active"})
    peering = {"name": "pagefleet", "identity": "op-b/2", "priority": None, "lifetime": 30,
               "namespaces": ["a", "old"]}
    settings = kopf.OperatorSettings()
    settings.peering.priority, settings.peering.lifetime = -2, 30
    now = datetime.datetime.now(datetime.UTC)
    leader = {"priority": -1, "lifetime": 30, "lastseen": (now - datetime.timedelta(seconds=20)).isoformat()}
    dead = {"priority": 5, "lifetime": 30, "lastseen": (now - datetime.timedelta(seconds=90)).isoformat()}
    targets: set[handlers.Target] = {("kopfpeerings", "a"), ("kopfpeerings", "old")}
    warnings = handlers.Warnings(logging.getLogger("test.heal"))
    for _, ns in targets:
        kube.objects[f"{PEERINGS.format(ns)}/pagefleet"] = {"status": {"op-a/1": leader, "op-c/3": dead}}
    last: dict[handlers.Target, dict[str, Any]] = {}
    await handlers.heal_peering(kube, peering, settings, targets, warnings, last)
    assert not warnings_with(caplog, "Recreated"), "nothing was missing"

    kube.objects.clear()
    kube.namespaces["old"] = "Terminating"
    await handlers.heal_peering(kube, peering, settings, targets, warnings, last)
    status = kube.objects[f"{PEERINGS.format('a')}/pagefleet"]["status"]
    assert set(status) == {"op-a/1", "op-b/2"}, "the live peers and this replica, not the dead one"
    assert status["op-a/1"]["priority"] == -1 and status["op-a/1"]["lastseen"] > leader["lastseen"]
    assert len(warnings_with(caplog, "Recreated the KopfPeering 'pagefleet' in 'a'")) == 1
    assert targets == {("kopfpeerings", "a")}, "the refused namespace is the follower's again"
    assert len(warnings_with(caplog, "'old'")) == 1 and not kube.has("old")
