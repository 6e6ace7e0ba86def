"""Quantized-GEMM Triton kernels against their torch twins, on the CPU under
TRITON_INTERPRET=1 (issue 15, must-hold 1): small and odd shapes (K not a multiple of
the group, N not a multiple of the tile, rows not a multiple of the block), every
dtype, zero points or symmetric, split-K forced, both the GEMV and the tl.dot paths.
The GPU run at real shapes is benchmarks/quant_bench.py."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from pagefleet.server.ops import activation, quant, triton_activation, triton_quant  # noqa: E402
from pagefleet.server.ops.int4_packing import pack_rows  # noqa: E402

if not triton_quant._INTERPRET and not torch.cuda.is_available():
    pytest.skip("triton kernels need TRITON_INTERPRET=1 on a machine without CUDA",
                allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() and not triton_quant._INTERPRET else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FP8 = torch.float8_e4m3fn


def rel_err(out, ref) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles small enough for the interpreter, so loops, masks and splits all run."""
    for cfg, keys in ((triton_quant.W4_CONFIG, {"gemv_block_n": 16, "gemv_block_k": 32,
                                                "gemm_block_n": 16, "gemm_block_k": 32,
                                                "target_programs": 8, "dequant_block_r": 4,
                                                "dequant_block_n": 16, "gemv_wide": {},
                                                "gemv_deep": {}, "gemv_tc_block_n": 32,
                                                # the tensor-core GEMV only where a test
                                                # asks for it (the paths below are others)
                                                "gemv_tc_max_m": 0}),
                      (triton_quant.FP8_CONFIG, {"gemv_block_n": 16, "gemv_block_k": 32,
                                                 "gemm_block_n": 16, "gemm_block_k": 32,
                                                 "w8a8_block_m": 16, "w8a8_block_n": 16,
                                                 "w8a8_block_k": 32, "target_programs": 8,
                                                 "act_block": 64})):
        for k, v in keys.items():
            monkeypatch.setitem(cfg, k, v)


def int4_case(m, k, n, group, zeros, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ng = -(-k // group)
    qw = pack_rows(torch.randint(0, 16, (k, n), generator=g)).to(DEV)
    s = (0.02 + 0.1 * torch.rand(ng, n, generator=g)).half().to(DEV)
    z = torch.randint(0, 16, (ng, n), generator=g).to(torch.uint8).to(DEV) if zeros else None
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    return x, qw, s, z, b


def record_launches(monkeypatch) -> list[int]:
    """The output tiles (x rows) of each split-K launch from here on, in order: shows which
    kernel path and tile width a call took."""
    launches: list[int] = []
    outputs = triton_quant._outputs

    def recorded(splits, m, n, tiles, *args):
        launches.append(tiles)
        return outputs(splits, m, n, tiles, *args)

    monkeypatch.setattr(triton_quant, "_outputs", recorded)
    return launches


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
    for target in (1, 1000):
        monkeypatch.setitem(triton_quant.W4_CONFIG, "target_programs", target)
        for fused in (False, True):
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


@pytest.mark.parametrize("path", ["w4_gemv", "w4_gemm", "w4_gemm_planes", "fp8_gemv",
                                  "fp8_silu", "fp8_gemm", "fp8_a8"])
def test_split_k_summed_by_the_last_program_is_the_second_kernels_bits(path, monkeypatch):
    """`fused_reduce`: each tile's last program sums the K splits (arrival counters)
    instead of `_splitk_reduce_kernel` after: the same bits over several output tiles
    (rows and columns), with a bias and without, and every counter back at zero for the
    next launch (a captured graph replays on them). The launches are recorded, so the
    test fails if the fused form (or the second kernel) never ran."""
    from pagefleet.server.ops import triton_common
    w4 = path.startswith("w4")
    cfg = triton_quant.W4_CONFIG if w4 else triton_quant.FP8_CONFIG
    monkeypatch.setitem(cfg, "target_programs", 1000)           # as many splits as fit
    monkeypatch.setitem(cfg, "gemv_max_m", 16 if path.endswith(("gemv", "silu")) else 0)
    m, k, n = (3, 400, 40) if path.endswith(("gemv", "silu")) else (20, 400, 40)
    if w4:
        monkeypatch.setitem(cfg, "dequant_min_m", 10 ** 9)
        monkeypatch.setitem(cfg, "gemm_planes", path == "w4_gemm_planes")
        x, qw, s, z, b = int4_case(m, k, n, 32, True, torch.bfloat16, seed=11)
        run = lambda bias: triton_quant.w4a16_linear(x, qw, s, z, 32, bias)  # noqa: E731
    else:
        block = (1, k)
        x, w, ws, b = fp8_case(m, k, n, block, torch.bfloat16, seed=13)
        gate_up = fp8_case(m, 2 * k, n, block, torch.bfloat16, seed=17)[0]
        q, a_scale = quant.quantize_fp8_per_token(x)
        run = {"fp8_gemv": lambda bias: triton_quant.fp8_w8a16_linear(x, w, ws, block, None, bias),
               "fp8_silu": lambda bias: triton_quant.fp8_silu_linear(gate_up, w, ws, block,
                                                                      None, bias),
               "fp8_gemm": lambda bias: triton_quant.fp8_w8a16_linear(x, w, ws, block, None,
                                                                       bias),
               "fp8_a8": lambda bias: triton_quant.fp8_gemm_a8(q, a_scale, w, ws, block, bias,
                                                               torch.bfloat16, scaled_mm=False),
               }[path]
    launches = []
    outputs = triton_quant._outputs

    def recorded(splits, m_, n_, tiles, *args):
        o = outputs(splits, m_, n_, tiles, *args)
        launches.append((splits, tiles, o.fused))
        return o

    monkeypatch.setattr(triton_quant, "_outputs", recorded)
    for bias in (b, None):
        got = []
        for fused in (False, True):
            monkeypatch.setitem(cfg, "fused_reduce", fused)
            launches.clear()
            got.append(run(bias))
            assert launches and all(sp > 1 and tiles > 1 and f == fused
                                    for sp, tiles, f in launches), launches
        assert torch.equal(got[0], got[1])
        counters = triton_common.arrival_counters(x.device, 1)
        assert counters is not None and not counters.any()


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


def fp8_case(m, k, n, block, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 3).to(FP8).to(DEV)
    ws = (0.5 + torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g)).to(DEV)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    return x, w, ws, b


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
