"""Scheduling under pressure on the real engine (tiny model): preemption, `n > 1`
groups, prompt logprobs of recomputed prompts, short prompts next to a long prefill.
Assertions are on outputs, counts and step order, never on time."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.server import LLM, SamplingParams
from pagefleet.server.config import EngineConfig
from pagefleet.server.engine.async_engine import AsyncEngine
from pagefleet.server.engine.core_process import ServedEngine
from pagefleet.server.engine.engine import LLMEngine
from tests.server.helpers import random_prompts


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen3")


@pytest.fixture(scope="module")
def solo(model):
    """Greedy outputs of requests run alone on a roomy engine."""
    llm = LLM(model, block_size=16, max_model_len=1024)
    cache: dict = {}

    def run(prompt: list[int], params: SamplingParams):
        key = (tuple(prompt), params.max_tokens, params.prompt_logprobs)
        if key not in cache:
            cache[key] = llm.generate([prompt], params)[0]
        return cache[key]
    return run


def run_all(eng: LLMEngine, max_steps: int = 1000) -> tuple[dict, list]:
    """Step until every request finished; (request id -> its last output, the ids
    that got a first token, in step order)."""
    done, first_tokens = {}, []
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.outputs[0].token_ids and o.request_id not in first_tokens:
                first_tokens.append(o.request_id)
            if o.finished:
                done[o.request_id] = o
    return done, first_tokens


def test_a_follower_does_not_wait_for_a_preempted_leader_in_the_other_heap(model, solo):
    """An `n > 1` follower waits for its leader's prompt only while the leader runs.
    Here the leader L is preempted; its recompute (prompt + outputs) is long, so it
    queues in the long heap, while its follower F (same arrival, short prompt) heads the
    short heap. Waiting for L there blocked the whole queue for good."""
    cfg = EngineConfig(model=str(model), max_num_seqs=2, num_kv_blocks=7, block_size=16,
                       short_prompt_tokens=16, max_model_len=112)
    eng = LLMEngine(cfg)
    p = greedy(60)
    x, lead = list(range(5, 15)), list(range(20, 30))
    eng.add_request("X", x, p, arrival_time=1.0)
    eng.add_request("L", lead, p, arrival_time=2.0)
    eng.add_request("F", lead, p, arrival_time=2.0, prefix_leader="L")
    done, _ = run_all(eng)
    assert sorted(done) == ["F", "L", "X"], (
        "stuck: " + str([(r.request_id, r.num_tokens) for r in eng.scheduler.waiting]))
    assert eng.scheduler.num_preemptions > 0
    alone = solo(lead, p).outputs[0].token_ids
    assert done["L"].outputs[0].token_ids == alone == done["F"].outputs[0].token_ids
    assert done["X"].outputs[0].token_ids == solo(x, p).outputs[0].token_ids
    eng.kv.check_whole()


@pytest.mark.parametrize("tokens", [None, 8])   # 8: prompts prefilled in chunks
def test_prompt_logprobs_are_reported_once_whatever_the_preemptions(model, solo, tokens):
    """A preempted request's prompt is computed again; its prompt logprobs were
    already sent and must not be sent again (they doubled, and the API indexed past
    the prompt: a 500)."""
    prompts = [[(7 * i + 3 * j) % 400 + 5 for j in range(20)] for i in range(6)]
    p = greedy(40, prompt_logprobs=1)
    kw = {"max_num_batched_tokens": tokens} if tokens else {}
    llm = LLM(str(model), block_size=16, max_model_len=64, num_kv_blocks=8, max_num_seqs=6, **kw)
    crowd = llm.generate(prompts, p)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, c in zip(prompts, crowd):
        a = solo(prompt, p)
        assert len(c.prompt_logprobs) == len(prompt)
        assert c.outputs[0].token_ids == a.outputs[0].token_ids
        assert c.prompt_logprobs[0] is None
        for got, want in zip(c.prompt_logprobs[1:], a.prompt_logprobs[1:]):
            assert got.keys() == want.keys()
            assert all(got[t] == pytest.approx(want[t], abs=1e-4) for t in got)
    llm.engine.kv.check_whole()


def test_a_short_prompt_does_not_wait_out_a_running_long_prefill(model, solo):
    """A question that arrives once a long document's chunked prefill has started gets
    its first token while the document is still prefilling (it took the whole budget
    each step, so the question waited for all of it); both outputs equal their solo
    runs token for token."""
    cfg = EngineConfig(model=str(model), block_size=16, max_model_len=1024, num_kv_blocks=80,
                       max_num_batched_tokens=64, short_prompt_tokens=32)
    eng = LLMEngine(cfg)
    doc, question = random_prompts(41, [700, 12], 512)
    p = greedy(6)
    eng.add_request("doc", doc, p)
    eng.step()
    d = eng.scheduler.requests["doc"]
    assert 0 < d.num_computed_tokens < d.num_prompt_tokens    # mid-prefill
    eng.add_request("question", question, p)
    first_token_step, step = {}, 0
    while eng.has_unfinished_requests():
        step += 1
        for o in eng.step():
            if o.outputs[0].token_ids:
                first_token_step.setdefault(o.request_id, step)
            if o.finished:
                want = solo(doc if o.request_id == "doc" else question, p)
                assert o.outputs[0].token_ids == want.outputs[0].token_ids
        assert step < 200
    assert first_token_step["question"] < first_token_step["doc"]
    eng.kv.check_whole()


async def until(cond, what: str, limit: float = 120.0) -> None:
    """Poll a condition (a bound against hangs, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not cond():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def run_async(model, jobs, **engine_kw) -> None:
    """`jobs(AsyncEngine)` against a real core process whose 10-block pool 6 requests
    of 110 tokens outgrow: they preempt each other."""
    served = ServedEngine(EngineConfig(model=str(model), block_size=16, max_model_len=128,
                                       num_kv_blocks=10, max_num_seqs=16), model)

    async def main():
        eng = AsyncEngine(served.core, served.ready, served.tokenizer, **engine_kw)
        await eng.start()
        try:
            await jobs(eng)
        finally:
            eng._stopping = True
            eng._loop.remove_reader(served.core.proc.sentinel)
            eng._reader.cancel()
    try:
        asyncio.run(main())
    finally:
        served.core.kill()


def test_preempted_requests_do_not_fill_the_admission_queue(model):
    """--max-num-queued-requests bounds requests accepted and never scheduled
    (docs/server.md). Preempted requests were admitted and resume by themselves; they
    counted too, so new requests got 429s under KV pressure with nothing new queued."""
    async def main(eng):
        # 6 one-block prompts start in the first steps (10 blocks, 16 rows), then
        # outgrow the pool and preempt each other: none of them is queued anew.
        streams = [eng.add(f"r{i}", [5 + i] * 10, greedy(100)) for i in range(3)]
        await until(lambda: all(s.scheduled_time for s in streams), "r0-r2 scheduled")
        streams += [eng.add(f"r{i}", [5 + i] * 10, greedy(100)) for i in range(3, 6)]
        await until(lambda: all(s.scheduled_time for s in streams), "r3-r5 scheduled")
        await until(lambda: eng.num_waiting >= 3, "preemptions")
        assert eng.num_unscheduled == 0
        eng.check_admission(3)          # raised QueueFullError: "5 requests waiting"
        # The limit still holds for new requests, free rows or not: the core has a
        # backlog (preempted requests), so nothing it is sent is taken at once.
        assert eng.stats.num_waiting > 0 and eng.num_running < 16
        probes = [eng.add(f"p{i}", [300 + i], greedy(1)) for i in range(3)]
        with pytest.raises(Exception, match="queue is full"):
            eng.check_admission(1)
        done = streams + probes
        await until(lambda: all(s.finished for s in done), "all finished", 300)
        assert all(s.error is None for s in done)
        assert eng.num_unscheduled == eng.num_waiting == eng.num_running == 0
    run_async(model, main, max_num_queued_requests=3)


def test_a_burst_that_fits_the_free_rows_is_not_queued(model):
    """Requests that arrive together at an idle server wait in the core's queue only
    until the next step: they are not queued for capacity. 16 free rows, but 10 KV
    blocks: ten one-block prompts fit, so with a cap of 3, 13 at once are admitted (the
    4th was a 429) and the 14th is refused (with the rows alone as credit, 19 were)."""
    async def main(eng):
        streams = []
        for i in range(10 + 3):
            eng.check_admission(1, 1)
            streams.append(eng.add(f"b{i}", [5 + i], greedy(2)))
        assert eng.num_queued == 3
        with pytest.raises(Exception, match="queue is full"):
            eng.check_admission(1)
        await until(lambda: all(s.finished for s in streams), "all finished", 300)
        assert all(s.error is None for s in streams)
        assert eng.num_queued == eng.num_unscheduled == 0
    run_async(model, main, max_num_queued_requests=3)


def test_gauges_follow_preempted_requests_back_to_running(model):
    """The waiting/running gauges (vllm:num_requests_waiting/running) equal the core's
    counts whenever the API side looks. The core did not report a preempted request
    scheduled again, so it counted as waiting until it finished: 0 running, 3 waiting
    while the core ran 3."""
    async def main(eng):
        streams = [eng.add(f"g{i}", [5 + i] * 10, greedy(100)) for i in range(6)]
        await until(lambda: all(s.scheduled_time for s in streams), "all scheduled")
        seen = []
        while not all(s.finished for s in streams):
            st = eng.stats
            seen.append(((eng.num_running, eng.num_waiting), (st.num_running, st.num_waiting)))
            await asyncio.sleep(0.002)
        assert any(waiting for _, (_, waiting) in seen)      # preempted ones were seen
        assert [api for api, _ in seen] == [core for _, core in seen]
    run_async(model, main)
