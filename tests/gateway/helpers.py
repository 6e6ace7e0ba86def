"""Real processes for the gateway tests: `pagefleet serve` backends (restartable on the
same port) and the gateway itself, in a uvicorn thread or as `pagefleet gateway`.

Bounded polling only (`wait_for`): no timing assertions.
"""

from __future__ import annotations

import asyncio
import os
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

    def __init__(self, name: str, model_dir: Path, args: list[str], log_dir: Path) -> None:
        self.name = name
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
            [str(exe), "serve", str(self.model_dir), "--served-model-name", "tiny", *self.args,
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
    """`pagefleet gateway ...` as its own process."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
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
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, timeout, 0.2, "gateway readiness")
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
