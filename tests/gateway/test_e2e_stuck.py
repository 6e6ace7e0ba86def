"""Replicas that stop answering without dying, and replicas that drain.

- Frozen (SIGSTOP): the kernel still accepts connections, so nothing fails fast. A
  request waiting for its headers fails over when the replica's health checks take it
  out of the pool, or at --upstream-first-byte-timeout (504 when no replica is left to
  try); a stream whose replica freezes mid-response ends with the SSE error event and
  [DONE] after --upstream-idle-timeout.
- Draining (SIGTERM): the server keeps /health at 200 for the liveness probe and
  refuses new requests with 503; the gateway retries those elsewhere, takes the
  replica out (from that 503, or from the draining header on /health), and takes it
  back once it has restarted.

The frozen/draining replica is a server of its own with a 32K context, so one stream
can run long enough (tens of seconds on the CPU) to be mid-response whatever the
machine's load; the others are the session's short backends.
"""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from tests.gateway.helpers import Backend, GatewayThread, gw_metric, models_yaml, wait_for

LONG = 32768
STREAM_TOKENS = 30000        # at about 1K tokens/s on the CPU: running for tens of seconds


@pytest.fixture(scope="module")
def slow(tiny_models, tmp_path_factory):
    model = tiny_models("qwen3-32k", arch="qwen3", max_position_embeddings=LONG)
    b = Backend("slow-0", model, ["--max-model-len", str(LONG), "--shutdown-timeout", "300"],
                tmp_path_factory.mktemp("slow-logs"), served=("tiny", "solo"))
    b.start().wait_ready()
    try:
        yield b
    finally:
        if b.proc is not None and b.proc.poll() is None:
            b.proc.send_signal(signal.SIGCONT)
        b.close()


def ep(b: Backend) -> dict:
    return {"name": b.name, "url": b.url}


def fleet(tmp_path, *models: dict):
    return models_yaml(tmp_path / "m.yaml", list(models))


def tiny_over(*backends: Backend) -> dict:
    return {"name": "tiny", "pools": [{"name": "p", "max_model_len": 256,
                                       "endpoints": [ep(b) for b in backends]}]}


def body(**kw) -> dict:
    return {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0, **kw}


def ready(gw: GatewayThread, endpoint: str) -> float:
    return gw_metric(gw.metrics(), "pagefleet_gateway_endpoint_ready", endpoint=endpoint)


def retries(gw: GatewayThread) -> float:
    try:
        return gw_metric(gw.metrics(), "pagefleet_gateway_upstream_retries_total", pool="p")
    except KeyError:         # none yet
        return 0.0


async def post_all(url: str, n: int, timeout: float = 90) -> list[httpx.Response]:
    """n requests at once (round robin sends every other one to each replica)."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
        return await asyncio.gather(*[c.post("/v1/completions", json=body())
                                      for _ in range(n)])


def freeze(b: Backend) -> None:
    b.proc.send_signal(signal.SIGSTOP)


def thaw(b: Backend) -> None:
    b.proc.send_signal(signal.SIGCONT)
    b.wait_ready()


def test_requests_on_a_frozen_replica_fail_over_when_its_checks_take_it_out(
        backends, slow, tmp_path):
    """No first-byte timeout in play (the default is 600 s): the frozen replica's
    failed health checks are what frees the requests waiting on it."""
    f = fleet(tmp_path, tiny_over(backends["short-0"], slow))
    gw = GatewayThread(f, routing="round-robin", health_timeout=0.5,
                       unhealthy_threshold=3).start()
    try:
        gw.wait_ready_endpoints("tiny", 2)
        freeze(slow)
        rs = asyncio.run(post_all(gw.url, 4))
        assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
        assert {r.headers["x-pagefleet-endpoint"] for r in rs} == {"short-0"}
        assert ready(gw, "slow-0") == 0
        assert retries(gw) >= 1          # round robin did send some to the frozen one
    finally:
        thaw(slow)
        gw.stop()


def test_no_headers_within_the_first_byte_timeout_retries_elsewhere_else_504(
        backends, slow, tmp_path):
    """Health checks that never give up (a huge threshold): only the first-byte
    timeout frees the request. With another replica it is served there; with none
    left to try the client gets a 504 in the OpenAI shape."""
    f = fleet(tmp_path, tiny_over(backends["short-0"], slow),
              {"name": "solo", "pools": [{"name": "s", "max_model_len": 256,
                                          "endpoints": [ep(slow)]}]})
    gw = GatewayThread(f, routing="round-robin", health_timeout=0.5,
                       unhealthy_threshold=1000, upstream_first_byte_timeout=2).start()
    one = GatewayThread(f, unhealthy_threshold=1000, upstream_first_byte_timeout=2,
                        max_attempts=1).start()
    try:
        gw.wait_ready_endpoints("tiny", 2)
        one.wait_ready_endpoints("solo", 1)
        freeze(slow)
        rs = asyncio.run(post_all(gw.url, 4))
        assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
        assert {r.headers["x-pagefleet-endpoint"] for r in rs} == {"short-0"}
        assert retries(gw) >= 1

        r = httpx.post(one.url + "/v1/completions", json={**body(), "model": "solo"},
                       timeout=90)
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == 504 and "--upstream-first-byte-timeout" in err["message"]
        assert err["type"] == "GatewayTimeoutError"
        assert r.headers.get("x-request-id")
    finally:
        thaw(slow)
        gw.stop()
        one.stop()


def test_a_stream_whose_replica_freezes_ends_with_an_error_event(slow, tmp_path):
    f = fleet(tmp_path, {"name": "tiny", "pools": [{"name": "p", "endpoints": [ep(slow)]}]})
    gw = GatewayThread(f, upstream_idle_timeout=2).start()
    try:
        gw.wait_ready_endpoints("tiny", 1)
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=90, json=body(
                max_tokens=STREAM_TOKENS, ignore_eos=True, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            freeze(slow)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == 504 and "--upstream-idle-timeout" in err["message"]
        # Everything before the error was the replica's own tokens.
        assert all(json.loads(x[6:])["choices"][0]["finish_reason"] is None
                   for x in rest[:-2])
    finally:
        thaw(slow)
        gw.stop()


def test_a_draining_replica_gets_no_requests_and_rejoins_once_restarted(
        backends, slow, tmp_path):
    """Two gateways over the same replicas: one checks every 0.2 s (it sees the
    draining header on /health), the other checks once a minute, so only the draining
    503s of real requests can tell it. Neither passes a 503 on to a client."""
    f = fleet(tmp_path, tiny_over(backends["short-0"], slow))
    quick = GatewayThread(f, routing="round-robin").start()
    blind = GatewayThread(f, routing="round-robin", health_interval=60).start()
    direct = httpx.Client(base_url=slow.url, timeout=90)
    restarted = False
    try:
        quick.wait_ready_endpoints("tiny", 2)
        blind.wait_ready_endpoints("tiny", 2)
        # A long stream keeps the server draining (it waits for in-flight requests).
        with direct.stream("POST", "/v1/completions", json=body(
                max_tokens=STREAM_TOKENS, ignore_eos=True, stream=True)) as held:
            assert held.status_code == 200
            held_lines = held.iter_lines()      # kept: a collected iterator closes the stream
            next(line for line in held_lines if line.startswith("data: "))
            slow.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: direct.post("/v1/completions", json=body()).status_code == 503,
                     60, what="slow-0 draining")
            refused = direct.post("/v1/completions", json=body())
            assert refused.headers["x-pagefleet-draining"] == "1"
            health = direct.get("/health")
            assert health.status_code == 200              # alive for the liveness probe
            assert health.headers["x-pagefleet-draining"] == "1"
            # The quick gateway's checks see the drain before any request does.
            wait_for(lambda: ready(quick, "slow-0") == 0, 30, what="slow-0 out of quick")
            for gw in (blind, quick):
                for _ in range(6):
                    r = httpx.post(gw.url + "/v1/completions", json=body(), timeout=90)
                    assert r.status_code == 200, r.text
                    assert r.headers["x-pagefleet-endpoint"] == "short-0"
            assert ready(blind, "slow-0") == 0 and retries(blind) >= 1
            assert retries(quick) == 0
        slow.proc.wait(120)                 # the held stream closed: the drain ends
        slow.start().wait_ready()
        restarted = True
        wait_for(lambda: ready(quick, "slow-0") == 1, 60, what="slow-0 back in the pool")
        rs = [httpx.post(quick.url + "/v1/completions", json=body(), timeout=90)
              for _ in range(4)]
        assert [r.status_code for r in rs] == [200] * 4
        assert "slow-0" in {r.headers["x-pagefleet-endpoint"] for r in rs}
    finally:
        direct.close()
        quick.stop()
        blind.stop()
        if not restarted:                   # failed midway: leave a fresh server behind
            slow.proc.send_signal(signal.SIGTERM)
            slow.proc.wait(120)
            slow.start().wait_ready()
