"""The per-model waiting queue: routes a request now, or holds it until a replica of
its pool class has room, in priority order, bounded by the queue cap and the
queue-time limit.

A request waits when every replica of its class is at its in-flight cap, or when the
class has no ready replica at all: that is the scale-from-zero hold, and the number of
such requests per model (`waiting`) is what the operator reads to scale a model up
from zero. Waiters are kept sorted by (priority, arrival); every change that can free
room (a request finishing, a replica joining, a fleet update) pumps the queue, which
hands each waiter, most urgent first, to the first replica that routing picks for it.
A waiter whose class is full does not block others whose class has room (short
requests never wait behind long ones).

Routing itself is `routing.route`, pure; this module only builds its inputs from the
live state and applies its decision (reserving an in-flight slot).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from dataclasses import dataclass, field

from pagefleet.server.api.errors import APIError
from pagefleet.server.gateway.admission import Queued, admit
from pagefleet.server.gateway.health import on_check, on_drain
from pagefleet.server.gateway.prefix import PromptBlocks, prompt_blocks, ring_key
from pagefleet.server.gateway.routing import Candidate, Decision, RouteSettings, route
from pagefleet.server.gateway.state import EndpointState, ModelState, PoolState

log = logging.getLogger("pagefleet.gateway")
_seq = itertools.count()


@dataclass(frozen=True)
class DispatchSettings:
    route: RouteSettings = field(default_factory=RouteSettings)
    ring_blocks: int = 4
    ring_vnodes: int = 64
    max_inflight: int = 256
    max_queued: int = 1024
    queue_timeout: float = 30.0
    critical_priority: int | None = None
    retry_after: int = 1
    unhealthy_threshold: int = 3


@dataclass(eq=False)
class Ticket:
    """One request on its way to a replica (it keeps its place across retries)."""

    rid: str
    model: ModelState
    priority: int
    class_pools: tuple[str, ...]                  # pools of the context class it fits
    prompt_ids: dict[tuple, list[int]]            # first prompt, per tokenizer key
    seq: int = field(default_factory=lambda: next(_seq))
    arrival: float = field(default_factory=time.monotonic)
    deadline: float = 0.0
    excluded: set[tuple[str, str, int]] = field(default_factory=set)
    waited: float = 0.0                           # seconds spent queued so far
    future: asyncio.Future | None = None
    _blocks: dict[tuple, PromptBlocks] = field(default_factory=dict)

    def blocks(self, pool: PoolState) -> PromptBlocks | None:
        ids = self.prompt_ids.get(pool.tokenizer_key)
        if ids is None:
            return None
        key = (pool.tokenizer_key, pool.block_size)
        b = self._blocks.get(key)
        if b is None:
            b = self._blocks[key] = prompt_blocks(ids, pool.block_size)
        return b

    @property
    def queued(self) -> Queued:
        return Queued(self.priority, self.seq)


@dataclass(eq=False)
class Reservation:
    ticket: Ticket
    pool: PoolState
    endpoint: EndpointState
    incarnation: int
    decision: Decision
    blocks: PromptBlocks | None
    root: int | None
    load: float = 0.0              # the replica's load before this request
    pool_load: float = 0.0         # the pool's total load before it
    pool_size: int = 0             # healthy replicas in the pool
    released: bool = False


class Dispatcher:
    def __init__(self, settings: DispatchSettings, events=None) -> None:
        self.s = settings
        self.events = events              # metrics hooks (metrics.GatewayMetrics) or None
        self.queues: dict[str, list[Ticket]] = {}

    # -- queries ---------------------------------------------------------------------------
    def waiting(self, model: str) -> int:
        return len(self.queues.get(model, ()))

    def waiting_for_pool(self, model: str, pool: str) -> int:
        return sum(1 for t in self.queues.get(model, ()) if pool in t.class_pools)

    def max_inflight(self, pool: PoolState) -> int:
        return pool.spec.max_inflight or self.s.max_inflight

    def queue_timeout(self, model: ModelState) -> float:
        return model.spec.queue_timeout or self.s.queue_timeout

    # -- routing -----------------------------------------------------------------------------
    def _has_room(self, pool: PoolState, e: EndpointState, t: Ticket) -> bool:
        return (e.ready and e.inflight < self.max_inflight(pool)
                and (pool.name, e.name, e.health.incarnation) not in t.excluded)

    def try_route(self, t: Ticket) -> Reservation | None:
        """Reserve a replica for the ticket now, or None when its class has no room."""
        model = t.model
        pools = [model.pools[n] for n in t.class_pools
                 if n in model.pools and model.pools[n].spec.weight > 0]
        eligible = [p for p in pools
                    if any(self._has_room(p, e, t) for e in p.endpoints.values())]
        if not eligible:
            return None
        if len(eligible) == 1:
            pool = eligible[0]
        else:
            chooser = model.chooser(tuple(sorted(t.class_pools)))
            pool = model.pools[chooser.pick({p.name: p.spec.weight for p in eligible})]
        now = time.monotonic()
        blocks = t.blocks(pool) if self.s.route.mode == "prefix" else None
        rk = ring_key(blocks, self.s.ring_blocks) if blocks is not None else None
        ready = pool.ready_endpoints()
        cands = [Candidate(
            name=e.name, inflight=e.inflight, waiting=e.others,
            kv_usage=e.metrics.kv_usage, has_room=self._has_room(pool, e, t),
            match=pool.index.match(e.name, blocks.lookup_hashes, now) if rk else 0,
            groups=pool.index.groups(e.name, now) if rk else 0) for e in ready]
        ring_order = list(pool.ring(self.s.ring_vnodes).walk(rk[0])) if rk else []
        decision = route(cands, root_len=rk[1] + 1 if rk else None, ring_order=ring_order,
                         settings=self.s.route, tiebreak=pool.rr_counter)
        pool.rr_counter += 1
        if decision is None:
            return None
        ep = pool.endpoints[decision.endpoint]
        ep.inflight += 1
        if self.events:
            self.events.routed(model.name, pool.name, decision.reason)
        chosen = next(c for c in cands if c.name == decision.endpoint)
        return Reservation(t, pool, ep, ep.health.incarnation, decision, blocks,
                           rk[1] if rk else None, chosen.load, sum(c.load for c in cands),
                           len(cands))

    # -- the queue -----------------------------------------------------------------------------
    async def acquire(self, t: Ticket, *, retry: bool = False) -> Reservation:
        """A reservation for the ticket: at once, or after waiting its turn.

        Raises APIError 429 (queue full: refused or shed) or 503 (queue-time limit)."""
        model = t.model
        if not retry:
            t.deadline = t.arrival + self.queue_timeout(model)
        q = self.queues.setdefault(model.name, [])
        if not q:
            res = self.try_route(t)
            if res is not None:
                return res
        if not retry:
            self._admit(t, q)
        loop = asyncio.get_running_loop()
        t.future = loop.create_future()
        bisect.insort(q, t, key=lambda x: (x.priority, x.seq))
        started = time.monotonic()
        try:
            self.pump(model.name)
            remaining = t.deadline - time.monotonic()
            if not t.future.done():
                await asyncio.wait({t.future}, timeout=max(remaining, 0.0))
            if t.future.done():
                return t.future.result()       # a reservation, or the 429 of a shed
            self._remove(t)
            if self.events:
                self.events.rejected(model.name, "queue_timeout")
            raise APIError(503, self._timeout_message(t))
        except asyncio.CancelledError:
            self._remove(t)
            fut = t.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())
            raise
        finally:
            t.waited += time.monotonic() - started

    def _admit(self, t: Ticket, q: list[Ticket]) -> None:
        cap = t.model.spec.max_num_queued_requests
        cap = self.s.max_queued if cap is None else cap
        decision = admit([w.queued for w in q], t.priority, cap, self.s.critical_priority)
        if decision.kind == "refuse":
            if self.events:
                self.events.rejected(t.model.name, "queue_full")
            raise self._full_error(t.model, cap, len(q))
        if decision.kind == "shed":
            victim = next(w for w in q if w.queued == decision.victim)
            self._remove(victim)
            if self.events:
                self.events.rejected(t.model.name, "shed")
            log.info("request %s: shed from the queue of %r for more urgent %s",
                     victim.rid, t.model.name, t.rid)
            if victim.future is not None and not victim.future.done():
                victim.future.set_exception(self._full_error(t.model, cap, len(q)))

    def _full_error(self, model: ModelState, cap: int, n: int) -> APIError:
        return APIError(429, f"the gateway's queue for model `{model.name}` is full ({n} "
                             f"requests waiting, limit {cap}); retry later", None,
                        {"Retry-After": str(self.s.retry_after)})

    def _timeout_message(self, t: Ticket) -> str:
        why = ("every replica is busy" if any(p.ready_endpoints() for p in t.model.pools.values())
               else "no replica is ready")
        return (f"the request waited more than {self.queue_timeout(t.model):g}s in the "
                f"gateway queue for model `{t.model.name}` ({why})")

    def _remove(self, t: Ticket) -> None:
        q = self.queues.get(t.model.name)
        if q:
            try:
                q.remove(t)
            except ValueError:
                pass

    def pump(self, model_name: str | None = None) -> None:
        """Hand waiting tickets, most urgent first, to replicas with room."""
        names = [model_name] if model_name is not None else list(self.queues)
        for name in names:
            q = self.queues.get(name)
            i = 0
            while q and i < len(q):
                t = q[i]
                if t.future is None or t.future.done():
                    q.pop(i)
                    continue
                if not self._any_room(t.model):
                    break
                res = self.try_route(t)
                if res is None:
                    i += 1
                    continue
                q.pop(i)
                t.future.set_result(res)

    def _any_room(self, model: ModelState) -> bool:
        return any(e.ready and e.inflight < self.max_inflight(p)
                   for p in model.pools.values() for e in p.endpoints.values())

    def fail_model(self, model_name: str, err: APIError) -> None:
        """The model left the fleet: its waiters get `err`."""
        for t in self.queues.pop(model_name, []):
            if t.future is not None and not t.future.done():
                t.future.set_exception(err)

    # -- after the upstream call ------------------------------------------------------------------
    def confirm(self, res: Reservation) -> None:
        """The replica accepted the request: it will hold the prompt's blocks."""
        if res.blocks is not None and res.endpoint.health.incarnation == res.incarnation:
            res.pool.index.record(res.endpoint.name, res.blocks, res.root, time.monotonic())

    def release(self, res: Reservation, *, failed: bool = False,
                drained: bool = False) -> None:
        """The request is done with the replica. failed: its connection failed or it
        did not answer in time, which counts as a failed health check and excludes it
        for this ticket. drained: it refused the request because it is shutting down,
        which takes it out of its pool at once (until a check finds it restarted)."""
        if res.released:
            return
        res.released = True
        ep = res.endpoint
        ep.inflight -= 1
        if failed or drained:
            res.ticket.excluded.add((res.pool.name, ep.name, res.incarnation))
        if (failed or drained) and ep.health.incarnation == res.incarnation:
            if drained:
                ep.health, event = on_drain(ep.health)
            else:
                ep.health, event = on_check(ep.health, False, self.s.unhealthy_threshold)
            if event == "left":
                res.pool.index.forget(ep.name)
                if drained:
                    log.warning("endpoint %s (%s) left pool %r: it is shutting down "
                                "(draining); back once a check finds it restarted",
                                ep.name, ep.spec.url, res.pool.name)
                else:
                    log.warning("endpoint %s (%s) left pool %r: %d failed checks in a row",
                                ep.name, ep.spec.url, res.pool.name, ep.health.failures)
                    ep.fail_pending()
        self.pump(res.pool.model.name)
