"""Scale from zero: the gateway's page as the operator reads it (pure), the
scale-to-zero rule (table tests), and the scraper against real HTTP servers found
through EndpointSlices in the API emulator."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import aiohttp.web
import pytest
import pytest_asyncio

from pagefleet.operator import autoscale, gateway
from pagefleet.operator.autoscale import PodSample, decide, scale_to_zero
from pagefleet.operator.gateway import GatewayRef, Page, PoolSignal, View
from pagefleet.operator.spec import AutoscalingSpec
from tests.operator.harness import Cluster

PAGE = """# HELP pagefleet_gateway_pool_requests_waiting Held requests that this pool could serve.
# TYPE pagefleet_gateway_pool_requests_waiting gauge
pagefleet_gateway_pool_requests_waiting{model_name="qwen",pool="ml/qwen-short"} 3.0
pagefleet_gateway_pool_requests_waiting{model_name="qwen",pool="ml/qwen-long"} 0.0
# TYPE pagefleet_gateway_requests_in_flight gauge
pagefleet_gateway_requests_in_flight{endpoint="a",model_name="qwen",pool="ml/qwen-short"} 2.0
pagefleet_gateway_requests_in_flight{endpoint="b",model_name="qwen",pool="ml/qwen-short"} 1.0
# TYPE pagefleet_gateway_last_request_timestamp_seconds gauge
pagefleet_gateway_last_request_timestamp_seconds{model_name="qwen"} 1000.0
pagefleet_gateway_last_request_timestamp_seconds{model_name="idle"} 0.0
# TYPE pagefleet_gateway_discovery_info gauge
pagefleet_gateway_discovery_info{discovery="kubernetes",namespace="*"} 1.0
# TYPE pagefleet_gateway_requests_total counter
pagefleet_gateway_requests_total{code="200",model_name="qwen"} 7.0
"""


def test_parse_page_reads_held_inflight_last_and_namespace() -> None:
    page = gateway.parse_page(PAGE)
    assert page.namespace == "*"
    assert page.waiting == {("qwen", "ml/qwen-short"): 3.0, ("qwen", "ml/qwen-long"): 0.0}
    assert page.inflight == {("qwen", "ml/qwen-short"): 3.0}
    assert page.last_request == {"qwen": 1000.0, "idle": 0.0}
    with pytest.raises(ValueError):
        gateway.parse_page("this is {not prometheus")


def test_pool_names_follow_the_gateways_namespace_mode() -> None:
    assert gateway.pool_label("*", "ml", "qwen") == "ml/qwen"
    assert gateway.pool_label("ml", "ml", "qwen") == "qwen"
    assert gateway.pool_label("other", "ml", "qwen") is None
    assert gateway.pool_label(None, "ml", "qwen") is None


def test_replicas_add_up() -> None:
    """Replicas share nothing: held and in-flight counts add up, the latest request wins."""
    a = gateway.parse_page(PAGE)
    b = Page("*", {("qwen", "ml/qwen-short"): 1.0}, {}, {"qwen": 1200.0})
    one_ns = Page("ml", {("qwen", "qwen-short"): 5.0}, {}, {"qwen": 900.0})
    view = View(pages=(a, b, one_ns), replicas=3)
    assert gateway.pool_signal(view, "ml", "qwen-short", "qwen") == PoolSignal(9.0, 3.0, 1200.0)
    assert gateway.pool_signal(view, "ml", "qwen-long", "qwen") == PoolSignal(0.0, 0.0, 1200.0)
    assert gateway.pool_signal(view, "ml", "new", "never-asked") == PoolSignal(0.0, 0.0, None)
    assert gateway.pool_signal(View(pages=(one_ns,), replicas=1), "other", "x", "qwen") is None
    assert View(pages=(a,), replicas=2, errors=("b: timed out",)).ok is False
    assert View(pages=(), replicas=0).ok is False, "no replica at all is no word"


def test_refs_and_endpoint_slices() -> None:
    assert gateway.parse_ref("pagefleet-system/pagefleet-gateway") == GatewayRef(
        "pagefleet-system", "pagefleet-gateway", "http")
    assert gateway.parse_ref("ns/gw:9000").port == "9000"
    for bad in ("gw", "/gw", "ns/", ""):
        with pytest.raises(gateway.GatewayRefError):
            gateway.parse_ref(bad)
    slices = [{"ports": [{"name": "http", "port": 8080}],
               "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                             {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                             {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
                             {"addresses": ["10.0.0.4"]}]},
              {"ports": [{"name": "other", "port": 1}], "endpoints": [{"addresses": ["10.0.0.9"]}]}]
    assert gateway.ready_addresses(slices, "http") == [("10.0.0.1", 8080), ("10.0.0.4", 8080)]
    assert gateway.ready_addresses(slices, "8080") == [("10.0.0.1", 8080), ("10.0.0.4", 8080)]


ZERO = AutoscalingSpec(enabled=True, min_replicas=0, max_replicas=3, metric="concurrency", target=4,
                       interval_seconds=1, scale_to_zero_idle_seconds=60)
NOW = 10_000.0


@pytest.mark.parametrize("current,signal,complete,load,idle_start,replicas,reason", [
    (0, PoolSignal(2, 0, NOW), True, 0.0, 0.0, 1, "scaled 0 -> 1: 2 request(s) waiting in the gateway"),
    (0, PoolSignal(1, 0, NOW), False, 0.0, 0.0, 1, "scaled 0 -> 1"),   # any replica's word wakes it
    (0, PoolSignal(0, 0, NOW - 5), True, 0.0, 0.0, 0, "holding 0: no request waiting"),
    (0, None, False, 0.0, 0.0, 0, "holding 0: no word from the gateway"),
    (1, PoolSignal(0, 0, NOW - 61), True, 0.0, 0.0, 0, "scaled 1 -> 0: idle for 61s"),
    (3, PoolSignal(0, 0, None), True, 0.0, NOW - 600, 0, "scaled 3 -> 0: idle for 600s"),
    (1, PoolSignal(0, 0, NOW - 30), True, 0.0, 0.0, None, "idle for 30s of 60s"),
    (1, PoolSignal(0, 0, NOW - 600), True, 0.0, NOW - 10, None, "idle for 10s of 60s"),   # a fresh wake
    (1, PoolSignal(1, 0, NOW - 600), True, 0.0, 0.0, None, "serving: 1 waiting"),
    (1, PoolSignal(0, 2, NOW - 600), True, 0.0, 0.0, None, "serving: 0 waiting, 2 in flight"),
    (1, PoolSignal(0, 0, NOW - 600), True, 3.0, 0.0, None, "serving: the servers report"),
    (1, PoolSignal(0, 0, NOW - 600), True, None, 0.0, None, "a ready pod did not report"),
    (1, PoolSignal(0, 0, NOW - 600), False, 0.0, 0.0, None, "incomplete"),   # a replica may hold one
    (1, None, False, 0.0, 0.0, None, "incomplete"),
])
def test_scale_to_zero(current: int, signal: PoolSignal | None, complete: bool, load: float | None,
                       idle_start: float, replicas: int | None, reason: str) -> None:
    d = scale_to_zero(current, ZERO, signal, complete, load, idle_start, NOW)
    assert d.replicas == replicas
    assert reason in d.reason, d.reason


def test_the_hpa_rule_never_goes_below_one_and_counts_the_gateways_queue() -> None:
    pods = [PodSample("p0", True, 4.0)]
    # Four running, at target: no change; with 8 more held in the gateway: ceil(12 / 4).
    assert decide(pods, 1, (), ZERO, NOW).replicas == 1
    d = decide(pods, 1, (), ZERO, NOW, extra=8)
    assert d.replicas == 3 and "concurrency 12, target 4 per replica (incl. 8 held in the gateway)" in d.reason
    # Idle pods: the HPA rule stops at 1 (scale to zero is the idle rule's).
    idle = decide([PodSample("p0", True, 0.0), PodSample("p1", True, 0.0)], 2, (), ZERO, NOW)
    assert idle.replicas == 1 and "scale to zero waits for the idle window" in idle.reason


# ------------------------------------------------------------ the scraper, for real

class FakeGatewayReplica:
    """A gateway replica's /metrics on loopback (what pagefleet_gateway_* looks like)."""

    def __init__(self, waiting: float) -> None:
        self.waiting = waiting
        self.port = 0
        self.runner: aiohttp.web.AppRunner | None = None

    async def start(self) -> FakeGatewayReplica:
        async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
            return aiohttp.web.Response(text=(
                f'pagefleet_gateway_pool_requests_waiting{{model_name="m",pool="ns/md"}} {self.waiting}\n'
                'pagefleet_gateway_discovery_info{discovery="kubernetes",namespace="*"} 1\n'))
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", metrics)
        self.runner = aiohttp.web.AppRunner(app)
        await self.runner.setup()
        site = aiohttp.web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest_asyncio.fixture(loop_scope="session")
async def replicas() -> AsyncIterator[list[FakeGatewayReplica]]:
    started = [await FakeGatewayReplica(w).start() for w in (2.0, 3.0)]
    try:
        yield started
    finally:
        for r in started:
            await r.stop()


@pytest.mark.asyncio(loop_scope="session")
async def test_scraper_reads_every_replica_behind_the_service(cluster: Cluster,
                                                              replicas: list[FakeGatewayReplica]) -> None:
    ns = "gw-system"
    for i, r in enumerate(replicas):   # one slice per replica: each listens on its own port here
        await cluster.kube.create(f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"gw-{i}", "namespace": ns, "labels": {gateway.SERVICE_NAME_LABEL: "gw"}},
            "ports": [{"name": "http", "port": r.port}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}]})
    scraper = gateway.GatewayScraper(cluster.kube, [gateway.parse_ref(f"{ns}/gw")], timeout=2, max_age=0)
    async with aiohttp.ClientSession() as session:
        view = await scraper.view(session)
        assert view.ok and view.replicas == 2
        assert gateway.pool_signal(view, "ns", "md", "m") == PoolSignal(5.0, 0.0, None)
        # One replica stops answering: its held requests are unknown, so the view is not
        # complete (no scale to zero), while the other's still wake the model.
        await replicas[1].stop()
        view = await scraper.view(session)
        assert not view.ok and len(view.errors) == 1 and view.replicas == 2
        assert gateway.pool_signal(view, "ns", "md", "m") == PoolSignal(2.0, 0.0, None)
        assert autoscale.scale_to_zero(0, ZERO, gateway.pool_signal(view, "ns", "md", "m"), view.ok,
                                       0.0, 0.0, NOW).replicas == 1
        # No Service by that name: no endpoint, an error naming it.
        missing = gateway.GatewayScraper(cluster.kube, [gateway.parse_ref(f"{ns}/nope")], max_age=0)
        view = await missing.view(session)
        assert not view.ok and view.errors == (f"{ns}/nope:http: no ready endpoint",)
