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
    # The input is the token the previous step is still sampling (async scheduling):
    # the runner reads it from the device, and the step always samples.
    pending: bool = False

    @property
    def samples(self) -> bool:
        """Whether this step completes the request's known tokens, so it yields a token."""
        r = self.request
        return self.pending or r.num_computed_tokens + self.num_new_tokens == r.num_tokens


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
                 enable_chunked_prefill: bool, policy: str = "fcfs",
                 max_model_len: int = 1 << 62) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
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

    def schedule_continuation(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling: the next step for a pure-decode step still in flight.

        Each request of `prev` decodes once more from the token `prev` is sampling,
        before the host knows it. Only when that is surely what `schedule()` would do
        after `prev`: nobody waiting could be admitted, and every request has room in
        the pool without preempting. Requests that `prev` surely finishes (max_tokens,
        max_model_len) are left out; those that stop on a token or string are found
        out while this step runs, and its token for them is dropped.
        `prev` must be a pure-decode step (every request one token, every one sampling).
        Returns None when the engine should finish `prev` first and schedule afresh.
        """
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None
        out = SchedulerOutput()
        for s in prev.scheduled:
            r = s.request
            if r.status is not Status.RUNNING:
                continue
            n_out = len(r.output_token_ids) + 1          # with the token in flight
            if n_out >= r.max_tokens or r.num_tokens + 1 >= self.max_model_len:
                if self.waiting:
                    return None   # a seat frees up: admit from the queue instead
                continue
            if not self.kv.allocate_slots(r, 1):
                return None
            out.scheduled.append(ScheduledRequest(r, 1, pending=True))
        return out if out.scheduled else None

    def advance(self, out: SchedulerOutput) -> None:
        """Once a step's input tokens are all known: count them as computed and publish
        the blocks they fill (the device runs them before anything that reads them)."""
        for s in out.scheduled:
            r = s.request
            if r.status is Status.RUNNING:
                r.num_computed_tokens += s.num_new_tokens
                self.kv.cache_computed_blocks(r)
