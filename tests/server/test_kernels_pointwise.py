"""The row-wise kernels against their torch twins under TRITON_INTERPRET=1: RMS norms,
rotary embedding (and its fused form with the KV cache write), SiLU-and-mul, and the
sampler's fused penalties-and-temperature prologue. Tolerances:
tests/server/kernel_helpers.py."""

from __future__ import annotations

import pytest

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server.kernel_helpers import (DEV, FP8, TOL, attention_small_tiles,
                                         make_cache, rel_err, torch, triton_attention)
from pagefleet.server.ops import activation, layernorm, logits, rotary
from pagefleet.server.ops import (triton_activation, triton_layernorm, triton_logits,
                                  triton_rotary)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    attention_small_tiles(monkeypatch)


# -- norms, rotary, activation ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (3, 200)])
def test_rms_norms(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    r = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    assert rel_err(triton_layernorm.rms_norm(x, w, 1e-6), layernorm.rms_norm(x, w, 1e-6)) <= TOL[dtype]
    out, res = triton_layernorm.fused_add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_res = layernorm.fused_add_rms_norm(x, r, w, 1e-5)
    assert rel_err(res, ref_res) <= TOL[dtype]
    assert rel_err(out, ref_out) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_per_head_on_strided_view(dtype):
    """Qwen3's q/k norm: a [tokens, heads, head_dim] view into the fused projection."""
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(5, 6 * 32, generator=g).to(dtype).to(DEV)
    q = qkv[:, :4 * 32].view(5, 4, 32)
    w = (1 + 0.3 * torch.randn(32, generator=g)).to(dtype).to(DEV)
    assert rel_err(triton_layernorm.rms_norm(q, w, 1e-6), layernorm.rms_norm(q, w, 1e-6)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab,hidden", [(1, 37, 200), (2, 64, 96), (3, 21, 130)])
def test_logits_gemv(monkeypatch, dtype, rows, vocab, hidden):
    """The decode logits GEMV against its twin: a vocabulary that is no multiple of the
    strip, K no multiple of the tile; float32 out, each value rounded to the activation
    dtype first (as the twin and HF's 16-bit lm_head round it)."""
    monkeypatch.setitem(triton_logits.LOGITS_CONFIG, "max_rows", 2)
    monkeypatch.setitem(triton_logits.LOGITS_CONFIG, "block_k", 64)
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    w = (0.1 * torch.randn(vocab, hidden, generator=g)).to(dtype).to(DEV)
    launched = []
    kernel = triton_logits._logits_gemv_kernel
    monkeypatch.setattr(triton_logits, "_logits_gemv_kernel", type("K", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or kernel[grid]})())
    out = triton_logits.logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, vocab)
    assert bool(launched) == (rows <= 2)        # above max_rows: the twin (cuBLAS)
    ref = logits.logits(x, w)
    assert rel_err(out, ref) <= TOL[dtype]
    assert torch.equal(out, out.to(dtype).float())


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
@pytest.mark.parametrize("tokens,hq,hk,d", [(6, 4, 2, 32), (11, 7, 1, 16)])
def test_rotary(dtype, scaling, tokens, hq, hk, d):
    cs = rotary.cos_sin_cache(d, 512, 10000.0, scaling).to(DEV)
    g = torch.Generator().manual_seed(tokens + hq)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEV)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    pos = torch.randint(0, 512, (tokens,), generator=g).to(DEV)
    q1, k1 = triton_rotary.rotary_embedding(pos, q, k, cs)
    q2, k2 = rotary.rotary_embedding(pos, q, k, cs)
    assert rel_err(q1, q2) <= TOL[dtype] and rel_err(k1, k2) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])   # bf16: see below
@pytest.mark.parametrize("scaling", [YARN, LINEAR])
def test_rotary_kernels_rotate_as_hf_with_scaled_rope(dtype, scaling):
    """The kernels read the scaled table (they compute no frequencies): q and k rotated
    at positions past the original 64 are HF's `apply_rotary_pos_emb` with the HF
    model's own cos/sin (YaRN's attention factor in), bit for bit in float32. Not
    bfloat16 here: the interpreter rounds it by truncation, which on YaRN tables measured
    1.06e-2 against the twin, just past the bf16 tolerance (the GPU rounds to nearest)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import (Qwen2RotaryEmbedding,
                                                          apply_rotary_pos_emb)

    tokens, hq, hk, d = 9, 4, 2, 32
    hf_cfg = Qwen2Config(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hk,
                         max_position_embeddings=64, rope_theta=10000.0,
                         rope_scaling=dict(scaling))
    cs = rotary.cos_sin_cache(d, 256, 10000.0, scaling).to(DEV)
    g = torch.Generator().manual_seed(len(scaling))
    q = torch.randn(tokens, hq, d, generator=g).to(dtype)
    k = torch.randn(tokens, hk, d, generator=g).to(dtype)
    v = torch.randn(tokens, hk, d, generator=g).to(dtype)
    pos = torch.tensor([0, 1, 63, 64, 65, 100, 170, 254, 255])
    cos, sin = Qwen2RotaryEmbedding(hf_cfg)(q, pos[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos, sin)
    ref_q, ref_k = ref_q[0].transpose(0, 1), ref_k[0].transpose(0, 1)
    q1, k1 = triton_rotary.rotary_embedding(pos.to(DEV), q.to(DEV), k.to(DEV), cs)
    kc, vc = make_cache(2, 16, hk, d, dtype, tokens)
    q2 = triton_rotary.rotary_and_store(pos.to(DEV), q.to(DEV), k.to(DEV), v.to(DEV), cs,
                                        kc, vc, torch.arange(tokens).to(DEV))
    k2 = kc.view(-1, hk, d)[:tokens]
    for out, ref in ((q1, ref_q), (k1, ref_k), (q2, ref_q), (k2, ref_k)):
        if dtype == torch.float32:
            assert torch.equal(out.cpu(), ref)
        else:
            assert rel_err(out.cpu().float(), ref.float()) <= TOL[dtype]


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.float32),
                                            (torch.bfloat16, FP8)])
@pytest.mark.parametrize("tokens,hq,hk,d,block_size", [(6, 4, 2, 32, 16), (13, 7, 1, 16, 32),
                                                      (5, 4, 2, 48, 16)])   # 48: the fallback
def test_rotary_and_store(dtype, kv_dtype, tokens, hq, hk, d, block_size):
    """The fused kernel writes the bits rotary-then-store writes (q returned, k and v in
    the cache, slot -1 untouched), and the model's default op composes the two twins."""
    from pagefleet.server.models.decoder import Ops
    cs = rotary.cos_sin_cache(d, 512, 10000.0, LLAMA3).to(DEV)
    g = torch.Generator().manual_seed(tokens * hq + d)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEV)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    v = qkv[:, (hq + hk) * d:].view(tokens, hk, d)
    pos = torch.randint(0, 512, (tokens,), generator=g).to(DEV)
    slots = torch.randperm(10 * block_size, generator=g)[:tokens]
    slots[1::4] = -1
    slots = slots.to(DEV)
    kc, vc = make_cache(10, block_size, hk, d, kv_dtype, tokens)
    ks, vs = (0.5, 2.0) if kv_dtype == FP8 else (1.0, 1.0)
    out_k, out_v, ref_k, ref_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q1 = triton_rotary.rotary_and_store(pos, q, k, v, cs, out_k, out_v, slots, ks, vs)
    q2 = Ops.rotary_and_store(pos, q, k, v, cs, ref_k, ref_v, slots, ks, vs)
    q3, k3 = triton_rotary.rotary_embedding(pos, q, k, cs)   # the two Triton ops in a row
    tri_k, tri_v = kc.clone(), vc.clone()
    triton_attention.store_kvcache(k3, v, tri_k, tri_v, slots, ks, vs)
    assert torch.equal(q1, q3) and rel_err(q1, q2) <= TOL[dtype]
    flat = lambda c: c.view(-1, hk, d).float().cpu()  # noqa: E731
    assert torch.equal(flat(out_k), flat(tri_k)) and torch.equal(flat(out_v), flat(tri_v))
    untouched = torch.ones(10 * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert torch.equal(flat(out_k)[untouched], flat(kc)[untouched])
    tol = 3e-2 if kv_dtype == FP8 else TOL[dtype]
    assert rel_err(flat(out_k), flat(ref_k)) <= tol and rel_err(flat(out_v), flat(ref_v)) <= tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (2, 3, 2 * 1100)])
def test_silu_and_mul(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (2 * torch.randn(*shape, generator=g)).to(dtype).to(DEV)
    assert rel_err(triton_activation.silu_and_mul(x), activation.silu_and_mul(x)) <= TOL[dtype]


@pytest.mark.parametrize("penalties", [True, False])
def test_penalize_and_scale_matches_twin(penalties):
    """The fused sampling prologue equals the sampler's twin (penalties, then the
    division by the temperature), rows gathered by slot, vocab not a block multiple."""
    from pagefleet.server.engine.sampler import apply_penalties
    from pagefleet.server.ops.triton_sampling import penalize_and_scale

    g = torch.Generator().manual_seed(3)
    slots_total, vocab, rows = 6, 2500, 4
    logits = torch.randn(rows, vocab, generator=g) * 4
    mask = torch.rand(slots_total, vocab, generator=g) < 0.1
    counts = (torch.rand(slots_total, vocab, generator=g) < 0.05).int() * torch.randint(
        1, 4, (slots_total, vocab), generator=g, dtype=torch.int32)
    params = torch.zeros(slots_total, 8)
    params[:, 0] = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0, 1.0])         # temperature
    params[:, 4] = torch.tensor([1.05, 1.0, 1.5, 0.9, 1.2, 2.0])        # repetition
    params[:, 5] = torch.tensor([0.0, 0.5, 0.2, 0.0, 1.0, 0.0])         # frequency
    params[:, 6] = torch.tensor([0.3, 0.0, 0.1, 0.0, 0.0, 1.5])         # presence
    slots = torch.tensor([4, 0, 5, 2])
    p = params[slots]
    ref = logits.clone()
    if penalties:
        ref = apply_penalties(ref, mask[slots], counts[slots], p[:, 4], p[:, 5], p[:, 6])
    ref = ref / p[:, 0:1]
    out = penalize_and_scale(logits.clone().to(DEV), mask.to(DEV), counts.to(DEV),
                             slots.to(DEV), params.to(DEV), (0, 4, 5, 6), penalties)
    assert rel_err(out.cpu(), ref) < 1e-6
