"""Greedy outputs equal HF transformers' own, token for token (issue: engine core, 1-2)."""

from __future__ import annotations

import pytest

from pagefleet.server import LLM, SamplingParams
from tests.server.helpers import assert_diverse, hf_greedy, random_prompts

ARCH_MODELS = {
    "llama": {"arch": "llama", "num_shards": 2},          # llama3 rope scaling, sharded
    "qwen2": {"arch": "qwen2"},                           # qkv bias
    "qwen3": {"arch": "qwen3"},                           # q/k norm, tied embeddings
    "mistral": {"arch": "mistral", "tie_word_embeddings": True},
}
LENGTHS = [1, 7, 33, 64, 120, 181, 257, 300]
MAX_NEW = [64, 40, 64, 17, 64, 33, 64, 50]


@pytest.fixture(scope="module")
def reference(tiny_models):
    cache = {}

    def get(name: str, prompts_key: str, prompts: list[list[int]], max_new: list[int]):
        key = (name, prompts_key)
        if key not in cache:
            cache[key] = hf_greedy(tiny_models(name, **ARCH_MODELS[name]), prompts, max_new)
        return cache[key]

    return get


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    outs = llm.generate(prompts, [greedy(n) for n in max_new])
    llm.engine.kv.check_whole()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(ARCH_MODELS))
def test_greedy_matches_hf(tiny_models, reference, name):
    model_dir = tiny_models(name, **ARCH_MODELS[name])
    prompts = random_prompts(1, LENGTHS, 512)
    ref = reference(name, "base", prompts, MAX_NEW)
    assert_diverse(ref)
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=16)
    assert run(llm, prompts, MAX_NEW) == ref


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_prefix_cache_hits_keep_outputs(tiny_models, reference, name):
    model_dir = tiny_models(name, **ARCH_MODELS[name])
    shared = random_prompts(7, [150], 512)[0]
    tails = random_prompts(8, [1, 5, 16, 17, 40, 2, 90, 31], 512)
    prompts = [shared + t for t in tails]
    max_new = [32] * len(prompts)
    ref = reference(name, "prefix", prompts, max_new)
    assert_diverse(ref)
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=16, block_size=16)
    first = run(llm, prompts[:1], max_new[:1])
    rest = llm.generate(prompts[1:], [greedy(n) for n in max_new[1:]])
    llm.engine.kv.check_whole()
    assert first + [o.outputs[0].token_ids for o in rest] == ref
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0
    assert all(o.num_cached_tokens >= 144 for o in rest)
    # The same prompts again: the whole prompts hit (but their last token).
    again = llm.generate(prompts, [greedy(n) for n in max_new])
    assert [o.outputs[0].token_ids for o in again] == ref
    assert llm.stats()["prefix_cache_hits"] > stats["prefix_cache_hits"]
    llm.engine.kv.check_whole()


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_chunked_prefill_keeps_outputs(tiny_models, reference, name):
    model_dir = tiny_models(name, **ARCH_MODELS[name])
    prompts = random_prompts(1, LENGTHS, 512)
    ref = reference(name, "base", prompts, MAX_NEW)
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=32)
    budgets = []
    schedule = llm.engine.scheduler.schedule

    def observed():
        out = schedule()
        budgets.append((out.num_batched_tokens, len(out.scheduled),
                        sum(s.num_new_tokens > 1 for s in out.scheduled)))
        return out

    llm.engine.scheduler.schedule = observed
    assert run(llm, prompts, MAX_NEW) == ref
    assert all(tokens <= 32 and seqs <= 16 for tokens, seqs, _ in budgets)
    # Prompts of 300 tokens took many chunked steps, mixed with decodes.
    assert sum(1 for t, s, p in budgets if p and s > p) > 0


@pytest.mark.parametrize("name", ["qwen3", "llama", "qwen2", "mistral"])
def test_preemption_keeps_outputs(tiny_models, reference, name):
    model_dir = tiny_models(name, **ARCH_MODELS[name])
    prompts = random_prompts(1, LENGTHS, 512)
    ref = reference(name, "base", prompts, MAX_NEW)
    # 8 requests need ~90 blocks together; 30 blocks force preemption by recompute.
    llm = LLM(model_dir, max_model_len=400, max_num_seqs=8, num_kv_blocks=30,
              max_num_batched_tokens=128)
    assert run(llm, prompts, MAX_NEW) == ref
    assert llm.stats()["num_preemptions"] > 0


# Rope scaling as Qwen2.5's model card adds it to config.json (the old `type` key; trained
# positions = max_position_embeddings = original x 1, served x 4), and its variants. The
# prompts run past the original 64 positions, to 250 of the 256 the scaling allows.
YARN_CARD = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
ROPE_MODELS = {
    "qwen2-yarn": {"arch": "qwen2", "max_position_embeddings": 64, "rope_scaling": YARN_CARD},
    "llama-yarn": {"arch": "llama", "max_position_embeddings": 256, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 16, "truncate": False}},
    "qwen2-linear": {"arch": "qwen2", "max_position_embeddings": 64,
                     "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
}
ROPE_LENGTHS = [1, 50, 90, 150, 200]
ROPE_MAX_NEW = [64, 64, 60, 60, 50]


@pytest.fixture(scope="module")
def rope_reference(tiny_models):
    prompts = random_prompts(3, ROPE_LENGTHS, 512)
    cache = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            cache[name] = hf_greedy(tiny_models(name, **ROPE_MODELS[name]), prompts,
                                    ROPE_MAX_NEW)
            assert_diverse(cache[name])
        return cache[name]

    return prompts, get


@pytest.mark.parametrize("name", list(ROPE_MODELS))
def test_greedy_matches_hf_with_rope_scaling(tiny_models, rope_reference, name):
    """The default max_model_len is the scaled one (vLLM's rule: 64 x 4), and greedy
    outputs past the original length are HF's, token for token."""
    prompts, reference = rope_reference
    llm = LLM(tiny_models(name, **ROPE_MODELS[name]), max_num_seqs=16)
    assert llm.engine.max_model_len == 256
    assert run(llm, prompts, ROPE_MAX_NEW) == reference(name)


def test_hf_overrides_serve_the_model_card_rope(tiny_models, rope_reference):
    """`hf_overrides` (--hf-overrides) on the unedited checkpoint serves what editing
    config.json as the model card says serves: the same tokens as HF on the edited one."""
    import json

    prompts, reference = rope_reference
    plain = tiny_models("qwen2-plain64", arch="qwen2", max_position_embeddings=64)
    llm = LLM(plain, max_num_seqs=16, hf_overrides=json.dumps({"rope_scaling": YARN_CARD}))
    assert llm.engine.max_model_len == 256
    assert run(llm, prompts, ROPE_MAX_NEW) == reference("qwen2-yarn")
