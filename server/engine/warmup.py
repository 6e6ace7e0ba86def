"""Warm-up: a few representative steps through the real core before the first request.

Why: what compiles lazily should compile at startup, not inside a user's step. Triton
builds one binary per kernel *variant* (every constexpr value, see ops/jit_variants.py):
the decode graphs captured at startup cover pure decode, but a pure prefill, a prefill
over cached context, a mixed step (eager decode rows + prefill rows) and the sampler's
penalty and top-k/top-p paths each reach variants of their own. Met cold while serving,
each cost 0.3-0.7 s on an H200 with every stream waiting: the TTFT spikes in the first
waves of each new workload shape in the side-by-side run (BENCHMARKS.md).

The requests are ordinary core requests with reserved ids, so they go through the
scheduler, KV manager, runner and sampler exactly as users' do. Afterwards the pool is
whole, the warm-up's prefix-cache entries are dropped and the counters are zeroed, so
metrics and cache hits start from nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pagefleet.server.engine.protocol import CoreRequest, CoreSamplingParams

if TYPE_CHECKING:
    from pagefleet.server.engine.core import EngineCore

log = logging.getLogger("pagefleet.engine")

ID_PREFIX = "pagefleet-warmup-"
MAX_STEPS = 64   # a bound, never reached: the requests below finish in about ten steps


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [(11 + salt * 131 + i * 17) % (vocab - 1) + 1 for i in range(n)]


def warm_up(core: "EngineCore") -> float:
    """Run the warm-up requests to completion; returns the seconds it took."""
    t0 = time.perf_counter()
    bs, vocab = core.kv.block_size, core.model_cfg.vocab_size
    # Not block-aligned, and small enough for the context, the step budget and a third
    # of the pool; an engine too small for that (a toy pool) starts without it.
    room = min(core.max_model_len, core.kv.num_blocks * bs // 3)
    n = min(2 * bs + 3, room // 2 - 8, core.config.max_num_batched_tokens // 4)
    if n < 4:
        log.info("warm-up skipped: %d tokens of context or pool are too few", room)
        return 0.0
    greedy = CoreSamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # Qwen2.5-Instruct's generation_config: the sampling most chat requests get.
    penalized = CoreSamplingParams(max_tokens=4, temperature=0.7, top_p=0.8, top_k=20,
                                   repetition_penalty=1.05, ignore_eos=True)
    plain = CoreSamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)   # outlives 1: alone
    first = _prompt(n, 1, vocab)
    # 1. A lone prefill, then its decodes.
    core.add_request(CoreRequest(ID_PREFIX + "0", first, greedy))
    for _ in range(2):
        _step(core)
    # 2. Two prefills joining running decodes (a mixed step): one sampled with
    #    penalties, one extending the first prompt (a prefix-cache hit: prefill over
    #    cached context).
    core.add_request(CoreRequest(ID_PREFIX + "1", _prompt(n + 5, 2, vocab), penalized))
    ext = first[: (n // bs) * bs] + _prompt(max(1, n // 2), 3, vocab)
    core.add_request(CoreRequest(ID_PREFIX + "2", ext, plain))
    for _ in range(MAX_STEPS):
        if not core.has_unfinished_requests():
            break
        _step(core)
    else:
        raise RuntimeError(f"warm-up did not finish in {MAX_STEPS} steps")
    steps = core.num_steps   # launched, before reset_after_warm_up zeroes it
    core.kv.check_whole()
    core.reset_after_warm_up()
    took = time.perf_counter() - t0
    log.info("warm-up: %d steps (prefill, mixed, prefix hit, sampled) in %.2f s", steps, took)
    return took


def _step(core: "EngineCore") -> None:
    out = core.step()
    if out.failed:
        raise RuntimeError(f"warm-up request failed: {out.failed[0]}")
