"""Runtime state of the fleet: models -> pools -> endpoints, updated from specs.

Specs (fleet.py) say what should exist; these objects carry what the gateway has
learned and counted: health, the last scrape, in-flight requests, the prefix index,
values learned from the replicas (context length, block size, KV capacity). Applying a
new spec keeps the state of endpoints whose name and URL did not change, so a reload
or a Kubernetes event does not reset health or forget caches.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pagefleet.server.gateway.fleet import EndpointSpec, FleetSpec, ModelSpec, PoolSpec
from pagefleet.server.gateway.health import Health, ScrapedMetrics
from pagefleet.server.gateway.prefix import PrefixIndex
from pagefleet.server.gateway.ring import HashRing
from pagefleet.server.gateway.routing import SmoothWeighted

DEFAULT_BLOCK_SIZE = 16


@dataclass(eq=False)
class EndpointState:
    spec: EndpointSpec
    pool: "PoolState"
    health: Health = field(default_factory=Health)
    metrics: ScrapedMetrics = field(default_factory=ScrapedMetrics)
    inflight: int = 0
    removed: bool = False          # no longer in the fleet (requests may still finish)
    last_check: float = 0.0
    # One future per request sent here that has no response headers yet: set when the
    # replica leaves its pool, so those requests fail over instead of waiting on a
    # replica that may never answer (a frozen process still accepts connections).
    awaiting_headers: set[asyncio.Future] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ready(self) -> bool:
        return self.health.ready and not self.removed

    def watch_lost(self) -> asyncio.Future:
        """A future that completes if this replica leaves its pool for failed checks;
        the caller must `unwatch` it once the response headers are in."""
        fut = asyncio.get_running_loop().create_future()
        self.awaiting_headers.add(fut)
        return fut

    def unwatch(self, fut: asyncio.Future) -> None:
        self.awaiting_headers.discard(fut)

    def fail_pending(self) -> int:
        """The replica left its pool: wake the requests still waiting for its headers
        (they retry elsewhere; nothing reached their clients). Returns how many."""
        waiting = [f for f in self.awaiting_headers if not f.done()]
        for f in waiting:
            f.set_result(None)
        self.awaiting_headers.clear()
        return len(waiting)

    @property
    def others(self) -> float:
        """Requests at the replica that this gateway did not send (other gateway
        replicas, direct clients), from the last scrape. The scraped gauges count this
        gateway's own requests too, and stay as scraped for up to a check interval
        after those finish: counting them again made an idle holder of a prefix look
        busy, and the bound sent its next request elsewhere."""
        m = self.metrics
        return max(0.0, m.running + m.waiting - m.own_inflight)


@dataclass(eq=False)
class PoolState:
    spec: PoolSpec
    model: "ModelState"
    prefix_ttl: float
    endpoints: dict[str, EndpointState] = field(default_factory=dict)
    learned_max_model_len: int | None = None
    learned_block_size: int | None = None
    max_model_len_warned: bool = False      # said once that it cannot be learned
    rr_counter: int = 0
    _ring: HashRing | None = None

    def __post_init__(self) -> None:
        self.index = PrefixIndex(self.prefix_ttl)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def max_model_len(self) -> int | None:
        return self.spec.max_model_len or self.learned_max_model_len

    @property
    def block_size(self) -> int:
        return self.spec.block_size or self.learned_block_size or DEFAULT_BLOCK_SIZE

    @property
    def tokenizer_source(self) -> str | None:
        return self.spec.tokenizer or self.model.spec.tokenizer

    @property
    def chat_template(self) -> str | None:
        return self.spec.chat_template or self.model.spec.chat_template

    @property
    def tokenizer_key(self) -> tuple[str | None, str | None]:
        return self.tokenizer_source, self.chat_template

    def ready_endpoints(self) -> list[EndpointState]:
        return [e for e in self.endpoints.values() if e.ready]

    def ring(self, vnodes: int) -> HashRing:
        names = frozenset(e.name for e in self.endpoints.values() if e.ready)
        if self._ring is None or self._ring.names != names:
            self._ring = HashRing(names, vnodes)
        return self._ring

    def apply(self, spec: PoolSpec) -> list[EndpointState]:
        """Take a new spec; returns the endpoints that were removed."""
        self.spec = spec
        removed = []
        wanted = {e.name: e for e in spec.endpoints}
        for name, ep in list(self.endpoints.items()):
            if name not in wanted or wanted[name].url != ep.spec.url:
                ep.removed = True
                removed.append(self.endpoints.pop(name))
                self.index.forget(name)
        for name, es in wanted.items():
            if name not in self.endpoints:
                self.endpoints[name] = EndpointState(es, self)
        return removed


@dataclass(eq=False)
class ModelState:
    spec: ModelSpec
    prefix_ttl: float
    pools: dict[str, PoolState] = field(default_factory=dict)
    last_request_time: float = 0.0
    choosers: dict[tuple[str, ...], SmoothWeighted] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    def apply(self, spec: ModelSpec) -> list[EndpointState]:
        self.spec = spec
        removed: list[EndpointState] = []
        wanted = {p.name: p for p in spec.pools}
        for name in list(self.pools):
            if name not in wanted:
                pool = self.pools.pop(name)
                for ep in pool.endpoints.values():
                    ep.removed = True
                    removed.append(ep)
        for name, ps in wanted.items():
            pool = self.pools.get(name)
            if pool is None:
                pool = self.pools[name] = PoolState(ps, self, self.prefix_ttl)
            removed += pool.apply(ps)
        return removed

    def has_ready(self) -> bool:
        return any(p.ready_endpoints() for p in self.pools.values())

    def chooser(self, pools: tuple[str, ...]) -> SmoothWeighted:
        c = self.choosers.get(pools)
        if c is None:
            c = self.choosers[pools] = SmoothWeighted()
        return c

    def touch(self) -> None:
        self.last_request_time = time.time()


@dataclass
class FleetChange:
    added: list[EndpointState] = field(default_factory=list)
    removed: list[EndpointState] = field(default_factory=list)
    removed_models: list[ModelState] = field(default_factory=list)


def apply_fleet(models: dict[str, ModelState], spec: FleetSpec, prefix_ttl: float) -> FleetChange:
    """Bring `models` in line with `spec` (in place); report what appeared and went."""
    before = {id(e): e for m in models.values() for p in m.pools.values()
              for e in p.endpoints.values()}
    change = FleetChange()
    wanted = {m.name: m for m in spec.models}
    for name in list(models):
        if name not in wanted:
            ms = models.pop(name)
            change.removed_models.append(ms)
            for p in ms.pools.values():
                for e in p.endpoints.values():
                    e.removed = True
                    change.removed.append(e)
    for name, mspec in wanted.items():
        ms = models.get(name)
        if ms is None:
            ms = models[name] = ModelState(mspec, prefix_ttl)
        change.removed += ms.apply(mspec)
    after = [e for m in models.values() for p in m.pools.values() for e in p.endpoints.values()]
    change.added = [e for e in after if id(e) not in before]
    return change
