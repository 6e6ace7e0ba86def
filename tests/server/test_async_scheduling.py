"""Async scheduling (the next decode queued before this step's tokens are read back)
changes nothing a client sees: same tokens, texts, finish reasons, logprobs."""

from __future__ import annotations

import pytest

from pagefleet.server import LLM, SamplingParams
from tests.server.helpers import random_prompts


def workload(llm_for_text: LLM):
    prompts = random_prompts(21, [5, 40, 90, 17, 3, 64, 128, 33, 70, 12], 512)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40),                          # may stop on EOS
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=35, ignore_eos=True,
                       repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=38, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ]
    # Stop conditions only known once a token is read back: a stop string and a stop
    # token taken from the synchronous run's own outputs.
    return prompts, params


def run(model_dir, async_scheduling: bool, prompts, params, **kw):
    kw = {"max_model_len": 256, "max_num_seqs": 4, **kw}
    llm = LLM(model_dir, async_scheduling=async_scheduling, **kw)
    outs = llm.generate(prompts, params)
    llm.engine.kv.check_whole()
    return llm, [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                  o.outputs[0].stop_reason, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("extra", [{}, {"num_kv_blocks": 12, "max_model_len": 176}])
def test_async_equals_sync(tiny_models, extra):
    model_dir = tiny_models("qwen3")
    prompts, params = workload(None)
    _, sync = run(model_dir, False, prompts, params, **extra)
    # Stop on a string and on a token that the sync run shows appear mid-output.
    text, ids = sync[0][1], sync[0][0]
    params[8] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=text[12:15])
    params[9] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[ids[9]])
    prompts[8] = prompts[9] = prompts[0]
    llm_sync, sync = run(model_dir, False, prompts, params, **extra)
    llm_async, asyn = run(model_dir, True, prompts, params, **extra)
    assert [o[:4] for o in asyn] == [o[:4] for o in sync]
    for a, b in zip(asyn, sync):   # batches may differ in shape: float noise only
        assert (a[4] is None) == (b[4] is None)
        for x, y in zip(a[4] or [], b[4] or []):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
    assert sync[8][2] == "stop" and sync[9][2] == "stop"
    assert llm_sync.engine.num_overlapped_steps == 0
    if extra:   # a pool this small keeps the queue waiting: preemption, few overlaps
        assert llm_async.stats()["num_preemptions"] > 0
    else:
        assert llm_async.engine.num_overlapped_steps > 10


def test_abort_while_a_step_is_in_flight(tiny_models):
    llm = LLM(tiny_models("qwen3"), max_model_len=256, max_num_seqs=4)
    eng = llm.engine
    for i, p in enumerate(random_prompts(4, [10, 20, 30], 512)):
        eng.add_request(f"f{i}", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    while eng.core._inflight is None:
        eng.step()
    eng.abort_request("f1")
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert set(done) == {"f0", "f2"}
    assert all(len(o.outputs[0].token_ids) == 50 for o in done.values())
    eng.kv.check_whole()


def _first_step_of_late_arrival(model_dir, hold: int | None, max_num_seqs: int = 4):
    """A long prefill is launched, the core resolves or runs ahead, then a request
    arrives: in which launched step does its prefill run, and what do both produce."""
    from pagefleet.server.engine.protocol import CoreRequest, CoreSamplingParams
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=max_num_seqs)
    core = llm.engine.core
    core.hold_after_prompt_tokens = hold
    a, b, c = random_prompts(31, [60, 12, 20], 512)
    greedy = CoreSamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core.add_request(CoreRequest("a", a, greedy))
    if max_num_seqs == 1:
        core.add_request(CoreRequest("c", c, greedy))   # waits: no room for arrivals
    tokens: dict[str, list[int]] = {}

    def step():
        for o in core.step().outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    step()                                   # a's prefill, 60 prompt tokens
    step()                                   # hold: resolve it; else: queue the next one
    core.add_request(CoreRequest("b", b, greedy))
    while core.scheduler.requests["b"].num_computed_tokens == 0:
        step()
    first_b = core.num_steps
    while core.has_unfinished_requests():
        step()
    core.kv.check_whole()
    return first_b, tokens


def test_server_holds_after_a_long_prefill_for_arrivals(tiny_models):
    """Serving, a step of many prompt tokens is resolved before the next is scheduled
    when that step has room: a request arriving meanwhile runs in the very next step
    instead of the one after it. Same tokens either way; no hold while a queue waits."""
    model_dir = tiny_models("qwen3")
    held, held_tokens = _first_step_of_late_arrival(model_dir, hold=16)
    ahead, ahead_tokens = _first_step_of_late_arrival(model_dir, hold=None)
    assert (held, ahead) == (2, 3)
    assert held_tokens == ahead_tokens and all(len(t) == 6 for t in held_tokens.values())
    # A request already waiting is ahead of any arrival: running ahead costs nobody.
    queued, _ = _first_step_of_late_arrival(model_dir, hold=16, max_num_seqs=1)
    queued_ahead, _ = _first_step_of_late_arrival(model_dir, hold=None, max_num_seqs=1)
    assert queued == queued_ahead
