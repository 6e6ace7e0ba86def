"""Test harness for the operator: a Kubernetes API emulator (kmock), the real
operator process (`pagefleet operator`) pointed at it, and the cluster parts that
the emulator does not run (the Deployment controller's pods and status, the
servers' /metrics endpoints), played by the tests on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import kmock
import yaml

from e2e.emulator import forget_refused_create, store_normalized
from tests.deploy.render import YAML_LOADER
from pagefleet.operator import crd
from pagefleet.operator.kube import KubeClient, path_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "manifests" / "examples"
POLL_TIMEOUT_S = 45.0  # generous: a bound for the poll loops, never an assertion on speed

PLURALS = {"Deployment": ("apps/v1", "deployments"), "Service": ("v1", "services"),
           "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"), "Pod": ("v1", "pods"),
           "Secret": ("v1", "secrets"), "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),
           "Event": ("v1", "events"), crd.KIND: (crd.API_VERSION, crd.PLURAL)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_example(name: str) -> list[dict[str, Any]]:
    with open(EXAMPLES / name) as fh:
        return [d for d in yaml.load_all(fh, Loader=YAML_LOADER) if d]


class Cluster:
    """The emulator plus helpers that act like kubectl and like the controllers
    the emulator lacks."""

    def __init__(self, emulator: kmock.KubernetesEmulator, kubeconfig: Path) -> None:
        self.emulator = emulator
        self.url = str(emulator.url)
        self.kubeconfig = kubeconfig
        self.kube = KubeClient(self.url)

    @staticmethod
    def path(kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        api_version, plural = PLURALS[kind]
        return path_for(api_version, plural, namespace, name, sub)

    async def apply(self, obj: dict[str, Any], namespace: str) -> dict[str, Any]:
        """Create an object the way an API server would store it: with a uid and a
        resourceVersion (the emulator assigns neither)."""
        obj = json.loads(json.dumps(obj))
        meta = obj.setdefault("metadata", {})
        meta["namespace"] = namespace
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("resourceVersion", "1")
        meta.setdefault("generation", 1)
        return await self.kube.create(self.path(obj["kind"], namespace), obj)

    async def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                    sub: str | None = None) -> dict[str, Any]:
        """A merge patch; a change of the spec bumps metadata.generation, as an API
        server does (the emulator does not)."""
        if sub in (None, "scale") and "spec" in patch and not (patch.get("metadata") or {}).get("generation"):
            live = await self.get(kind, namespace, name) or {}
            patch = {**patch, "metadata": {**(patch.get("metadata") or {}),
                                           "generation": int((live.get("metadata") or {}).get("generation") or 1) + 1}}
            if sub == "scale":  # the scale subresource writes spec.replicas of the object
                await self.kube.patch(self.path(kind, namespace, name), {"metadata": patch["metadata"]})
                patch = {"spec": patch["spec"]}
        return await self.kube.patch(self.path(kind, namespace, name, sub), patch)

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.kube.get(self.path(kind, namespace, name))

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        return await self.kube.delete(self.path(kind, namespace, name))

    async def events(self, namespace: str, involved: str | None = None) -> list[dict[str, Any]]:
        items = await self.kube.list(self.path("Event", namespace))
        return [e for e in items if involved is None or e.get("involvedObject", {}).get("name") == involved]

    def history(self, kind: str, namespace: str, name: str) -> list[dict[str, Any]]:
        """Every stored version of an object, oldest first (kmock keeps them)."""
        api_version, plural = PLURALS[kind]
        obj = self.emulator.objects[f"{api_version}/{plural}", namespace, name]
        return [dict(v.raw) for v in obj.history if v is not None]

    async def wait_for(self, fn: Callable[[], Awaitable[Any]], what: str,
                       timeout: float = POLL_TIMEOUT_S) -> Any:
        """Poll until fn() returns something truthy; fail naming `what`."""
        deadline = asyncio.get_running_loop().time() + timeout
        last: Any = None
        while asyncio.get_running_loop().time() < deadline:
            last = await fn()
            if last:
                return last
            await asyncio.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")

    async def wait_object(self, kind: str, namespace: str, name: str,
                          check: Callable[[dict[str, Any]], bool] = lambda o: True,
                          what: str = "", timeout: float = POLL_TIMEOUT_S) -> dict[str, Any]:
        async def probe() -> dict[str, Any] | None:
            obj = await self.get(kind, namespace, name)
            return obj if obj is not None and check(obj) else None
        return await self.wait_for(probe, what or f"{kind} {namespace}/{name}", timeout)

    async def wait_condition(self, namespace: str, name: str, type_: str, status: str) -> dict[str, Any]:
        def check(obj: dict[str, Any]) -> bool:
            conds = (obj.get("status") or {}).get("conditions") or []
            return any(c.get("type") == type_ and c.get("status") == status for c in conds)
        return await self.wait_object(crd.KIND, namespace, name, check,
                                      f"{name}: condition {type_}={status}")


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, except that a create a test's reaction refused is not kept
    (`forget_refused_create`), and that objects are stored the way kube-apiserver
    serializes them (`store_normalized`: omitempty false/empty fields dropped,
    quantities canonical), so a client that expects its own spelling back fails here
    as it would on a cluster."""

    async def _handle(self, request: Any) -> Any:
        store_normalized(self, request)
        response = await super()._handle(request)
        await forget_refused_create(self, request, response)
        return response


def register_resources(emulator: kmock.KubernetesEmulator) -> None:
    emulator.resources.load_bundled()
    emulator.resources[f"{crd.API_VERSION}/{crd.PLURAL}"] = kmock.ResourceInfo(
        kind=crd.KIND, singular=crd.SINGULAR, namespaced=True, shortnames=set(crd.SHORT_NAMES),
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
        subresources={"status", "scale"})


class OperatorProcess:
    """A running `pagefleet operator`: its liveness URL, process and log."""

    def __init__(self, proc: asyncio.subprocess.Process, liveness: str, log_path: Path) -> None:
        self.proc, self.liveness, self.log_path = proc, liveness, log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no clean exit, no goodbye to the peering (a node failure)."""
        if self.proc.returncode is None:
            self.proc.kill()


@contextlib.asynccontextmanager
async def operator_run(cluster: Cluster, log_path: Path, *args: str,
                       env: dict[str, str] | None = None) -> AsyncIterator[OperatorProcess]:
    """Run `pagefleet operator` as a subprocess until the block ends; yields it once
    its liveness endpoint answers. Always terminated (then killed) on exit."""
    port = free_port()
    liveness = f"http://127.0.0.1:{port}/healthz"
    full_env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig), PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    full_env.pop("KUBERNETES_SERVICE_HOST", None)  # never mistake the test machine for a pod
    log = open(log_path, "wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pagefleet.server.cli", "operator", "--liveness", liveness, *args,
        stdout=log, stderr=asyncio.subprocess.STDOUT, env=full_env)
    try:
        async def alive() -> bool:
            if proc.returncode is not None:
                raise AssertionError(f"operator exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
            try:
                async with aiohttp.ClientSession() as s, s.get(liveness) as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False
        await cluster.wait_for(alive, "the operator's liveness endpoint")
        yield OperatorProcess(proc, liveness, log_path)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()
        # Shown by pytest for failing tests only.
        print(f"--- operator log ({log_path}) ---\n{log_path.read_text()[-6000:]}")


@contextlib.asynccontextmanager
async def operator_process(cluster: Cluster, log_path: Path, *args: str) -> AsyncIterator[str]:
    """operator_run, yielding just the liveness URL."""
    async with operator_run(cluster, log_path, *args) as op:
        yield op.liveness


class MetricsServer:
    """A pod's /metrics on loopback, exposing vLLM's queue gauge."""

    def __init__(self, model: str = "m") -> None:
        self.model = model
        self.waiting = 0.0
        self.garbage = False
        self.port = 0
        self._runner: aiohttp.web.AppRunner | None = None

    async def _metrics(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if self.garbage:
            return aiohttp.web.Response(text="this is {not prometheus\x00")
        body = ("# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{engine="0",model_name="{self.model}"}} {self.waiting}\n'
                "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="{self.model}"}} 3.0\n')
        return aiohttp.web.Response(text=body, content_type="text/plain")

    async def start(self) -> MetricsServer:
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = aiohttp.web.AppRunner(app)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def pod_from_template(deployment: dict[str, Any], index: int, metrics_port: int,
                      ready: bool = True) -> dict[str, Any]:
    """What the ReplicaSet controller and kubelet would make: a pod from the
    Deployment's template, running on loopback with its /metrics on `metrics_port`."""
    template = json.loads(json.dumps(deployment["spec"]["template"]))
    meta = template["metadata"]
    meta["name"] = f"{deployment['metadata']['name']}-{index}"
    meta.setdefault("annotations", {})["prometheus.io/port"] = str(metrics_port)
    for c in template["spec"]["containers"]:
        for p in c.get("ports", []):
            p["containerPort"] = metrics_port
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"],
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
