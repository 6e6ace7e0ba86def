"""Engine behaviour on a tiny model: aborts, rejections, stops, seeds, streaming text."""

from __future__ import annotations

import pytest

from pagefleet.server import LLM, SamplingParams
from pagefleet.server.config import ConfigError
from pagefleet.server.engine.engine import PromptTooLongError, RequestRejected
from pagefleet.server.engine.sampling_params import SamplingParamsError
from tests.server.helpers import random_prompts, watch_scalar_index_writes


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("qwen3"), max_model_len=256, max_num_seqs=4,
               max_num_batched_tokens=64, num_kv_blocks=64)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_abort_mid_generation_returns_every_block(llm):
    eng = llm.engine
    prompts = random_prompts(3, [40, 70, 20, 90, 33, 15], 512)
    for i, p in enumerate(prompts):
        eng.add_request(f"ab{i}", p, greedy(60, ignore_eos=True))
    for _ in range(6):
        eng.step()
    running = list(eng.scheduler.running)
    waiting = sorted(r.request_id for r in eng.scheduler.waiting)
    assert running and waiting
    out = eng.abort_request(running[0])
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.abort_request(waiting[-1]).outputs[0].finish_reason == "abort"
    assert eng.abort_request("no-such-request") is None
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert len(finished) == 4
    assert all(o.outputs[0].finish_reason == "length" for o in finished.values())
    eng.kv.check_whole()
    # Abort everything in flight, prefills included.
    for i, p in enumerate(prompts):
        eng.add_request(f"ab2-{i}", p, greedy(60, ignore_eos=True))
    eng.step()
    for i in range(len(prompts)):
        eng.abort_request(f"ab2-{i}")
    assert not eng.has_unfinished_requests()
    eng.kv.check_whole()


def test_rejections_are_clear_and_leave_the_engine_whole(llm):
    eng = llm.engine
    with pytest.raises(PromptTooLongError) as e:
        eng.add_request("long", list(range(3, 300)), greedy(10))
    assert "maximum context length is 256 tokens" in str(e.value)
    assert "However, you requested 307 tokens (297 in the messages, 10 in the completion)" in str(e.value)
    with pytest.raises(PromptTooLongError):
        eng.add_request("room", list(range(3, 200)), greedy(100))
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request("empty", [], greedy(4))
    with pytest.raises(RequestRejected, match="out of range") as e:
        eng.add_request("bad", [5, 100000], greedy(4))
    assert e.value.param == "prompt"
    with pytest.raises(SamplingParamsError):
        eng.add_request("badstop", [5, 6], greedy(4, stop_token_ids=[10**6]))
    eng.add_request("dup", [5, 6], greedy(2))
    with pytest.raises(RequestRejected, match="already in use"):
        eng.add_request("dup", [5, 6], greedy(2))
    while eng.has_unfinished_requests():
        eng.step()
    eng.kv.check_whole()
    assert llm.generate([[5, 6, 7]], greedy(3))[0].outputs[0].token_ids


def test_config_errors_name_the_flag(tiny_models):
    with pytest.raises(ConfigError, match="--max-model-len"):
        LLM(tiny_models("qwen3"), max_model_len=10**6)
    with pytest.raises(ConfigError, match="--max-num-batched-tokens"):
        LLM(tiny_models("qwen3"), max_model_len=512, enable_chunked_prefill=False,
            max_num_batched_tokens=64)
    with pytest.raises(ConfigError, match="--max-model-len"):
        LLM(tiny_models("qwen3"), max_model_len=512, num_kv_blocks=4)


def test_stop_strings_and_stop_tokens(llm):
    prompt = random_prompts(5, [30], 512)[0]
    base = llm.generate([prompt], greedy(40, ignore_eos=True))[0].outputs[0]
    text, ids = base.text, base.token_ids
    assert len(text) > 20
    stop = text[10:13]
    first = text.find(stop)
    out = llm.generate([prompt], greedy(40, ignore_eos=True, stop=[stop, "\x00never"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:first]
    kept = llm.generate([prompt], greedy(40, ignore_eos=True, stop=stop,
                                         include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:first + len(stop)]

    tok = next(t for t in ids[6:] if ids.index(t) >= 3)   # max_tokens below stays >= 1
    out = llm.generate([prompt], greedy(40, ignore_eos=True, stop_token_ids=[tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == ids[:ids.index(tok) + 1]
    # The stop token's text is left out, as in vLLM, unless asked for.
    upto = llm.generate([prompt], greedy(ids.index(tok), ignore_eos=True))[0].outputs[0].text
    through = llm.generate([prompt], greedy(ids.index(tok) + 1,
                                            ignore_eos=True))[0].outputs[0].text
    assert upto != through
    assert out.text == upto
    kept = llm.generate([prompt], greedy(40, ignore_eos=True, stop_token_ids=[tok],
                                         include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == through and kept.token_ids == out.token_ids

    out = llm.generate([prompt], greedy(40, ignore_eos=True, stop_token_ids=[ids[0]],
                                        min_tokens=8))[0].outputs[0]
    assert len(out.token_ids) >= 8

    out = llm.generate([prompt], greedy(5, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == ids[:5]


def test_eos_from_generation_config_stops(tiny_models, llm):
    eng = llm.engine
    tok = eng.tokenizer
    assert tok.convert_tokens_to_ids("<|im_end|>") in eng.eos_token_ids
    assert tok.convert_tokens_to_ids("<|endoftext|>") in eng.eos_token_ids
    assert eng.core.eos_token_ids == eng.eos_token_ids
    prompt = random_prompts(5, [30], 512)[0]
    ids = llm.generate([prompt], greedy(40, ignore_eos=True))[0].outputs[0].token_ids
    # The text of the first k greedy tokens, k = 1..8.
    texts = [llm.generate([prompt], greedy(k, ignore_eos=True))[0].outputs[0].text
             for k in range(1, 9)]
    # Make a greedy token whose text shows (and that did not occur before) an EOS for
    # this request: generation stops on it.
    j = next(k for k in range(3, 8) if ids[k] not in ids[:k] and texts[k] != texts[k - 1]
             and "\ufffd" not in texts[k])
    core = eng.core
    core.eos_token_ids = core.eos_token_ids + (ids[j],)
    try:
        out = llm.generate([prompt], greedy(40))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert out.token_ids == ids[:j + 1]
        # The EOS token's text is never output, special or not (vLLM's rule).
        shown = llm.generate([prompt], greedy(40, skip_special_tokens=False))[0].outputs[0]
        assert out.text == texts[j - 1] and shown.text == texts[j - 1]
        ignored = llm.generate([prompt], greedy(40, ignore_eos=True))[0].outputs[0]
        assert ignored.token_ids == ids
    finally:
        core.eos_token_ids = core.eos_token_ids[:-1]


def test_seeded_sampling_reproducible_whatever_the_batch(llm):
    prompt = random_prompts(9, [25], 512)[0]
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True)
    alone = llm.generate([prompt], p)[0].outputs[0].token_ids
    others = random_prompts(10, [5, 50, 12, 80, 3], 512)
    batch = others[:2] + [prompt] + others[2:]
    params = [SamplingParams(temperature=0.8, max_tokens=20 + i, ignore_eos=True) for i in range(5)]
    params.insert(2, p)
    mixed = llm.generate(batch, params)[2].outputs[0].token_ids
    assert alone == mixed
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                       max_tokens=30, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_streamed_text_is_monotonic_and_complete(llm):
    eng = llm.engine
    prompt = random_prompts(11, [20], 512)[0]
    full = llm.generate([prompt], greedy(30, ignore_eos=True))[0].outputs[0]
    eng.add_request("stream", prompt, greedy(30, ignore_eos=True, stop=["\x01\x02"]))
    seen = ""
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.outputs[0].text.startswith(seen)
            seen = o.outputs[0].text
    assert seen == full.text


def test_logprobs_and_string_prompts(llm):
    out = llm.generate(["Hello world, the model"], greedy(6, logprobs=2, ignore_eos=True))[0]
    c = out.outputs[0]
    assert out.prompt == "Hello world, the model"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello world, the model")
    assert len(c.logprobs) == len(c.token_ids) == 6
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and max(lp.values()) == lp[tok]   # greedy picks the top


def test_bfloat16_runs_on_cpu(tiny_models):
    llm = LLM(tiny_models("qwen2"), max_model_len=128, dtype="bfloat16")
    out = llm.generate([[5, 6, 7, 8]], greedy(8, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8
    assert llm.engine.runner.dtype.is_floating_point and str(llm.engine.runner.dtype) == "torch.bfloat16"


def test_warm_up_leaves_nothing_behind_and_tiny_pools_start(tiny_models):
    """The core's start-up warm-up: afterwards the pool is whole, nothing is cached,
    counters are zero (metrics start from nothing); an engine whose pool is too small
    for it starts anyway and serves."""
    from pagefleet.server import LLM, SamplingParams

    model_dir = tiny_models("qwen3-warm", arch="qwen3", num_layers=1)
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    core = llm.engine.core
    core.check_whole()
    assert not core.kv.cached and core.kv.stats.queries == 0 and core.num_steps == 0
    assert core.stats().generation_tokens == 0 and core.scheduler.num_preemptions == 0
    tiny = LLM(model_dir, max_model_len=16, max_num_seqs=2, max_num_batched_tokens=64,
               num_kv_blocks=1)   # 16 tokens: no room for the warm-up
    out = tiny.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_triton_compile_after_ready_is_logged_and_counted(caplog, monkeypatch):
    """The compile watch rides Triton's own hooks: compiles before `mark_ready` (warm-up,
    graph capture, another engine's start) are silent; one after it is a warning naming
    the kernel, counted;
    a hook installed before ours is still called and can still skip a compile."""
    from triton import knobs

    from pagefleet.server.ops import compile_watch

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append("before") or False)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append("after"))
    monkeypatch.setattr(compile_watch, "_state", {**compile_watch._state, "installed": False,
                                                  "ready": False, "count": 0, "seconds": 0.0})
    assert compile_watch.install()

    class Fn:
        name = "_prefill_kernel"

    def compile_once() -> bool:
        skip = knobs.runtime.jit_cache_hook(key=1, repr="_prefill_kernel[num_warps=4]()", fn=Fn())
        if not skip:
            knobs.runtime.jit_post_compile_hook(key=1, repr="_prefill_kernel[num_warps=4]()", fn=Fn())
        return skip

    with caplog.at_level("WARNING", logger="pagefleet.engine"):
        assert compile_once() is False          # during start-up
        assert compile_watch.compiles_while_serving() == (0, 0.0) and not caplog.records
        compile_watch.mark_ready()
        compile_once()
    assert compile_watch.compiles_while_serving()[0] == 1
    assert "Triton compiled _prefill_kernel while serving" in caplog.text
    # A second engine starting in the same process: its warm-up compiles are no stalls
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagefleet.engine"):
        compile_watch.mark_starting()
        compile_once()
    assert compile_watch.compiles_while_serving()[0] == 1 and not caplog.records
    assert calls == ["before", "after"] * 3


def test_steps_write_no_python_scalar_through_an_index_tensor(llm, monkeypatch):
    """The whole step path (scheduler, runner staging, sampler, structured outputs off):
    no write that would synchronize on a GPU (see `watch_scalar_index_writes`), over
    chunked prefills, mixed steps, prefix hits and penalised, banned and biased rows."""
    seen = watch_scalar_index_writes(monkeypatch)
    shared = random_prompts(7, [40], 512)[0]
    prompts = [shared + p for p in random_prompts(8, [5, 30, 70, 12], 512)]
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05,
                             max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, min_tokens=4, max_tokens=6),
              SamplingParams(temperature=0, logit_bias={5: 3.0}, max_tokens=6, ignore_eos=True,
                             logprobs=2),
              SamplingParams(temperature=0.9, min_p=0.05, seed=3, max_tokens=6, ignore_eos=True)]
    llm.generate(prompts, params)
    assert seen == []
    llm.engine.kv.check_whole()


def test_offline_n_sequences_per_prompt(llm):
    """vLLM's offline `n`: each prompt's RequestOutput holds n sequences (index j);
    sequence j is the one seed + j gives alone, so the first equals n=1, and they
    share the prompt's KV blocks. The engine itself takes one sequence a request."""
    prompts = random_prompts(21, [40, 25], 512)
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    hits = llm.stats()["prefix_cache_hits"]
    outs = llm.generate(prompts, SamplingParams(**{**vars_of(sampled), "n": 3}))
    assert llm.stats()["prefix_cache_hits"] > hits          # later sequences reuse the prompt
    for prompt, out in zip(prompts, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for j, c in enumerate(out.outputs):
            alone = llm.generate([prompt], SamplingParams(**{**vars_of(sampled),
                                                              "seed": 11 + j}))[0]
            assert c.token_ids == alone.outputs[0].token_ids
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    one = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, n=2))[0].outputs
    assert one[0].token_ids == one[1].token_ids                # greedy: the same twice
    with pytest.raises(SamplingParamsError) as e:
        llm.engine.add_request("n2", prompts[0], SamplingParams(max_tokens=4, n=2))
    assert e.value.param == "n"


def test_offline_chat_renders_the_template(llm):
    conv = [{"role": "user", "content": "hello there"}]
    tok = llm.tokenizer
    ids = tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    via_chat = llm.chat(conv, greedy(6, ignore_eos=True))
    assert via_chat[0].prompt_token_ids == ids
    assert via_chat[0].outputs[0].token_ids == \
        llm.generate([ids], greedy(6, ignore_eos=True))[0].outputs[0].token_ids
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "hi"},
                                  {"role": "user", "content": "again"}]], greedy(3))
    assert len(two) == 2 and len(two[1].prompt_token_ids) > len(ids)


def vars_of(p: SamplingParams) -> dict:
    """A SamplingParams' constructor fields (the derived ones left out)."""
    import dataclasses

    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}
