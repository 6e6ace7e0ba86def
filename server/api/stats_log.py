"""The periodic log line operators grep for, in vLLM's wording.

"Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s, Running: R
reqs, Waiting: W reqs, GPU KV cache usage: U%, Prefix cache hit rate: H%". Rates are
over the last interval; an idle server logs nothing (no useless repeated lines).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("pagefleet.stats")


@dataclass
class Sample:
    t: float
    prompt_tokens: float
    generation_tokens: float
    prefix_queries: int
    prefix_hits: int


def stats_line(prev: Sample, cur: Sample, running: int, waiting: int, kv_usage: float) -> str:
    dt = max(cur.t - prev.t, 1e-9)
    queries = cur.prefix_queries - prev.prefix_queries
    hits = cur.prefix_hits - prev.prefix_hits
    hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
    return (f"Avg prompt throughput: {(cur.prompt_tokens - prev.prompt_tokens) / dt:.1f} "
            f"tokens/s, Avg generation throughput: "
            f"{(cur.generation_tokens - prev.generation_tokens) / dt:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"GPU KV cache usage: {100.0 * kv_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")


def is_idle(prev: Sample, cur: Sample, running: int, waiting: int) -> bool:
    return (running == 0 and waiting == 0 and cur.prompt_tokens == prev.prompt_tokens
            and cur.generation_tokens == prev.generation_tokens)


async def log_stats_forever(async_engine, metrics, interval: float) -> None:
    def sample() -> Sample:
        s = async_engine.stats
        return Sample(time.monotonic(), metrics.prompt_tokens._value.get(),
                      metrics.generation_tokens._value.get(),
                      s.prefix_cache_queries if s else 0, s.prefix_cache_hits if s else 0)

    prev = sample()
    while True:
        await asyncio.sleep(interval)
        cur, s = sample(), async_engine.stats
        running, waiting = async_engine.num_running, async_engine.num_waiting
        if not is_idle(prev, cur, running, waiting):
            log.info(stats_line(prev, cur, running, waiting, s.kv_cache_usage if s else 0.0))
        prev = cur
