"""Real servers for the API tests: uvicorn on 127.0.0.1 with a tiny model.

`ThreadServer` runs the app in-process (a uvicorn thread; fast to start, and tests can
read the engine's state); `SubprocessServer` runs `pagefleet serve ...` for what needs a
real process (signals, the CLI). Both wait for /health with bounded polling.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float = 60.0, interval: float = 0.05, what: str = "condition"):
    """Poll until cond() is truthy (a bound against hangs, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample's values whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{([^}]*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(4))
            found = True
    if not found:
        raise KeyError(f"metric {name}{labels or ''} not found")
    return total


class ThreadServer:
    def __init__(self, model_dir: Path, *, api_key: str | None = None,
                 served_model_name: str = "tiny", **settings) -> None:
        import dataclasses

        import uvicorn

        from pagefleet.server.api.app import build_app
        from pagefleet.server.config import EngineConfig, ServerConfig
        from pagefleet.server.engine.core_process import ServedEngine

        eng_names = {f.name for f in dataclasses.fields(EngineConfig)}
        eng_kw = {"max_model_len": 512, "kv_cache_memory": 32 << 20}
        eng_kw.update({k: v for k, v in settings.items() if k in eng_names})
        srv_kw = {k: v for k, v in settings.items() if k not in eng_names}
        from pagefleet.server.api.serve import bind_listener

        # Bound now, before the engine starts: a port only picked here could be taken
        # by another test's server meanwhile.
        self.sock = bind_listener("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.engine_cfg = EngineConfig(model=str(model_dir), **eng_kw)
        self.server_cfg = ServerConfig(host="127.0.0.1", port=self.port, **srv_kw)
        self.served = ServedEngine(self.engine_cfg, model_dir)   # the core in its own process
        self.app = build_app(self.served, self.server_cfg,
                             served_model_name=served_model_name, api_key=api_key)
        self.model = served_model_name
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def async_engine(self):
        return self.app.state.async_engine

    def start(self) -> "ThreadServer":
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 120, what="startup")
        assert self.server.started, "server failed to start"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.served.core.kill()
        self.sock.close()

    def core_call(self, method: str) -> dict:
        """A utility call into the core process (`counters`, `check_whole`, `stats`)."""
        import asyncio

        eng = self.async_engine
        return asyncio.run_coroutine_threadsafe(eng.call_utility(method), eng._loop).result(60)

    def kv_whole(self) -> bool:
        c = self.core_call("counters")
        return c["free_blocks"] == c["total_blocks"] and not c["running"] and not c["waiting"]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text


class SubprocessServer:
    """`pagefleet serve ARGS --port 0` in its own process; stderr goes to a file.

    The server binds a free port itself, before loading the model, and names it in its
    "listening on" line: a port picked here and passed in could be taken by another
    test's server during the engine's start, which then answered this one's /health."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None) -> None:
        self.port = 0
        self.url = ""
        self.log_path = log_path
        full_env = {**os.environ, **(env or {})}
        self.log = open(log_path, "wb")
        exe = Path(sys.executable).with_name("pagefleet")
        self.proc = subprocess.Popen([str(exe), "serve", *args, "--host", "127.0.0.1",
                                      "--port", "0"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=full_env)

    def wait_ready(self, timeout: float = 180) -> "SubprocessServer":
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            if not self.port:
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.output())
                if not m:
                    return False
                self.port = int(m.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, timeout, 0.2, "server readiness")
        return self

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()
