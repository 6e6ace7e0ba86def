"""`pagefleet serve`: resolve the model, build the engine, run uvicorn, drain on SIGTERM.

Shutdown follows what Kubernetes expects of a pod: on SIGTERM (or Ctrl-C) the server
keeps listening but answers new generation requests with 503 (a terminating pod is
already out of its Service; stragglers learn to retry elsewhere), keeps /health at 200
while the engine lives (a failing liveness probe would cut the drain short), lets
in-flight requests finish for up to
`--shutdown-timeout` seconds, aborts the rest with an error response (nothing accepted
ends silently), then stops uvicorn and exits 0. A second Ctrl-C forces the exit.

The port is bound before the engine starts (as vLLM does): loading a large model takes
minutes, a port that is taken fails at once instead of after the load, and nothing can
take it meanwhile. Until the engine is up, `LoadingResponder` answers on that port:
/metrics with 200 (Prometheus scrapes pods that are not ready yet, and a scrape that
timed out for the whole load read as a server down), everything else, /health
included, with 503 "the engine is loading". `--port 0` takes a free port, which the
"listening on" line names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping

from pagefleet.server.config import DEMO_MODEL, ConfigError, EngineConfig, ServerConfig

log = logging.getLogger("pagefleet.serve")


_CONTROL = {c: f"\\x{c:02x}" for c in range(32) if c != 9}
_CONTROL.update({10: "\\n", 13: "\\r", 127: "\\x7f"})


class OneLineFormatter(logging.Formatter):
    """Escapes control characters in the message: a user-controlled string (a model
    name, a header, a stop string with --enable-log-requests) can never start a line
    that looks like one of ours. Tracebacks, which the server writes itself, keep their
    lines."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        safe = msg.translate(_CONTROL)
        if safe is not msg and safe != msg:
            record = logging.makeLogRecord({**record.__dict__, "msg": safe, "args": None})
        return super().format(record)


def setup_logging() -> None:
    root = logging.getLogger("pagefleet")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(OneLineFormatter("%(levelname)s %(asctime)s [%(name)s] %(message)s",
                                              "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("PAGEFLEET_LOG_LEVEL", "INFO").upper())
        root.propagate = False


def _make_server(config, async_engine, shutdown_timeout: float):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn.Server whose first SIGTERM/SIGINT drains instead of closing the socket
        at once, and which does not re-raise the signal afterwards (exit code 0)."""

        draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                if sig == signal.SIGINT:
                    log.warning("second interrupt: exiting without waiting")
                    self.force_exit = True
                    self.should_exit = True
                return
            self.draining = True
            log.info("received %s: no new requests; waiting up to %gs for %d in-flight",
                     signal.Signals(sig).name, shutdown_timeout, async_engine.num_open)
            loop = self._loop
            if loop is None:
                self.should_exit = True
                return
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

        async def _drain(self) -> None:
            try:
                aborted = await async_engine.drain(shutdown_timeout)
                if aborted:
                    log.warning("shutdown: %d request(s) did not finish within "
                                "--shutdown-timeout and were answered with an error", aborted)
                else:
                    log.info("shutdown: all in-flight requests finished")
            finally:
                self.should_exit = True

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

    server = DrainingServer(config)
    server._loop = None
    return server


# Where the API key may come from, in precedence order: the flag, then our variable,
# then vLLM's, so a deployment migrated from vLLM that injects VLLM_API_KEY (a Secret
# as an env var) keeps its authentication instead of silently serving without one.
API_KEY_ENV_VARS = ("PAGEFLEET_API_KEY", "VLLM_API_KEY")


def resolve_api_key(flag: str | None, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(key, where it came from) by API_KEY_ENV_VARS precedence; an empty value counts
    as unset. The source is what the log names: never the key itself."""
    if flag:
        return flag, "--api-key"
    for name in API_KEY_ENV_VARS:
        if env.get(name):
            return env[name], name
    return None, None


def http_url(host: str, port: int) -> str:
    """The URL of (host, port) as a client writes it: an IPv6 address in brackets
    (`http://[::]:8000`; `http://:::8000` is no URL)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port), as uvicorn would bind it (SO_REUSEADDR,
    IPv6 when the host is an IPv6 address); raises OSError if it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)   # uvicorn's backlog; Python sockets are not inherited by children
    except OSError:
        sock.close()
        raise
    return sock


def listen_or_explain(command: str, host: str, port: int) -> socket.socket | None:
    """`bind_listener`, or None after one line on stderr naming the flags: a port in
    use fails at once, before minutes of loading (`pagefleet serve` and `gateway`)."""
    try:
        return bind_listener(host, port)
    except OSError as e:
        print(f"pagefleet {command}: error: cannot listen on {host}:{port}: "
              f"{e.strerror or e} (--host/--port)", file=sys.stderr)
        return None


LOADING_METRICS = (b"# pagefleet: the engine is loading; its metrics follow once it is up.\n")


class LoadingResponder:
    """Answers on the bound socket while the engine loads, in a thread (the load
    blocks the main one): GET /metrics gets 200 with no samples, so the target is up
    and PagefleetServerDown does not fire on every model load; anything else gets 503
    with Retry-After. `stop()` hands the socket over to uvicorn, before it serves."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagefleet-loading", daemon=True)

    def start(self) -> LoadingResponder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                readable, _, _ = select.select([self.sock], [], [], 0.1)
                if not readable or self._stop.is_set():
                    continue
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return   # the socket was closed (the start failed)
            with conn:
                try:
                    self._answer(conn)
                except OSError:
                    pass

    @staticmethod
    def _answer(conn: socket.socket, limit_s: float = 2.0) -> None:
        # One connection at a time, so a client that trickles its request line gets
        # `limit_s` in all (not per read): it can neither starve the scrapes nor hold
        # up stop(), which the server's start waits on.
        deadline = time.monotonic() + limit_s
        data = b""
        while b"\r\n\r\n" not in data and len(data) < 16384:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            conn.settimeout(left)
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        method, _, rest = data.partition(b"\r\n")[0].decode("latin-1").partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        if method in ("GET", "HEAD") and path == "/metrics":
            status, ctype, body, extra = "200 OK", "text/plain; version=0.0.4; charset=utf-8", LOADING_METRICS, ""
        else:
            status, ctype, extra = "503 Service Unavailable", "application/json", "Retry-After: 5\r\n"
            body = json.dumps({"error": {"message": "the engine is loading; retry when /health answers 200",
                                         "type": "ServiceUnavailable", "code": 503}}).encode()
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"{extra}Connection: close\r\n\r\n").encode()
        conn.sendall(head + (b"" if method == "HEAD" else body))


def check_tokenizer_fits(server_cfg: ServerConfig, tokenizer) -> None:
    """ConfigError when a flag needs what the tokenizer lacks: `--reasoning-parser`
    needs its `</think>` as one token. Checked once the tokenizer is loaded, before the
    weights, so the mistake costs seconds and reads as the other configuration errors.
    (`--tool-call-parser` parses text and needs no particular token.)"""
    if server_cfg.reasoning_parser:
        from pagefleet.server.api.reasoning import (ReasoningConfigError, get_reasoning_parser,
                                                    think_token_ids)

        try:
            think_token_ids(get_reasoning_parser(server_cfg.reasoning_parser), tokenizer)
        except ReasoningConfigError as e:
            raise ConfigError(str(e)) from None


def run_serve(engine_cfg: EngineConfig, server_cfg: ServerConfig, notices: list[str]) -> int:
    setup_logging()
    sock = listen_or_explain("serve", server_cfg.host, server_cfg.port)
    if sock is None:
        return 1
    server_cfg.port = sock.getsockname()[1]
    log.info("listening on %s; /metrics answers now, requests once the engine is up",
             http_url(server_cfg.host, server_cfg.port))
    loading = LoadingResponder(sock).start()
    try:
        return _run_serve(engine_cfg, server_cfg, notices, sock, loading)
    finally:
        loading.stop()
        sock.close()


def _run_serve(engine_cfg: EngineConfig, server_cfg: ServerConfig, notices: list[str],
               sock: socket.socket, loading: LoadingResponder | None = None) -> int:
    for notice in notices:
        log.warning(notice)
    from pagefleet.server.api.chat import load_chat_template
    from pagefleet.server.models.hub import ModelNotFoundError, resolve_model

    api_key, key_source = resolve_api_key(server_cfg.api_key, os.environ)
    shadowed = [n for n in API_KEY_ENV_VARS if os.environ.get(n) and n != key_source]
    if key_source and shadowed:
        log.warning("the API key comes from %s; %s is also set and is not used", key_source,
                    " and ".join(shadowed))
    try:
        chat_template = load_chat_template(server_cfg.chat_template)
        if engine_cfg.model is None:
            from pagefleet.server.testing import demo_model_path

            model_dir = demo_model_path()
            served = server_cfg.served_model_name or [DEMO_MODEL]
            log.warning("no MODEL given: serving the built-in demo model '%s' from %s (a tiny "
                        "model trained on a few topics, for trying the API); to serve a real "
                        "model: pagefleet serve MODEL, e.g. pagefleet serve "
                        "Qwen/Qwen2.5-7B-Instruct or a local HF model directory",
                        ", ".join(served), model_dir)
        else:
            model_dir = resolve_model(engine_cfg.model, engine_cfg.revision)
            served = server_cfg.served_model_name or [engine_cfg.model]
        if engine_cfg.tokenizer:
            engine_cfg.tokenizer = str(resolve_model(engine_cfg.tokenizer, engine_cfg.revision,
                                                     what="tokenizer"))
        from pagefleet.server.engine.core_process import CoreStartupError, ServedEngine

        engine = ServedEngine(engine_cfg, model_dir, usage="server",
                              check_tokenizer=lambda tok: check_tokenizer_fits(server_cfg, tok))
    except (ConfigError, ModelNotFoundError) as e:
        print(f"pagefleet serve: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except CoreStartupError as e:
        print(f"pagefleet serve: error: the engine failed to start: {e}", file=sys.stderr)
        return e.exit_code if e.kind == "oom" and e.exit_code else 1

    try:
        return _serve(engine, engine_cfg, server_cfg, served, model_dir, api_key, chat_template,
                      sock, key_source, loading)
    finally:
        engine.core.kill()


def _serve(engine, engine_cfg: EngineConfig, server_cfg: ServerConfig, served: str, model_dir,
           api_key: str | None, chat_template: str | None, sock: socket.socket,
           key_source: str | None = None, loading: LoadingResponder | None = None) -> int:
    import uvicorn

    from pagefleet.server.api.app import build_app

    app = build_app(engine, server_cfg, served_model_name=served,
                    model_root=str(engine_cfg.model or model_dir), api_key=api_key,
                    chat_template=chat_template)
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port,
                            log_level=server_cfg.uvicorn_log_level, lifespan="on",
                            timeout_graceful_shutdown=5, access_log=False,
                            timeout_keep_alive=server_cfg.timeout_keep_alive)
    async_engine = app.state.async_engine
    server = _make_server(config, async_engine, server_cfg.shutdown_timeout)
    exit_code = {"code": 0}

    def on_dead(code: int) -> None:
        """The engine core died: /health is 503 already; stop so the pod restarts."""
        exit_code["code"] = code
        server.should_exit = True

    async_engine.on_dead = on_dead
    log.info("starting on %s (API key %s)", http_url(server_cfg.host, server_cfg.port),
             f"required, from {key_source}" if api_key else "not required")
    if loading is not None:
        loading.stop()   # uvicorn answers from here on
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # pragma: no cover - forced exit
        return 130
    if exit_code["code"]:
        log.error("exiting with code %d: the engine core died", exit_code["code"])
        return exit_code["code"]
    if not server.started:
        return 1
    log.info("stopped")
    return 0
