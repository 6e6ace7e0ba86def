"""int4 (AWQ / GPTQ) weight-only GEMM kernels against their torch twins under
TRITON_INTERPRET=1: the GEMV, the tl.dot kernels, dequantize-then-matmul, multi-group
GEMV tiles, the launch shape classes, split-K, and the tensor-core GEMV. Shapes and
tolerances: tests/server/kernel_helpers.py; the GEMV's load placements:
test_quant_kernels_w4_gemv_loads.py."""

from __future__ import annotations

import pytest

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server.kernel_helpers import (TOL, int4_case, quant_small_tiles,
                                         record_launches, rel_err, torch, triton_quant)
from pagefleet.server.ops import quant


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    quant_small_tiles(monkeypatch)


W4_CASES = [
    # rows, K, N, group (K = one group per column), zeros
    (1, 64, 32, 32, True),
    (1, 200, 40, 128, True),     # K not a multiple of the group; N not of the tile
    (2, 96, 24, 96, False),      # one group per column (-1), symmetric
    (3, 136, 24, 64, True),      # short last group
    (17, 64, 40, 32, False),     # rows not a multiple of the block
]


# The GEMV runs one program row per input row: it is tested at small batches only.
# "dequant": the whole weight dequantized by its kernel, then a plain matmul (prefill).
@pytest.mark.parametrize("case,path", [(c, p) for c in W4_CASES
                                       for p in ("gemv", "gemv_xvec", "gemm", "gemm_planes",
                                                 "dequant")
                                       if not p.startswith("gemv") or c[0] <= 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_w4a16(case, dtype, path, monkeypatch):
    m, k, n, group, zeros = case
    # gemv_xvec: the GEMV with each word row's 8 activations in one vector load
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_xvec", path == "gemv_xvec")
    # gemm_planes: the tl.dot kernel with each word loaded once and split into nibble planes
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemm_planes", path == "gemm_planes")
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_max_m", 16 if path.startswith("gemv") else 0)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "dequant_min_m", 1 if path == "dequant" else 10 ** 9)
    x, qw, s, z, b = int4_case(m, k, n, group, zeros, dtype, seed=m * 1000 + k + n)
    out = triton_quant.w4a16_linear(x, qw, s, z, group, b)
    ref = quant.w4a16_linear(x.float(), qw, s, z, group, b.float())
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("case", W4_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w4_dequantize_is_the_twins_bit_for_bit(case, dtype):
    """Nibbles read through the float bit trick, not an int-to-float conversion: the
    same float32 values, every nibble position, every zero point (bfloat16 within its
    rounding: the interpreter's float32 -> bfloat16 conversion is not round-to-nearest)."""
    _, k, n, group, zeros = case
    _, qw, s, z, _ = int4_case(1, k, n, group, zeros, dtype, seed=k + n)
    out = triton_quant.w4_dequantize(qw, s, z, group, dtype)
    ref = quant.w4_dequantize(qw, s, z, group, dtype)
    if dtype == torch.float32:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("k,group,block_k", [(200, 32, 64), (136, 32, 128), (256, 64, 128),
                                             (96, 16, 64)])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("xvec", [False, True])
def test_w4_gemv_tile_spans_groups(k, group, block_k, zeros, xvec, monkeypatch):
    """A GEMV tile of several groups (one scale row per slice): K ending inside a slice
    and slices wholly past K, with and without split-K; activations loaded a scalar at a
    time or a word row's 8 at once (`gemv_xvec`)."""
    assert triton_quant._gemv_tile(block_k, group, k) == (block_k, block_k // group)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_xvec", xvec)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_max_m", 16)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_block_k", block_k)
    x, qw, s, z, b = int4_case(2, k, 40, group, zeros, torch.float32, seed=k + group)
    ref = quant.w4a16_linear(x, qw, s, z, group, b)
    for target in (1, 1000):
        monkeypatch.setitem(triton_quant.W4_CONFIG, "target_programs", target)
        assert rel_err(triton_quant.w4a16_linear(x, qw, s, z, group, b), ref) <= 1e-5


@pytest.mark.parametrize("m,k,n,tiles", [
    (1, 64, 96, 12),    # wide: 6 tiles of 16 fill the target of 6 -> 8-column tiles
    (2, 64, 48, 12),    # wide by its rows: 3 tiles x 2 rows
    (1, 256, 40, 2),    # deep: K >= 4 N -> 32-column tiles
    (1, 96, 40, 3),     # neither: the base 16-column tiles
    (1, 512, 96, 12),   # wide and deep (512 >= 4 x 96): wide wins
])
def test_w4_gemv_launch_config_follows_the_layer_shape(m, k, n, tiles, monkeypatch):
    """W4_CONFIG's gemv_wide / gemv_deep: the shape class picks the launch (the recorded
    output tiles show which), and each class's output is the twin's."""
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_max_m", 2)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "target_programs", 6)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_wide", {"gemv_block_n": 8, "gemv_warps": 2})
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_deep", {"gemv_block_n": 32})
    launches = record_launches(monkeypatch)
    x, qw, s, z, b = int4_case(m, k, n, 32, True, torch.float32, seed=m + k + n)
    out = triton_quant.w4a16_linear(x, qw, s, z, 32, b)
    assert launches == [tiles]
    assert rel_err(out, quant.w4a16_linear(x, qw, s, z, 32, b)) <= 1e-5


@pytest.mark.parametrize("planes", [False, True])
def test_w4a16_split_k_and_single_split_agree(planes, monkeypatch):
    """Split-K (summed by the last program) against one split, GEMV and tl.dot paths
    (`gemm_planes`: the word-once tl.dot kernel)."""
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemm_planes", planes)
    x, qw, s, z, b = int4_case(2, 256, 32, 32, True, torch.float32, 7)
    ref = quant.w4a16_linear(x, qw, s, z, 32, b)
    for path in (0,) if planes else (16, 0):
        monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_max_m", path)
        for target in (1, 1000):
            monkeypatch.setitem(triton_quant.W4_CONFIG, "target_programs", target)
            tiles = 2 * 2 if path else 2
            assert (triton_quant._splits(tiles, 256, 32, x.device, triton_quant.W4_CONFIG)[0] > 1) \
                == (target == 1000)
            assert rel_err(triton_quant.w4a16_linear(x, qw, s, z, 32, b), ref) <= 1e-5


TC_CASES = [
    # rows, K, N, group (K: one group a column), zeros
    (1, 256, 40, 128, True),     # N not a multiple of the tile
    (2, 384, 64, 384, False),    # one group a column, symmetric
    (9, 256, 72, 256, True),     # 16-row operand
    (16, 128, 32, 128, False),
]


@pytest.mark.parametrize("case", TC_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4_tensor_core_gemv(case, dtype, monkeypatch):
    """The tensor-core GEMV (`_w4_gemv_tc_kernel`, the interpreter's twin of its inline
    PTX): the twin's result with one split and many, split-K summed in the kernel and
    after, a bias and none; the call really took it."""
    m, k, n, group, zeros = case
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_tc_min_m", 1)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_tc_max_m", 16)
    calls = []
    tc = triton_quant._w4_gemv_tc
    monkeypatch.setattr(triton_quant, "_w4_gemv_tc", lambda *a: calls.append(1) or tc(*a))
    x, qw, s, z, b = int4_case(m, k, n, group, zeros, dtype, seed=m + k + n)
    for target in (1, 1000):
        monkeypatch.setitem(triton_quant.W4_CONFIG, "target_programs", target)
        for fused in (False, True):
            monkeypatch.setitem(triton_quant.W4_CONFIG, "fused_reduce", fused)
            for bias in (b, None):
                out = triton_quant.w4a16_linear(x, qw, s, z, group, bias)
                ref = quant.w4a16_linear(x.float(), qw, s, z, group,
                                         None if bias is None else bias.float())
                assert out.dtype == dtype and out.shape == (m, n)
                assert rel_err(out, ref) <= TOL[dtype]
    assert len(calls) == 8


@pytest.mark.parametrize("m,k,group,dtype,takes", [
    (2, 256, 128, torch.bfloat16, True),
    (16, 256, -1, torch.float16, True),
    (1, 256, 128, torch.bfloat16, False),     # below gemv_tc_min_m
    (17, 256, 128, torch.bfloat16, False),    # past gemv_tc_max_m
    (2, 200, 200, torch.bfloat16, False),     # K not a multiple of 128
    (2, 256, 64, torch.bfloat16, False),      # a 128-row tile would span two groups
    (2, 256, 128, torch.float32, False),      # float32 activations
])
def test_w4_tensor_core_gemv_takes_only_what_it_can(m, k, group, dtype, takes, monkeypatch):
    """Calls outside the tensor-core GEMV's reach go to the other paths, with the twin's
    result either way."""
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_tc_min_m", 2)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_tc_max_m", 16)
    monkeypatch.setitem(triton_quant.W4_CONFIG, "gemv_max_m", 2)
    calls = []
    tc = triton_quant._w4_gemv_tc
    monkeypatch.setattr(triton_quant, "_w4_gemv_tc", lambda *a: calls.append(1) or tc(*a))
    g = k if group == -1 else group
    x, qw, s, z, b = int4_case(m, k, 40, g, True, dtype, seed=m + k)
    out = triton_quant.w4a16_linear(x, qw, s, z, g, b)
    assert bool(calls) == takes
    assert rel_err(out, quant.w4a16_linear(x.float(), qw, s, z, g, b.float())) <= TOL[dtype]


@pytest.mark.parametrize("m,n,k,group,dtype,fits", [
    (1, 4608, 3584, 128, torch.float16, True),     # Qwen2.5-7B qkv, one row
    (8, 3584, 18944, 128, torch.bfloat16, True),   # down, 8 rows
    (3, 128, 1280, 1280, torch.float16, True),     # one group a column
    (9, 4608, 3584, 128, torch.float16, False),    # past operand B's 8 columns
    (0, 4608, 3584, 128, torch.float16, False),
    (1, 4600, 3584, 128, torch.float16, False),    # N not a multiple of the tile
    (1, 4608, 3600, 3600, torch.float16, False),   # K not a multiple of 128
    (1, 4608, 3584, 64, torch.float16, False),     # a 128-row tile would span two groups
    (1, 4608, 3584, 128, torch.float32, False),    # float32 activations
])
def test_gluon_gemv_takes_only_what_it_computes(m, n, k, group, dtype, fits):
    """The Gluon tensor-core GEMV (ops/gluon_w4.py; GPU only, checked against the twin by
    benchmarks/gemv_mma_check.py, compiled for sm_90 by test_kernels_compile.py) is asked
    only for calls it computes; here, off the GPU, never at all, and the Triton paths give
    the twin's result with it configured for every batch up to 8."""
    from pagefleet.server.ops import gluon_w4
    assert gluon_w4.fits(m, n, k, group, 64, dtype) is fits
    x = torch.zeros(max(m, 1), k, dtype=dtype)
    assert not gluon_w4.usable(x, n, k, group, 64)



@pytest.mark.parametrize("m, changes, ring", [
    (1, {}, False), (4, {}, False), (7, {}, False), (8, {}, True),
    (8, {"gemv_mma_ring_min_m": 0}, False),                        # 0: never
    (8, {"gemv_mma_stages": 1}, False),                            # a ring needs two tiles
    (2, {"gemv_mma_ring_min_m": 2}, True), (1, {"gemv_mma_ring_min_m": 2}, False),
])
def test_gluon_gemv_ring_serves_its_rows(m, changes, ring):
    """The shipped W4_CONFIG stages the Gluon GEMV's operands through the cp.async ring
    from 8 rows (the decode graphs' size for 5-8 sequences), where it measured faster,
    and keeps the register kernel below (faster at 1-4 rows; BENCHMARKS.md, 2026-12-04,
    twelfth session)."""
    from pagefleet.server.ops import triton_quant as tq
    assert tq.ring_serves(m, {**tq.W4_CONFIG, **changes}) is ring


@pytest.mark.parametrize("m, n, k, sms, tma, plan", [
    # Qwen2.5-7B's layers on an H200's 132 multiprocessors: (splits, K a split, ring,
    # tiles of weights in flight, tiles of the row staged in shared memory, TMA ring
    # slots, TMA register cap, the blocked copy and stream-K programs: A/Bs' only)
    (1, 37888, 3584, 132, True, (1, 3584, False, 1, 32, 6, 48, False, 0)),   # gate_up: TMA, unsplit
    (1, 3584, 18944, 132, True, (11, 1792, False, 1, 16, 4, 48, False, 0)),  # down: 14-tile splits
    (1, 4608, 3584, 132, True, (10, 384, False, 1, 0, 0, 0, False, 0)),      # qkv: registers
    (1, 3584, 3584, 132, True, (14, 256, False, 1, 0, 0, 0, False, 0)),      # o
    # tensors TMA cannot read: the register kernel's plans
    (1, 37888, 3584, 132, False, (1, 3584, False, 3, 32, 0, 0, False, 0)),
    (1, 3584, 18944, 132, False, (11, 1792, False, 3, 16, 0, 0, False, 0)),  # 5 an SM, 3 deep
    (2, 37888, 3584, 132, True, (1, 3584, False, 3, 0, 0, 0, False, 0)),     # 2-4 rows: no staging
    (4, 3584, 18944, 132, True, (14, 1408, False, 1, 0, 0, 0, False, 0)),    # ... the base split
    (8, 37888, 3584, 132, True, (1, 3584, True, 1, 0, 0, 0, False, 0)),      # the ring's rows
    # one multiprocessor: down is unsplit, its 148 K tiles too many to stage
    (1, 3584, 18944, 1, True, (1, 18944, False, 3, 0, 0, 0, False, 0)),
])
def test_gluon_gemv_plan_by_layer_class(m, n, k, sms, tma, plan):
    """At one row gate_up and down run the TMA kernel (gate_up unsplit, down in 14-tile
    splits: 616 programs, one wave at 5 an SM), qkv and o the register kernel; where
    the tensors do not allow TMA, the register kernel stages the row and keeps three
    tiles in flight; at 2-4 rows gate_up is three tiles deep (W4_CONFIG gemv_mma_one_row
    / gemv_mma_rows: BENCHMARKS.md, 2026-12-04, thirteenth to fifteenth sessions). The
    plan depends on the shape, the GPU and the tensors' alignment only, so a captured
    graph replays it."""
    from pagefleet.server.ops import triton_quant as tq
    got = tq.mma_plan(m, n, k, sms, tq.W4_CONFIG, tma)
    assert tuple(got) == plan
    assert got.splits * got.per >= k > (got.splits - 1) * got.per
    assert got.xs_tiles * 128 * 2 <= 16 * 1024   # the staged row's shared memory
    assert got.stages <= got.per // 128          # no ring slot the split never fills


@pytest.mark.parametrize("block_n, warps", [(128, 4), (32, 4), (16, 1)])
def test_tma_plan_needs_a_warp_per_16_columns(block_n, warps):
    """The TMA kernel's register layouts give each math warp 16 columns of the tile
    (and a 32-column TMA box at least): other tilings keep the register kernel's plan."""
    from pagefleet.server.ops import triton_quant as tq
    cfg = {**tq.W4_CONFIG, "gemv_mma_block_n": block_n, "gemv_mma_warps": warps}
    assert tq.mma_plan(1, 3584, 18944, 132, cfg).stages == 0     # down
    cfg.update(gemv_mma_block_n=128, gemv_mma_warps=8)
    assert tq.mma_plan(1, 3584, 18944, 132, cfg).stages == 4


def test_blocked_copy_is_an_ab_plan_key_where_k_fills_its_tiles():
    """A "tma" plan's "blocked" key, or a class's (the layout A/B: the TMA or register
    kernel reads a copy of the layer with each column tile's rows together) is a key
    `mma_plan` reads, and holds only where K is whole 128-row tiles (a box of a ragged last tile would read the next
    column tile's rows)."""
    import copy

    from pagefleet.server.ops import triton_quant as tq
    one_row = copy.deepcopy(tq.W4_CONFIG["gemv_mma_one_row"])
    one_row["unsplit"]["tma"]["blocked"] = True
    cfg = {**tq.W4_CONFIG, "gemv_mma_one_row": one_row}
    assert tq.plan_key_errors(cfg) == []
    assert tq.mma_plan(1, 37888, 3584, 132, cfg).blocked
    assert not tq.mma_plan(1, 37888, 3584 + 64, 132, cfg).blocked
    assert not tq.mma_plan(1, 3584, 18944, 132, cfg).blocked     # down: not asked
    assert not tq.mma_plan(1, 37888, 3584, 132, tq.W4_CONFIG).blocked
    # a register-kernel class (q/k/v, o at one row) takes the key beside its plan's
    one_row["other"] = {"blocked": True}
    assert tq.plan_key_errors(cfg) == []
    qkv = tq.mma_plan(1, 4608, 3584, 132, cfg)
    assert qkv.blocked and not qkv.stages and not qkv.ring


@pytest.mark.parametrize("tiles_n, tiles_k, programs", [
    (592, 28, 660), (56, 148, 660), (592, 28, 528), (7, 5, 9), (3, 4, 100), (64, 28, 64)])
def test_stream_k_ranges_cover_every_tile_once(tiles_n, tiles_k, programs):
    """The stream-K grid (`gluon_w4_tma.stream_shape` / `stream_owner`, what
    `_w4_gemv_tma_stream_kernel` computes): program p's range [p T / P, (p + 1) T / P)
    of the T = tiles_n x tiles_k tiles, none empty, cover every tile once; each column
    tile's segments go to distinct partial-sum slots (the program's rank among the tile's
    owners) below the plan's count; no segment is longer than the staged row. Summed the
    kernel's way (a segment's tiles, then the slots in order) a product equals the whole."""
    import torch

    from pagefleet.server.ops import gluon_w4_tma as gt
    p, parts, longest = gt.stream_shape(tiles_n, tiles_k, programs)
    total = tiles_n * tiles_k
    assert p == min(programs, total)
    g = torch.Generator().manual_seed(tiles_n * 31 + tiles_k)
    w = torch.randint(-8, 8, (tiles_n, tiles_k), generator=g).double()
    slots = torch.zeros(tiles_n, parts, dtype=torch.float64)
    seen = torch.zeros(tiles_n, tiles_k, dtype=torch.int64)
    for q in range(p):
        g0, g1 = q * total // p, (q + 1) * total // p
        assert g1 > g0
        for b in range(g0 // tiles_k, (g1 - 1) // tiles_k + 1):
            s0, s1 = max(g0, b * tiles_k), min(g1, (b + 1) * tiles_k)
            assert s1 - s0 <= longest
            first = gt.stream_owner(b * tiles_k, total, p)
            count = gt.stream_owner((b + 1) * tiles_k - 1, total, p) - first + 1
            assert 0 <= q - first < count <= parts
            assert all(gt.stream_owner(t, total, p) == q for t in range(s0, s1))
            seen[b, s0 - b * tiles_k:s1 - b * tiles_k] += 1
            slots[b, q - first] += w[b, s0 - b * tiles_k:s1 - b * tiles_k].sum()
    assert bool((seen == 1).all())
    assert torch.equal(slots.sum(1), w.sum(1))


def test_stream_plan_key():
    """A "tma" plan's "stream" key (programs an SM): the stream-K form at gate_up's and
    down's shapes, its partial sums counted and its longest segment staged; none without
    the fused split-K sum it relies on, and none unless asked."""
    import copy

    from pagefleet.server.ops import triton_quant as tq
    one_row = copy.deepcopy(tq.W4_CONFIG["gemv_mma_one_row"])
    for cls in ("unsplit", "deep"):
        one_row[cls]["tma"]["stream"] = 5
    cfg = {**tq.W4_CONFIG, "gemv_mma_one_row": one_row}
    assert tq.plan_key_errors(cfg) == []
    gate_up = tq.mma_plan(1, 37888, 3584, 132, cfg)
    assert (gate_up.stream, gate_up.splits, gate_up.xs_tiles, gate_up.stages) == (660, 3, 32, 6)
    down = tq.mma_plan(1, 3584, 18944, 132, cfg)
    assert (down.stream, down.xs_tiles, down.stages) == (660, 16, 4) and down.splits >= 12
    assert tq.mma_plan(1, 37888, 3584, 132, cfg, stream=False).stream == 0
    assert tq.mma_plan(1, 37888, 3584, 132, {**cfg, "fused_reduce": False}).stream == 0
    assert tq.mma_plan(1, 37888, 3584, 132, tq.W4_CONFIG).stream == 0
    assert tq.mma_plan(1, 4608, 3584, 132, cfg).stream == 0      # qkv: the register kernel


def test_block_columns_stores_each_column_tile_contiguously():
    """`gluon_w4_tma.block_columns`: column tile b's rows r (words, scales, zero points)
    at row b x rows + r of a `[tiles x rows, block_n]` tensor, so a program's stream is
    one contiguous range; the copy keeps every value."""
    import torch

    from pagefleet.server.ops import gluon_w4_tma as gt
    g = torch.Generator().manual_seed(0)
    qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (48, 192), dtype=torch.int32, generator=g)
    s = torch.rand(3, 192, generator=g).half()
    z = torch.randint(0, 16, (3, 192), dtype=torch.uint8, generator=g)
    bq, bs, bz = gt.block_columns(qw, s, z, 64)
    assert bq.shape == (3 * 48, 64) and bq.is_contiguous() and bs.shape == bz.shape == (9, 64)
    for b in range(3):
        assert torch.equal(bq[b * 48:(b + 1) * 48], qw[:, b * 64:(b + 1) * 64])
        assert torch.equal(bs[b * 3:(b + 1) * 3], s[:, b * 64:(b + 1) * 64])
        assert torch.equal(bz[b * 3:(b + 1) * 3], z[:, b * 64:(b + 1) * 64])
    assert gt.block_columns(qw, s, None, 64)[2] is None


def test_plan_keys_no_plan_reads_are_named():
    """`plan_key_errors`: the shipped class tables carry only keys `mma_plan` reads, and
    a misspelt key, a saved patch's key without the patch ("smem_ahead") or an unknown
    class is named, so the benchmarks refuse such a variant instead of timing the
    shipped kernel under its name (the twenty-first session's A/B first ran so)."""
    import copy

    from pagefleet.server.ops import triton_quant as tq
    assert tq.plan_key_errors(tq.W4_CONFIG) == []
    one_row = copy.deepcopy(tq.W4_CONFIG["gemv_mma_one_row"])
    one_row["unsplit"]["tma"]["stagse"] = 8
    one_row["deep"]["depht"] = 3
    one_row["unspilt"] = {"tma": {"stages": 6, "maxnreg": 48}}
    rows = {"unsplit": {"depth": 3, "tma": {"stages": 2, "maxnreg": 48, "smem_ahead": True}}}
    assert tq.plan_key_errors({**tq.W4_CONFIG, "gemv_mma_one_row": one_row,
                               "gemv_mma_rows": rows}) == [
        "gemv_mma_one_row.unsplit.tma: unknown key 'stagse'",
        "gemv_mma_one_row.deep: unknown key 'depht'",
        "gemv_mma_one_row: unknown class 'unspilt'",
        "gemv_mma_rows.unsplit.tma: unknown key 'smem_ahead'"]


def _tma_layer(n: int = 4608, k: int = 3584):
    import torch
    return (torch.zeros(k // 8, n, dtype=torch.int32), torch.ones(k // 128, n, dtype=torch.float16),
            torch.zeros(k // 128, n, dtype=torch.uint8))


def test_tma_descriptors_keep_no_weight_alive():
    """The TMA kernel's descriptors are cached per (address, shape, dtype) so a decode
    step builds none, and hold no reference to the weights: a finished engine's weights
    must be freed (a module-level cache that held tensors once kept every finished
    engine's KV cache alive)."""
    import gc
    import weakref

    from pagefleet.server.ops import gluon_w4_tma as gt
    if not gt.IMPORTED:
        pytest.skip("no Gluon in this Triton")
    qw, s, z = _tma_layer()
    first = gt.descriptors(qw, s, z, 64)
    assert gt.descriptors(qw, s, z, 64) == first and gt.descriptors(qw, s, z, 64)[0] is first[0]
    assert [d.block_shape for d in first] == [[16, 32], [1, 64], [1, 64]]
    assert gt.descriptors(qw, s, None, 64)[2] is gt.descriptors(qw, s, None, 64)[1]  # no zeros
    refs = [weakref.ref(t) for t in (qw, s, z)]
    del qw, s, z, first
    gc.collect()
    assert all(r() is None for r in refs)


def test_tma_serves_only_tensors_it_can_read():
    """TMA reads contiguous tensors from 16-byte aligned addresses, int32 words, 16-bit
    scales, uint8 zero points; anything else keeps the register kernel's plan."""
    import torch

    from pagefleet.server.ops import gluon_w4_tma as gt
    if not gt.IMPORTED:
        pytest.skip("no Gluon in this Triton")
    qw, s, z = _tma_layer()
    assert gt.aligned(qw, s, z) and gt.aligned(qw, s, None)
    shifted = torch.zeros(qw.numel() + 1, dtype=torch.int32)[1:].view(qw.shape)   # 4 bytes off
    assert not gt.aligned(shifted, s, z)
    assert not gt.aligned(qw.t().contiguous().t(), s, z)                   # not contiguous
    assert not gt.aligned(qw, s.float(), z)
    assert not gt.aligned(qw, s, z.to(torch.int32))


def test_gluon_gemv_stages_only_one_row():
    """The shared-memory copy holds one input row (every MMA column reads it, and only
    column 0 is stored), so no config can stage it for more rows."""
    from pagefleet.server.ops import triton_quant as tq
    cfg = {**tq.W4_CONFIG, "gemv_mma_rows": {"unsplit": {"xsmem": True, "depth": 2}}}
    assert [tq.mma_plan(m, 37888, 3584, 132, cfg, False)[3:5] for m in (1, 2, 4)] == \
        [(3, 32), (2, 0), (2, 0)]


@pytest.mark.parametrize("m, n, k, sms, changes, stages", [
    (1, 3584, 18944, 132, {}, True),                           # down: its row staged
    (1, 4608, 3584, 132, {}, False),                           # o-like: not staged
    (2, 3584, 18944, 132, {}, False),                          # one row only
    (1, 3584, 18944, 132, {"silu_stage": False}, False),       # off
    (1, 3584, 18944, 132, {"gemv_mma_ring_min_m": 1}, False),  # the ring stages no row
    (1, 3584, 18944, 1, {}, False),                            # too many K tiles to stage
])
def test_gluon_gemv_takes_silu_only_where_it_stages_the_row(m, n, k, sms, changes, stages):
    """The down projection's SiLU-and-mul moves into the Gluon GEMV only where that GEMV
    stages the one input row in shared memory (the SiLU is computed on the way in; the
    other plans read the activations tile by tile and get the SiLU kernel before them).
    The bits equal the two kernels' (benchmarks/gemv_mma_check.py, on the GPU)."""
    from pagefleet.server.ops import triton_quant as tq
    assert tq.silu_stages(m, n, k, sms, {**tq.W4_CONFIG, **changes}) is stages
