"""Continuous batching under a token budget and a sequence budget.

Each step: running requests first (decodes, then continuing prefill chunks), then
waiting requests in policy order while both budgets and the KV pool allow. A prompt
longer than the remaining token budget is chunked when chunked prefill is on. When a
running request needs a block and none is free, the request the policy ranks last is
preempted: its blocks are freed and it goes back to the waiting queue to be
recomputed later (prefix caching usually gives most of its blocks back).

The scheduler only decides and keeps the books; it runs no model.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from pagefleet.server.engine.kv_cache import KVCacheManager
from pagefleet.server.engine.request import Request, Status


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step completes the request's known tokens, so it yields a token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, policy: str = "fcfs") -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.waiting: list[Request] = []          # sorted by policy
        self.running: list[Request] = []          # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue -----------------------------------------------------------------------
    def _key(self, req: Request) -> tuple:
        return req.sort_key(self.policy)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Take a request out of the queues and return its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.kv.free_request(req.request_id)
        self.requests.pop(req.request_id, None)

    # -- decisions -------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free_request(req.request_id)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=self._key)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        chosen: dict[str, ScheduledRequest] = {}

        # Running requests: decodes first, then prefill chunks, each in admission order.
        decodes, chunks = [], []
        for req in self.running:
            (decodes if req.num_tokens - req.num_computed_tokens <= 1 else chunks).append(req)
        for req in decodes + chunks:
            if req.status is not Status.RUNNING:
                continue   # preempted earlier in this step
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = max(self.running, key=self._key)
                self._preempt(victim)
                out.preempted.append(victim)
                undone = chosen.pop(victim.request_id, None)
                if undone is not None:
                    budget += undone.num_new_tokens
                if victim is req:
                    break
            else:
                chosen[req.request_id] = ScheduledRequest(req, num_new)
                budget -= num_new

        # Waiting requests, unless this step had to preempt (the pool is short).
        while self.waiting and not out.preempted and budget > 0 \
                and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit_tokens = ([], 0)
            if req.num_computed_tokens == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(req, num_new, hits):
                break
            self.kv.record_lookup(req.num_tokens, num_hit_tokens)
            self.waiting.pop(0)
            req.num_computed_tokens = num_hit_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.time()
            req.status = Status.RUNNING
            self.running.append(req)
            chosen[req.request_id] = ScheduledRequest(req, num_new)
            budget -= num_new

        out.scheduled = list(chosen.values())
        return out

    def advance(self, out: SchedulerOutput) -> None:
        """After the step ran: count the computed tokens and publish full blocks."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_computed_blocks(s.request)
