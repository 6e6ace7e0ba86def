"""Whole tiny models on TritonOps (every op a Triton kernel, interpreted on the CPU,
float32) against the torch ops' greedy tokens: a qwen3 through the flat, padded and
piecewise decode paths, and AWQ / act-order GPTQ checkpoints through the quantized
GEMMs. The kernels' small test tiles: tests/server/kernel_helpers.py."""

from __future__ import annotations

import pytest

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server.kernel_helpers import attention_small_tiles, quant_small_tiles


@pytest.fixture
def attention_tiles(monkeypatch):
    attention_small_tiles(monkeypatch)


@pytest.fixture
def quant_tiles(monkeypatch):
    quant_small_tiles(monkeypatch)


@pytest.mark.usefixtures("attention_tiles")
def test_triton_ops_model_greedy_matches_torch_ops(tiny_models):
    """A tiny qwen3 (q/k norm, GQA) run end to end on TritonOps (interpreted, float32)
    gives the torch path's greedy tokens, with prefix hits and chunked prefill."""
    from pagefleet.server import LLM, SamplingParams
    from pagefleet.server.models.decoder import Ops
    from pagefleet.server.ops.triton_ops import TritonOps
    from tests.server.helpers import random_prompts

    # hidden 64 over 4 heads: head_dim 32 (qwen3 doubles it), which the rotary kernels
    # take (half a power of two), so the fused rotary + KV write runs, not its fallback.
    model_dir = tiny_models("qwen3-kernels", arch="qwen3", num_layers=2, hidden_size=64)
    shared = random_prompts(3, [40], 512)[0]
    prompts = [shared + t for t in random_prompts(4, [3, 21], 512)] + random_prompts(5, [50, 20], 512)
    # Different lengths: requests finish at different steps, so decode rows shift and
    # block tables grow across block boundaries (the padded path's host mirrors).
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (6, 3, 9, 5)]
    outs = {}
    # Triton through the CUDA decode path (static buffers, padded batch; eager here),
    # prefill and mixed steps through the flat path, then through the pieces of the
    # forward (engine/piecewise.py: attention on slices of static buffers, padding).
    for name, ops, padded, pieces in (("torch", Ops, False, False),
                                      ("triton-padded", TritonOps, True, False),
                                      ("triton-pieces", TritonOps, True, True)):
        llm = LLM(model_dir, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=32,
                  block_size=16, enforce_eager=True)
        runner = llm.engine.runner
        runner.set_ops(ops)
        if padded:   # the CUDA decode path (static buffers, padded batch), run eagerly
            runner._setup_decode_path(pieces=pieces)
            assert runner._decode_sizes == [1, 2, 3]
        first = llm.generate(prompts[:1], params[:1])
        rest = llm.generate(prompts[1:], params[1:])
        outs[name] = [o.outputs[0].token_ids for o in first + rest]
        assert llm.stats()["prefix_cache_hits"] > 0
        llm.engine.kv.check_whole()
        if pieces:
            assert runner._pieces.num_steps > 0
    assert outs["triton-padded"] == outs["torch"]
    assert outs["triton-pieces"] == outs["torch"]
    assert sum(len(set(s)) for s in outs["torch"]) >= 3 * len(prompts)


@pytest.mark.usefixtures("quant_tiles")
def test_quantized_model_on_triton_ops_matches_torch_ops(tmp_path):
    """A one-layer AWQ and act-order GPTQ model end to end on TritonOps (interpreted,
    float32), prefill through the tl.dot kernel and decode through the GEMV: the torch
    path's greedy tokens."""
    from pagefleet.server import LLM, SamplingParams
    from pagefleet.server.models.decoder import Ops
    from pagefleet.server.ops.triton_ops import TritonOps
    from pagefleet.server.testing import build_tiny_model
    from pagefleet.server.testing_quant import quantize_checkpoint
    from tests.server.helpers import random_prompts

    src = build_tiny_model(tmp_path / "src", "qwen2", hidden_size=64, num_layers=1,
                           num_heads=2, num_kv_heads=1, vocab_size=300)
    prompts = random_prompts(4, [9, 5], 290)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for fmt, kw in (("awq", dict(group_size=32)), ("gptq", dict(group_size=32, desc_act=True))):
        q = quantize_checkpoint(src, tmp_path / fmt, fmt, **kw)
        outs = {}
        for name, ops in (("torch", Ops), ("triton", TritonOps)):
            llm = LLM(q, max_model_len=64, max_num_seqs=2, enforce_eager=True)
            llm.engine.runner.set_ops(ops)
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert outs["triton"] == outs["torch"], fmt
