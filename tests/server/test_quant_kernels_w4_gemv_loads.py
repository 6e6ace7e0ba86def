"""The int4 GEMV's load placements under TRITON_INTERPRET=1: the next K tile's words
(and scales, zero points) loaded a step ahead, and unmasked loads where the tiles
divide N and K, are the plain kernel's bits. Shapes: tests/server/kernel_helpers.py."""

from __future__ import annotations

import pytest

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server.kernel_helpers import (int4_case, quant_small_tiles,
                                         record_launches, rel_err, torch, triton_quant)
from pagefleet.server.ops import quant


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    quant_small_tiles(monkeypatch)


@pytest.mark.parametrize("xvec", [False, True])
@pytest.mark.parametrize("k,group,zeros", [(200, 32, True), (256, 128, False)])
def test_w4_gemv_prefetch_is_the_plain_loops_bits(xvec, k, group, zeros, monkeypatch):
    """`gemv_prefetch` (1: the next K tile's words loaded a step ahead, past the split's
    end too; 2: its scales and zero points as well) is the plain loop's arithmetic: the
    same bits with N not a multiple of the tile, one split and many, split-K summed in
    the kernel or after, a bias or none. The launches are recorded, so the GEMV path is
    the one compared."""
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_xvec", xvec)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_max_m", 16)
    m, n = 2, 40
    x, qw, s, z, b = int4_case(m, k, n, group, zeros, torch.bfloat16, seed=k + group)
    launches = record_launches(monkeypatch)
    # fused_reduce only picks how several splits are summed: one split (target 1) is
    # the same launch either way, so it runs once.
    for target, fused in ((1, False), (1000, False), (1000, True)):
        monkeypatch.setitem(triton_quant.W4_CONFIG, "target_programs", target)
        monkeypatch.setitem(triton_quant.W4_CONFIG, "fused_reduce", fused)
        for bias in (b, None):
            got = []
            for prefetch in (0, 1, 2):
                monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_prefetch", prefetch)
                launches.clear()
                got.append(triton_quant.w4a16_linear(x, qw, s, z, group, bias))
                assert launches == [m * -(-n // 16)]
            assert all(torch.equal(got[0], g) for g in got[1:])


@pytest.mark.parametrize("k,group,zeros", [(256, 64, True), (512, 128, False), (256, 256, True)])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_w4_gemv_unmasked_tiles_are_the_masked_bits(k, group, zeros, prefetch, monkeypatch):
    """Where the tiles divide N and K the GEMV loads without masks (`EVEN`; the
    prefetch's last tile reloads itself rather than read past the split): its columns
    are the masked kernel's bits, taken from the same weights narrowed to a width the
    tile does not divide (same tiles and splits), with one split and many."""
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_max_m", 16)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_block_k", 128)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_prefetch", prefetch)
    x, qw, s, z, b = int4_case(2, k, 48, group, zeros, torch.bfloat16, seed=k + group)
    narrow = [t[..., :40].contiguous() if t is not None else None for t in (qw, s, z, b)]
    for target in (1, 1000):
        monkeypatch.setitem(triton_quant.W4_CONFIG, "target_programs", target)
        even = triton_quant.w4a16_linear(x, qw, s, z, group, b)
        masked = triton_quant.w4a16_linear(x, narrow[0], narrow[1], narrow[2], group, narrow[3])
        assert torch.equal(even[:, :40], masked)
        assert rel_err(even.float(), quant.w4a16_linear(x, qw, s, z, group, b).float()) < 1e-2
