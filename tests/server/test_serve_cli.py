"""`pagefleet serve` as a real process: SIGTERM drain, the demo model, --config and
legacy flags, and the Hugging Face path failing fast offline (issue: Serve, 5)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.server.helpers_serve import SubprocessServer, free_port, metric

PAGEFLEET = str(Path(sys.executable).with_name("pagefleet"))


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen3")


def test_sigterm_drains_in_flight_and_exits_0(model_dir, tmp_path):
    srv = SubprocessServer([str(model_dir), "--max-num-seqs", "4", "--max-model-len", "1024",
                            "--kv-cache-memory", str(32 << 20), "--shutdown-timeout", "120"],
                           tmp_path / "server.log").wait_ready()
    try:
        n_tokens = 400

        async def scenario():
            async with httpx.AsyncClient(timeout=300) as c:
                async def complete(i):
                    body = {"prompt": f"request number {i}", "max_tokens": n_tokens,
                            "ignore_eos": True}
                    if i % 2 == 0:
                        return await c.post(srv.url + "/v1/completions", json=body)
                    async with c.stream("POST", srv.url + "/v1/completions",
                                        json={**body, "stream": True}) as r:
                        await r.aread()
                        return r
                tasks = [asyncio.create_task(complete(i)) for i in range(6)]

                async def all_received():
                    # SIGTERM only once the server holds all six: one still on its way
                    # would rightly be refused with a 503 as a late arrival.
                    text = (await c.get(srv.url + "/metrics")).text
                    return metric(text, "vllm:num_requests_running") + metric(
                        text, "vllm:num_requests_waiting") >= len(tasks)
                for _ in range(1200):
                    if await all_received():
                        break
                    await asyncio.sleep(0.05)
                srv.terminate()
                # Draining: new requests get 503 while the old ones finish; /health
                # stays 200 (the engine loop is alive) so liveness does not kill the drain.
                for _ in range(600):
                    late = await c.post(srv.url + "/v1/completions",
                                        json={"prompt": "too late", "max_tokens": 2})
                    if late.status_code == 503:
                        break
                    await asyncio.sleep(0.05)
                health = (await c.get(srv.url + "/health")).status_code
                return await asyncio.gather(*tasks), late, health

        results, late, health = asyncio.run(scenario())
        assert late.status_code == 503 and late.json()["error"]["code"] == 503
        assert "shutting down" in late.json()["error"]["message"] and health == 200
        for r in results:
            assert r.status_code == 200
            if r.headers["content-type"].startswith("application/json"):
                assert r.json()["usage"]["completion_tokens"] == n_tokens
            else:
                assert r.text.rstrip().endswith("data: [DONE]")
                assert '"finish_reason":"length"' in r.text and '"error"' not in r.text
        assert srv.proc.wait(120) == 0, srv.output()
        assert "all in-flight requests finished" in srv.output()
    finally:
        srv.close()


def test_demo_model_with_config_file_and_legacy_flags(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-num-seqs: 2\nmax_model_len: 256\nserved-model-name: my-demo\n"
                   "kv-cache-memory: 16777216\n")
    srv = SubprocessServer(["--config", str(cfg), "--disable-log-requests", "--trust-remote-code",
                            "--api-key", "k1"], tmp_path / "demo.log").wait_ready()
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="k1", max_retries=0)
        card = client.models.list().data[0]
        assert card.id == "my-demo" and card.model_extra["max_model_len"] == 256
        r = client.chat.completions.create(model="my-demo", max_tokens=64, temperature=0,
                                           messages=[{"role": "user", "content": "hello"}])
        reply = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and reply.isprintable(), reply
        assert "\ufffd" not in reply and reply.rstrip()[-1] in ".!?", reply
        assert not (tmp_path / "cache").exists()      # shipped in the package: nothing built
        out = srv.output()
        assert "serving the built-in demo model 'my-demo'" in out
        assert "to serve a real model: pagefleet serve MODEL" in out
        assert "--disable-log-requests is accepted for vLLM compatibility" in out
        assert "--trust-remote-code is accepted for vLLM compatibility" in out
        assert "hello" not in out            # no prompt text in logs by default
        # A keep-alive connection idle past uvicorn's 5 s default is still open: a proxy
        # in front that reuses it (nginx, an ALB, the kube API proxy) gets no 502.
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            for idle in (0, 6):
                time.sleep(idle)
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                assert sock.recv(65536).startswith(b"HTTP/1.1 200"), f"closed after {idle} s idle"
        srv.terminate()
        assert srv.proc.wait(60) == 0, srv.output()
    finally:
        srv.close()


def test_vllm_api_key_variable_is_read(tmp_path):
    """A deployment migrated from vLLM that injects its key as VLLM_API_KEY keeps its
    authentication (it was ignored: the server answered without a key); the log names
    the source but never the key."""
    srv = SubprocessServer(["--max-model-len", "128", "--kv-cache-memory", str(16 << 20)],
                           tmp_path / "key.log",
                           env={"VLLM_API_KEY": "sk-from-env", "PAGEFLEET_API_KEY": ""}
                           ).wait_ready()
    try:
        body = {"prompt": "hi", "max_tokens": 1}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 401
        ok = httpx.post(srv.url + "/v1/completions", json=body, timeout=60,
                        headers={"Authorization": "Bearer sk-from-env"})
        assert ok.status_code == 200, ok.text
        out = srv.output()
        assert "API key required, from VLLM_API_KEY" in out and "sk-from-env" not in out
    finally:
        srv.close()


def test_vllm_disable_fastapi_docs_flag(tmp_path):
    """vLLM's --disable-fastapi-docs takes the unauthenticated /docs, /redoc and
    /openapi.json down (it was refused as an unknown flag)."""
    srv = SubprocessServer(["--max-model-len", "128", "--kv-cache-memory", str(16 << 20),
                            "--disable-fastapi-docs"], tmp_path / "docs.log").wait_ready()
    try:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(srv.url + path, timeout=30).status_code == 404, path
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    finally:
        srv.close()


def test_ipv6_host_is_logged_in_brackets():
    """`--host ::1` logs a URL a client can use (it was http://::1:PORT)."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("::1 cannot be bound here")
    proc = subprocess.run([PAGEFLEET, "serve", "./no/such/dir", "--host", "::1", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no such directory" in proc.stderr
    assert re.search(r"listening on http://\[::1\]:\d+;", proc.stderr), proc.stderr


@pytest.mark.parametrize("env,needle", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:{closed}"}, "could not be reached"),
])
def test_hub_repo_id_fails_fast_without_network(tmp_path, env, needle):
    env = {k: v.format(closed=free_port()) for k, v in env.items()}
    proc = subprocess.run([PAGEFLEET, "serve", "some-org/some-model", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HOME": str(tmp_path / "hf"), **env})
    assert proc.returncode != 0
    assert "could not fetch model 'some-org/some-model' from the Hugging Face Hub" in proc.stderr
    assert needle in proc.stderr


def test_missing_local_dir_and_help():
    proc = subprocess.run([PAGEFLEET, "serve", "./no/such/dir", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no such directory" in proc.stderr
    help_text = subprocess.run([PAGEFLEET, "serve", "--help"], capture_output=True, text=True,
                               timeout=60, check=True).stdout
    for flag in ("--max-num-queued-requests", "--queue-timeout", "--request-body-timeout",
                 "--shutdown-timeout", "--kv-cache-memory", "--api-key", "--served-model-name",
                 "--config"):
        assert flag in help_text


def test_a_taken_port_fails_before_the_model_loads():
    """The port is bound first: a taken one is an error naming it at once (not after a
    model load that can take minutes), and the model is never read."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = subprocess.run([PAGEFLEET, "serve", "./no/such/dir", "--host", "127.0.0.1",
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
    assert "no such directory" not in proc.stderr   # the model was not looked at


def test_port_0_binds_a_free_port_named_in_the_log(model_dir, tmp_path):
    srv = SubprocessServer([str(model_dir), "--max-model-len", "256",
                            "--kv-cache-memory", str(16 << 20)], tmp_path / "s.log").wait_ready()
    try:
        out = srv.output()
        assert srv.port > 0
        assert out.index(f"listening on http://127.0.0.1:{srv.port}") < out.index("KV cache:")
        assert f"starting on http://127.0.0.1:{srv.port}" in out
        assert httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]
    finally:
        srv.close()


def test_metrics_answer_while_the_engine_loads(tmp_path):
    """Prometheus scrapes pods that are not ready yet (prometheus-operator keeps their
    endpoints): a /metrics that waited for the whole load read as a server down, and
    PagefleetServerDown fired on every model load. The load is stretched with the
    engine's fault hook (each warm-up step stalls), not mocked."""
    srv = SubprocessServer(["--max-num-seqs", "2", "--max-model-len", "256",
                            "--kv-cache-memory", str(16 << 20)], tmp_path / "load.log",
                           env={"PAGEFLEET_FAULTS": "stall:pagefleet-warmup-",
                                "PAGEFLEET_FAULT_STALL_SECONDS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", srv.output())):
            assert srv.proc.poll() is None and time.monotonic() < deadline, srv.output()
            time.sleep(0.05)
        url = m.group(1)
        loading = httpx.get(url + "/metrics", timeout=3)
        health = httpx.get(url + "/health", timeout=3)
        api = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=3)
        assert "starting on" not in srv.output(), "the engine was up already: the load was not observed"
        assert loading.status_code == 200 and "vllm:" not in loading.text, loading.text
        assert health.status_code == 503, "not ready while loading"
        assert api.status_code == 503 and api.headers["retry-after"] and "loading" in api.json()["error"]["message"]
        srv.wait_ready()
        ready = httpx.get(url + "/metrics", timeout=10)
        assert ready.status_code == 200 and "vllm:num_requests_running" in ready.text
    finally:
        srv.close()


def test_a_trickling_client_does_not_hold_the_loading_responder() -> None:
    """The loading responder serves one connection at a time; a client sending its
    request line a byte a second must lose its turn after the responder's limit, not
    keep /metrics (and the hand-over to uvicorn, which joins the thread) waiting."""
    import threading

    from pagefleet.server.api.serve import LoadingResponder

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    responder = LoadingResponder(sock).start()
    stop_trickle, connected = threading.Event(), threading.Event()

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", port)) as c:
            connected.set()      # queued first: the responder accepts in arrival order
            for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
                if stop_trickle.wait(1.0):
                    return
                try:
                    c.send(bytes([b]))
                except OSError:
                    return

    t = threading.Thread(target=trickle)
    t.start()
    try:
        assert connected.wait(30)
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert r.status_code == 200
        assert t.is_alive(), "the scrape was answered only after the trickler gave up"
    finally:
        stop_trickle.set()
        t.join()
        responder.stop()
        sock.close()


def test_a_reasoning_parser_the_tokenizer_cannot_support_is_a_startup_error(model_dir, tmp_path):
    """`--reasoning-parser` needs `</think>` as one token: a tokenizer without it is a
    one-line `pagefleet serve: error:` with exit code 2, like the other configuration
    errors, found from the tokenizer before the weights load (audit G7: it was a
    traceback after the load and the warm-up, exit code 1)."""
    for parser in ("deepseek_r1", "qwen3"):
        proc = subprocess.run([PAGEFLEET, "serve", str(model_dir), "--reasoning-parser", parser,
                               "--max-model-len", "256", "--host", "127.0.0.1", "--port", "0"],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 2, proc.stderr
        assert f"pagefleet serve: error: --reasoning-parser {parser}: the tokenizer has no " \
            "single token for '</think>'" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert "Model weights:" not in proc.stderr and "KV cache:" not in proc.stderr

    # A tokenizer that has the tags passes the same check and serves.
    think = tiny_think_model(tmp_path)
    srv = SubprocessServer([str(think), "--reasoning-parser", "qwen3", "--max-model-len", "256",
                            "--kv-cache-memory", str(16 << 20)], tmp_path / "think.log")
    try:
        srv.wait_ready()
    finally:
        srv.close()


def tiny_think_model(tmp_path):
    from pagefleet.server.testing import build_tiny_model

    return build_tiny_model(tmp_path / "think", "qwen3", added_tokens=("<think>", "</think>"))
