"""Pools through the real gateway (issue 13, must-hold 5 and 6): long/short split by
context fit, weighted rollouts, streaming passed through byte for byte and chunk by
chunk, X-Request-Id on both sides, and the `pagefleet gateway` command itself."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai

from tests.gateway.helpers import (
    Backend,
    GatewayProcess,
    GatewayThread,
    RecordingProxy,
    metric,
    models_yaml,
    wait_for,
)

WORDS = "model token cache block batch queue request server memory prefix chunk".split()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def ep(b) -> dict:
    return {"name": b.name, "url": b.url}


def test_short_requests_reach_only_the_short_pool_and_long_only_the_long(backends, tmp_path,
                                                                          gw_model):
    short, long_ = backends["short-0"], backends["long-0"]
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "tokenizer": str(gw_model), "pools": [
        {"name": "short", "max_model_len": 256, "endpoints": [ep(short)]},
        {"name": "long", "endpoints": [ep(long_)]}]}])       # learns 1024 from /v1/models
    gw = GatewayThread(f).start()
    try:
        gw.wait_ready_endpoints("tiny", 2)
        wait_for(lambda: httpx.get(gw.url + "/v1/models").json()["data"][0]["max_model_len"]
                 == 1024, 30, what="learned context length")
        before = {b.name: metric(b.metrics(), "vllm:prompt_tokens_total") for b in (short, long_)}
        cases = []          # (body, expected pool)
        for i in range(6):
            cases.append(({"prompt": words(20, i), "max_tokens": 16}, "short-0"))
            cases.append(({"prompt": words(400, 100 + i), "max_tokens": 8}, "long-0"))
        cases.append(({"prompt": words(200, 7), "max_tokens": 100}, "long-0"))   # 300 > 256
        cases.append(({"messages": [{"role": "user", "content": words(30, 8)}]}, "short-0"))
        sent = {"short-0": 0, "long-0": 0}
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            for body, want in cases:
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                if "messages" in body:
                    body = {**body, "max_tokens": None}
                r = c.post(path, json={"model": "tiny", "temperature": 0, **body})
                assert r.status_code == 200, r.text
                assert r.headers["x-pagefleet-endpoint"] == want, (len(body.get("prompt", "")), want)
                sent[want] += r.json()["usage"]["prompt_tokens"]
            too_long = c.post("/v1/completions", json={"model": "tiny", "prompt": words(1100, 9),
                                                        "max_tokens": 4})
        assert too_long.status_code == 400
        err = too_long.json()["error"]
        assert err["param"] == "messages"
        assert err["message"].startswith("This model's maximum context length is 1024 tokens.")
        # The backends' own counters: each pool saw exactly its requests' prompt tokens.
        for b in (short, long_):
            got = metric(b.metrics(), "vllm:prompt_tokens_total") - before[b.name]
            assert got == sent[b.name], (b.name, got, sent)
    finally:
        gw.stop()


def test_weights_80_20_split_500_requests(backends, tmp_path):
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [
        {"name": "stable", "max_model_len": 256, "weight": 80, "endpoints": [ep(backends["short-0"])]},
        {"name": "canary", "max_model_len": 256, "weight": 20,
         "endpoints": [ep(backends["short-1"])]}]}])
    gw = GatewayThread(f).start()
    try:
        gw.wait_ready_endpoints("tiny", 2)

        async def send_all():
            async with httpx.AsyncClient(base_url=gw.url, timeout=120) as c:
                async def one(i):
                    r = await c.post("/v1/completions", json={
                        "model": "tiny", "prompt": f"request {i} " + words(6, i),
                        "max_tokens": 1})
                    assert r.status_code == 200, r.text
                    return r.headers["x-pagefleet-endpoint"]
                sem = asyncio.Semaphore(16)

                async def limited(i):
                    async with sem:
                        return await one(i)
                return await asyncio.gather(*[limited(i) for i in range(500)])

        got = asyncio.run(asyncio.wait_for(send_all(), 600))
        share = got.count("short-0") / len(got)
        assert abs(share - 0.80) <= 0.05, share
        assert got.count("short-0") + got.count("short-1") == 500
    finally:
        gw.stop()


def test_streaming_through_the_gateway_command_is_byte_identical(backends, tmp_path):
    """What the client reads through `pagefleet gateway` is exactly what the backend
    sent for that request (recorded on the wire between gateway and backend)."""
    b = backends["short-1"]
    tap = RecordingProxy(b.port).start()
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [
        {"name": "p", "max_model_len": 256, "endpoints": [{"name": b.name, "url": tap.url}]}]}])
    gw = GatewayProcess(["--models-file", str(f), "--health-interval", "0.2"],
                        tmp_path / "gateway.log").wait_ready()
    try:
        wait_for(lambda: httpx.get(gw.url + "/v1/models").json()["data"], 30,
                 what="a ready endpoint")
        rid = "bytes-through-the-gateway"
        with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=120,
                          headers={"X-Request-Id": rid}, json={
                              "model": "tiny", "messages": [{"role": "user", "content": "tell me"}],
                              "max_tokens": 24, "temperature": 0, "stream": True,
                              "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            assert r.headers["x-request-id"] == rid
            assert r.headers["content-type"].startswith("text/event-stream")
            via = b"".join(r.iter_raw())
        sent = tap.response_body(rid.encode())
        assert via == sent
        # Several events, whatever the timing: the server puts every token that is ready
        # into one chunk, so on a loaded machine 24 tokens came in 6 events, not 24.
        assert via.count(b"data: ") >= 3 and via.endswith(b"data: [DONE]\n\n")
        assert b'"usage":{"prompt_tokens"' in via
        # The id names the request in both logs.
        wait_for(lambda: f"request {rid}:" in gw.output(), 10, what="gateway log line")
        assert f"request {rid}:" in b.output()
        # The official client works through the gateway.
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.chat.completions.create(model="tiny", max_tokens=5, messages=[
            {"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        chunks = list(client.completions.create(model="tiny", prompt="hi", max_tokens=5,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
    finally:
        gw.close()
        tap.stop()
    assert gw.proc.returncode == 0


def test_stream_chunks_arrive_while_the_backend_still_generates(backends, tmp_path):
    b = backends["long-0"]
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [
        {"name": "p", "endpoints": [ep(b)]}]}])
    gw = GatewayThread(f).start()
    try:
        gw.wait_ready_endpoints("tiny", 1)
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": "hello", "max_tokens": 600, "ignore_eos": True,
                "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            # The first chunk is here and the server is still generating this request.
            assert metric(b.metrics(), "vllm:num_requests_running") == 1
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        gw.stop()


class NoAnswers:
    """A replica that answers /health and nothing else: 401 on /v1/models (a key the
    gateway does not have), 404 on /tokenize (a server without that endpoint)."""

    def __init__(self) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                status = {"/health": 200, "/v1/models": 401}.get(self.path, 404)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_pools_of_keyed_servers_learn_their_context_without_the_key(
        backends, tmp_path, gw_model, caplog):
    """Servers with --api-key and a pool without `api_key` (the clients' keys are
    passed through): /v1/models gives the prober a 401, so it learns max_model_len
    from /tokenize, which needs no key, and the long/short split holds. A pool whose
    replicas tell it nothing gets a warning instead of silently taking any prompt."""
    keyed = Backend("keyed-0", gw_model, ["--max-model-len", "256", "--api-key", "sk-srv"],
                    tmp_path).start().wait_ready()
    deaf = NoAnswers()
    f = models_yaml(tmp_path / "m.yaml", [
        {"name": "tiny", "tokenizer": str(gw_model), "pools": [
            {"name": "short", "endpoints": [ep(keyed)]},
            {"name": "long", "endpoints": [ep(backends["long-0"])]}]},
        {"name": "other", "pools": [{"name": "deaf", "endpoints": [
            {"name": "deaf-0", "url": deaf.url}]}]}])
    gw = GatewayThread(f).start()
    auth = {"Authorization": "Bearer sk-srv"}
    try:
        gw.wait_ready_endpoints("tiny", 2)
        lens = wait_for(lambda: {m["id"]: m["max_model_len"] for m in httpx.get(
            gw.url + "/v1/models").json()["data"]}, 30, what="models listed")
        assert lens["tiny"] == 1024
        assert gw.gateway.models["tiny"].pools["short"].max_model_len == 256
        with httpx.Client(base_url=gw.url, timeout=120, headers=auth) as c:
            for n, want in ((20, "keyed-0"), (400, "long-0"), (30, "keyed-0")):
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": words(n, n),
                                                     "max_tokens": 8})
                assert r.status_code == 200, r.text
                assert r.headers["x-pagefleet-endpoint"] == want, n
        warned = [r.getMessage() for r in caplog.records
                  if "cannot learn max_model_len" in r.getMessage()]
        assert len(warned) == 1, warned
        assert "pool 'deaf'" in warned[0] and "/v1/models: HTTP 401" in warned[0]
        assert "/tokenize: HTTP 404" in warned[0] and "Set max_model_len" in warned[0]
    finally:
        gw.stop()
        deaf.close()
        keyed.close()


def test_gateway_command_on_port_0_logs_the_port_it_took(backends, tmp_path):
    f = models_yaml(tmp_path / "m.yaml", [{"name": "tiny", "pools": [
        {"name": "p", "max_model_len": 256, "endpoints": [ep(backends["short-1"])]}]}])
    gw = GatewayProcess(["--models-file", str(f)], tmp_path / "gateway.log", port=0)
    try:
        gw.wait_ready()           # inside the try: a gateway that is never found is stopped
        assert gw.port != 0
        assert f"gateway starting on http://127.0.0.1:{gw.port} " in gw.output()
        assert httpx.get(gw.url + "/health", timeout=30).status_code == 200
    finally:
        gw.close()
    assert gw.proc.returncode == 0
