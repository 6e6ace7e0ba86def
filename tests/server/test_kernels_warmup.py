"""The engine's warm-up against Triton's per-variant compiles: after it, a varied
workload on TritonOps (interpreted on the CPU) meets no kernel variant the warm-up did
not, with float weights and with fp8 ones. The kernels' small test tiles:
tests/server/kernel_helpers.py."""

from __future__ import annotations

import pytest

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server.kernel_helpers import attention_small_tiles


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    attention_small_tiles(monkeypatch)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_warm_up_reaches_every_kernel_variant_a_workload_does(tiny_models, quantization):
    """Triton compiles a kernel once per variant (constexprs, int/pointer
    specializations); one met first while serving stalls every stream for the compile.
    After the engine's warm-up, a varied workload (1 to 6 prompts per wave, greedy and
    sampled, prefix hits, mixed decode + prefill steps, different lengths) must reach
    no variant the warm-up did not; with fp8 weights too (the GEMVs, the SiLU one at
    one decode row, the weight-only and fp8-activation GEMMs)."""
    import random

    from pagefleet.server import LLM, SamplingParams
    from pagefleet.server.engine import gemm_warmup, warmup
    from pagefleet.server.engine.runner import PROMPT_LOGPROB_SLICE
    from pagefleet.server.ops import jit_variants
    from pagefleet.server.ops.triton_ops import TritonOps

    model_dir = tiny_models("qwen3-variants", arch="qwen3", num_layers=1, hidden_size=64)
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              block_size=16, enforce_eager=True, quantization=quantization)
    runner = llm.engine.runner
    runner.set_ops(TritonOps)
    runner._setup_decode_path(force=True)   # the CUDA decode path, eagerly
    with jit_variants.record() as warm:
        # what a CUDA engine does before serving: the GEMM sweep (quantized linears run
        # Triton kernels there), then the warm-up requests
        gemm_warmup.warm_gemm_kernels(runner.model, 64, max(runner.max_rows, PROMPT_LOGPROB_SLICE))
        warmup.warm_up(llm.engine.core)
    assert {"triton_attention._prefill_kernel", "triton_attention._decode_kernel",
            "triton_rotary._rotary_store_kernel"} <= set(warm)
    if quantization:
        assert "triton_quant._fp8_gemv_kernel" in warm
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    with jit_variants.record() as served:
        for n, sampled in ((1, False), (3, True), (6, False)):
            prompts = [(shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(3, 50))]
                       for i in range(n)]
            params = [SamplingParams(temperature=0.7 if sampled else 0.0, top_p=0.8, top_k=20,
                                     repetition_penalty=1.05 if sampled else 1.0,
                                     max_tokens=rng.randint(2, 7), ignore_eos=True) for _ in prompts]
            llm.generate(prompts, params)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert jit_variants.new_variants(warm, served) == {}
    llm.engine.kv.check_whole()
