"""The w4 GEMV's inline-PTX decodes (`server/ops/gluon_w4.py`), run on the CPU by a small
emulator of the instructions they use (`ptx_subset`): each word's nibbles come out as
`q - z` (the shipped decodes) or as `bias + q` with the bias `FOLD_BIASES` names (the
folded ones, whose bias and zero point the TMA kernel takes off after the MMA). Then the
folded arithmetic itself: a tile's product with those corrections equals sum((q - z) x),
and in float32 its error stays below that of the weights dequantized to fp16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server import kernel_helpers  # noqa: F401
from tests.server import ptx_subset
from pagefleet.server.ops import gluon_w4

RNG = np.random.default_rng(7)
WORDS = np.concatenate([RNG.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32),
                        np.array([0, 0xFFFFFFFF, 0x12345678, 0x87654321], dtype=np.uint32)])
ZEROS = RNG.integers(0, 16, WORDS.shape).astype(np.uint32)


def nibbles(words: np.ndarray) -> np.ndarray:
    """`[n, 8]`: nibble i of each word (K row 8 j + i of its tile)."""
    return np.stack([(words >> np.uint32(4 * i)) & 0xF for i in range(8)], 1).astype(np.int64)


def magic_bits(z: np.ndarray, f16: bool) -> np.ndarray:
    """`gluon_w4._magic_bits`: (1024 or 128) + z as a 16-bit pattern, twice."""
    return ((0x6400 if f16 else 0x4300) + z) * 0x10001


def fma_bits(z: np.ndarray) -> np.ndarray:
    """`gluon_w4._fma_bits`: -(64 + z) in fp16, twice."""
    return (0xD400 + 16 * z) * 0x10001


@pytest.mark.parametrize("f16", [True, False])
def test_subtracting_decode_gives_q_minus_z(f16):
    out = ptx_subset.run(gluon_w4._pair_asm(f16), {8: WORDS, 9: magic_bits(ZEROS, f16)})
    decode = ptx_subset.f16_bits if f16 else ptx_subset.bf16_bits
    q = nibbles(WORDS)
    for p in range(4):
        np.testing.assert_array_equal(decode(out[2 * p]), q[:, p] - ZEROS)
        np.testing.assert_array_equal(decode(out[2 * p + 1]), q[:, p + 4] - ZEROS)


def test_fma_decode_gives_q_minus_z():
    out = ptx_subset.run(gluon_w4._pair_asm_fma(),
                         {8: WORDS, 9: magic_bits(ZEROS, True), 10: fma_bits(ZEROS)})
    q = nibbles(WORDS)
    for p in range(4):
        np.testing.assert_array_equal(ptx_subset.f16_bits(out[2 * p]), q[:, p] - ZEROS)
        np.testing.assert_array_equal(ptx_subset.f16_bits(out[2 * p + 1]), q[:, p + 4] - ZEROS)


def fold_values(fold: int, words: np.ndarray) -> np.ndarray:
    """`[n, 8]` the folded decode's values for each word's nibbles, by emulation: the
    outputs are 32-bit pairs (nibble p low, nibble p + 4 high)."""
    out = ptx_subset.run(gluon_w4._pair_asm_fold(fold), {4: words, 5: words})
    vals = np.zeros((len(words), 8))
    for p in range(4):
        lo, hi = (out[p] & 0xFFFF).astype(np.uint16), (out[p] >> 16).astype(np.uint16)
        vals[:, p], vals[:, p + 4] = ptx_subset.f16_bits(lo), ptx_subset.f16_bits(hi)
    assert set(out) == {0, 1, 2, 3}, "the folded decode writes its four pairs only"
    return vals


@pytest.mark.parametrize("fold", [1, 2])
def test_folded_decode_gives_the_row_bias_plus_q(fold):
    even, odd = gluon_w4.FOLD_BIASES[fold]
    bias = np.array([even if i % 2 == 0 else odd for i in range(8)])
    np.testing.assert_array_equal(fold_values(fold, WORDS), nibbles(WORDS) + bias)


def test_folded_decode_rejects_an_unknown_form():
    with pytest.raises(ValueError, match="fold must be 1 or 2"):
        gluon_w4._pair_asm_fold(3)


def corrections(x: np.ndarray, fold: int) -> tuple[float, float]:
    """(C, S) of one K tile as `gluon_w4_tma._fold_corrections` computes them: C weights
    each activation by its K row's bias (even rows FOLD_BIASES[fold][0], odd [1])."""
    even, odd = gluon_w4.FOLD_BIASES[fold]
    w = np.where(np.arange(len(x)) % 2 == 0, even, odd)
    return float((w * x).sum()), float(x.sum())


@pytest.mark.parametrize("fold", [1, 2])
def test_folded_tile_product_equals_q_minus_z(fold):
    """Exact arithmetic: sum((bias + q) x) - C - z S over one 128-row tile (16 words a
    row, K row 8 j + i in nibble i of word j) is sum((q - z) x)."""
    n = 64
    words = RNG.integers(0, 2 ** 32, (n, 16), dtype=np.uint64).astype(np.uint32)
    z = RNG.integers(0, 16, n)
    x = torch.randn(128).half().double().numpy()
    vals = fold_values(fold, words.reshape(-1)).reshape(n, 128)    # [row, 8 j + i]
    q = nibbles(words.reshape(-1)).reshape(n, 128)
    c, s = corrections(x, fold)
    got = vals @ x - c - z * s
    np.testing.assert_allclose(got, (q - z[:, None]) @ x, rtol=0, atol=1e-9)


def _tile_sums_f32(a: torch.Tensor, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """One tile's MMA chain as float32: from `start`, 8 steps of 16 products each."""
    acc = start.float().clone()
    for c in range(8):
        sl = slice(16 * c, 16 * c + 16)
        acc = acc + (a[:, sl].float() * x[sl].float()).sum(1)
    return acc


@pytest.mark.parametrize("fold", [1, 2])
@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_folded_float32_error_is_below_fp16_dequantized_weights(fold, spread):
    """The folded sums carry the bias (C is ~1024 x the activations), so they round
    more than the exact decode; what HF and vLLM multiply, weights dequantized to fp16,
    rounds more still: the folded GEMV stays the closer of the two to the exact
    product, on average by well over 4x."""
    g = torch.Generator().manual_seed(3)
    n, k = 256, 1024
    q = torch.randint(0, 16, (n, k), generator=g)
    z = torch.randint(0, 16, (n, k // 128), generator=g)
    s = (torch.rand(n, k // 128, generator=g) * 0.02 + 0.001).half()
    x = (torch.randn(k, generator=g) * torch.where(torch.rand(k, generator=g) < 0.01,
                                                     spread, 1.0)).half()
    even, odd = gluon_w4.FOLD_BIASES[fold]
    bias = torch.tensor([even if i % 2 == 0 else odd for i in range(k)])
    zk = z.repeat_interleave(128, 1)
    exact = ((q - zk).double() * s.double().repeat_interleave(128, 1)) @ x.double()
    folded = torch.zeros(n)
    for t in range(k // 128):
        sl = slice(128 * t, 128 * t + 128)
        c, sm = corrections(x[sl].double().numpy(), fold)
        start = -(torch.tensor(c) + z[:, t] * torch.tensor(sm))
        prod = _tile_sums_f32(bias[sl] + q[:, sl], x[sl], start)
        folded = folded + prod * s[:, t].float()
    dequant = ((q - zk).float() * s.float().repeat_interleave(128, 1)).half().float() @ x.float()
    err_fold = (folded.double() - exact).abs()
    err_deq = (dequant.double() - exact).abs()
    assert err_fold.mean() * 4 < err_deq.mean(), (err_fold.mean(), err_deq.mean())
    assert err_fold.max() < err_deq.max(), (err_fold.max(), err_deq.max())
