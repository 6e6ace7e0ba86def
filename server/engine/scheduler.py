"""Continuous batching under a token budget and a sequence budget.

Each step: running requests first (decodes, then continuing prefill chunks), then
waiting requests in policy order (short prompts may go ahead of long ones queued just
before them, see request_queue.py) while both budgets and the KV pool allow. A prompt
longer than the remaining token budget is chunked when chunked prefill is on. While a
short prompt heads the queue, the continuing chunks leave it room (up to half the
budget), so it does not wait out a long prefill that started before it. When a
running request needs a block and none is free, the request the policy ranks last is
preempted: its blocks are freed and it goes back to the waiting queue to be
recomputed later (prefix caching usually gives most of its blocks back).

With async scheduling the next step is scheduled while the previous one is still on
the device: a request the previous step samples counts its pending token
(`Request.num_pending`), so its next decode is planned now and its input id is read
on the device. A request whose pending token is surely its last (max_tokens, the
context limit) is not scheduled again.

The scheduler only decides and keeps the books; it runs no model. Every operation is
O(1) or O(log n) in the queue length; a step costs O(running requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagefleet.server.engine.kv_cache import KVCacheManager
from pagefleet.server.engine.request import Request, Status
from pagefleet.server.engine.request_queue import WaitQueue


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Whether this step completes the request's known + pending tokens, so it yields
    # a token; and whether its input is the token the previous step is still sampling.
    samples: bool = False
    pending: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    first_scheduled: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)   # back after a preemption
    num_decodes: int = 0          # the first `num_decodes` rows are one-token decodes

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, policy: str = "fcfs",
                 max_model_len: int = 1 << 62, long_prefill_token_threshold: int = 0,
                 short_prompt_tokens: int = 0, short_overtake_s: float = 0.0) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = policy
        self.waiting = WaitQueue(policy, short_prompt_tokens, short_overtake_s)
        self.running: dict[str, Request] = {}     # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue -----------------------------------------------------------------------
    def _key(self, req: Request) -> tuple:
        return req.sort_key(self.policy)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, stop_reason: int | None = None) -> None:
        """Take a request out of the queues and return its blocks."""
        if req.status is Status.RUNNING:
            del self.running[req.request_id]
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.kv.free_request(req.request_id)
        self.requests.pop(req.request_id, None)

    # -- decisions -------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        del self.running[req.request_id]
        self.kv.free_request(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req)   # keeps its key: ahead of later arrivals

    def _chunk(self, num_new: int, budget: int) -> int:
        cap = self.long_prefill_token_threshold
        if cap and num_new > cap:
            num_new = cap
        return min(num_new, budget)

    def _leader_prefilling(self, req: Request) -> bool:
        """An `n > 1` follower waits while its leader's prompt is being computed, so the
        prompt is computed once and shared through the prefix cache. Only while the
        leader is RUNNING: a waiting leader (preempted, or queued in the other heap of
        the short/long queue, since its recompute counts its output tokens too) may sit
        behind the follower, which blocks the queue as its head, so waiting for it
        would never end. Then the follower goes without sharing; the leader gets the
        follower's prompt blocks from the cache instead."""
        leader = self.requests.get(req.prefix_leader) if req.prefix_leader else None
        return (leader is not None and leader.status is Status.RUNNING
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def _short_reserve(self, budget: int) -> tuple[int, Request | None]:
        """(tokens, head): what the running prefill chunks leave over this step for a
        short prompt at the head of the waiting queue: its tokens to compute, at most
        half the budget left after the decodes. Without it a prompt chunked over many
        steps took the whole budget each step, and a question that arrived once a long
        document was admitted waited out the document's whole prefill: the short heap
        only helped while both were queued. The running chunks keep at least half the
        budget, so a long prefill still progresses every step however many short
        prompts come. Nothing is set aside for a long head (plain policy order), a head
        that cannot be admitted this step (no row, its tokens not known, its leader
        prefilling, too few free blocks), or with chunked prefill off. O(log n): a peek
        at the queue's head."""
        if (not self.enable_chunked_prefill or not self.waiting
                or len(self.running) >= self.max_num_seqs):
            return 0, None
        head = self.waiting.peek()
        need = head.num_tokens - head.num_computed_tokens
        if need > self.waiting.short_tokens or head.num_pending or self._leader_prefilling(head):
            return 0, None
        reserve = min(need, budget // 2)
        if self.kv.blocks_needed(reserve) > self.kv.num_free_blocks:
            return 0, None   # the pool cannot take it now: the budget would go unused
        return reserve, head

    def room_for_arrivals(self) -> bool:
        """Whether a request arriving now would join the next step: nothing waits ahead
        of it and the running requests' next tokens leave budget and a row over. It
        walks the running requests, so the core asks only after a long step."""
        if self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        need, budget = 0, self.max_num_batched_tokens
        for req in self.running.values():
            need += max(1, self._chunk(req.num_tokens - req.num_computed_tokens, budget))
            if need >= budget:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        max_len = self.max_model_len
        kv = self.kv

        # Running requests: decodes first, then prefill chunks, each in admission order.
        decodes: list[ScheduledRequest] = []
        needy: list[Request] = []      # decodes that need a new block (may preempt)
        chunks: list[Request] = []
        for req in self.running.values():
            left = req.num_tokens - req.num_computed_tokens
            if left == 1:
                if req.num_pending and req.will_finish_on_length(max_len):
                    continue   # its last token is in flight
                if budget <= 0:
                    continue   # more decodes than the token budget: the rest wait
                if not kv.allocate_slots(req, 1):
                    needy.append(req)    # the pool is short: handled with preemption below
                    continue
                decodes.append(ScheduledRequest(
                    req, 1, True, req.num_pending > 0
                    and req.num_computed_tokens == len(req.all_token_ids)))
                budget -= 1
            elif left > 1:
                chunks.append(req)
        rest: list[ScheduledRequest] = []
        reserve, head = self._short_reserve(budget) if chunks else (0, None)
        for req in needy + chunks if needy else chunks:
            if req.status is not Status.RUNNING:
                continue   # preempted earlier in this step
            left = req.num_tokens - req.num_computed_tokens
            if left == 1:
                num_new = 1
            elif reserve and (self.policy != "priority" or head.priority <= req.priority):
                num_new = self._chunk(left, budget - reserve)   # room for the short head
            else:
                num_new = self._chunk(left, budget)
            if num_new <= 0 or num_new > budget:
                continue
            while not kv.allocate_slots(req, num_new):
                victim = max(self.running.values(), key=self._key)
                self._preempt(victim)
                out.preempted.append(victim)
                for group in (decodes, rest):
                    for i, s in enumerate(group):
                        if s.request is victim:
                            budget += s.num_new_tokens
                            del group[i]
                            break
                if victim is req:
                    break
            else:
                pending = req.num_pending > 0 and req.num_computed_tokens == len(req.all_token_ids)
                sr = ScheduledRequest(req, num_new, num_new == left, pending)
                (decodes if num_new == 1 and num_new == left else rest).append(sr)
                budget -= num_new

        # Waiting requests, unless this step had to preempt (the pool is short). The
        # head blocks the queue when it does not fit (no overtaking).
        while self.waiting and not out.preempted and budget > 0 \
                and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            if req.num_pending or self._leader_prefilling(req):
                break   # its tokens are not all known yet: next step
            hits, num_hit_tokens = ([], 0)
            if req.num_computed_tokens == 0 and (req.params.prompt_logprobs is None or
                                                 req.prompt_logprobs_next >= req.num_prompt_tokens):
                # (prompt logprobs need every prompt position computed: no cache hits
                # until all were reported, e.g. before a recompute after preemption)
                hits, num_hit_tokens = kv.get_computed_blocks(req)
            left = req.num_tokens - num_hit_tokens
            if left > budget and not self.enable_chunked_prefill:
                break
            num_new = self._chunk(left, budget)
            if not kv.allocate_slots(req, num_new, hits):
                break
            kv.record_lookup(req.num_tokens, num_hit_tokens)
            self.waiting.pop()
            req.num_computed_tokens = num_hit_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens
            if not req.ever_scheduled:
                req.ever_scheduled = True
                out.first_scheduled.append(req)
            else:
                out.resumed.append(req)
            req.status = Status.RUNNING
            self.running[req.request_id] = req
            sr = ScheduledRequest(req, num_new, num_new == left)
            (decodes if num_new == 1 and num_new == left else rest).append(sr)
            budget -= num_new

        # Decode rows first: the runner runs them through the decode kernel.
        out.scheduled = decodes + rest if rest else decodes
        out.num_decodes = len(decodes)
        return out

    def advance(self, out: SchedulerOutput, pending: bool) -> None:
        """Count a step's input tokens as computed and publish the blocks they fill.

        Rows whose input is known run at launch (`pending=False`); rows whose input is
        the previous step's token wait until that token is read back (`pending=True`),
        because a block's hash needs its token ids. The device runs the step before
        anything that reads those blocks, so publishing at launch is safe."""
        for s in out.scheduled:
            if s.pending != pending:
                continue
            r = s.request
            if r.status is Status.RUNNING:
                r.num_computed_tokens += s.num_new_tokens
                self.kv.cache_computed_blocks(r)
