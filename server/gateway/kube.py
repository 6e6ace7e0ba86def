"""Kubernetes discovery: ModelDeployments and their ready pods, listed then watched.

Read-only: the gateway needs `get/list/watch` on `modeldeployments.pagefleet.dev` and
on `pods`, nothing else. Each ModelDeployment is a pool of the model named by its
`servedModelName` (else `model`): several ModelDeployments with one served name are
the long/short pools and canaries of one model. A pool's endpoints are its ready pods
(Ready condition true, an IP, not terminating), found by the operator's pod label
`pagefleet.dev/model-deployment=<name>`.

From the ModelDeployment spec: `engine.maxModelLen` (context class; unset: learned
from a replica), `engine.blockSize`, `engine.maxNumSeqs` (in-flight cap per replica),
`engine.schedulingPolicy`, `gateway.weight` (rollout weight, default 100),
`gateway.tokenizer` (else `model`: what the gateway tokenizes with), and
`autoscaling.minReplicas: 0` with autoscaling on (listed in /v1/models while at zero).

The client is a small async one on httpx (the server image's own dependency): in a pod
it uses the service account's token and CA; elsewhere the current context of
$KUBECONFIG (server URL, token, CA or insecure-skip-tls-verify) — what the tests point
at the kmock API emulator. `fleet_from_objects` is the pure part.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx

from pagefleet.server.gateway.fleet import EndpointSpec, FleetSpec, ModelSpec, PoolSpec

log = logging.getLogger("pagefleet.gateway")

GROUP, VERSION, PLURAL = "pagefleet.dev", "v1alpha1", "modeldeployments"
POD_LABEL = "pagefleet.dev/model-deployment"
DEFAULT_PORT = 8000
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


# -- pure: objects -> fleet ---------------------------------------------------------------
def pod_ready(pod: dict) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])


def pod_port(pod: dict) -> int:
    """The server container's port named 'http', else its first port, else 8000."""
    containers = (pod.get("spec") or {}).get("containers") or []
    ports = [p for c in containers for p in c.get("ports") or []]
    for p in ports:
        if p.get("name") == "http" and p.get("containerPort"):
            return int(p["containerPort"])
    return int(ports[0]["containerPort"]) if ports and ports[0].get("containerPort") else DEFAULT_PORT


def _pool_name(md: dict, all_namespaces: bool) -> str:
    meta = md["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if all_namespaces else meta["name"]


def fleet_from_objects(mdeps: list[dict], pods: list[dict], all_namespaces: bool = False) -> FleetSpec:
    """ModelDeployments + pods -> FleetSpec (pure). Pods map to their ModelDeployment
    by the operator's label, within one namespace."""
    by_md: dict[tuple[str, str], list[dict]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(POD_LABEL)
        if owner and pod_ready(pod):
            by_md.setdefault((meta.get("namespace", ""), owner), []).append(pod)
    models: dict[str, list[tuple[dict, PoolSpec]]] = {}
    for md in sorted(mdeps, key=lambda m: (m["metadata"].get("namespace", ""), m["metadata"]["name"])):
        meta, spec = md["metadata"], md.get("spec") or {}
        if meta.get("deletionTimestamp"):
            continue
        engine, gw = spec.get("engine") or {}, spec.get("gateway") or {}
        served = spec.get("servedModelName") or spec.get("model")
        if not served:
            continue
        eps = tuple(sorted((EndpointSpec(name=p["metadata"]["name"],
                                         url=f"http://{p['status']['podIP']}:{pod_port(p)}")
                            for p in by_md.get((meta.get("namespace", ""), meta["name"]), [])),
                           key=lambda e: e.name))
        weight = gw.get("weight", 100)
        pool = PoolSpec(
            name=_pool_name(md, all_namespaces), endpoints=eps,
            max_model_len=_pos_int(engine.get("maxModelLen")),
            block_size=_pos_int(engine.get("blockSize")),
            weight=float(weight) if isinstance(weight, (int, float)) and weight >= 0 else 100.0,
            max_inflight=_pos_int(engine.get("maxNumSeqs")),
            scheduling_policy="priority" if engine.get("schedulingPolicy") == "priority" else "fcfs",
            tokenizer=gw.get("tokenizer") or spec.get("model"))
        models.setdefault(served, []).append((md, pool))
    out = []
    for name, entries in sorted(models.items()):
        specs = [md.get("spec") or {} for md, _ in entries]
        zero = any((s.get("autoscaling") or {}).get("enabled")
                   and (s.get("autoscaling") or {}).get("minReplicas") == 0 for s in specs)
        out.append(ModelSpec(name=name, pools=tuple(p for _, p in entries),
                             root=specs[0].get("model"), scale_from_zero=zero))
    return FleetSpec(models=tuple(out))


def _pos_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


# -- the API client --------------------------------------------------------------------------
class KubeAPI:
    def __init__(self, server: str, token: str | None = None,
                 verify: bool | str = True) -> None:
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.server = server.rstrip("/")
        self.client = httpx.AsyncClient(base_url=self.server, headers=headers, verify=verify,
                                        timeout=httpx.Timeout(30.0, read=None))

    @classmethod
    def from_environment(cls) -> "KubeAPI":
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
            "KUBERNETES_SERVICE_PORT", "443")
        if host and (SA_DIR / "token").exists():
            token = (SA_DIR / "token").read_text().strip()
            host = f"[{host}]" if ":" in host else host
            return cls(f"https://{host}:{port}", token, str(SA_DIR / "ca.crt"))
        return cls(**_kubeconfig())

    async def close(self) -> None:
        await self.client.aclose()

    async def list(self, path: str, params: dict | None = None) -> tuple[list[dict], str]:
        r = await self.client.get(path, params=params)
        r.raise_for_status()
        body = r.json()
        return body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion", "")

    @contextlib.asynccontextmanager
    async def watch(self, path: str, params: dict, rv: str) -> AsyncIterator[AsyncIterator[dict]]:
        """A watch stream, open once this returns (the response headers are in)."""
        q = {**params, "watch": "true", "allowWatchBookmarks": "true"}
        if rv:
            q["resourceVersion"] = rv
        async with self.client.stream("GET", path, params=q) as r:
            r.raise_for_status()

            async def events() -> AsyncIterator[dict]:
                async for line in r.aiter_lines():
                    if line.strip():
                        yield json.loads(line)
            yield events()


def _kubeconfig() -> dict:
    import yaml

    path = os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config")).split(os.pathsep)[0]
    with open(path, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh) or {}
    ctx_name = cfg.get("current-context")
    ctx = next((c["context"] for c in cfg.get("contexts") or [] if c["name"] == ctx_name), {})
    cluster = next((c["cluster"] for c in cfg.get("clusters") or []
                    if c["name"] == ctx.get("cluster")), None)
    if cluster is None:
        raise RuntimeError(f"kubeconfig {path}: no cluster for context {ctx_name!r}")
    user = next((u["user"] for u in cfg.get("users") or [] if u["name"] == ctx.get("user")), {}) or {}
    verify: bool | str = True
    if cluster.get("insecure-skip-tls-verify"):
        verify = False
    elif cluster.get("certificate-authority"):
        verify = cluster["certificate-authority"]
    return {"server": cluster["server"], "token": user.get("token"), "verify": verify}


def own_namespace() -> str:
    try:
        return (SA_DIR / "namespace").read_text().strip()
    except OSError:
        return "default"


# -- the discovery source ------------------------------------------------------------------------
class KubernetesDiscovery:
    """List, then watch, ModelDeployments and pods; apply a new FleetSpec on change."""

    def __init__(self, namespace: str | None = None, api: KubeAPI | None = None,
                 relist_delay: float = 2.0) -> None:
        self.namespace = namespace or own_namespace()
        self.all_namespaces = self.namespace == "*"
        self.api = api
        self.relist_delay = relist_delay
        self.mdeps: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self._last: FleetSpec | None = None
        self._md_rv = self._pod_rv = ""

    def _paths(self) -> tuple[str, str]:
        if self.all_namespaces:
            return f"/apis/{GROUP}/{VERSION}/{PLURAL}", "/api/v1/pods"
        ns = self.namespace
        return f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}", f"/api/v1/namespaces/{ns}/pods"

    @staticmethod
    def _key(obj: dict) -> str:
        m = obj.get("metadata") or {}
        return f"{m.get('namespace', '')}/{m.get('name', '')}"

    def spec(self) -> FleetSpec:
        return fleet_from_objects(list(self.mdeps.values()), list(self.pods.values()),
                                  self.all_namespaces)

    async def first(self) -> FleetSpec:
        if self.api is None:
            self.api = KubeAPI.from_environment()
        md_path, pod_path = self._paths()
        items, self._md_rv = await self.api.list(md_path)
        self.mdeps = {self._key(o): o for o in items}
        items, self._pod_rv = await self.api.list(pod_path, {"labelSelector": POD_LABEL})
        self.pods = {self._key(o): o for o in items}
        self._last = self.spec()
        log.info("kubernetes discovery (%s): %d ModelDeployment(s), %d pod(s)",
                 "all namespaces" if self.all_namespaces else f"namespace {self.namespace}",
                 len(self.mdeps), len(self.pods))
        return self._last

    async def watch(self, apply: Callable[[FleetSpec], None]) -> None:
        md_path, pod_path = self._paths()
        await asyncio.gather(
            self._watch_loop(md_path, {}, self.mdeps, "_md_rv", apply),
            self._watch_loop(pod_path, {"labelSelector": POD_LABEL}, self.pods, "_pod_rv", apply))

    async def _watch_loop(self, path: str, params: dict, store: dict[str, dict], rv_attr: str,
                          apply: Callable[[FleetSpec], None]) -> None:
        """Open a watch, then list (so nothing between the two is missed, also on API
        servers that keep no resource versions), then follow the events; on any
        failure or a closed watch, start over."""
        while True:
            try:
                async with self.api.watch(path, params, getattr(self, rv_attr)) as events:
                    items, rv = await self.api.list(path, params or None)
                    store.clear()
                    store.update({self._key(o): o for o in items})
                    setattr(self, rv_attr, rv)
                    self._publish(apply)
                    async for ev in events:
                        kind, obj = ev.get("type"), ev.get("object") or {}
                        if kind == "ERROR":
                            raise RuntimeError(obj.get("message", "watch error"))
                        rv = (obj.get("metadata") or {}).get("resourceVersion")
                        if rv:
                            setattr(self, rv_attr, rv)
                        if kind in ("ADDED", "MODIFIED"):
                            store[self._key(obj)] = obj
                        elif kind == "DELETED":
                            store.pop(self._key(obj), None)
                        else:
                            continue                       # BOOKMARK
                        self._publish(apply)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - start over after any watch failure
                log.warning("kubernetes watch of %s failed (%s); retrying", path, e)
                setattr(self, rv_attr, "")
                await asyncio.sleep(self.relist_delay)

    def _publish(self, apply: Callable[[FleetSpec], None]) -> None:
        spec = self.spec()
        if spec != self._last:
            self._last = spec
            apply(spec)

