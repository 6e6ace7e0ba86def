"""The pagefleet gateway's view of each model: what scale from zero reads.

The gateway holds requests for a model that has no ready replica (or whose replicas
are all at their in-flight cap) and exports, per model and pool:

- `pagefleet_gateway_pool_requests_waiting{model_name,pool}`: held requests,
- `pagefleet_gateway_requests_in_flight{model_name,pool,endpoint}`: dispatched ones,
- `pagefleet_gateway_last_request_timestamp_seconds{model_name}`: the last arrival,
- `pagefleet_gateway_discovery_info{discovery,namespace}`: which namespace it watches,
  which decides how it names pools (`<name>`, or `<namespace>/<name>` for all).

The gateway runs as several replicas that share nothing, so every replica is scraped:
the operator reads the EndpointSlices of the gateway's Service (ready endpoints only)
and asks each address directly; waiting and in-flight counts add up, the last request
is the latest of any replica. A Service URL would reach one replica at random.

`parse_page`, `combine` and `pool_signal` are pure; `GatewayScraper` does the I/O and
caches one round for a short while, so the evaluations of many ModelDeployments in
one interval share a scrape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from pagefleet.operator.kube import KubeClient, KubeError, path_for

WAITING = "pagefleet_gateway_pool_requests_waiting"
INFLIGHT = "pagefleet_gateway_requests_in_flight"
LAST_REQUEST = "pagefleet_gateway_last_request_timestamp_seconds"
DISCOVERY = "pagefleet_gateway_discovery_info"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
DEFAULT_PORT = "http"
MAX_BODY_BYTES = 8 * 1024 * 1024


class GatewayRefError(ValueError):
    """A --gateway-service value that is not NAMESPACE/NAME[:PORT]."""


@dataclasses.dataclass(frozen=True)
class GatewayRef:
    namespace: str
    name: str
    port: str = DEFAULT_PORT        # the Service port's name or number

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}:{self.port}"


def parse_ref(text: str) -> GatewayRef:
    """`pagefleet-system/pagefleet-gateway[:http]` -> GatewayRef."""
    ns, slash, rest = text.partition("/")
    name, _, port = rest.partition(":")
    if not slash or not ns or not name:
        raise GatewayRefError(f"expected NAMESPACE/NAME[:PORT], got {text!r}")
    return GatewayRef(ns, name, port or DEFAULT_PORT)


@dataclasses.dataclass(frozen=True)
class Page:
    """One gateway replica's page, reduced to what the operator reads."""

    namespace: str | None                               # discovery namespace ('*': all)
    waiting: Mapping[tuple[str, str], float]            # (model, pool) -> held
    inflight: Mapping[tuple[str, str], float]           # (model, pool) -> dispatched
    last_request: Mapping[str, float]                   # model -> unix time (0: never)


@dataclasses.dataclass(frozen=True)
class PoolSignal:
    """What the gateway says about one ModelDeployment's pool."""

    waiting: float
    inflight: float
    last_request: float | None      # None: the model has had no request yet


@dataclasses.dataclass(frozen=True)
class View:
    """One scrape round over every gateway replica of every configured Service."""

    pages: tuple[Page, ...]
    replicas: int                    # gateway replicas asked
    errors: tuple[str, ...] = ()     # one line per replica that could not be read
    at: float = 0.0

    @property
    def ok(self) -> bool:
        """Every replica answered (a missing one could be holding requests)."""
        return self.replicas > 0 and not self.errors


def parse_page(text: str) -> Page:
    """A gateway's /metrics text -> Page (raises ValueError on a page that is not
    Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    waiting: dict[tuple[str, str], float] = {}
    inflight: dict[tuple[str, str], float] = {}
    last: dict[str, float] = {}
    namespace = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            if s.name == WAITING:
                key = (labels.get("model_name", ""), labels.get("pool", ""))
                waiting[key] = waiting.get(key, 0.0) + s.value
            elif s.name == INFLIGHT:
                key = (labels.get("model_name", ""), labels.get("pool", ""))
                inflight[key] = inflight.get(key, 0.0) + s.value
            elif s.name == LAST_REQUEST:
                model = labels.get("model_name", "")
                last[model] = max(last.get(model, 0.0), s.value)
            elif s.name == DISCOVERY and s.value:
                namespace = labels.get("namespace")
    return Page(namespace, waiting, inflight, last)


def pool_label(page_namespace: str | None, namespace: str, name: str) -> str | None:
    """How a gateway that watches `page_namespace` names the pool of ModelDeployment
    namespace/name (server/gateway/kube.py: `name`, or `namespace/name` when it watches
    all namespaces); None when that gateway does not see the namespace."""
    if page_namespace == "*":
        return f"{namespace}/{name}"
    if page_namespace == namespace:
        return name
    return None


def pool_signal(view: View, namespace: str, name: str, served: str) -> PoolSignal | None:
    """The gateway replicas' combined word on one pool: held and dispatched requests
    summed, the model's latest request. None when no replica serves this pool's
    namespace (no gateway in front of it)."""
    waiting = inflight = 0.0
    last: float | None = None
    seen = False
    for page in view.pages:
        pool = pool_label(page.namespace, namespace, name)
        if pool is None:
            continue
        seen = True
        waiting += page.waiting.get((served, pool), 0.0)
        inflight += page.inflight.get((served, pool), 0.0)
        t = page.last_request.get(served)
        if t:
            last = t if last is None else max(last, t)
    return PoolSignal(waiting, inflight, last) if seen else None


def ready_addresses(slices: Sequence[Mapping[str, Any]], port: str) -> list[tuple[str, int]]:
    """(address, port) of the ready endpoints in a Service's EndpointSlices, for the
    Service port named (or numbered) `port`."""
    out = []
    for sl in slices:
        ports = sl.get("ports") or []
        number = next((p.get("port") for p in ports
                       if port in (p.get("name"), str(p.get("port")))), None)
        if number is None and len(ports) == 1 and not ports[0].get("name"):
            number = ports[0].get("port")   # a Service with one unnamed port
        if number is None:
            continue
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating"):
                continue
            out += [(a, int(number)) for a in ep.get("addresses") or []]
    return sorted(set(out))


class GatewayScraper:
    """Scrapes every replica of the configured gateway Services; one round is shared
    by the callers of the next `max_age` seconds."""

    def __init__(self, kube: KubeClient, refs: Sequence[GatewayRef], timeout: float = 2.0,
                 max_age: float = 0.5) -> None:
        self.kube = kube
        self.refs = tuple(refs)
        self.timeout = timeout
        self.max_age = max_age
        self._view: View | None = None
        self._lock = asyncio.Lock()

    def describe(self) -> str:
        return ", ".join(str(r) for r in self.refs)

    async def view(self, session: aiohttp.ClientSession) -> View:
        async with self._lock:
            now = time.time()
            if self._view is not None and now - self._view.at < self.max_age:
                return self._view
            self._view = await self._round(session, now)
            return self._view

    async def _round(self, session: aiohttp.ClientSession, now: float) -> View:
        targets: list[tuple[GatewayRef, str]] = []
        errors: list[str] = []
        for ref in self.refs:
            try:
                slices = await self.kube.list(path_for("discovery.k8s.io/v1", "endpointslices", ref.namespace),
                                              {SERVICE_NAME_LABEL: ref.name})
            except (KubeError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                errors.append(f"{ref}: cannot list its EndpointSlices: {e}")
                continue
            addrs = ready_addresses(slices, ref.port)
            if not addrs:
                errors.append(f"{ref}: no ready endpoint")
            for host, port in addrs:
                host = f"[{host}]" if ":" in host else host
                targets.append((ref, f"http://{host}:{port}/metrics"))

        async def one(url: str) -> Page | str:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                    if r.status != 200:
                        return f"{url}: HTTP {r.status}"
                    body = await r.content.read(MAX_BODY_BYTES)
                return parse_page(body.decode("utf-8", errors="replace"))
            except asyncio.TimeoutError:
                return f"{url}: timed out after {self.timeout:g}s"
            except (aiohttp.ClientError, OSError, ValueError) as e:
                return f"{url}: {type(e).__name__}: {e}"

        results = await asyncio.gather(*(one(url) for _, url in targets))
        pages = tuple(r for r in results if isinstance(r, Page))
        errors += [r for r in results if isinstance(r, str)]
        return View(pages=pages, replicas=len(targets), errors=tuple(errors), at=now)
