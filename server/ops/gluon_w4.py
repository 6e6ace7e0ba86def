"""The w4a16 decode GEMV on the tensor cores with every register placed by hand (Gluon,
sm_90): Marlin's way of feeding an MMA from 4-bit words, for 1-8 input rows.

Why: at one input row the Triton GEMVs (`triton_quant._w4_gemv_kernel`, CUDA cores,
float32 arithmetic) issue ~6 SASS instructions a nibble and read the weights at about
half the copy bandwidth (BENCHMARKS.md, 2026-12-03): the decode step is bound by issue.
Triton's own tensor-core GEMV (`_w4_gemv_tc_kernel`) decodes words in pairs but lets the
compiler choose register layouts, and the operand then goes through shared memory and a
cp.async pipeline (4.3 instructions a nibble, sm_90 SASS under Triton 3.6) and loses at
one row. Here each thread loads exactly the words its MMA fragments need, so nothing
moves between threads:

- `out^T = W^T x^T` with mma.sync m16n8k16: the weights are operand A (`[BLOCK_N,
  128]` per 128-row K tile, inside one quantization group), the input rows operand B
  (`[128, 8]`, rows past M zero), float32 accumulation;
- a thread of lane `4 i + c` owns rows `i` and `i + 8` of its warp's 16-row tiles and,
  in operand A, columns `16 j + 8 s + 2 c + e`. Operand columns are a permutation of the
  tile's K rows (the same one for both operands, so the product is unchanged): column
  `e + 2 rh + 8 v + 16 u + 32 rl` holds K row `8 (4 rh + rl) + (v + 2 u) + 4 e`, which
  gives lane `c` the four whole words `4 c .. 4 c + 3` of each of its rows and, in
  operand B, the 32 contiguous activations `32 c .. 32 c + 31` (four 16-byte loads);
- a word's 8 nibbles become 4 registers of two 16-bit values `q - z` each: one shift,
  one LOP3 into the bits of 1024 (fp16) or 128 (bf16) and one packed subtraction of
  (1024 or 128) + z per register (inline PTX; exact: small integers);
- each K tile's MMAs accumulate from zero and the group's scale multiplies the float32
  result (the Triton tensor-core GEMV's arithmetic, so the same rounding);
- the next tiles' words, scales and zero points load while this tile is multiplied
  (1-3 tiles ahead; at one row the program's K split of the row waits in shared
  memory: `triton_quant.mma_plan` decides per layer class; down's staging computes
  silu(gate) * up from the `[gate | up]` row, `triton_quant.w4a16_silu_linear`);
  split-K as the Triton GEMVs do it (partials summed in split order by each tile's last
  program: `triton_common.last_arrival`'s protocol).

`_w4_gemv_ring_kernel` is the same arithmetic with the operands staged through a
cp.async ring in shared memory; it serves from 8 rows (`triton_quant.ring_serves`). At
one row gate_up and down run `gluon_w4_tma` (the weights streamed by TMA into a
shared-memory ring by a producer warp), which shares this module's decode and operand
order and adds `_pair_asm_fma`, the 9-instruction fp16 decode.

Gluon does not run under TRITON_INTERPRET: `usable` keeps this kernel to sm_90 GPUs and a
tested Triton, tests/server/compile_sm90.py compiles it for sm_90 on the CPU, and the
GPU check compares it with the float32 twin (`benchmarks/gemv_mma_check.py`).
"""

from __future__ import annotations

import torch
import triton

from pagefleet.server.ops import gluon_common

try:   # Gluon's API moves between releases: any import failure = off
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier   # 3.9 / 3.6
    _async_load = (getattr(async_copy, "async_load", None)          # 3.9 / 3.6
                   or async_copy.async_copy_global_to_shared)
    _commit, _wait = async_copy.commit_group, async_copy.wait_group
    REINTERPRET = triton.language.constexpr(
        hasattr(gl.shared_memory_descriptor, "reinterpret"))
    IMPORTED = True
except ImportError:   # pragma: no cover - depends on the installed Triton
    IMPORTED = False


# PAGEFLEET_GLUON_GEMV=0 keeps the Triton GEMVs everywhere (gluon_common.env_switch)
AVAILABLE = (IMPORTED and gluon_common.supported_triton(triton.__version__)
             and gluon_common.env_switch("PAGEFLEET_GLUON_GEMV"))

# K rows a tile (one operand's width, inside one quantization group) and operand B's
# columns (mma m16n8k16: up to 8 input rows a launch)
BK = triton.language.constexpr(128)
ROWS = triton.language.constexpr(8)


def fits(m: int, n: int, k: int, group_size: int, block_n: int, dtype: torch.dtype) -> bool:
    """Whether the kernel computes this call: 16-bit activations, 1-8 rows, N a multiple
    of the tile, K tiles of 128 rows inside one quantization group."""
    return (dtype in (torch.float16, torch.bfloat16) and 0 < m <= ROWS.value
            and n % block_n == 0 and k % BK.value == 0
            and (group_size >= k or group_size % BK.value == 0))


def usable(x: torch.Tensor, n: int, k: int, group_size: int, block_n: int) -> bool:
    """A tested Triton on an sm_90 GPU, and a call the kernel `fits`."""
    return (AVAILABLE and x.is_cuda and fits(x.shape[0], n, k, group_size, block_n, x.dtype)
            and gluon_common.hopper(x.device.index))


def _words_layout(block_n: int, warps: int) -> "gl.DistributedLinearLayout":
    """`[block_n, 16]` words of a K tile, each where its operand-A fragment is: lane
    `4 i + c` holds words `4 c .. 4 c + 3` (registers) of rows `i`, `i + 8` (a register
    bit) of each 16-row tile; warps take consecutive 16-row tiles, then the tiles repeat
    in registers (the MMA layout's order)."""
    block_n, warps = int(block_n), int(warps)
    reps = block_n // (16 * warps)
    reg = [[0, 1], [0, 2], [8, 0]] + [[16 * warps << i, 0] for i in range(reps.bit_length() - 1)]
    lane = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    warp = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [block_n, 16])


def _acts_layout(warps: int) -> "gl.DistributedLinearLayout":
    """`[128, 8]` activations (K rows x input rows): lane `4 i + c` holds K rows `32 c ..
    32 c + 31` of input row `i` (contiguous: vector loads); every warp the same."""
    warps = int(warps)
    reg = [[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]]
    lane = [[32, 0], [64, 0], [0, 1], [0, 2], [0, 4]]
    warp = [[0, 0] for _ in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [128, 8])


def _at_least_one(n: int) -> int:
    """A shared buffer's tile count: one where the kernel does not use the buffer (a
    zero-sized allocation is not allowed)."""
    return max(int(n), 1)


if IMPORTED:   # built inside the kernel from its constexprs (a layout argument would not
    # serialize into Triton's cache hook, which server/ops/compile_watch.py installs)
    words_layout = gluon.constexpr_function(_words_layout)
    acts_layout = gluon.constexpr_function(_acts_layout)
    at_least_one = gluon.constexpr_function(_at_least_one)


def _pair_asm(f16: bool) -> str:
    """One word -> its 8 nibbles minus the zero point as 16-bit values, in the order
    (p, p + 4) for p = 0..3: `$8` the word, `$9` the bits of (1024 or 128) + z twice."""
    magic, ty = ("0x64006400", "f16x2") if f16 else ("0x43004300", "bf16x2")
    body = ["{ .reg .b32 t, u;"]
    for p in range(4):
        src = "$8" if p == 0 else "u"
        if p:
            body.append(f"shr.u32 u, $8, {4 * p};")
        body.append(f"lop3.b32 t, {src}, 0x000F000F, {magic}, 0xEA;")
        body.append(f"sub.rn.{ty} t, t, $9;")
        body.append(f"mov.b32 {{${2 * p}, ${2 * p + 1}}}, t;")
    body.append("}")
    return " ".join(body)


def _pair_asm_fma() -> str:
    """fp16 only: `_pair_asm`'s result in 9 instructions a word instead of 11 (Marlin's
    way): the odd nibbles p are masked in place (1024 + 16 q) and one packed FMA takes
    them to q - z (x 1/16, plus `$10`: the bits of -(64 + z) twice), so one shift serves
    two nibble pairs. Exact: small integers and multiples of 16 below 1280. (Not bf16:
    its 7-bit mantissa cannot hold 16 q above 128.)"""
    magic, ty = "0x64006400", "f16x2"
    body = ["{ .reg .b32 t, u, c;", "mov.b32 c, 0x2C002C00;"]
    for p in range(4):
        src = "$8" if p < 2 else "u"
        if p == 2:
            body.append("shr.u32 u, $8, 8;")
        if p % 2 == 0:
            body.append(f"lop3.b32 t, {src}, 0x000F000F, {magic}, 0xEA;")
            body.append(f"sub.rn.{ty} t, t, $9;")
        else:
            body.append(f"lop3.b32 t, {src}, 0x00F000F0, {magic}, 0xEA;")
            body.append(f"fma.rn.{ty} t, t, c, $10;")
        body.append(f"mov.b32 {{${2 * p}, ${2 * p + 1}}}, t;")
    body.append("}")
    return " ".join(body)


ASM_F16 = triton.language.constexpr(_pair_asm(True))
ASM_BF16 = triton.language.constexpr(_pair_asm(False))
ASM_FMA_F16 = triton.language.constexpr(_pair_asm_fma())


if IMPORTED:

    @gluon.jit
    def pdl_wait(PDL: gl.constexpr):
        """`triton_common.pdl_wait` for the Gluon kernels (which cannot call a Triton
        function): wait for the kernel before; release the next one before the wait in
        the eager mode (3), after it in the early mode (2)."""
        if PDL == 3:
            gdc_launch_dependents()
        if PDL:
            gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()

    @gluon.jit
    def _decode(w, zz, F16: gl.constexpr):
        """The 8 `q - z` of each word, as (nibble p, nibble p + 4) for p = 0..3."""
        if F16:
            r = gl.inline_asm_elementwise(ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, zz],
                                          dtype=(gl.float16,) * 8, is_pure=True, pack=1)
        else:
            r = gl.inline_asm_elementwise(ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, zz],
                                          dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        return r

    @gluon.jit
    def _decode_fma(w, zz, zh):
        """`_decode`'s fp16 values by `_pair_asm_fma` (`zh`: the bits of -(64 + z))."""
        return gl.inline_asm_elementwise(ASM_FMA_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                                         [w, zz, zh], dtype=(gl.float16,) * 8,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _magic_bits(z, F16: gl.constexpr):
        """Per column, the decode's subtrahend as a 16-bit pattern twice (z: int32 zero
        points, 0..15): (1024 or 128) + z, exact at those magnitudes."""
        MAGIC: gl.constexpr = 0x6400 if F16 else 0x4300
        return (MAGIC + z) * 0x10001

    @gluon.jit
    def _fma_bits(z):
        """Per column, the fp16 FMA decode's addend, -(64 + z), as a 16-bit pattern twice
        (steps of 1/16 from 0xD400)."""
        return (0xD400 + 16 * z) * 0x10001

    @gluon.jit
    def _operand_a(w, zz, BLOCK_N: gl.constexpr, A_L: gl.constexpr, F16: gl.constexpr):
        """`[BLOCK_N, 16]` words -> operand A `[BLOCK_N, 128]` in the permuted K order of
        the module docstring, without moving a value between threads."""
        l0, h0, l1, h1, l2, h2, l3, h3 = _decode(w, zz, F16)
        return _arrange_a(l0, h0, l1, h1, l2, h2, l3, h3, BLOCK_N, A_L)

    @gluon.jit
    def _operand_a_fma(w, zz, zh, BLOCK_N: gl.constexpr, A_L: gl.constexpr):
        """`_operand_a` (fp16) by `_decode_fma`: the same values."""
        l0, h0, l1, h1, l2, h2, l3, h3 = _decode_fma(w, zz, zh)
        return _arrange_a(l0, h0, l1, h1, l2, h2, l3, h3, BLOCK_N, A_L)

    @gluon.jit
    def _arrange_a(l0, h0, l1, h1, l2, h2, l3, h3, BLOCK_N: gl.constexpr, A_L: gl.constexpr):
        """The decoded nibble pairs as operand A (a relabelling of registers)."""
        lo = gl.join(gl.join(l0, l1), gl.join(l2, l3))       # [n, r, v, u]: nibble v + 2u
        hi = gl.join(gl.join(h0, h1), gl.join(h2, h3))       # nibble v + 2u + 4
        a = gl.join(lo, hi)                                  # [n, r, v, u, e]
        a = gl.reshape(a, [BLOCK_N, 4, 4, 2, 2, 2])          # [n, rh, rl, v, u, e]
        a = gl.permute(a, [0, 2, 4, 3, 1, 5])                # [n, rl, u, v, rh, e]
        a = gl.reshape(a, [BLOCK_N, BK])
        return gl.convert_layout(a, A_L, assert_trivial=True)

    @gluon.jit
    def _operand_b(x, B_L: gl.constexpr):
        """`[128, 8]` activations in K order -> operand B in the permuted order."""
        x = gl.reshape(x, [4, 4, 2, 2, 2, ROWS])              # [rh, rl, e, u, v, m]
        x = gl.permute(x, [1, 3, 4, 0, 2, 5])                # [rl, u, v, rh, e, m]
        x = gl.reshape(x, [BK, ROWS])
        return gl.convert_layout(x, B_L, assert_trivial=True)

    @gluon.jit
    def _tile_loads(w_base, s_ptr, z_ptr, sn, wn, kk, k_start, N, GROUP: gl.constexpr,
                    HAS_ZERO: gl.constexpr):
        """The words, float32 scales and zero points (int32; 8 without HAS_ZERO) of the
        K tile at row `kk`."""
        w = gl.load(w_base + (kk - k_start) // 8 * N)
        g = (kk // GROUP) * N
        s = gl.load(s_ptr + g + sn).to(gl.float32)
        if HAS_ZERO:
            z = gl.load(z_ptr + g + wn).to(gl.int32)
        else:
            z = gl.full(wn.shape, 8, gl.int32, layout=wn.type.layout)
        return w, s, z

    @gluon.jit
    def _tile_product(w, s, z, x, BLOCK_N: gl.constexpr, A_L: gl.constexpr,
                      B_L: gl.constexpr, MMA: gl.constexpr, F16: gl.constexpr):
        """One K tile's float32 `[BLOCK_N, 8]` product, its group's scale applied."""
        zz = gl.broadcast(w, _magic_bits(z, F16)[:, None])[1]
        a = _operand_a(w, zz, BLOCK_N, A_L, F16)
        b = _operand_b(x, B_L)
        t = mma_v2(a, b, gl.zeros([BLOCK_N, ROWS], gl.float32, layout=MMA))
        return t * s[:, None]

    @gluon.jit
    def _step(acc, w, s, z, xs, x_ptrs, x_mask, k0, k_start, xzero, BLOCK_N: gl.constexpr,
              A_L: gl.constexpr, B_L: gl.constexpr, MMA: gl.constexpr, F16: gl.constexpr,
              X_L: gl.constexpr, XS_TILES: gl.constexpr):
        """`acc` plus the K tile at row `k0`: its activations from the shared-memory copy
        of the one input row (XS_TILES; every operand column gets that row, and the
        columns past M are never stored) or from global memory."""
        if XS_TILES:
            x1 = xs.index((k0 - k_start) // BK).load(gl.SliceLayout(1, X_L))
            x = gl.broadcast(gl.expand_dims(x1, 1), xzero)[0]
        else:
            x = gl.load(x_ptrs + k0, mask=x_mask, other=0.0)
        return acc + _tile_product(w, s, z, x, BLOCK_N, A_L, B_L, MMA, F16)

    @gluon.jit
    def _stage_row(xs2, x_ptr, k_start, k_end, K, XS_TILES: gl.constexpr,
                   WARPS: gl.constexpr, ACT: gl.constexpr):
        """The program's K split of input row 0 into shared memory (nothing past k_end),
        waited for by every thread: one cp.async a thread per 8 activations, or with ACT
        (the row is `[gate | up]`, 2K wide) silu(gate) * up computed on the way."""
        XC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        ti = gl.arange(0, XS_TILES, layout=gl.SliceLayout(1, XC))
        ki = gl.arange(0, BK, layout=gl.SliceLayout(0, XC))
        kk = k_start + ti[:, None] * BK + ki[None, :]
        if ACT:
            gate = gl.load(x_ptr + kk, mask=kk < k_end, other=0.0)
            up = gl.load(x_ptr + K + kk, mask=kk < k_end, other=0.0)
            xs2.store(_silu_mul(gate, up))
        else:
            _async_load(xs2, x_ptr + kk, mask=kk < k_end)
            _commit()
            _wait(0)
        _barrier()

    @gluon.jit
    def _silu_mul(gate, up):
        """silu(gate) * up rounded where `triton_activation.silu_mul` rounds (the
        activation to the input dtype, then the product), in the input dtype: the same
        bits as the SiLU kernel (a Gluon function cannot call that Triton one;
        benchmarks/gemv_mma_check.py compares the two on the GPU)."""
        dt: gl.constexpr = gate.dtype
        g = gate.to(gl.float32)
        act = (g / (1.0 + gl.exp(-g))).to(dt).to(gl.float32)
        return (act * up.to(gl.float32)).to(dt)

    @gluon.jit(do_not_specialize=["M", "splits"])
    def _w4_gemv_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, part_ptr, res_ptr, cnt_ptr,
                            M, N, K, stride_xm, stride_os, stride_om, k_per_split, splits,
                            GROUP: gl.constexpr, HAS_ZERO: gl.constexpr,
                            HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                            WARPS: gl.constexpr, F16: gl.constexpr, PRELOAD: gl.constexpr,
                            SPLITS_PAD: gl.constexpr, FUSED: gl.constexpr,
                            PDL: gl.constexpr, DEPTH: gl.constexpr = 1,
                            XS_TILES: gl.constexpr = 0, ACT: gl.constexpr = False,
                            w_rows=0, s_rows=0, BLOCKED: gl.constexpr = False):
        """One program: BLOCK_N output columns (N a multiple of it) over one K split (a
        multiple of 128) for all M <= 8 input rows. PRELOAD: the first tiles' weights are
        requested before the wait for the kernel before (they do not depend on it), so
        under PDL their latency overlaps that kernel's tail.

        DEPTH (1-3): K tiles of weights loaded ahead, the loop unrolled DEPTH times (no
        register copies). ptxas puts every global load of the loop on one scoreboard
        (benchmarks/sass_scoreboards.py; BENCHMARKS.md, 2026-12-04, thirteenth
        session), so a warp's first use of a tile waits for all its loads in flight: the
        prefetch does not pipeline, it batches, and DEPTH tiles share one memory
        latency.
        XS_TILES (M = 1 only; a power of two, at least the split's K tiles): the input
        row staged in shared memory once, so no tile waits on an L2 read of its
        activations right before its MMA.
        ACT (with XS_TILES): x's row is `[gate | up]` (2K wide) and the input is
        silu(gate) * up, computed as the row is staged (the MLP's down projection without
        the SiLU kernel before it).
        BLOCKED: the words, scales and zero points in `gluon_w4_tma.block_columns`'s
        layout at BLOCK_N columns (the program's column tile its own w_rows word rows and
        s_rows scale rows; the layout A/B's)."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, 8])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        W_L: gl.constexpr = words_layout(BLOCK_N, WARPS)
        X_L: gl.constexpr = acts_layout(WARPS)
        XT: gl.constexpr = at_least_one(XS_TILES)
        # written as one [tiles, 128] copy, read a tile at a time (a rank-1 view)
        xs2 = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [XT, BK],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        xs = _row_view(xs2, XT, REINTERPRET)
        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        k_start = pid_s * k_per_split
        k_end = gl.minimum(K, k_start + k_per_split)
        # words ([K / 8, N], the tile's 16 rows advanced by the loads' row argument)
        if BLOCKED:   # the tile's own rows, BLOCK_N words apart
            qw_ptr = qw_ptr + pid_n.to(gl.int64) * w_rows * BLOCK_N
            s_ptr = s_ptr + pid_n * s_rows * BLOCK_N
            z_ptr = z_ptr + pid_n * s_rows * BLOCK_N
            ld = BLOCK_N
            n0 = 0
        else:
            ld = N
            n0 = pid_n * BLOCK_N
        wn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, W_L))
        wr = gl.arange(0, 16, layout=gl.SliceLayout(0, W_L))
        w_base = qw_ptr + (k_start // 8 + wr).to(gl.int64)[None, :] * ld + wn[:, None]
        # activations
        xk = gl.arange(0, BK, layout=gl.SliceLayout(1, X_L))
        xm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, X_L))
        x_ptrs = x_ptr + xm.to(gl.int64)[None, :] * stride_xm + xk[:, None]
        x_mask = (xm < M)[None, :] & (xk >= 0)[:, None]
        xzero = gl.zeros([BK, ROWS], x_ptr.dtype.element_ty, layout=X_L)
        # scales (the accumulator's rows, as read: sl) and zero points (the words' rows)
        sn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        sl = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        acc = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=MMA)
        last_k = k_end - BK
        if PRELOAD:
            wa, sa, za, wb, sb, zb, wc, sc, zc = _first_tiles(
                w_base, s_ptr, z_ptr, sl, wn, k_start, last_k, ld, GROUP, HAS_ZERO, DEPTH)
        pdl_wait(PDL)
        if not PRELOAD:
            wa, sa, za, wb, sb, zb, wc, sc, zc = _first_tiles(
                w_base, s_ptr, z_ptr, sl, wn, k_start, last_k, ld, GROUP, HAS_ZERO, DEPTH)
        if XS_TILES:
            _stage_row(xs2, x_ptr, k_start, k_end, K, XS_TILES, WARPS, ACT)
        if DEPTH == 1:
            for k0 in range(k_start, k_end, BK):
                w, s, z = wa, sa, za
                # the next tile (the last reloads itself)
                wa, sa, za = _tile_loads(w_base, s_ptr, z_ptr, sl, wn,
                                         gl.minimum(k0 + BK, last_k), k_start, ld, GROUP,
                                         HAS_ZERO)
                acc = _step(acc, w, s, z, xs, x_ptrs, x_mask, k0, k_start, xzero, BLOCK_N,
                            A_L, B_L, MMA, F16, X_L, XS_TILES)
        else:
            # each buffer multiplied, then refilled with the tile DEPTH ahead
            for k0 in range(k_start, k_end, DEPTH * BK):
                acc = _step(acc, wa, sa, za, xs, x_ptrs, x_mask, k0, k_start, xzero,
                            BLOCK_N, A_L, B_L, MMA, F16, X_L, XS_TILES)
                wa, sa, za = _tile_loads(w_base, s_ptr, z_ptr, sl, wn,
                                         gl.minimum(k0 + DEPTH * BK, last_k), k_start, ld,
                                         GROUP, HAS_ZERO)
                if k0 + BK < k_end:
                    acc = _step(acc, wb, sb, zb, xs, x_ptrs, x_mask, k0 + BK, k_start,
                                xzero, BLOCK_N, A_L, B_L, MMA, F16, X_L, XS_TILES)
                wb, sb, zb = _tile_loads(w_base, s_ptr, z_ptr, sl, wn,
                                         gl.minimum(k0 + (DEPTH + 1) * BK, last_k), k_start,
                                         ld, GROUP, HAS_ZERO)
                if DEPTH == 3:
                    if k0 + 2 * BK < k_end:
                        acc = _step(acc, wc, sc, zc, xs, x_ptrs, x_mask, k0 + 2 * BK,
                                    k_start, xzero, BLOCK_N, A_L, B_L, MMA, F16, X_L,
                                    XS_TILES)
                    wc, sc, zc = _tile_loads(w_base, s_ptr, z_ptr, sl, wn,
                                             gl.minimum(k0 + 5 * BK, last_k), k_start, ld,
                                             GROUP, HAS_ZERO)
        _finish(acc, sn, pid_n, pid_s, M, N, b_ptr, part_ptr, res_ptr, cnt_ptr, stride_os,
                stride_om, splits, HAS_BIAS, SPLITS_PAD, FUSED, MMA)

    @gluon.jit
    def _first_tiles(w_base, s_ptr, z_ptr, sn, wn, k_start, last_k, N, GROUP: gl.constexpr,
                     HAS_ZERO: gl.constexpr, DEPTH: gl.constexpr):
        """The split's first DEPTH tiles (the rest of the three: the first again, unused)."""
        wa, sa, za = _tile_loads(w_base, s_ptr, z_ptr, sn, wn, k_start, k_start, N, GROUP,
                                 HAS_ZERO)
        wb, sb, zb = wa, sa, za
        wc, sc, zc = wa, sa, za
        if DEPTH >= 2:
            wb, sb, zb = _tile_loads(w_base, s_ptr, z_ptr, sn, wn,
                                     gl.minimum(k_start + BK, last_k), k_start, N, GROUP,
                                     HAS_ZERO)
        if DEPTH == 3:
            wc, sc, zc = _tile_loads(w_base, s_ptr, z_ptr, sn, wn,
                                     gl.minimum(k_start + 2 * BK, last_k), k_start, N, GROUP,
                                     HAS_ZERO)
        return wa, sa, za, wb, sb, zb, wc, sc, zc

    @gluon.jit
    def _row_view(xs2, XT: gl.constexpr, NEW: gl.constexpr):
        """`[XT, 128]` shared memory seen with a rank-1 layout, so that indexing a tile
        gives a `[128]` view (3.9 names the call `reinterpret`, 3.6 `_reinterpret`)."""
        FLAT1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        if NEW:
            v = xs2.reinterpret(xs2.dtype, [XT, BK], FLAT1)
        else:
            v = xs2._reinterpret(xs2.dtype, [XT, BK], FLAT1)
        return v

    @gluon.jit
    def _finish(acc, sn, pid_n, pid_s, M, N, b_ptr, part_ptr, res_ptr, cnt_ptr, stride_os,
                stride_om, splits, HAS_BIAS: gl.constexpr, SPLITS_PAD: gl.constexpr,
                FUSED: gl.constexpr, MMA: gl.constexpr):
        """The result: stored, or this split's partial and the tile's last program sums.
        FUSED 2 (`ops/deferred.py`): the partial added, in fixed point, to the layer's
        int64 accumulator row at `part_ptr` (exact integer adds: any order gives the
        same sum), for the consumer kernel to convert; no arrival count, no last sum."""
        om = gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))
        mask = (om < M)[None, :] & (sn < N)[:, None]
        offs = om.to(gl.int64)[None, :] * stride_om + sn[:, None]
        if FUSED == 2:
            fixed = (acc * 1073741824.0).to(gl.int64)   # x 2^30, toward zero (deferred.SCALE)
            gl.atomic_add(part_ptr + offs, fixed, mask=mask, sem="relaxed", scope="gpu")
        elif FUSED:
            gl.store(part_ptr + pid_s.to(gl.int64) * stride_os + offs, acc, mask=mask)
            _barrier()
            arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                gl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
                tot = gl.zeros_like(acc)
                for sp in gl.static_range(SPLITS_PAD):
                    live = (offs * 0 + sp) < splits
                    p = gl.load(part_ptr + sp * stride_os + offs, mask=mask & live, other=0.0,
                                cache_modifier=".cg")
                    tot = gl.where(live, tot + p, tot)
                if HAS_BIAS:
                    tot += gl.load(b_ptr + sn, mask=sn < N, other=0.0).to(gl.float32)[:, None]
                gl.store(res_ptr + offs, tot.to(res_ptr.dtype.element_ty), mask=mask)
        else:
            if HAS_BIAS:
                acc += gl.load(b_ptr + sn, mask=sn < N, other=0.0).to(gl.float32)[:, None]
            gl.store(part_ptr + pid_s.to(gl.int64) * stride_os + offs,
                     acc.to(part_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _ring_issue(words, scl, zps, xs, qw_ptr, s_ptr, z_ptr, x_ptr, wr, wn, sn, zn, xm, xk,
                    kk, k_start, k_end, M, N, stride_xm, GROUP: gl.constexpr,
                    HAS_ZERO: gl.constexpr, WEIGHTS: gl.constexpr, ACTS: gl.constexpr):
        """cp.async of the K tile at row `kk` into one ring stage (nothing past k_end):
        WEIGHTS its words, scales and zero points (they do not depend on the kernel
        before), ACTS its activations (they do)."""
        live = kk < k_end
        if WEIGHTS:
            row = (kk - k_start) // 8
            _async_load(words, qw_ptr + (row + wr).to(gl.int64)[:, None] * N + wn[None, :],
                        mask=live & (wr >= 0)[:, None] & (wn >= 0)[None, :])
            g = (kk // GROUP).to(gl.int64) * N
            _async_load(scl, s_ptr + g + sn, mask=live & (sn >= 0))
            if HAS_ZERO:
                _async_load(zps, z_ptr + g + zn, mask=live & (zn >= 0))
        if ACTS:
            _async_load(xs, x_ptr + xm.to(gl.int64)[:, None] * stride_xm + (kk + xk)[None, :],
                        mask=live & (xm < M)[:, None] & (xk >= 0)[None, :])

    @gluon.jit(do_not_specialize=["M", "splits"])
    def _w4_gemv_ring_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, part_ptr, res_ptr, cnt_ptr,
                             M, N, K, stride_xm, stride_os, stride_om, k_per_split, splits,
                             GROUP: gl.constexpr, HAS_ZERO: gl.constexpr,
                             HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                             WARPS: gl.constexpr, F16: gl.constexpr, STAGES: gl.constexpr,
                             SPLITS_PAD: gl.constexpr, FUSED: gl.constexpr,
                             PDL: gl.constexpr):
        """`_w4_gemv_mma_kernel`'s arithmetic with its operands staged through a ring of
        STAGES shared-memory tiles filled by cp.async (Marlin's pipeline): STAGES - 1 K
        tiles in flight a program, held by shared memory instead of registers. Under ncu
        (H200, gate_up, one row) the register kernel's warps wait on global loads ~5 of
        every ~9 cycles between issues; here that falls to 0.7, but the shared-memory
        reads, the barrier a tile and the extra instructions take it back: slower at 1-4
        rows, ~3% faster a decode step at 8 (BENCHMARKS.md, 2026-12-04, twelfth session;
        `triton_quant.ring_serves`). The first STAGES - 1 tiles' weights are requested
        before the PDL wait, their activations after it. The scales' and zero points'
        copies (16 bytes a thread) are smaller than the layout, so the other threads
        repeat them into the same bytes."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, 8])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        W_L: gl.constexpr = words_layout(BLOCK_N, WARPS)
        X_L: gl.constexpr = acts_layout(WARPS)
        # copies: 16 bytes a thread (words 4 columns of a row, activations 8 K rows)
        WC: gl.constexpr = gl.BlockedLayout([1, 4], [128 // BLOCK_N, BLOCK_N // 4], [WARPS, 1],
                                            [1, 0])
        XC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        SC: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
        ZC: gl.constexpr = gl.BlockedLayout([16], [32], [WARPS], [0])
        # the words' rows 4c..4c+3 that lanes c = 0..3 read at once fall in distinct banks
        WS: gl.constexpr = gl.SwizzledSharedLayout(8, 4, 4, [1, 0])
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        FLAT1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        words = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BLOCK_N], WS)
        scl = gl.allocate_shared_memory(s_ptr.dtype.element_ty, [STAGES, BLOCK_N], FLAT1)
        zps = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N], FLAT1)
        xs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, ROWS, BK], FLAT)
        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        k_start = pid_s * k_per_split
        k_end = gl.minimum(K, k_start + k_per_split)
        n0 = pid_n * BLOCK_N
        wr = gl.arange(0, 16, layout=gl.SliceLayout(1, WC))
        wn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, WC))
        cs = n0 + gl.arange(0, BLOCK_N, layout=SC)
        cz = n0 + gl.arange(0, BLOCK_N, layout=ZC)
        xm = gl.arange(0, ROWS, layout=gl.SliceLayout(1, XC))
        xk = gl.arange(0, BK, layout=gl.SliceLayout(0, XC))
        qw_base = qw_ptr + (k_start // 8).to(gl.int64) * N
        for i in gl.static_range(STAGES - 1):
            _ring_issue(words.index(i), scl.index(i), zps.index(i), xs.index(i), qw_base,
                        s_ptr, z_ptr, x_ptr, wr, wn, cs, cz, xm, xk, k_start + i * BK, k_start,
                        k_end, M, N, stride_xm, GROUP, HAS_ZERO, True, False)
            _commit()
        pdl_wait(PDL)
        for i in gl.static_range(STAGES - 1):
            _ring_issue(words.index(i), scl.index(i), zps.index(i), xs.index(i), qw_base,
                        s_ptr, z_ptr, x_ptr, wr, wn, cs, cz, xm, xk, k_start + i * BK, k_start,
                        k_end, M, N, stride_xm, GROUP, HAS_ZERO, False, True)
        _commit()
        _wait(0)
        sn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        acc = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=MMA)
        t = 0
        for k0 in range(k_start, k_end, BK):
            _wait(STAGES - 2)
            _barrier()   # every thread's copies of tile t landed; every read of t - 1 done
            st = t % STAGES
            w = words.index(st).permute([1, 0]).load(W_L)
            s = scl.index(st).load(gl.SliceLayout(1, MMA)).to(gl.float32)
            if HAS_ZERO:
                z = zps.index(st).load(gl.SliceLayout(1, W_L)).to(gl.int32)
            else:
                z = gl.full([BLOCK_N], 8, gl.int32, layout=gl.SliceLayout(1, W_L))
            x = xs.index(st).permute([1, 0]).load(X_L)
            nxt = (t + STAGES - 1) % STAGES
            _ring_issue(words.index(nxt), scl.index(nxt), zps.index(nxt), xs.index(nxt),
                        qw_base, s_ptr, z_ptr, x_ptr, wr, wn, cs, cz, xm, xk,
                        k0 + (STAGES - 1) * BK, k_start, k_end, M, N, stride_xm, GROUP,
                        HAS_ZERO, True, True)
            _commit()
            acc += _tile_product(w, s, z, x, BLOCK_N, A_L, B_L, MMA, F16)
            t += 1
        _wait(0)
        _finish(acc, sn, pid_n, pid_s, M, N, b_ptr, part_ptr, res_ptr, cnt_ptr, stride_os,
                stride_om, splits, HAS_BIAS, SPLITS_PAD, FUSED, MMA)
