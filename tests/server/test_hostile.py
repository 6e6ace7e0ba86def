"""No request can take a replica down (issue 10): bounded inputs at the edge, one
request's failure isolated in the engine, large bodies off the event loop, quiet and
truthful logs and gauges under abuse. Real servers on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import threading

import httpx
import pytest

from pagefleet.server.api import body_limit
from tests.server.helpers_serve import SubprocessServer, ThreadServer, metric, wait_for

FAULTS = "add:fx-add,prepare:fx-prep,finish:fx-fin,stall:fx-stall"


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen3")


@pytest.fixture(scope="module")
def srv(model_dir):
    """A server whose core injects faults for request ids with the markers above."""
    old = os.environ.get("PAGEFLEET_FAULTS")
    os.environ["PAGEFLEET_FAULTS"] = FAULTS
    os.environ["PAGEFLEET_FAULT_STALL_SECONDS"] = "4"
    try:
        server = ThreadServer(model_dir, max_num_seqs=2, max_model_len=2048,
                              max_num_queued_requests=64).start()
    finally:
        if old is None:
            os.environ.pop("PAGEFLEET_FAULTS", None)
        else:
            os.environ["PAGEFLEET_FAULTS"] = old
    yield server
    server.stop()


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=120, **kw)


def idle(srv) -> bool:
    text = srv.metrics()
    return (metric(text, "vllm:num_requests_running") == 0
            and metric(text, "vllm:num_requests_waiting") == 0 and srv.kv_whole())


STREAM = {"prompt": "hello world", "max_tokens": 40, "ignore_eos": True, "stream": True}


def test_an_overflowing_integer_is_a_400_and_the_engine_lives(srv):
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                      "top_k": 9223372036854775808})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    assert httpx.get(srv.url + "/health").status_code == 200
    ok = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("field,value", [
    ("seed", 2 ** 64), ("seed", 2 ** 70), ("seed", -2 ** 63 - 1), ("top_k", 10 ** 6),
    ("top_k", -2), ("n", 10 ** 9), ("priority", 2 ** 80), ("max_tokens", 2 ** 64),
    ("min_tokens", 10 ** 7), ("logprobs", 21), ("stop_token_ids", [2 ** 70]),
    ("stop", ["x"] * 1000), ("temperature", "NaN"), ("top_p", 0), ("prompt", [2 ** 63]),
    ("prompt", [[]]), ("frequency_penalty", 1e308)])
def test_bounds_are_400s_naming_the_field(srv, field, value):
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").split(".")[0] == field


def test_chat_bounds(srv):
    bad = [({"messages": [{"role": "nobody", "content": "x"}]}, "messages"),
           ({"messages": [{"role": "user"}]}, "messages"),
           ({"messages": [{"role": "user", "content": "x"}], "seed": -2 ** 63 - 1}, "seed"),
           ({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
             "top_logprobs": 21}, "top_logprobs")]
    for body, param in bad:
        r = post(srv, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_tokenize_with_no_messages_to_continue(srv):
    r = post(srv, "/tokenize", {"messages": [], "continue_final_message": True,
                                "add_generation_prompt": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_429(srv):
    r = post(srv, "/v1/completions", {"prompt": ["hi"] * 100, "max_tokens": 2})
    assert r.status_code == 400 and "max-num-queued-requests" in r.json()["error"]["message"]


@pytest.mark.parametrize("marker", ["fx-add", "fx-prep", "fx-fin"])
def test_a_failure_in_one_request_fails_that_request_only(srv, marker):
    async def scenario():
        async with httpx.AsyncClient(timeout=120) as c:
            async def stream():
                async with c.stream("POST", srv.url + "/v1/completions", json=STREAM) as r:
                    return r.status_code, (await r.aread()).decode()
            good = asyncio.create_task(stream())
            bad = await c.post(srv.url + "/v1/completions", headers={"X-Request-Id": marker},
                               json={"prompt": "boom", "max_tokens": 20, "ignore_eos": True})
            return await good, bad
    (status, body), bad = asyncio.run(scenario())
    assert status == 200 and body.rstrip().endswith("[DONE]") and '"error"' not in body
    assert bad.status_code == 500 and "the engine failed this request" in bad.text
    assert httpx.get(srv.url + "/health").status_code == 200
    wait_for(lambda: idle(srv), 60, what="idle engine with every block back")
    assert srv.core_call("check_whole")["ok"]


def test_gauges_follow_admission_while_the_engine_is_in_a_long_step(srv):
    """A scrape during a long step sees every request the server holds."""
    async def scenario():
        async with httpx.AsyncClient(timeout=120) as c:
            stall = asyncio.create_task(c.post(
                srv.url + "/v1/completions", headers={"X-Request-Id": "fx-stall"},
                json={"prompt": "hello", "max_tokens": 2}))
            await asyncio.to_thread(wait_for, lambda: metric(
                srv.metrics(), "vllm:num_requests_running") == 1, 30)
            more = [asyncio.create_task(c.post(srv.url + "/v1/completions", json={
                "prompt": "hi", "max_tokens": 2})) for _ in range(6)]
            seen = await asyncio.to_thread(wait_for, lambda: (lambda t: (
                metric(t, "vllm:num_requests_waiting"), metric(t, "vllm:num_requests_running"))
            )(srv.metrics()) == (6.0, 1.0) and not stall.done(), 30, 0.02, "gauges")
            return seen, await stall, await asyncio.gather(*more)
    seen, stall, more = asyncio.run(scenario())
    assert seen and stall.status_code == 200 and all(r.status_code == 200 for r in more)
    wait_for(lambda: idle(srv), 60, what="idle")


def test_a_large_body_never_blocks_the_event_loop(srv):
    """While a 10 MB prompt is being tokenized, /health answers and a concurrent stream
    keeps receiving tokens (the big request is still in flight when both happen)."""
    big = {"prompt": "hello world the model " * 460_000, "max_tokens": 4}   # ~10 MB

    async def scenario():
        async with httpx.AsyncClient(timeout=600) as c:
            async with c.stream("POST", srv.url + "/v1/completions",
                                json={**STREAM, "max_tokens": 1500}) as r:
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass
                heavy = asyncio.create_task(c.post(srv.url + "/v1/completions", json=big))
                await asyncio.sleep(0.5)          # the body is sent and being tokenized
                health = await c.get(srv.url + "/health")
                chunks = 0
                while chunks < 20:
                    if (await lines.__anext__()).startswith("data: "):
                        chunks += 1
                in_flight = not heavy.done()
                heavy_resp = await heavy
                return health.status_code, chunks, in_flight, heavy_resp
    health, chunks, in_flight, heavy = asyncio.run(scenario())
    assert in_flight, "the 10 MB request finished before /health and 20 stream chunks"
    assert health == 200 and chunks == 20
    assert heavy.status_code == 400 and "maximum context length" in heavy.text
    huge = httpx.post(srv.url + "/v1/completions", content=b"{" + b" " * (33 << 20) + b"}",
                      headers={"content-type": "application/json"}, timeout=120)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == 413
    wait_for(lambda: idle(srv), 120, what="idle")


@pytest.mark.parametrize("path,fn,body", [
    ("/tokenize", "_tokenize", {"prompt": "hello world " * 10_000}),
    ("/detokenize", "_detokenize", {"tokens": [100] * 20_000}),
], ids=["tokenize", "detokenize"])
def test_the_tokenizer_endpoints_cannot_hold_up_generation(srv, monkeypatch, path, fn, body):
    """/tokenize and /detokenize are open without an API key, and a 32 MB body there is
    half a minute of CPU: it must not delay a generation request's preparation. The
    tokenizer endpoint's (real) work is held here until the completion is answered; a
    preparation thread shared by both (the defect) keeps the completion waiting behind
    it, so its client times out. Both bodies are past OFFLOAD_BYTES (threads, not the
    event loop)."""
    serving = srv.app.state.serving
    started, release = threading.Event(), threading.Event()
    real = getattr(serving, fn)

    def held(raw: bytes, tok):
        started.set()
        release.wait(120)
        return real(raw, tok)

    monkeypatch.setattr(serving, fn, held)
    completion = {"prompt": "hi " * 30_000, "max_tokens": 4, "truncate_prompt_tokens": 100}
    assert len(json.dumps(completion)) >= 64 << 10 and len(json.dumps(body)) >= 64 << 10

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as c:
            side = asyncio.create_task(c.post(srv.url + path, json=body))
            assert await asyncio.to_thread(started.wait, 60), "the tokenizer call never started"
            try:
                gen = await c.post(srv.url + "/v1/completions", json=completion, timeout=60)
                side_pending = not side.done()
            finally:
                release.set()
            return gen, side_pending, await side
    gen, side_pending, side = asyncio.run(scenario())
    assert gen.status_code == 200 and gen.json()["usage"]["prompt_tokens"] == 100, gen.text
    assert side_pending and side.status_code == 200, side.text[:300]


def _upload(port: int, megabytes: int, chunked: bool) -> tuple[bytes, OSError | None]:
    """Send a request as most HTTP clients do (the whole body, then read the reply);
    return every byte the server sent before it closed, and the error (if any) that
    cut the upload short."""
    mb = b" " * (1 << 20)
    frame = b"100000\r\n" + mb + b"\r\n" if chunked else mb
    length = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % (megabytes << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n" + length + b"\r\n\r\n")
        cut = None
        try:
            for _ in range(megabytes):
                sock.sendall(frame)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError as e:
            cut = e
        data = b""
        while part := sock.recv(1 << 16):
            data += part
    return data, cut


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_refused_upload_still_reads_its_413(srv, chunked):
    """The 413 reaches a client that is still uploading: the server reads and drops the
    rest of the body instead of closing on unread bytes, for a declared length and for a
    chunked body alike. Closing on unread bytes makes the kernel reset the connection,
    and a reset drops whatever of the reply had not left the server yet: on a loaded
    machine that is the 413's body ("peer closed connection without sending complete
    message body"). So the upload must end without a reset, and the reply be whole."""
    for _ in range(3):
        data, cut = _upload(srv.port, 40, chunked)
        assert cut is None, f"the server reset the upload it had refused: {cut!r}"
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), data[:300]
        assert json.loads(body)["error"]["code"] == 413
    assert post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_refused_upload_that_awaits_100_continue_is_not_waited_for(srv, monkeypatch):
    """A client sending `Expect: 100-continue` gets the 413 and the close at once: it
    will never send the body, so the server must not linger for it (with the linger
    made longer than this socket's timeout, waiting would fail the test)."""
    monkeypatch.setattr(body_limit, "LINGER_S", 600.0)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (40 << 20))
        data = b""
        while part := sock.recv(1 << 16):
            data += part
    assert data.startswith(b"HTTP/1.1 413") and b"100 Continue" not in data, data[:400]


MALFORMED = [
    b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"prompt": 1}', b'{"prompt": null}',
    b'{"prompt": "x", "max_tokens": -1}', b'{"prompt": "x", "max_tokens": "many"}',
    b'{"prompt": "x", "temperature": -0.5}', b'{"prompt": "x", "top_p": 7}',
    b'{"prompt": "x", "stop": [1, 2]}', b'{"prompt": "x", "stream_options": {"include_usage": 1}}',
    b'{"prompt": [[1, 2], "mixed"]}', b'{"prompt": "x", "n": 0}', b'{"prompt": "x", "seed": 1e400}',
    b'{"prompt": "x", "logit_bias": {"5": 1}}', b'{"prompt": "x", "stream_options": {}}',
    b'{"messages": []}', b'{"messages": "hi"}', b'{"messages": [{"role": "user", "content": 5}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"prompt": "x", "priority": 3}', b'{"prompt": "x", "model": "nope"}',
    b'{"prompt": [99999999]}', b'{"prompt": "x", "max_tokens": 99999}',
]


def test_a_storm_of_malformed_requests_amid_valid_streams(srv):
    rng = random.Random(7)
    bodies = []
    for _ in range(200):
        b = rng.choice(MALFORMED)
        path = rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize",
                           "/detokenize"])
        if rng.random() < 0.2:   # random byte flips of a valid body
            raw = bytearray(json.dumps({"prompt": "hello", "max_tokens": 3}).encode())
            for _ in range(3):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            b = bytes(raw)
        bodies.append((path, b))

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as c:
            async def stream():
                async with c.stream("POST", srv.url + "/v1/completions", json=STREAM) as r:
                    return r.status_code, (await r.aread()).decode()
            streams = [asyncio.create_task(stream()) for _ in range(8)]
            bad = [await c.post(srv.url + path, content=b,
                                headers={"content-type": "application/json"})
                   for path, b in bodies]
            return await asyncio.gather(*streams), bad
    streams, bad = asyncio.run(scenario())
    assert all(s == 200 and body.rstrip().endswith("[DONE]") and '"error"' not in body
               for s, body in streams)
    codes = [r.status_code for r in bad]
    assert all(c < 500 for c in codes), [(c, r.text[:200]) for c, r in zip(codes, bad) if c >= 500]
    assert httpx.get(srv.url + "/health").status_code == 200
    wait_for(lambda: idle(srv), 60, what="idle")


def test_queue_timeouts_are_counted_apart_from_hang_ups(model_dir):
    server = ThreadServer(model_dir, max_num_seqs=1, max_model_len=2048, queue_timeout=1.0)
    srv = server.start()
    try:
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", srv.url + "/v1/completions",
                          json={**STREAM, "max_tokens": 1900}) as blocker:
                lines = blocker.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
                late = c.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert late.status_code == 503
        wait_for(lambda: idle(srv), 60, what="idle")
        text = srv.metrics()
        assert metric(text, "pagefleet:request_queue_timeouts_total") == 1
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 2
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def proc_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    s = SubprocessServer([str(model_dir), "--served-model-name", "tiny", "--max-model-len",
                          "256", "--kv-cache-memory", str(16 << 20)], log).wait_ready()
    yield s
    s.close()


def test_hang_up_mid_body_is_a_debug_line_not_a_traceback(proc_server):
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", proc_server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
                         b'{"prompt": "hel')
    r = httpx.post(proc_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    out = proc_server.output()
    assert "Traceback" not in out and "ERROR" not in out, out[-2000:]


def test_log_lines_cannot_be_forged(proc_server):
    forged = "x\nINFO 01-01 00:00:00 [pagefleet.api] FORGED LOG LINE"
    r = httpx.post(proc_server.url + "/v1/completions",
                   json={"model": forged, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404
    wait_for(lambda: "FORGED" in proc_server.output(), 30, what="the 404 logged")
    lines = proc_server.output().splitlines()
    assert not any(line.startswith("INFO 01-01 00:00:00 [pagefleet.api] FORGED") for line in lines)
    assert any("x\\nINFO 01-01" in line for line in lines)


@pytest.fixture(scope="module")
def narrow(model_dir):
    """Two sequences at a time and a short queue timeout: a request with n = 4 runs two
    choices while its other two queue behind them, each wave for well over the timeout
    (1500 tokens take seconds; the timeout is 0.5 s)."""
    server = ThreadServer(model_dir, max_num_seqs=2, max_model_len=2048,
                          queue_timeout=0.5).start()
    yield server
    server.stop()


WIDE = {"prompt": "hello world", "max_tokens": 1500, "ignore_eos": True, "n": 4}


def test_the_queue_timeout_is_the_requests_not_each_choices(narrow):
    """Choices 2-3 wait for choices 0-1 far longer than --queue-timeout; they are
    admitted work of a running request, so the request gets all four (was a 503)."""
    r = post(narrow, "/v1/completions", WIDE)
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 4 * 1500
    wait_for(lambda: idle(narrow), 60, what="idle")


def test_a_streamed_wide_request_gets_every_choice_and_no_in_band_error(narrow):
    """Streamed, the per-choice timeout gave 200, choices 0-1, then an in-band 503."""
    with httpx.stream("POST", narrow.url + "/v1/completions", json={**WIDE, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
    finished = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"]
                if ch["finish_reason"]}
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}
    wait_for(lambda: idle(narrow), 60, what="idle")


def test_a_wide_request_none_of_whose_choices_runs_still_times_out_whole(narrow):
    """The timeout still holds for the request as a whole: behind a request that takes
    both sequences, n = 3 gets its 503 and none of its choices is left in the queue."""
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", narrow.url + "/v1/completions",
                      json={**STREAM, "max_tokens": 1900, "n": 2}) as blocker:
            lines = blocker.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            late = c.post(narrow.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 2, "n": 3})
            assert late.status_code == 503, late.text[:300]
            assert "--queue-timeout" in late.json()["error"]["message"]
    wait_for(lambda: idle(narrow), 60, what="idle with every block back")


PARTIAL = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 5000\r\n\r\n" + b'{"prompt": "hel')


def _reply(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (the socket's timeout bounds it)."""
    data = b""
    while part := sock.recv(1 << 16):
        data += part
    return data


def test_a_body_that_never_finishes_gets_a_408_and_the_close(model_dir):
    """Slowloris on the body: headers and part of the body, then nothing. The request
    gets a 408 in the OpenAI shape once --request-body-timeout passes, and the server
    closes the connection (it stayed open for good)."""
    server = ThreadServer(model_dir, max_model_len=256, request_body_timeout=0.5).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(PARTIAL)
            data = _reply(sock)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data[:300]
        err = json.loads(body)["error"]
        assert err["code"] == 408 and err["type"] == "RequestTimeoutError"
        assert "--request-body-timeout" in err["message"]
        ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        server.stop()


def test_sigterm_answers_a_body_still_arriving_without_a_traceback(model_dir, tmp_path):
    """On SIGTERM a connection stuck mid-body gets a 503 at once and the server exits 0;
    it used to hold the shutdown for uvicorn's graceful timeout and then log a
    CancelledError traceback from the body read."""
    s = SubprocessServer([str(model_dir), "--max-model-len", "256",
                          "--kv-cache-memory", str(16 << 20)], tmp_path / "serve.log").wait_ready()
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=60) as sock:
            sock.sendall(PARTIAL)
            # Whether the body read began before the signal or after it (the server
            # still reads requests while it drains), the answer is the same.
            assert post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
            s.terminate()
            data = _reply(sock)
        assert data.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in data.lower(), data[:300]
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == 503
        assert s.proc.wait(60) == 0, s.output()
        out = s.output()
        assert "Traceback" not in out and "CancelledError" not in out and "ERROR" not in out, \
            out[-3000:]
    finally:
        s.close()
