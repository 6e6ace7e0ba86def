"""Routing decisions, as pure functions over snapshots (tested without the network).

Two steps per request:

1. **Pool.** `fitting_class` keeps the pools whose context holds the prompt plus
   `max_tokens` (vLLM's rule) and picks the smallest such context, so short requests
   never queue behind long documents; `SmoothWeighted` splits the class's traffic by
   the pools' rollout weights (nginx's smooth weighted round robin: an exact split,
   evenly interleaved).
2. **Replica.** `route` picks one endpoint of the pool:
   - *prefix*: the replica holding the longest cached prefix of the prompt (at least
     the ring key's blocks), unless its load (ours in flight there + others'), would exceed the
     bound `ceil((1 + eps) * (total + 1) / n)` (consistent hashing with bounded loads),
     or its KV cache is saturated; then the next-longest holder within the bound;
   - *ring*: otherwise walk the consistent-hash ring from the key of the prompt's first
     blocks and take the first replica within the bound whose share of prefix groups
     stays at most `ceil((G + 1) / n)`, so a new prefix sticks to one replica and the
     prefixes spread evenly over the replicas' caches;
   - *least load* when the prompt has no full block to look up, and *spill* (least
     load) when every replica is past the bound.
   Only replicas with room (healthy, below their in-flight cap) are picked; the average
   is over every healthy replica of the pool.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


# -- step 1: pools ------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolFit:
    name: str
    max_model_len: int | None       # None: not known yet; treated as the largest
    weight: float
    prompt_len: int                 # with this pool's tokenizer


def fits(prompt_len: int, max_tokens: int | None, max_model_len: int | None) -> bool:
    """vLLM's context rule: the prompt leaves room for at least one token, and for
    max_tokens when it is set."""
    if max_model_len is None:
        return True
    return prompt_len < max_model_len and (max_tokens is None
                                           or prompt_len + max_tokens <= max_model_len)


def fitting_class(pools: Sequence[PoolFit], max_tokens: int | None) -> list[PoolFit]:
    """The pools of the smallest context that fits; empty when none does. Pools with
    weight 0 (a drained canary) take no traffic and are left out."""
    ok = [p for p in pools if p.weight > 0 and fits(p.prompt_len, max_tokens, p.max_model_len)]
    if not ok:
        return []
    size = min(math.inf if p.max_model_len is None else p.max_model_len for p in ok)
    return [p for p in ok if (math.inf if p.max_model_len is None else p.max_model_len) == size]


def context_error(pools: Sequence[PoolFit], max_tokens: int | None) -> str:
    """The server's 400 message for a request no pool can hold, against the largest
    context the model offers."""
    known = [p for p in pools if p.max_model_len is not None] or list(pools)
    big = max(known, key=lambda p: p.max_model_len or 0)
    completion = max_tokens or 0
    return (f"This model's maximum context length is {big.max_model_len} tokens. However, "
            f"you requested {big.prompt_len + completion} tokens ({big.prompt_len} in the "
            f"messages, {completion} in the completion). Please reduce the length of the "
            "messages or completion.")


class SmoothWeighted:
    """nginx's smooth weighted round robin: over any window the split follows the
    weights within one request, with picks interleaved rather than bunched."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def pick(self, weights: dict[str, float]) -> str:
        total = sum(weights.values())
        best = None
        for name in sorted(weights):
            self.current[name] = self.current.get(name, 0.0) + weights[name]
            if best is None or self.current[name] > self.current[best]:
                best = name
        assert best is not None, "pick() needs at least one pool"
        self.current[best] -= total
        return best


# -- step 2: replicas -----------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One healthy replica of the pool, as routing sees it now."""

    name: str
    inflight: int           # the gateway's own requests in flight there
    waiting: float = 0.0    # requests there that this gateway did not send (EndpointState.others)
    kv_usage: float = 0.0   # scraped vllm:kv_cache_usage_perc
    has_room: bool = True   # below its in-flight cap (and not excluded for this request)
    match: int = 0          # leading lookup blocks of this prompt it holds
    groups: int = 0         # prefix groups (ring keys) it holds

    @property
    def load(self) -> float:
        return self.inflight + self.waiting


@dataclass(frozen=True)
class RouteSettings:
    mode: str = "prefix"             # prefix | least-load | round-robin
    epsilon: float = 0.25
    kv_saturation: float = 0.9


@dataclass(frozen=True)
class Decision:
    endpoint: str
    reason: str                      # prefix | ring | least_load | spill | round_robin
    matched: int = 0                 # blocks expected to hit


def load_bound(cands: Sequence[Candidate], epsilon: float) -> int:
    """Most load a replica may carry after taking one more request:
    ceil((1 + eps) * (total + 1) / n) over the pool's healthy replicas."""
    total = sum(c.load for c in cands)
    return math.ceil((1.0 + epsilon) * (total + 1) / len(cands) - 1e-9)


def _rotation(cands: Sequence[Candidate], tiebreak: int) -> dict[str, int]:
    n = len(cands)
    return {c.name: (i - tiebreak) % n for i, c in enumerate(sorted(cands, key=lambda c: c.name))}


def least_loaded(cands: Sequence[Candidate], tiebreak: int) -> Candidate | None:
    rot = _rotation(cands, tiebreak)
    room = [c for c in cands if c.has_room]
    if not room:
        return None
    return min(room, key=lambda c: (c.load, c.kv_usage, rot[c.name]))


def route(cands: Sequence[Candidate], *, root_len: int | None, ring_order: Sequence[str],
          settings: RouteSettings, tiebreak: int = 0) -> Decision | None:
    """Pick a replica, or None when none has room (the request then waits).

    `root_len` is the ring key's length in blocks (None: the prompt has no full block
    to look up); `ring_order` the pool's replicas in ring order from that key.
    """
    room = [c for c in cands if c.has_room]
    if not room:
        return None
    if settings.mode == "round-robin":
        ordered = sorted(room, key=lambda c: c.name)
        return Decision(ordered[tiebreak % len(ordered)].name, "round_robin")
    if settings.mode == "least-load" or root_len is None:
        best = least_loaded(cands, tiebreak)
        return Decision(best.name, "least_load", best.match) if best else None

    bound = load_bound(cands, settings.epsilon)
    rot = _rotation(cands, tiebreak)

    def within(c: Candidate) -> bool:
        return c.has_room and c.load + 1 <= bound and c.kv_usage < settings.kv_saturation

    holders = [c for c in room if c.match >= root_len and within(c)]
    if holders:
        best = min(holders, key=lambda c: (-c.match, c.load, c.kv_usage, rot[c.name]))
        return Decision(best.name, "prefix", best.match)

    by_name = {c.name: c for c in cands}
    groups_cap = math.ceil((sum(c.groups for c in cands) + 1) / len(cands) - 1e-9)
    walk = [by_name[n] for n in ring_order if n in by_name]
    for balanced in (True, False):
        for c in walk:
            if within(c) and (not balanced or c.groups + 1 <= groups_cap):
                return Decision(c.name, "ring", c.match)
    best = least_loaded(cands, tiebreak)
    return Decision(best.name, "spill", best.match) if best else None
