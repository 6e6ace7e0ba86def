"""The w4 GEMV's inline-PTX decodes (`server/ops/gluon_w4.py`), run on the CPU by a small
emulator of the instructions they use (`ptx_subset`): each word's nibbles come out as
`q - z`, bit for bit, for every zero point and every nibble."""

from __future__ import annotations

import numpy as np
import pytest

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
