"""fp8 GEMM kernels against their torch twins under TRITON_INTERPRET=1: weight-only
(GEMV and tl.dot), SiLU-and-mul fused into the GEMV's load, its load placements and
chunked accumulator, fp8 x fp8 on quantized activations, and the per-token activation
quantization. Shapes and tolerances: tests/server/kernel_helpers.py."""

from __future__ import annotations

import pytest

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server.kernel_helpers import (DEV, TOL, fp8_case, quant_small_tiles,
                                         rel_err, torch, triton_quant)
from pagefleet.server.ops import activation, quant, triton_activation


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    quant_small_tiles(monkeypatch)


FP8_CASES = [
    # rows, K, N, (bn, bk): (1, K) per output row; blocks; (1, bk) rows of block scales
    (1, 96, 40, (1, 96)),
    (2, 200, 48, (16, 64)),      # K not a multiple of the block, N not of the tile
    (5, 64, 24, (1, 32)),
    (19, 128, 40, (32, 128)),
]


@pytest.mark.parametrize("case", FP8_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemv", [True, False])
def test_fp8_weight_only(case, dtype, gemv):
    m, k, n, block = case
    x, w, ws, b = fp8_case(m, k, n, block, dtype, seed=m + k + n)
    out = triton_quant.fp8_w8a16_linear(x, w, ws, block, None, b, gemv=gemv)
    ref = quant.fp8_linear(x.float(), w, ws, block, None, b.float())
    assert out.dtype == dtype and rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("case", FP8_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [1, 1000])
def test_fp8_silu_linear_is_the_two_kernels_bit_for_bit(case, dtype, splits, monkeypatch):
    """The down projection with SiLU-and-mul in the GEMV's activation load: the same bits
    as `silu_and_mul` then the GEMV (decode rows), and the two ops above the GEMV's batch;
    with and without split-K."""
    m, k, n, block = case
    monkeypatch.setitem(triton_quant.FP8_CONFIG, "target_programs", splits)
    gate_up = fp8_case(m, 2 * k, n, block, dtype, seed=3 * m + k)[0] * 3
    _, w, ws, b = fp8_case(m, k, n, block, dtype, seed=m + 2 * k)
    for gemv_max_m, fused_on in ((16, True), (0, True), (16, False)):
        monkeypatch.setitem(triton_quant.FP8_CONFIG, "gemv_max_m", gemv_max_m)
        monkeypatch.setitem(triton_quant.FP8_CONFIG, "silu_gemv", fused_on)
        fused = triton_quant.fp8_silu_linear(gate_up, w, ws, block, None, b)
        two = triton_quant.fp8_linear(triton_activation.silu_and_mul(gate_up), w, ws, block,
                                      None, b)
        assert fused.dtype == dtype and torch.equal(fused, two)
    ref = quant.fp8_linear(activation.silu_and_mul(gate_up.float()), w, ws, block, None,
                           b.float())
    assert rel_err(fused, ref) <= TOL[dtype] * 2


@pytest.mark.parametrize("case", FP8_CASES[:3])   # decode-sized rows (the GEMV's)
@pytest.mark.parametrize("prefetch,xb", [(True, False), (False, True), (True, True)])
def test_fp8_gemv_load_placements_change_no_bit(case, prefetch, xb, monkeypatch):
    """gemv_prefetch (the next tile's weights loaded a step ahead) and gemv_xb (the
    activations loaded in the weights' layout) move loads, not arithmetic: the shipped
    GEMV's bits, plain and with SiLU-and-mul in the load, with and without split-K."""
    m, k, n, block = case
    x, w, ws, b = fp8_case(m, k, n, block, torch.bfloat16, seed=5 * m + k)
    gate_up = fp8_case(m, 2 * k, n, block, torch.bfloat16, seed=7 * m + k)[0] * 3
    monkeypatch.setitem(triton_quant.FP8_CONFIG, "gemv_max_m", 16)
    for splits in (1, 1000):
        monkeypatch.setitem(triton_quant.FP8_CONFIG, "target_programs", splits)
        got = []
        for on in (False, True):
            monkeypatch.setitem(triton_quant.FP8_CONFIG, "gemv_prefetch", prefetch and on)
            monkeypatch.setitem(triton_quant.FP8_CONFIG, "gemv_xb", xb and on)
            got.append((triton_quant.fp8_w8a16_linear(x, w, ws, block, None, b, gemv=True),
                        triton_quant.fp8_silu_linear(gate_up, w, ws, block, None, b)))
        assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    ref = quant.fp8_linear(x.float(), w, ws, block, None, b.float())
    assert rel_err(got[1][0], ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("case", FP8_CASES[:3])   # decode-sized rows (the GEMV's)
@pytest.mark.parametrize("kchunk", [1, 4, 16])
def test_fp8_gemv_chunked_accumulator(case, kchunk, monkeypatch):
    """gemv_kchunk: the GEMV's accumulator summed a chunk of products per step (fewer
    registers): the twin's result within rounding, for row and block scales, with
    SiLU-and-mul in the load, with and without split-K (float32: the order of the sum is
    all that changes)."""
    m, k, n, block = case
    x, w, ws, b = fp8_case(m, k, n, block, torch.float32, seed=11 * m + k)
    gate_up = fp8_case(m, 2 * k, n, block, torch.float32, seed=13 * m + k)[0]
    monkeypatch.setitem(triton_quant.FP8_CONFIG, "gemv_max_m", 16)
    monkeypatch.setitem(triton_quant.FP8_CONFIG, "gemv_kchunk", kchunk)
    ref = quant.fp8_linear(x, w, ws, block, None, b)
    ref_silu = quant.fp8_linear(activation.silu_and_mul(gate_up), w, ws, block, None, b)
    for splits in (1, 1000):
        monkeypatch.setitem(triton_quant.FP8_CONFIG, "target_programs", splits)
        out = triton_quant.fp8_w8a16_linear(x, w, ws, block, None, b, gemv=True)
        assert rel_err(out, ref) <= 1e-6
        assert rel_err(triton_quant.fp8_silu_linear(gate_up, w, ws, block, None, b),
                       ref_silu) <= 1e-6


@pytest.mark.parametrize("case", FP8_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_on_fp8_activations(case, dtype):
    """The fp8 x fp8 kernel on the same e4m3 activations and row scales as its twin."""
    m, k, n, block = case
    x, w, ws, b = fp8_case(m, k, n, block, dtype, seed=2 * m + k)
    q, a_scale = quant.quantize_fp8_per_token(x)
    out = triton_quant.fp8_gemm_a8(q, a_scale, w, ws, block, b, dtype, scaled_mm=False)
    ref = quant.fp8_gemm_a8(q, a_scale, w, ws, block, b, torch.float32)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("static", [False, True])
def test_per_token_activation_quantization(static):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 150, generator=g) * torch.linspace(0.1, 5, 7)[:, None]).to(DEV)
    x[2] = 0.0                                             # an all-zero row
    scale = torch.tensor([0.01], device=DEV) if static else None
    qa, sa = triton_quant.quantize_fp8_per_token(x, scale)
    qb, sb = quant.quantize_fp8_per_token(x, scale)
    assert torch.allclose(sa, sb, rtol=1e-6, atol=0)
    a, b = qa.float().cpu(), qb.float().cpu()
    diff = a != b
    if triton_quant._INTERPRET:
        # The interpreter drops the carry when rounding up crosses a power of two (it
        # yields half the value); the GPU's cvt rounds correctly (checked in
        # quant_bench.py). Anything else is a real difference.
        carry = (a == b / 2) & (torch.log2(b.abs()).frac() == 0)
        assert bool((~diff | carry).all()) and diff.float().mean() < 0.05
    else:
        assert not diff.any()


def test_large_batches_take_fp8_activations(monkeypatch):
    """fp8_linear: weight-only up to w8a16_max_m rows, then fp8 x fp8."""
    x, w, ws, b = fp8_case(20, 64, 32, (1, 64), torch.float32, 9)
    monkeypatch.setitem(triton_quant.FP8_CONFIG, "w8a16_max_m", 8)
    a8 = triton_quant.fp8_linear(x, w, ws, (1, 64), None, b)
    assert rel_err(a8, quant.fp8_w8a8_linear(x, w, ws, (1, 64), None, b)) < 0.05
    assert rel_err(a8, quant.fp8_linear(x, w, ws, (1, 64), None, b)) > 1e-4
    monkeypatch.setitem(triton_quant.FP8_CONFIG, "w8a16_max_m", 32)
    a16 = triton_quant.fp8_linear(x, w, ws, (1, 64), None, b)
    assert rel_err(a16, quant.fp8_linear(x, w, ws, (1, 64), None, b)) <= 1e-5
