"""Scheduler decisions, driven without a model: budgets, policies, preemption."""

from __future__ import annotations

import random

from pagefleet.server.engine.kv_cache import KVCacheManager
from pagefleet.server.engine.protocol import CoreSamplingParams
from pagefleet.server.engine.request import Request, Status
from pagefleet.server.engine.request_queue import WaitQueue
from pagefleet.server.engine.scheduler import Scheduler


def make(num_blocks=64, block_size=4, seqs=4, tokens=16, chunked=True, policy="fcfs",
         caching=False, short=0, overtake_s=0.0) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                     enable_chunked_prefill=chunked, policy=policy,
                     short_prompt_tokens=short, short_overtake_s=overtake_s)


def req(rid: str, n: int, priority: int = 0, t: float = 0.0, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), CoreSamplingParams(max_tokens=max_tokens),
                   priority=priority, arrival_time=t)


def fake_step(s: Scheduler, finish_after: int | None = None):
    """Run one synchronous step as the engine would: schedule, advance, append a token
    to the rows that sample."""
    out = s.schedule()
    samplers = [x.request for x in out.scheduled if x.samples]
    s.advance(out, pending=False)
    for r in samplers:
        r.all_token_ids.append(7)
        if r.num_output_tokens >= (finish_after or r.params.max_tokens):
            s.finish(r, "length")
    out.sampled = [r.request_id for r in samplers]
    return out


def test_every_step_respects_both_budgets_and_pool_returns_whole():
    rng = random.Random(0)
    s = make(num_blocks=40, seqs=3, tokens=10)
    for i in range(12):
        s.add(req(f"r{i}", rng.randint(1, 30), t=i, max_tokens=rng.randint(1, 6)))
    steps = 0
    while s.has_unfinished():
        out = fake_step(s)
        assert out.num_batched_tokens <= 10
        assert len(out.scheduled) <= 3 and len(s.running) <= 3
        steps += 1
        assert steps < 500
    s.kv.check_whole()


def test_decodes_go_before_prefill_chunks():
    s = make(tokens=8, seqs=4)
    s.add(req("a", 3, t=0))
    fake_step(s)              # a prefilled, has 1 token to decode next
    s.add(req("b", 40, t=1))  # long prompt: chunked
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert [x.num_new_tokens for x in out.scheduled] == [1, 7]


def test_without_chunked_prefill_a_prompt_is_scheduled_whole_or_not_at_all():
    s = make(tokens=16, chunked=False)
    s.add(req("a", 10, t=0))
    s.add(req("b", 10, t=1))
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10)]


def test_fcfs_and_priority_orders():
    s = make(seqs=1, tokens=64, policy="priority")
    s.add(req("late-urgent", 4, priority=-1, t=3))
    s.add(req("early", 4, priority=0, t=1))
    s.add(req("earlier-low", 4, priority=5, t=0))
    s.add(req("early-2", 4, priority=0, t=2))
    order = []
    while s.has_unfinished():
        out = fake_step(s, finish_after=1)
        order += out.sampled
    assert order == ["late-urgent", "early", "early-2", "earlier-low"]

    f = make(seqs=1, tokens=64, policy="fcfs")
    for rid, prio, t in [("c", -1, 3), ("a", 9, 1), ("b", 0, 2)]:
        f.add(req(rid, 4, priority=prio, t=t))
    order = []
    while f.has_unfinished():
        out = fake_step(f, finish_after=1)
        order += out.sampled
    assert order == ["a", "b", "c"]


def test_preemption_picks_the_policy_last_and_requeues_it_first():
    # 4 blocks of 4 tokens; two requests of 7 tokens each take 2 blocks, then both
    # need a third block to decode: the later one is preempted.
    s = make(num_blocks=4, block_size=4, seqs=4, tokens=64)
    s.add(req("old", 7, t=0, max_tokens=6))
    s.add(req("new", 7, t=1, max_tokens=6))
    fake_step(s)          # both prefilled (7 tokens each, 2 blocks each)
    fake_step(s)          # each decodes its 8th token into its 2nd block
    out = fake_step(s)    # 9th token needs a 3rd block: "new" is preempted
    assert [r.request_id for r in out.preempted] == ["new"]
    assert s.num_preemptions == 1
    head = s.waiting.peek()
    assert head.request_id == "new" and head.num_computed_tokens == 0
    while s.has_unfinished():
        fake_step(s)
    s.kv.check_whole()


def test_priority_preempts_lowest_priority_even_if_older():
    s = make(num_blocks=4, block_size=4, seqs=4, tokens=64, policy="priority")
    s.add(req("low-old", 7, priority=9, t=0))
    s.add(req("high-new", 7, priority=0, t=1))
    fake_step(s)
    fake_step(s)
    out = fake_step(s)
    assert [r.request_id for r in out.preempted] == ["low-old"]


def test_waiting_requests_wait_while_preempting():
    s = make(num_blocks=4, block_size=4, seqs=4, tokens=64)
    s.add(req("a", 7, t=0))
    s.add(req("b", 7, t=1))
    fake_step(s)
    fake_step(s)
    s.add(req("c", 1, t=2))
    out = fake_step(s)
    assert out.preempted and "c" not in [x.request.request_id for x in out.scheduled]


def test_pipelined_steps_plan_from_pending_tokens():
    """Async scheduling: a request the in-flight step samples is scheduled again as a
    pending decode; one whose pending token is its last is not."""
    s = make(tokens=64, seqs=4)
    s.add(req("a", 5, max_tokens=3))
    s.add(req("b", 5, max_tokens=1))
    first = s.schedule()
    s.advance(first, pending=False)
    for x in first.scheduled:          # launched: both sample, tokens not read back yet
        x.request.num_pending += 1
    nxt = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.pending) for x in nxt.scheduled] == \
        [("a", 1, True)]               # b's pending token is its only one
    assert nxt.num_decodes == 1
    for x in first.scheduled:          # first step read back: tokens known now
        x.request.num_pending -= 1
        x.request.all_token_ids.append(9)
    s.advance(nxt, pending=True)
    a = s.requests["a"]
    assert a.num_computed_tokens == 6 and a.num_tokens == 6


def test_preempted_request_with_pending_token_waits_until_it_is_known():
    s = make(num_blocks=4, block_size=4, seqs=4, tokens=64)
    s.add(req("old", 7, t=0, max_tokens=6))
    s.add(req("new", 7, t=1, max_tokens=6))
    fake_step(s)
    fake_step(s)
    for r in list(s.running.values()):
        r.num_pending = 1                # both have a token in flight
    out = s.schedule()                   # the 9th token needs a 3rd block
    assert [r.request_id for r in out.preempted] == ["new"]
    new = s.requests["new"]
    assert new.status is Status.WAITING and s.waiting.peek() is new
    s.kv.free_request("old")             # room now, but new's token is not known yet
    assert "new" not in [x.request.request_id for x in s.schedule().scheduled]


def test_wait_queue_orders_and_lazy_removal():
    q = WaitQueue("fcfs")
    a, b, c = req("a", 1, t=0), req("b", 1, t=1), req("c", 1, t=2)
    for r in (c, a, b):
        q.add(r)
    q.remove(b)
    assert len(q) == 2 and q.pop() is a
    q.add(a)                             # preempted: back ahead of later arrivals
    assert q.peek() is a and sorted(r.request_id for r in q) == ["a", "c"]
    q.remove(a)
    q.add(a)                             # re-queued: its stale entries are skipped
    assert [q.pop().request_id for _ in range(len(q))] == ["a", "c"]
    p = WaitQueue("priority")
    for r, prio in ((a, 5), (b, 0), (c, 0)):
        r.priority = prio
        p.add(r)
    p.remove(b)
    assert [p.pop().request_id for _ in range(len(p))] == ["c", "a"]


def _first_step(s: Scheduler) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_new_tokens) for x in s.schedule().scheduled]


def test_short_prompt_goes_ahead_of_a_long_one_queued_just_before_it():
    """The mixed workload's pit: a question queued behind a document waits out the
    document's prefill. With the short lane it takes its tokens from the step first and
    the document is chunked with the rest; in strict order it waits a step."""
    strict = make(num_blocks=128, tokens=64, short=0)
    lanes = make(num_blocks=128, tokens=64, short=16, overtake_s=2.0)
    for s in (strict, lanes):
        s.add(req("doc", 200, t=0.0))
        s.add(req("question", 10, t=0.5))
    assert _first_step(strict) == [("doc", 64)]
    assert _first_step(lanes) == [("question", 10), ("doc", 54)]


def test_a_long_prompt_is_not_passed_over_for_longer_than_the_window():
    s = make(num_blocks=128, tokens=64, short=16, overtake_s=2.0)
    s.add(req("doc", 200, t=0.0))
    s.add(req("late-question", 10, t=2.5))    # the document has waited 2.5 s longer
    assert _first_step(s) == [("doc", 64)]
    q = WaitQueue("fcfs", short_tokens=16, overtake_s=2.0)
    doc, a, b = req("doc", 200, t=0.0), req("a", 10, t=1.0), req("b", 10, t=3.0)
    for r in (b, doc, a):
        q.add(r)
    assert [q.pop().request_id for _ in range(3)] == ["a", "doc", "b"]


def test_short_lane_keeps_priorities_and_lazy_removal():
    q = WaitQueue("priority", short_tokens=16, overtake_s=2.0)
    urgent_doc, question = req("urgent-doc", 200, priority=0, t=0.0), req("q", 10, priority=5, t=0.1)
    q.add(question)
    q.add(urgent_doc)
    assert q.peek() is urgent_doc            # a worse priority never overtakes
    q.remove(urgent_doc)
    assert len(q) == 1 and q.pop() is question and not q
    q.add(urgent_doc)
    short_urgent = req("short-urgent", 4, priority=0, t=1.0)
    q.add(short_urgent)
    assert q.pop() is short_urgent and q.pop() is urgent_doc



def _running_doc(n: int = 400, **kw) -> Scheduler:
    """A long document admitted and one chunk into its prefill (so it is RUNNING)."""
    s = make(num_blocks=256, tokens=64, short=16, overtake_s=2.0, **kw)
    s.add(req("doc", n, t=0.0))
    out = fake_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("doc", 64)]
    return s


def test_a_running_long_prefill_leaves_room_for_a_short_prompt_that_arrives():
    """The mixed workload's pit once the document is admitted: its chunks took the whole
    budget every step, so a question that arrived after it waited out the whole
    prefill. Now the chunk leaves the question its tokens (the document still gets the
    rest); with the short lane off the order is plain fcfs."""
    s = _running_doc()
    s.add(req("question", 10, t=0.5))
    assert _first_step(s) == [("doc", 54), ("question", 10)]
    strict = make(num_blocks=256, tokens=64, short=0)
    strict.add(req("doc", 400, t=0.0))
    fake_step(strict)
    strict.add(req("question", 10, t=0.5))
    assert _first_step(strict) == [("doc", 64)]


def test_a_running_long_prefill_keeps_half_the_budget_however_many_short_prompts_come():
    s = _running_doc(800, seqs=32)
    doc = s.requests["doc"]
    admitted, i = set(), 0
    while doc.num_computed_tokens < doc.num_prompt_tokens:   # a new question every step
        s.add(req(f"q{i}", 16, t=1.0 + i))
        i += 1
        before = doc.num_computed_tokens
        out = fake_step(s)
        got = doc.num_computed_tokens - before
        assert got >= 32 or doc.num_computed_tokens == doc.num_prompt_tokens
        admitted |= {x.request.request_id for x in out.scheduled} - {"doc"}
    assert len(admitted) == i    # and each question was admitted the step it came


def test_a_worse_priority_short_prompt_takes_no_room_from_a_running_prefill():
    s = make(num_blocks=256, tokens=64, short=16, overtake_s=2.0, policy="priority")
    s.add(req("doc", 400, priority=0, t=0.0))
    fake_step(s)
    s.add(req("low", 10, priority=5, t=0.5))
    assert _first_step(s) == [("doc", 64)]
    s.add(req("urgent", 10, priority=0, t=0.6))
    assert _first_step(s) == [("doc", 54), ("urgent", 10)]
