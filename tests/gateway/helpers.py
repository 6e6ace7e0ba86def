"""Real processes for the gateway tests: `pagefleet serve` backends (restartable on the
same port) and the gateway itself, in a uvicorn thread or as `pagefleet gateway`.

Bounded polling only (`wait_for`): no timing assertions.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import yaml

from tests.server.helpers_serve import free_port, metric, wait_for

__all__ = ["Backend", "GatewayThread", "GatewayProcess", "metric", "wait_for", "free_port",
           "gw_metric", "run_concurrently"]


class Backend:
    """`pagefleet serve MODEL ARGS` on a fixed port; kill() and start() again."""

    def __init__(self, name: str, model_dir: Path, args: list[str], log_dir: Path,
                 served: tuple[str, ...] = ("tiny",)) -> None:
        self.name = name
        self.served = served
        self.model_dir = model_dir
        self.args = args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "Backend":
        exe = Path(sys.executable).with_name("pagefleet")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(exe), "serve", str(self.model_dir), "--served-model-name", *self.served, *self.args,
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PAGEFLEET_LOG_LEVEL": "INFO"})
        return self

    def wait_ready(self, timeout: float = 240) -> "Backend":
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.output()}")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, timeout, 0.2, f"{self.name} readiness")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def close(self) -> None:
        self.kill()
        if self._log:
            self._log.close()

    def output(self) -> str:
        if self._log:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def computed_tokens(self) -> float:
        """Prompt tokens this engine computed: prefix-cache queries minus hits."""
        text = self.metrics()
        return metric(text, "vllm:prefix_cache_queries_total") - \
            metric(text, "vllm:prefix_cache_hits_total")


def models_yaml(path: Path, models: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"models": models}, sort_keys=False))
    return path


class GatewayThread:
    """The gateway app under uvicorn in a thread of the test process."""

    def __init__(self, models_file: Path, **settings) -> None:
        import uvicorn

        from pagefleet.server.gateway.app import build_app
        from pagefleet.server.gateway.config import GatewayConfig
        from pagefleet.server.gateway.serve import make_gateway

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings.setdefault("health_interval", 0.2)
        settings.setdefault("reload_interval", 0.2)
        self.cfg = GatewayConfig(host="127.0.0.1", port=self.port, models_file=str(models_file),
                                 **settings)
        self.cfg.validate()
        self.gateway = make_gateway(self.cfg)
        self.app = build_app(self.gateway)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "GatewayThread":
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 60, what="gateway")
        assert self.server.started, "gateway failed to start"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def wait_ready_endpoints(self, model: str, n: int, timeout: float = 60) -> None:
        def ok():
            try:
                return gw_metric(self.metrics(), "pagefleet_gateway_pool_ready_endpoints",
                                 model_name=model) >= n
            except KeyError:
                return False
        wait_for(ok, timeout, 0.1, f"{n} ready endpoint(s) for {model}")


class GatewayProcess:
    """`pagefleet gateway ...` as its own process. port=0: the gateway picks a free
    port, and the one its log names is used."""

    def __init__(self, args: list[str], log_path: Path, port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        exe = Path(sys.executable).with_name("pagefleet")
        self.proc = subprocess.Popen([str(exe), "gateway", *args, "--host", "127.0.0.1",
                                      "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120) -> "GatewayProcess":
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited {self.proc.returncode}:\n{self.output()}")
            if self.port == 0:
                m = re.search(r"gateway starting on http://127\.0\.0\.1:(\d+)", self.output())
                if not m:
                    return False
                self.port = int(m.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        try:
            wait_for(ready, timeout, 0.2, "gateway readiness")
        except BaseException:
            self.close()      # a gateway that never got ready must not outlive the test
            raise
        return self

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


def gw_metric(text: str, name: str, **labels: str) -> float:
    return metric(text, name, **labels)


def run_concurrently(coros_factory, n: int, limit: int, timeout: float = 300):
    """Run n coroutines (factory(i)) with at most `limit` at once; returns results."""
    async def main():
        sem = asyncio.Semaphore(limit)

        async def one(i):
            async with sem:
                return await coros_factory(i)
        return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(n)]), timeout)
    return asyncio.run(main())


class RecordingProxy:
    """A TCP relay that records every byte each side sent, per connection: put it
    between the gateway and a backend to see exactly what the backend answered."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections: list[dict[str, bytearray]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def pipe(reader, writer, buf: bytearray) -> None:
            try:
                while data := await reader.read(65536):
                    buf += data
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(c_reader, c_writer) -> None:
            u_reader, u_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            rec = {"request": bytearray(), "response": bytearray()}
            self.connections.append(rec)
            await asyncio.gather(pipe(c_reader, u_writer, rec["request"]),
                                 pipe(u_reader, c_writer, rec["response"]))

        async def main() -> None:
            self._server = await asyncio.start_server(handle, "127.0.0.1", self.port)
            self._ready.set()
            await self._server.serve_forever()

        try:
            self._loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass

    def start(self) -> "RecordingProxy":
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)

    def response_body(self, marker: bytes) -> bytes:
        """The de-chunked body of the recorded response to the request containing
        `marker` (the first request on its connection)."""
        for rec in list(self.connections):
            if marker in bytes(rec["request"]):
                return dechunk(bytes(rec["response"]))
        raise KeyError(marker)


def dechunk(raw: bytes) -> bytes:
    """HTTP/1.1 response bytes -> its body (chunked or with a content-length)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    headers = head.lower()
    if b"transfer-encoding: chunked" not in headers:
        length = int(headers.split(b"content-length:")[1].split(b"\r\n")[0])
        return rest[:length]
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2:]
