"""The waiting queue on live state objects, without the network: priority order, class
isolation, the queue-time limit, scale-from-zero holding, retry exclusion."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.server.api.errors import APIError
from pagefleet.server.gateway.dispatch import Dispatcher, DispatchSettings, Ticket
from pagefleet.server.gateway.fleet import EndpointSpec, FleetSpec, ModelSpec, PoolSpec
from pagefleet.server.gateway.health import Health
from pagefleet.server.gateway.state import ModelState, apply_fleet


def fleet(*pools: PoolSpec) -> ModelState:
    models: dict[str, ModelState] = {}
    apply_fleet(models, FleetSpec((ModelSpec("m", pools),)), prefix_ttl=60)
    m = models["m"]
    for p in m.pools.values():
        for e in p.endpoints.values():
            e.health = Health(ready=True, incarnation=1)
    return m


def pool(name: str, *eps: str, mml: int | None = None, cap: int = 1) -> PoolSpec:
    return PoolSpec(name, tuple(EndpointSpec(e, f"http://{e}:1") for e in eps),
                    max_model_len=mml, max_inflight=cap)


def ticket(m: ModelState, pools: tuple[str, ...], priority: int = 0) -> Ticket:
    return Ticket("r", m, priority, pools, {})


async def test_most_urgent_first():
    m = fleet(pool("p", "a"))
    d = Dispatcher(DispatchSettings())
    first = await d.acquire(ticket(m, ("p",)))
    order = []

    async def wait(prio):
        res = await d.acquire(ticket(m, ("p",), prio))
        order.append(prio)
        d.release(res)

    tasks = []
    for prio in (5, 1, 3):
        tasks.append(asyncio.ensure_future(wait(prio)))
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert d.waiting("m") == 3 and order == []
    d.release(first)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [1, 3, 5]


async def test_a_full_long_pool_does_not_block_short_requests():
    m = fleet(pool("short", "s", mml=256), pool("long", "l", mml=1024))
    d = Dispatcher(DispatchSettings())
    s0 = await d.acquire(ticket(m, ("short",)))
    await d.acquire(ticket(m, ("long",)))
    long_waiter = asyncio.ensure_future(d.acquire(ticket(m, ("long",), priority=-5)))
    short_waiter = asyncio.ensure_future(d.acquire(ticket(m, ("short",), priority=9)))
    await asyncio.sleep(0.01)
    assert d.waiting_for_pool("m", "long") == 1 and d.waiting_for_pool("m", "short") == 1
    d.release(s0)
    await asyncio.sleep(0.01)
    assert short_waiter.done() and short_waiter.result().pool.name == "short"
    assert not long_waiter.done()
    long_waiter.cancel()


async def test_queue_time_limit_and_scale_from_zero_hold():
    m = fleet(pool("p", "a"))
    ep = m.pools["p"].endpoints["a"]
    ep.health = Health(ready=False)
    d = Dispatcher(DispatchSettings(queue_timeout=0.05))
    with pytest.raises(APIError) as e:
        await d.acquire(ticket(m, ("p",)))
    assert e.value.status == 503 and "no replica is ready" in e.value.message
    assert d.waiting("m") == 0
    d = Dispatcher(DispatchSettings(queue_timeout=30))
    held = asyncio.ensure_future(d.acquire(ticket(m, ("p",))))
    await asyncio.sleep(0.01)
    assert d.waiting("m") == 1 and not held.done()
    ep.health = Health(ready=True, incarnation=1)       # the replica joins
    d.pump("m")
    res = await asyncio.wait_for(held, 5)
    assert res.endpoint is ep and d.waiting("m") == 0


async def test_a_failed_replica_is_excluded_for_the_retry_until_it_restarts():
    m = fleet(pool("p", "a", "b", cap=4))
    d = Dispatcher(DispatchSettings(unhealthy_threshold=3))
    t = ticket(m, ("p",))
    res = await d.acquire(t)
    failed = res.endpoint.name
    d.release(res, failed=True)
    assert m.pools["p"].endpoints[failed].health.failures == 1
    again = await d.acquire(t, retry=True)
    assert again.endpoint.name != failed
    d.release(again, failed=True)
    # Both excluded: the retry waits, and gets the first one back once it restarts.
    retry = asyncio.ensure_future(d.acquire(t, retry=True))
    await asyncio.sleep(0.01)
    assert not retry.done()
    ep = m.pools["p"].endpoints[failed]
    ep.health = Health(ready=True, incarnation=ep.health.incarnation + 1)
    d.pump("m")
    assert (await asyncio.wait_for(retry, 5)).endpoint is ep


async def test_cancelled_waiter_leaves_the_queue_and_frees_nothing_twice():
    m = fleet(pool("p", "a"))
    d = Dispatcher(DispatchSettings())
    first = await d.acquire(ticket(m, ("p",)))
    w = asyncio.ensure_future(d.acquire(ticket(m, ("p",))))
    await asyncio.sleep(0.01)
    w.cancel()
    await asyncio.sleep(0.01)
    assert d.waiting("m") == 0
    d.release(first)
    d.release(first)
    assert m.pools["p"].endpoints["a"].inflight == 0
