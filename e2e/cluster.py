"""The cluster the e2e suite runs against, behind one interface:

- a real cluster when KUBECONFIG is set (kind or k3s with the images loaded; see
  docs/deploy.md): `kubectl` as you would type it, and `kubectl proxy` for the API
  and the Service proxy;
- otherwise the emulated cluster in `e2e/emulator.py` (kmock + a kubelet that runs
  real `pagefleet` processes).

Tests use only `kubectl(...)`, `get(path)` and `http` (an httpx client on the API
server, through which `service_url()` reaches a Service like `kubectl proxy` users do).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from e2e.emulator import ADMIN_TOKEN, EmulatedCluster


class Cluster:
    emulated: bool = False
    timeout: float = 900.0           # a bound for polling, not an expectation of speed
    apply_flags: tuple[str, ...] = ()

    def __init__(self, kubectl: str, workdir: Path) -> None:
        self.kubectl_bin = kubectl
        self.workdir = workdir
        self.kubeconfig: Path | None = None
        self.http: httpx.Client

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> str:
        cmd = [self.kubectl_bin, *(["--kubeconfig", str(self.kubeconfig)] if self.kubeconfig else []), *args]
        res = subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=120)
        if check and res.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res.stdout + res.stderr

    def get(self, path: str) -> dict[str, Any] | None:
        r = self.http.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def items(self, path: str) -> list[dict[str, Any]]:
        return (self.get(path) or {}).get("items") or []

    def service_url(self, namespace: str, service: str, port: str = "http") -> str:
        return f"{self.http.base_url}api/v1/namespaces/{namespace}/services/{service}:{port}/proxy"

    def wait_for(self, fn: Callable[[], Any], what: str, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout or self.timeout)
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = fn()
            except httpx.HTTPError as e:
                last = e
            else:
                if last:
                    return last
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; last: {str(last)[:2000]}")

    def logs(self) -> str:
        return ""

    def close(self) -> None:
        self.http.close()


class RealCluster(Cluster):
    def __init__(self, kubectl: str, workdir: Path) -> None:
        super().__init__(kubectl, workdir)
        self.kubeconfig = Path(os.environ["KUBECONFIG"])
        self.proxy = subprocess.Popen([kubectl, "proxy", "--port=0"], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
        assert self.proxy.stdout is not None
        line = self.proxy.stdout.readline()
        m = re.search(r"127\.0\.0\.1:(\d+)", line)
        if not m:
            self.proxy.kill()
            raise AssertionError(f"kubectl proxy did not start: {line}")
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{m.group(1)}/", timeout=120)

    def logs(self) -> str:
        return self.kubectl("-n", "pagefleet-system", "logs", "deploy/pagefleet-operator", "--tail=80", check=False)

    def close(self) -> None:
        super().close()
        self.proxy.terminate()
        try:
            self.proxy.wait(10)
        except subprocess.TimeoutExpired:
            self.proxy.kill()


class FakeCluster(Cluster):
    emulated = True
    timeout = 120.0
    # The emulator serves no OpenAPI documents; tests/deploy validates every object
    # against the Kubernetes schemas instead.
    apply_flags = ("--validate=false",)

    def __init__(self, kubectl: str, workdir: Path) -> None:
        super().__init__(kubectl, workdir)
        self.emu = EmulatedCluster(workdir).__enter__()
        self.kubeconfig = self.emu.kubeconfig
        self.http = httpx.Client(base_url=self.emu.url + "/", timeout=120,
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    @property
    def api_server(self) -> Any:
        return self.emu.api_server

    @property
    def kubelet(self) -> Any:
        return self.emu.kubelet

    def logs(self) -> str:
        out = []
        for path in sorted((self.workdir / "logs").glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()
            out.append(f"==== {path.name}\n" + "\n".join(lines[-40:]))
        return "\n".join(out)

    def close(self) -> None:
        super().close()
        self.emu.__exit__(None, None, None)
