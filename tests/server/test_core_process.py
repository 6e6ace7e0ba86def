"""The engine core in its own process (issue 9): the same tokens as in-process, seeds
that survive the process boundary and any batch, stop strings that stop the core."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.server import LLM, SamplingParams
from pagefleet.server.config import EngineConfig
from pagefleet.server.engine.async_engine import AsyncEngine
from pagefleet.server.engine.core_process import ServedEngine
from tests.server.helpers import random_prompts

SETTINGS = {"max_model_len": 512, "max_num_seqs": 4, "kv_cache_memory": 16 << 20}


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen3")


@pytest.fixture(scope="module")
def served(model_dir):
    eng = ServedEngine(EngineConfig(model=str(model_dir), **SETTINGS), model_dir)
    yield eng
    eng.core.kill()


def run_async(served, jobs):
    """Run `jobs(engine)` against the core process on a fresh event loop."""
    async def main():
        eng = AsyncEngine(served.core, served.ready, served.tokenizer)
        await eng.start()
        try:
            return await jobs(eng)
        finally:
            eng._stopping = True     # keep the core process for the next test
            eng._loop.remove_reader(served.core.proc.sentinel)
            eng._reader.cancel()
    return asyncio.run(main())


async def collect(eng, rid, ids, params):
    text, toks, out = [], [], None
    async for out in eng.generate(rid, ids, params):
        text.append(out.outputs[0].text)
        toks.extend(out.outputs[0].token_ids)
    return "".join(text), toks, out.outputs[0].finish_reason, out.outputs[0].stop_reason


def delta(**kw) -> SamplingParams:
    return SamplingParams(output_kind="delta", ignore_eos=True, **kw)


def test_core_process_matches_in_process(served, model_dir):
    prompts = random_prompts(31, [5, 40, 17, 90, 3, 64], 512)
    params = [delta(temperature=0, max_tokens=30),
              delta(temperature=0.9, top_p=0.9, seed=11, max_tokens=25),
              delta(temperature=1.0, top_k=20, seed=5, repetition_penalty=1.3, max_tokens=20),
              delta(temperature=0, max_tokens=24, logprobs=2),
              delta(temperature=0.7, top_k=20, top_p=0.8, seed=2, max_tokens=28),
              delta(temperature=0, max_tokens=12, min_tokens=6)]

    async def jobs(eng):
        return await asyncio.gather(*[collect(eng, f"m{i}", p, sp)
                                      for i, (p, sp) in enumerate(zip(prompts, params))])
    remote = run_async(served, jobs)
    llm = LLM(model_dir, **SETTINGS)
    local = llm.generate(prompts, params)
    for (text, toks, reason, _), o in zip(remote, local):
        assert toks == o.outputs[0].token_ids and text == o.outputs[0].text
        assert reason == o.outputs[0].finish_reason
    assert sum(len(set(t)) for _, t, _, _ in remote) > 3 * len(prompts)


def test_seeded_sampling_survives_batch_and_process(served, model_dir):
    prompt = random_prompts(9, [25], 512)[0]
    seeded = dict(temperature=1.0, top_p=0.9, top_k=30, seed=1234, max_tokens=30)

    async def alone(eng):
        return await collect(eng, "alone", prompt, delta(**seeded))

    async def crowded(eng):
        others = [collect(eng, f"o{i}", p, delta(temperature=0.8, max_tokens=20 + i,
                                                 repetition_penalty=1.1))
                  for i, p in enumerate(random_prompts(10, [5, 50, 12, 80, 3], 512))]
        res = await asyncio.gather(*others[:2], collect(eng, "seeded", prompt, delta(**seeded)),
                                   *others[2:])
        return res[2]
    a = run_async(served, alone)
    b = run_async(served, crowded)
    local = LLM(model_dir, **SETTINGS).generate([prompt], SamplingParams(**seeded, ignore_eos=True))
    assert a[1] == b[1] == local[0].outputs[0].token_ids
    assert len(set(a[1])) > 5


def test_stop_string_stops_the_core(served):
    """A stop string matched in the API process aborts the request in the core: the
    core computes at most the tokens in flight when the abort arrives, not max_tokens."""
    prompt = random_prompts(5, [30], 512)[0]

    async def jobs(eng):
        text, toks, _, _ = await collect(eng, "probe", prompt, delta(temperature=0, max_tokens=40))
        stop = text[10:14]
        before = (await eng.call_utility("counters"))["generation_tokens"]
        text2, toks2, reason, stop_reason = await collect(
            eng, "stopper", prompt, delta(temperature=0, max_tokens=450, stop=[stop]))
        for _ in range(50):   # the abort has reached the core once nothing runs there
            c = await eng.call_utility("counters")
            if not c["running"]:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        after = await eng.call_utility("counters")
        return text, stop, text2, toks2, reason, stop_reason, after, after["generation_tokens"] - before
    text, stop, text2, toks2, reason, stop_reason, after, computed = run_async(served, jobs)
    assert reason == "stop" and stop_reason == stop and text2 == text[:text.find(stop)]
    assert "stopper" not in after["running"] and not after["waiting"]
    # Tokens up to the stop, plus at most the few steps in flight.
    assert len(toks2) <= computed <= len(toks2) + 8, (len(toks2), computed)


def test_startup_timeout_bounds_the_wait_for_the_core(model_dir):
    """--startup-timeout is how long the API process waits for the core to be ready:
    past it, a startup error naming the deadline and the core process killed (a spawned
    Python process that loads a model cannot be ready within a millisecond)."""
    from pagefleet.server.engine.core_process import CoreStartupError

    with pytest.raises(CoreStartupError, match=r"not ready within 0\.001s"):
        ServedEngine(EngineConfig(model=str(model_dir), startup_timeout=0.001, **SETTINGS),
                     model_dir)
