"""Scheduler decisions, driven without a model: budgets, policies, preemption."""

from __future__ import annotations

import random

from pagefleet.server.engine.kv_cache import KVCacheManager
from pagefleet.server.engine.request import Request
from pagefleet.server.engine.sampling_params import SamplingParams
from pagefleet.server.engine.scheduler import Scheduler


def make(num_blocks=64, block_size=4, seqs=4, tokens=16, chunked=True, policy="fcfs",
         caching=False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                     enable_chunked_prefill=chunked, policy=policy)


def req(rid: str, n: int, priority: int = 0, t: float = 0.0, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens),
                   priority=priority, arrival_time=t)


def fake_step(s: Scheduler, finish_after: int | None = None):
    """Run one step as the engine would: schedule, advance, append a token to samplers."""
    out = s.schedule()
    samplers = [x.request for x in out.scheduled if x.samples]
    s.advance(out)
    for r in samplers:
        r.append_token(7)
        if len(r.output_token_ids) >= (finish_after or r.params.max_tokens):
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
    assert s.waiting[0].request_id == "new" and s.waiting[0].num_computed_tokens == 0
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
