"""Scraping: parsing vLLM's exposition, finding the pod's port, tolerating failure."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp.web
import pytest

from pagefleet.operator.metrics import metrics_url, parse_metric, pod_ready, sample_pods
from tests.operator.harness import MetricsServer, free_port

VLLM_TEXT = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 4.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 3.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 96.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="qwen"} 12.0
"""


@pytest.mark.parametrize("text,metric,expected", [
    (VLLM_TEXT, "vllm:num_requests_waiting", 7.0),             # samples of a pod are summed
    (VLLM_TEXT, "vllm:num_requests_running", 96.0),
    (VLLM_TEXT, "vllm:num_preemptions_total", 12.0),           # counters by their sample name
    (VLLM_TEXT, "vllm:kv_cache_usage_perc", None),             # absent
    ("vllm:num_requests_waiting 2\n", "vllm:num_requests_waiting", 2.0),  # untyped, unlabelled
    ('vllm:num_requests_waiting{a="b"} NaN\n', "vllm:num_requests_waiting", None),
    ("", "vllm:num_requests_waiting", None),
    ("<html>502 Bad Gateway</html>", "vllm:num_requests_waiting", None),
    ('vllm:num_requests_waiting{model_name="x" 3\n', "vllm:num_requests_waiting", None),
    ("\x00\xff garbage {{{", "vllm:num_requests_waiting", None),
])
def test_parse_metric(text: str, metric: str, expected: float | None) -> None:
    assert parse_metric(text, metric) == expected


def pod(ip: str | None = "10.0.0.5", ready: bool = True, annotations: dict[str, str] | None = None,
        ports: list[dict[str, Any]] | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [{"name": "server", "ports": ports or []}]},
            "status": status}


@pytest.mark.parametrize("p,url", [
    (pod(annotations={"prometheus.io/port": "9100", "prometheus.io/path": "/m"}), "http://10.0.0.5:9100/m"),
    (pod(ports=[{"name": "grpc", "containerPort": 9}, {"name": "http", "containerPort": 8080}]),
     "http://10.0.0.5:8080/metrics"),
    (pod(), "http://10.0.0.5:8000/metrics"),
    (pod(ip="fd00::7"), "http://[fd00::7]:8000/metrics"),
    (pod(ip=None), None),
])
def test_metrics_url(p: dict[str, Any], url: str | None) -> None:
    assert metrics_url(p) == url


@pytest.mark.parametrize("p,ready", [
    (pod(), True), (pod(ready=False), False), (pod(ip=None), False), (pod(deleting=True), False),
    ({"metadata": {"name": "x"}}, False),
])
def test_pod_ready(p: dict[str, Any], ready: bool) -> None:
    assert pod_ready(p) is ready


@pytest.mark.asyncio(loop_scope="session")
async def test_sample_pods_over_real_http() -> None:
    good, garbage = await MetricsServer().start(), await MetricsServer().start()
    good.waiting, garbage.garbage = 6, True
    # A server that accepts and never answers: the scrape must time out, not hang.
    hang_started, release = asyncio.Event(), asyncio.Event()

    async def hang(request: aiohttp.web.Request) -> aiohttp.web.Response:
        hang_started.set()
        await release.wait()
        return aiohttp.web.Response(text="vllm:num_requests_waiting 99\n")
    app = aiohttp.web.Application()
    app.router.add_get("/metrics", hang)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    hang_port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", hang_port).start()
    closed_port = free_port()  # nothing listens there
    try:
        def loopback(port: int, **kw: Any) -> dict[str, Any]:
            return pod(ip="127.0.0.1", annotations={"prometheus.io/port": str(port)}, **kw)

        pods = [loopback(good.port), loopback(garbage.port), loopback(hang_port), loopback(closed_port),
                loopback(good.port, ready=False)]
        samples = await sample_pods(pods, ("vllm:num_requests_waiting",), timeout=0.5)
        assert [(s.ready, s.value) for s in samples] == [
            (True, 6.0), (True, None), (True, None), (True, None), (False, None)]
        assert hang_started.is_set()
    finally:
        release.set()
        await good.stop()
        await garbage.stop()
        await runner.cleanup()


def test_parse_metrics_reads_several_in_one_pass() -> None:
    from pagefleet.operator.metrics import parse_metrics

    text = VLLM_TEXT + 'vllm:num_requests_waiting_extra{a="}"} 100\n' + 'vllm:kv_cache_usage_perc{x="a\\"}b"} 0.5 1700000000\n'
    assert parse_metrics(text, ("vllm:num_requests_waiting", "vllm:num_requests_running",
                                "vllm:kv_cache_usage_perc")) == {
        "vllm:num_requests_waiting": 7.0, "vllm:num_requests_running": 96.0, "vllm:kv_cache_usage_perc": 0.5}
    assert parse_metrics("vllm:num_requests_running 3\nvllm:num_requests_running{ 4\n",
                         ("vllm:num_requests_running",)) is None, "a malformed line spoils the page"


def test_line_parser_agrees_with_prometheus_client_on_a_server_page() -> None:
    """On a full page as the server exports it (histograms and all), the scanner reads
    the same sums as prometheus_client's parser."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagefleet.operator.metrics import parse_metrics

    reg = CollectorRegistry()
    waiting = Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=reg)
    running = Gauge("vllm:num_requests_running", "r", ["model_name", "engine"], registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", ["model_name"], registry=reg)
    tokens = Counter("vllm:generation_tokens", "g", ["model_name"], registry=reg)
    for e in ("0", "1"):
        waiting.labels("q", e).set(3 + int(e))
        running.labels("q", e).set(90)
    for v in (0.01, 0.2, 3.0):
        ttft.labels("q").observe(v)
    tokens.labels("q").inc(1234)
    page = generate_latest(reg).decode()
    names = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:generation_tokens_total")
    reference: dict[str, float] = {}
    for fam in text_string_to_metric_families(page):
        for sample in fam.samples:
            if sample.name in names:
                reference[sample.name] = reference.get(sample.name, 0.0) + sample.value
    assert parse_metrics(page, names) == reference == {
        "vllm:num_requests_waiting": 7.0, "vllm:num_requests_running": 180.0, "vllm:generation_tokens_total": 1234.0}


@pytest.mark.asyncio(loop_scope="session")
async def test_one_session_keeps_its_connections_across_rounds() -> None:
    """The operator scrapes through one long-lived session: every round reuses the
    keep-alive connection to a pod instead of opening a new one (and a new session)."""
    from pagefleet.operator.metrics import new_session

    peers: list[Any] = []

    async def handler(request: aiohttp.web.Request) -> aiohttp.web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return aiohttp.web.Response(text="vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n")
    app = aiohttp.web.Application()
    app.router.add_get("/metrics", handler)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    session = new_session()
    try:
        p = pod(ip="127.0.0.1", annotations={"prometheus.io/port": str(port)})
        for _ in range(4):
            (s,) = await sample_pods([p], ("vllm:num_requests_running", "vllm:num_requests_waiting"),
                                     session=session)
            assert s.value == 3.0 and s.values == {"vllm:num_requests_waiting": 1.0, "vllm:num_requests_running": 2.0}
        assert len(peers) == 4 and len(set(peers)) == 1, f"a new connection per round: client ports {peers}"
    finally:
        await session.close()
        await runner.cleanup()


@pytest.mark.asyncio(loop_scope="session")
async def test_scrape_errors_say_what_failed() -> None:
    closed = free_port()
    (s,) = await sample_pods([pod(ip="127.0.0.1", annotations={"prometheus.io/port": str(closed)})],
                             ("vllm:num_requests_waiting",), timeout=0.5)
    assert s.value is None and s.error and f"127.0.0.1:{closed}" in s.error
