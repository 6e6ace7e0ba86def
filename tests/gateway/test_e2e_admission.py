"""Admission through the real gateway and real backends (issue 13, must-hold 4): the
queue cap's 429 with Retry-After, lowest priority refused first, the highest never,
the queue-time 503, per-key rate limits over a 10 s window; and the scale-from-zero
hold: a request for a model with no ready replica waits until one appears."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import yaml

from tests.gateway.helpers import GatewayThread, gw_metric, models_yaml, wait_for


def pool(backend, **kw) -> dict:
    return {"name": kw.pop("name", "p"), "endpoints": [{"name": backend.name, "url": backend.url}],
            **kw}


def waiting(gw: GatewayThread) -> float:
    return gw_metric(gw.metrics(), "pagefleet_gateway_requests_waiting", model_name="tiny")


def inflight(gw: GatewayThread) -> float:
    return gw_metric(gw.metrics(), "pagefleet_gateway_requests_in_flight", model_name="tiny")


def body(priority: int | None = None, **kw) -> dict:
    b = {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0, **kw}
    if priority is not None:
        b["priority"] = priority
    return b


async def poll(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Blocker:
    """A long stream holding the pool's only in-flight slot until closed."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.cm = None

    async def open(self) -> None:
        self.cm = self.client.stream("POST", "/v1/completions", json=body(
            max_tokens=1000, ignore_eos=True, stream=True))
        r = await self.cm.__aenter__()
        assert r.status_code == 200
        self.lines = r.aiter_lines()
        await self.lines.__anext__()                 # streaming has begun

    async def close(self) -> None:
        await self.cm.__aexit__(None, None, None)


def test_queue_cap_refuses_the_lowest_priority_first_and_never_the_highest(backends, tmp_path):
    f = models_yaml(tmp_path / "m.yaml", [{
        "name": "tiny", "max_num_queued_requests": 3,
        "pools": [pool(backends["long-0"], max_inflight=1)]}])
    gw = GatewayThread(f, critical_priority=-10, retry_after=2).start()
    gw.wait_ready_endpoints("tiny", 1)

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=300) as c:
            blocker = Blocker(c)
            await blocker.open()
            low = [asyncio.ensure_future(c.post("/v1/completions", json=body(5)))
                   for _ in range(1)]
            for _ in range(2):
                await poll(lambda n=len(low): waiting(gw) == n, "queued low")
                low.append(asyncio.ensure_future(c.post("/v1/completions", json=body(5))))
            await poll(lambda: waiting(gw) == 3, "three waiting")
            # Full queue: an equally unimportant newcomer is refused at once.
            r = await c.post("/v1/completions", json=body(5))
            assert r.status_code == 429 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["type"] == "RateLimitError"
            # A more urgent one sheds the latest least-urgent waiter.
            mid = asyncio.ensure_future(c.post("/v1/completions", json=body(0)))
            shed = await low[2]
            assert shed.status_code == 429 and not low[0].done() and not low[1].done()
            # Critical ones (X-Priority header) shed the rest, lowest priority first ...
            crit = []
            for i in range(4):
                crit.append(asyncio.ensure_future(c.post(
                    "/v1/completions", json=body(), headers={"X-Priority": "-20"})))
                if i == 0:
                    assert (await low[1]).status_code == 429 and not mid.done()
                elif i == 1:
                    assert (await low[0]).status_code == 429 and not mid.done()
                elif i == 2:
                    assert (await mid).status_code == 429
            # ... and the fourth waits beyond the cap instead of being refused.
            await poll(lambda: waiting(gw) == 4, "a critical request beyond the cap")
            assert not any(t.done() for t in crit)
            await blocker.close()
            return [await t for t in crit]

    try:
        crit = asyncio.run(asyncio.wait_for(scenario(), 300))
        assert [r.status_code for r in crit] == [200] * 4, [r.text for r in crit]
        text = gw.metrics()
        assert gw_metric(text, "pagefleet_gateway_rejections_total", model_name="tiny",
                         reason="shed") == 4
        assert gw_metric(text, "pagefleet_gateway_rejections_total", model_name="tiny",
                         reason="queue_full") == 1
        wait_for(lambda: waiting(gw) == 0 and inflight(gw) == 0, 60, what="idle gateway")
    finally:
        gw.stop()


def test_queue_time_limit_gives_503(backends, tmp_path):
    f = models_yaml(tmp_path / "m.yaml", [{
        "name": "tiny", "queue_timeout": 0.5, "pools": [pool(backends["long-0"], max_inflight=1)]}])
    gw = GatewayThread(f).start()
    gw.wait_ready_endpoints("tiny", 1)

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=300) as c:
            blocker = Blocker(c)
            await blocker.open()
            r = await c.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stream": True})
            await blocker.close()
            return r

    try:
        r = asyncio.run(asyncio.wait_for(scenario(), 300))
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "ServiceUnavailableError"
        assert "waited more than 0.5s" in err["message"] and "busy" in err["message"]
    finally:
        gw.stop()


def test_rate_limit_per_key_holds_within_ten_percent_over_ten_seconds(backends, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [
        {"key": "sk-slow", "name": "slow", "requests_per_second": 5, "burst": 5},
        {"key": "sk-fast", "name": "fast", "requests_per_second": 1000, "burst": 1000}]}))
    f = models_yaml(tmp_path / "m.yaml", [{
        "name": "tiny", "pools": [pool(backends["short-0"]), pool(backends["short-1"], name="q")]}])
    gw = GatewayThread(f, api_keys_file=str(keys)).start()
    gw.wait_ready_endpoints("tiny", 2)
    rate, burst, window = 5.0, 5.0, 10.0

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as c:
            assert (await c.post("/v1/completions", json=body())).status_code == 401
            bad = await c.post("/v1/completions", json=body(),
                               headers={"Authorization": "Bearer nope"})
            assert bad.status_code == 401 and bad.json()["error"]["type"] == "AuthenticationError"
            results: list[httpx.Response] = []
            t0 = time.monotonic()

            async def worker():
                while time.monotonic() - t0 < window:
                    results.append(await c.post("/v1/completions", json=body(max_tokens=1),
                                                headers={"Authorization": "Bearer sk-slow"}))
            fast = [c.post("/v1/completions", json=body(max_tokens=1),
                           headers={"Authorization": "Bearer sk-fast"}) for _ in range(20)]
            got = await asyncio.gather(*[worker() for _ in range(4)], *fast)
            elapsed = time.monotonic() - t0
            return results, got[4:], elapsed

    try:
        results, fast, elapsed = asyncio.run(asyncio.wait_for(scenario(), 300))
        ok = [r for r in results if r.status_code == 200]
        limited = [r for r in results if r.status_code == 429]
        assert len(ok) + len(limited) == len(results)
        assert len(limited) > len(ok)                 # the clients did push past the rate
        for r in limited:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "RateLimitError"
        expected = burst + rate * elapsed
        assert 0.9 * expected <= len(ok) <= 1.1 * expected, (len(ok), expected)
        assert [r.status_code for r in fast] == [200] * 20    # another key's own bucket
    finally:
        gw.stop()


def test_bad_input_gets_a_clear_4xx(backends, tmp_path):
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [pool(backends["short-0"])]}])
    gw = GatewayThread(f).start()
    gw.wait_ready_endpoints("tiny", 1)
    try:
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            cases = [
                (c.post("/v1/completions", content=b"{not json"), 400, None),
                (c.post("/v1/completions", content=b""), 400, None),
                (c.post("/v1/chat/completions", json={"model": "tiny"}), 400, "messages"),
                (c.post("/v1/chat/completions", json={"model": "tiny", "messages": "x"}), 400,
                 "messages"),
                (c.post("/v1/completions", json=body(), headers={"X-Priority": "high"}), 400,
                 "X-Priority"),
                (c.post("/v1/completions", json={**body(), "model": "gpt-x"}), 404, "model"),
                (c.post("/v1/embeddings", json={}), 404, None),
                (c.get("/v1/completions"), 405, None),
                # A sampling field the gateway does not check: the server's 400, unchanged.
                (c.post("/v1/completions", json=body(top_p=7)), 400, "top_p"),
            ]
            for r, status, param in cases:
                assert r.status_code == status, (r.status_code, r.text)
                err = r.json()["error"]
                assert err["code"] == status and err["message"]
                if param:
                    assert err["param"] == param, err
                assert r.headers.get("x-request-id")
    finally:
        gw.stop()


def test_scale_from_zero_hold_until_a_replica_appears(backends, tmp_path):
    """No replica: /v1/models still lists the model, a request is held and counted in
    the per-model waiting metric, and is served once an endpoint appears in the file."""
    f = tmp_path / "m.yaml"
    zero = {"name": "tiny", "scale_from_zero": True, "queue_timeout": 120,
            "pools": [{"name": "tiny-pool", "max_model_len": 256, "endpoints": []}]}
    models_yaml(f, [zero])
    gw = GatewayThread(f).start()
    b = backends["short-2"]

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=300) as c:
            cards = (await c.get("/v1/models")).json()["data"]
            assert [m["id"] for m in cards] == ["tiny"] and cards[0]["max_model_len"] == 256
            held = asyncio.ensure_future(c.post("/v1/completions", json=body()))
            await poll(lambda: waiting(gw) == 1, "a held request")
            text = await asyncio.to_thread(gw.metrics)
            assert gw_metric(text, "pagefleet_gateway_pool_requests_waiting", model_name="tiny",
                             pool="tiny-pool") == 1
            assert not held.done()
            models_yaml(f, [{**zero, "pools": [{**zero["pools"][0], "endpoints": [
                {"name": b.name, "url": b.url}]}]}])
            return await held

    try:
        r = asyncio.run(asyncio.wait_for(scenario(), 300))
        assert r.status_code == 200, r.text
        assert r.headers["x-pagefleet-endpoint"] == "short-2"
        assert waiting(gw) == 0
    finally:
        gw.stop()


def test_no_replica_and_no_hold_budget_gives_503(tmp_path):
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "queue_timeout": 0.3,
                                           "pools": [{"name": "p", "endpoints": []}]}])
    gw = GatewayThread(f).start()
    try:
        assert httpx.get(gw.url + "/v1/models").json()["data"] == []   # nothing ready
        r = httpx.post(gw.url + "/v1/completions", json=body(), timeout=60)
        assert r.status_code == 503 and "no replica is ready" in r.json()["error"]["message"]
    finally:
        gw.stop()


@pytest.mark.parametrize("policy,backend", [("fcfs", "short-0"), ("priority", "long-0")])
def test_priority_reaches_the_servers_only_when_they_schedule_by_it(backends, tmp_path, policy,
                                                                    backend):
    """fcfs servers refuse a non-zero `priority`: the gateway, which honours it, strips
    it for them; priority servers take it (the body rewrite itself: test_units)."""
    srv = backends[backend]
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [
        {"name": "p", "scheduling_policy": policy, "endpoints": [{"name": srv.name, "url": srv.url}]}]}])
    gw = GatewayThread(f).start()
    gw.wait_ready_endpoints("tiny", 1)
    try:
        r1 = httpx.post(gw.url + "/v1/completions", json=body(3), timeout=60)
        r2 = httpx.post(gw.url + "/v1/completions", json=body(), timeout=60,
                        headers={"X-Priority": "4"})
        assert (r1.status_code, r2.status_code) == (200, 200), (r1.text, r2.text)
        # Sent as is, the fcfs server would refuse it: the stripping is what makes it pass.
        direct = httpx.post(srv.url + "/v1/completions", json=body(3), timeout=60)
        assert direct.status_code == (400 if policy == "fcfs" else 200)
    finally:
        gw.stop()


def test_an_oversized_body_gets_413_before_the_gateway_reads_it(backends, tmp_path):
    """--max-request-body-bytes, as on the server: a body over it is refused from its
    Content-Length (or, chunked, from its bytes so far) before it is parsed or
    tokenized; one under it is served."""
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [pool(backends["short-0"])]}])
    gw = GatewayThread(f, max_request_body_bytes=2000).start()
    gw.wait_ready_endpoints("tiny", 1)
    big = {**body(), "prompt": "hello " * 400}                # about 2.4 KB

    def chunked():
        raw = yaml.safe_dump(big).encode()    # any bytes: refused before parsing
        for i in range(0, len(raw), 500):
            yield raw[i:i + 500]

    try:
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            for r in (c.post("/v1/completions", json=big),
                      c.post("/v1/completions", content=chunked(),
                             headers={"X-Request-Id": "too-big"})):
                assert r.status_code == 413, r.text
                err = r.json()["error"]
                assert err["code"] == 413 and err["type"] == "RequestTooLargeError"
                assert "--max-request-body-bytes 2000" in err["message"]
                assert r.headers.get("x-request-id")
            assert r.headers["x-request-id"] == "too-big"
            ok = c.post("/v1/completions", json={**body(), "prompt": "hello " * 200})
            assert ok.status_code == 200, ok.text
    finally:
        gw.stop()


def test_models_list_needs_a_key_with_an_api_keys_file(backends, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"key": "sk-a", "name": "a"}]}))
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [pool(backends["short-0"])]}])
    gw = GatewayThread(f, api_keys_file=str(keys)).start()
    gw.wait_ready_endpoints("tiny", 1)
    try:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = httpx.get(gw.url + "/v1/models", headers=headers, timeout=30)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["type"] == "AuthenticationError"
            assert r.headers["www-authenticate"] == "Bearer"
        r = httpx.get(gw.url + "/v1/models", headers={"Authorization": "Bearer sk-a"},
                      timeout=30)
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]
        # /health and /metrics stay open for probes and scrapers.
        assert httpx.get(gw.url + "/health", timeout=30).status_code == 200
        assert httpx.get(gw.url + "/metrics", timeout=30).status_code == 200
    finally:
        gw.stop()


def _partial_post(port: int, headers: str) -> bytes:
    """A completion request whose headers promise 100,000 bytes of body and whose body
    never comes; the reply, read until the gateway answers and closes (or 60 s)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: 100000\r\n{headers}Connection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode() + b'{"model": "tiny", "prompt": "')
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_a_keyless_or_rate_limited_client_is_refused_before_its_body(backends, tmp_path):
    """The key and the rate limit are checked from the headers, before the body is read:
    a client without a valid key gets its 401 (over its rate, its 429) while its body is
    still to come, not a 408 once --request-body-timeout has passed (the gateway used to
    buffer up to --max-request-body-bytes for anyone before looking at the key). A keyed
    request's body is read and served as before."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [
        {"key": "sk-a", "name": "a"},
        {"key": "sk-slow", "name": "slow", "requests_per_second": 0.001, "burst": 1}]}))
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [pool(backends["short-0"])]}])
    gw = GatewayThread(f, api_keys_file=str(keys), request_body_timeout=60).start()
    gw.wait_ready_endpoints("tiny", 1)
    try:
        for auth in ("", "Authorization: Bearer nope\r\n"):
            data = _partial_post(gw.port, auth)
            head, _, payload = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 401"), data[:300]
            assert b"www-authenticate: bearer" in head.lower()
            assert json.loads(payload)["error"]["type"] == "AuthenticationError"
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            for key in ("sk-a", "sk-slow"):
                r = c.post("/v1/completions", json=body(), headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
        data = _partial_post(gw.port, "Authorization: Bearer sk-slow\r\n")
        head, _, payload = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429"), data[:300]
        assert b"retry-after:" in head.lower()
        assert "rate limit" in json.loads(payload)["error"]["message"]
        metrics = gw.metrics()
        assert gw_metric(metrics, "pagefleet_gateway_requests_total", model_name="",
                         code="401") == 2
    finally:
        gw.stop()
