"""Per-replica check loop: `/health` for liveness, `/metrics` for load and cache facts.

Each interval a replica gets one check: `/health` must answer 200 within the timeout;
the same tick scrapes `/metrics` for `vllm:num_requests_running/_waiting`,
`vllm:kv_cache_usage_perc` and `vllm:cache_config_info` (block size and KV capacity,
which size the gateway's picture of its prefix cache). A `/health` 200 that carries
the server's draining header (it is shutting down) takes the replica out at once.
When a replica leaves for failed checks, the requests still waiting for its response
headers fail over to another replica.

A pool whose context length is not configured learns it from a replica: its
`/v1/models` card (with the pool's `api_key`, else none), else `/tokenize`, which
pagefleet and vLLM servers serve without an API key, so pools whose clients' keys are
passed through (no `api_key` in the pool) learn it too. If neither answers, a warning
says so once: the pool is then treated as holding any prompt.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

import httpx

from pagefleet.server.api.errors import DRAINING_HEADER
from pagefleet.server.gateway.health import ScrapedMetrics, on_check, on_drain, parse_metrics
from pagefleet.server.gateway.state import EndpointState

log = logging.getLogger("pagefleet.gateway")


@dataclass(frozen=True)
class Check:
    ok: bool                                 # /health answered 200 in time
    scraped: ScrapedMetrics | None = None
    draining: bool = False                   # ... with the draining header


async def check_once(client: httpx.AsyncClient, url: str) -> Check:
    try:
        health, metrics = await asyncio.gather(client.get(url + "/health"),
                                               client.get(url + "/metrics"),
                                               return_exceptions=True)
    except Exception:  # noqa: BLE001 - any failure is a failed check
        return Check(False)
    if isinstance(health, BaseException) or health.status_code != 200:
        return Check(False)
    scraped = None
    if not isinstance(metrics, BaseException) and metrics.status_code == 200:
        scraped = parse_metrics(metrics.text)
    return Check(True, scraped, bool(health.headers.get(DRAINING_HEADER)))


async def _card_max_model_len(client: httpx.AsyncClient, ep: EndpointState) -> int:
    """max_model_len from the replica's /v1/models (needs the key when it wants one)."""
    key = ep.pool.spec.api_key
    r = await client.get(ep.spec.url + "/v1/models",
                         headers={"authorization": f"Bearer {key}"} if key else {})
    r.raise_for_status()
    return int((r.json().get("data") or [])[0]["max_model_len"])


async def _tokenize_max_model_len(client: httpx.AsyncClient, ep: EndpointState) -> int:
    """max_model_len from the replica's /tokenize answer, which needs no API key."""
    r = await client.post(ep.spec.url + "/tokenize", json={"prompt": ""})
    r.raise_for_status()
    return int(r.json()["max_model_len"])


async def learn_max_model_len(client: httpx.AsyncClient, ep: EndpointState) -> bool:
    """Learn the pool's context length from this replica; False (and a warning, once
    per pool) when it cannot: the pool then takes prompts of any length, so the
    long/short split does not work until `max_model_len` is set on the pool."""
    errors = []
    for source, ask in (("/v1/models", _card_max_model_len),
                        ("/tokenize", _tokenize_max_model_len)):
        try:
            mml = await ask(client, ep)
            break
        except Exception as e:  # noqa: BLE001 - optional knowledge; retried next check
            errors.append(f"{source}: {_describe(e)}")
    else:
        if not ep.pool.max_model_len_warned:
            ep.pool.max_model_len_warned = True
            log.warning("pool %r: cannot learn max_model_len from endpoint %s (%s); until "
                        "it can, the pool is treated as holding prompts of any length. Set "
                        "max_model_len on the pool (or api_key, if its servers want one)",
                        ep.pool.name, ep.name, "; ".join(errors))
        return False
    if ep.pool.learned_max_model_len != mml:
        ep.pool.learned_max_model_len = mml
        log.info("pool %r: max_model_len %d (from %s's %s)", ep.pool.name, mml, ep.name,
                 source)
    return True


def _describe(e: Exception) -> str:
    if isinstance(e, httpx.HTTPStatusError):
        return f"HTTP {e.response.status_code}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def apply_check(ep: EndpointState, ok: bool, scraped: ScrapedMetrics | None,
                threshold: int, draining: bool = False) -> str | None:
    """Fold one check into the endpoint's state; returns 'joined', 'left' or None.
    A draining replica leaves at once; one that leaves for failed checks has the
    requests still waiting for its headers failed over."""
    if draining:
        ep.health, event = on_drain(ep.health)
    else:
        ep.health, event = on_check(ep.health, ok, threshold)
    pool = ep.pool
    if scraped is not None:
        ep.metrics = scraped
        if scraped.block_size and pool.spec.block_size is None:
            pool.learned_block_size = scraped.block_size
        if scraped.num_gpu_blocks:
            pool.index.set_capacity(ep.name, scraped.num_gpu_blocks)
    if event == "joined":
        pool.index.forget(ep.name)       # a (re)started engine has an empty cache
        if scraped is not None and scraped.num_gpu_blocks:
            pool.index.set_capacity(ep.name, scraped.num_gpu_blocks)
        log.info("endpoint %s (%s) joined pool %r of model %r", ep.name, ep.spec.url,
                 pool.name, pool.model.name)
    elif event == "left" and draining:
        pool.index.forget(ep.name)
        ep.metrics = ScrapedMetrics()
        log.warning("endpoint %s (%s) left pool %r: it is shutting down (draining); back "
                    "once a check finds it restarted", ep.name, ep.spec.url, pool.name)
    elif event == "left":
        pool.index.forget(ep.name)
        ep.metrics = ScrapedMetrics()
        n = ep.fail_pending()
        log.warning("endpoint %s (%s) left pool %r: %d failed checks in a row%s", ep.name,
                    ep.spec.url, pool.name, ep.health.failures,
                    f"; failing over {n} request(s) still waiting for its answer" if n else "")
    return event


async def probe_forever(ep: EndpointState, client: httpx.AsyncClient, interval: float,
                        threshold: int, on_event) -> None:
    """Check `ep` every `interval` seconds until it leaves the fleet."""
    while not ep.removed:
        before = ep.inflight
        check = await check_once(client, ep.spec.url)
        if ep.removed:
            return
        scraped = check.scraped
        if scraped is not None:   # ours there at the scrape: at most this many
            scraped = replace(scraped, own_inflight=max(before, ep.inflight))
        if check.ok and not check.draining and ep.pool.spec.max_model_len is None \
                and ep.pool.learned_max_model_len is None:
            await learn_max_model_len(client, ep)    # before it takes traffic
            if ep.removed:
                return
        event = apply_check(ep, check.ok, scraped, threshold, check.draining)
        if event is not None:
            on_event(ep, event)
        await asyncio.sleep(interval)
