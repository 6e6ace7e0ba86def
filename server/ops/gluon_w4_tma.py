"""The one-row w4a16 GEMV with its weights streamed by TMA (Gluon, sm_90):
`gluon_w4`'s arithmetic, its loads taken off the registers' scoreboard.

Why: in `gluon_w4._w4_gemv_mma_kernel` the weights come into registers by global loads,
and ptxas puts all of them on one scoreboard, so a warp's first use of a tile waits for
every tile it has in flight: a deeper prefetch batches tiles into one memory latency
instead of overlapping them (BENCHMARKS.md, 2026-12-04, thirteenth session). A cp.async
ring pipelines but costs a block barrier and per-thread address math a tile, and lost at
one row (twelfth session). Here (fifteenth session):

- a producer warp (`_produce`, Gluon's warp_specialize) copies each K tile of the
  program's split -- words, scales, zero points -- by TMA into a ring of STAGES
  shared-memory slots, each slot's copies completing its `full` mbarrier. It reads
  nothing the kernel before writes, so it starts at launch, under that kernel's tail
  (PDL); a split of at most STAGES tiles is requested whole at once;
- the four math warps (`_consume`) stage the input row once (after the PDL wait), then
  wait per tile on its slot's barrier (no address arithmetic a tile) and each thread
  releases the slot on its `empty` mbarrier after its product (the shared loads it made
  are then complete). Triton 3.6's barrier analysis still puts a `bar.sync` of the four
  math warps before each of those waits (SASS read in the eighteenth session), which
  the protocol does not need (`benchmarks/results/2026-12-04i-tma_nobar.patch`
  removes it, unmeasured);
- fp16 decodes a word in 9 instructions (`gluon_w4._pair_asm_fma`) and the staged row
  is stored in operand-register order, so operand B is four 16-byte loads a thread with
  nothing moved after (`_stage_row_paired`).

Layout: the words' TMA box is `[16, 32]` (16 word rows of one K tile x 32 columns) in
128-byte swizzle; the MMA's row `m = 16 w + 8 h + i` of warp `w` takes column `16 w +
2 i + h`, so a thread's two rows are adjacent columns (one 8-byte shared load a word
row, no bank conflict under the swizzle). Scales, zero points and results follow the
same column order; the operand order, MMA and split-K are `gluon_w4`'s. Gluon pads the
producer warp to a warpgroup of 4, so a program is 8 warps: `triton_quant.mma_plan`
caps the registers at launch (`maxnreg`), which with the shared memory sets the
programs an SM.
"""

from __future__ import annotations

import functools

import torch
import triton

from pagefleet.server.ops import gluon_w4

try:   # Gluon's API moves between releases: any import failure = off
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _tma_load = (getattr(tma, "async_load", None)                   # 3.9 / 3.6
                 or tma.async_copy_global_to_shared)
    IMPORTED = gluon_w4.IMPORTED
except ImportError:   # pragma: no cover - depends on the installed Triton
    IMPORTED = False

BK = triton.language.constexpr(128)        # K rows a tile
BOX_N = triton.language.constexpr(32)      # columns a words box (128 bytes: the swizzle's width)
PRODUCER_REGS = triton.language.constexpr(24)   # the TMA warp's registers (setmaxnreg)


def _box_layout(nb: int, warps: int) -> "gl.DistributedLinearLayout":
    """`[nb x 16, 32]` words (box and word row, column) as loaded: a thread's two
    adjacent columns in consecutive registers (one 8-byte load), then word rows 4c +
    0..3 for lane group c; lanes i take columns 2i; warp bit 0 the second 16 columns of
    a box, the higher bits the boxes."""
    nb, warps = int(nb), int(warps)
    reg = [[0, 1], [1, 0], [2, 0]]
    lane = [[4, 0], [8, 0], [0, 2], [0, 4], [0, 8]]
    warp = [[0, 16]] + [[16 << i, 0] for i in range(nb.bit_length() - 1)]
    assert len(warp) == warps.bit_length() - 1, "BLOCK_N must be 16 x warps"
    return gl.DistributedLinearLayout(reg, lane, warp, [], [nb * 16, 32])


def _vec_layout(block_n: int, warps: int) -> "gl.DistributedLinearLayout":
    """`[1, block_n]` scales or zero points as loaded: the same columns a thread's words
    have (two adjacent in consecutive registers)."""
    block_n, warps = int(block_n), int(warps)
    reg = [[0, 1]]
    lane = [[0, 0], [0, 0], [0, 2], [0, 4], [0, 8]]
    warp = [[0, 16 << i] for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [1, block_n])


if IMPORTED:
    box_layout = gluon.constexpr_function(_box_layout)
    vec_layout = gluon.constexpr_function(_vec_layout)

    @gluon.jit
    def _to_mma_rows(v, BLOCK_N: gl.constexpr):
        """`[BLOCK_N]` values in storage column order -> MMA row order (a relabelling of
        registers: column 16 w + 2 i + h is row 16 w + 8 h + i)."""
        v = gl.reshape(v, [BLOCK_N // 16, 8, 2])
        v = gl.permute(v, [0, 2, 1])
        return gl.reshape(v, [BLOCK_N])

    @gluon.jit
    def _issue(w_desc, s_desc, z_desc, words, scl, zps, bar, kk, wr0, sr0, c0,
               GROUP: gl.constexpr, NB: gl.constexpr, HAS_ZERO: gl.constexpr):
        """TMA copies of the K tile at row kk into one ring slot, completing on `bar`: the
        words from row wr0 + kk / 8, the scales and zero points from row sr0 + kk / GROUP,
        columns from c0 (`_produce` says which layout)."""
        nbytes: gl.constexpr = (NB * 16 * BOX_N * 4 + NB * BOX_N * 2
                                + (NB * BOX_N if HAS_ZERO else 0))
        mbarrier.expect(bar, nbytes)
        for b in gl.static_range(NB):
            _tma_load(w_desc, [wr0 + kk // 8, c0 + b * BOX_N], bar, words.slice(b * 16, 16))
        _tma_load(s_desc, [sr0 + kk // GROUP, c0], bar, scl.slice(0, 1))
        if HAS_ZERO:
            _tma_load(z_desc, [sr0 + kk // GROUP, c0], bar, zps.slice(0, 1))

    @gluon.jit
    def _origin(b, w_rows, s_rows, BLOCK_N: gl.constexpr, BLOCKED: gl.constexpr):
        """Column tile b's first word row, first scale row and first column in the
        tensors: its own rows of `block_columns`'s layout (BLOCKED), else its columns of
        the checkpoint's `[K / 8, N]` and `[groups, N]`."""
        if BLOCKED:
            wr0 = b * w_rows
            sr0 = b * s_rows
            c0 = 0
        else:
            wr0 = 0
            sr0 = 0
            c0 = b * BLOCK_N
        return wr0, sr0, c0

    @gluon.jit
    def _produce(w_desc, s_desc, z_desc, words, scl, zps, full, empty, k_start, k_end,
                 pid_n, w_rows, s_rows, GROUP: gl.constexpr, NB: gl.constexpr,
                 HAS_ZERO: gl.constexpr, STAGES: gl.constexpr, BLOCKED: gl.constexpr):
        """The producer warp: every K tile of the split into the ring, each into a slot
        the consumers released (a slot's first round passes at once). It reads nothing
        the kernel before writes, so it never waits for it (PDL). BLOCKED: the tensors
        are `block_columns`'s (`_origin`)."""
        wr0, sr0, c0 = _origin(pid_n, w_rows, s_rows, NB * BOX_N, BLOCKED)
        n_tiles = (k_end - k_start) // BK
        for t in range(n_tiles):
            st = t % STAGES
            mbarrier.wait(empty.index(st), ((t // STAGES) & 1) ^ 1)
            _issue(w_desc, s_desc, z_desc, words.index(st), scl.index(st), zps.index(st),
                   full.index(st), k_start + t * BK, wr0, sr0, c0, GROUP, NB, HAS_ZERO)

    @gluon.jit
    def _stage_row_paired(xs2, x_ptr, k_start, k_end, K, XS_TILES: gl.constexpr,
                          WARPS: gl.constexpr, ACT: gl.constexpr):
        """`gluon_w4._stage_row` with each 8 activations stored as (0, 4, 1, 5, 2, 6, 3,
        7): the pairs an MMA operand register holds (K rows k and k + 4) side by side, so
        a tile's operand B is four 16-byte loads a thread with no byte moved after."""
        XC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        ti = gl.arange(0, XS_TILES, layout=gl.SliceLayout(1, XC))
        ki = gl.arange(0, BK, layout=gl.SliceLayout(0, XC))
        kk = k_start + ti[:, None] * BK + ki[None, :]
        x = gl.load(x_ptr + kk, mask=kk < k_end, other=0.0)
        if ACT:
            up = gl.load(x_ptr + K + kk, mask=kk < k_end, other=0.0)
            x = gluon_w4._silu_mul(x, up)
        x = gl.reshape(x, [XS_TILES, 16, 2, 4])
        x = gl.permute(x, [0, 1, 3, 2])
        xs2.store(gl.convert_layout(gl.reshape(x, [XS_TILES, BK]), XC))
        gluon_w4._barrier()

    @gluon.jit
    def _operand_b_paired(x, B_L: gl.constexpr):
        """`[128, 8]` activations as `_stage_row_paired` stored them -> operand B (a
        relabelling: position 32 c + 8 rl + 4 u + 2 v + e is column 32 rl + 16 u + 8 v +
        2 c + e)."""
        x = gl.reshape(x, [4, 4, 2, 2, 2, gluon_w4.ROWS])       # [c, rl, u, v, e, m]
        x = gl.permute(x, [1, 2, 3, 0, 4, 5])
        x = gl.reshape(x, [BK, gluon_w4.ROWS])
        return gl.convert_layout(x, B_L, assert_trivial=True)

    @gluon.jit
    def _tile(words, scl, zps, full, xs, xzero, t, xt, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HAS_ZERO: gl.constexpr, F16: gl.constexpr,
              MMA: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr, W_L: gl.constexpr,
              X_L: gl.constexpr, BOX_L: gl.constexpr, VEC_L: gl.constexpr):
        """Ring tile t's operands, once its copies landed: A (the decoded words), B (the
        staged row's tile xt) and the float32 scales by MMA row."""
        NB: gl.constexpr = BLOCK_N // BOX_N
        st = t % STAGES
        mbarrier.wait(full.index(st), (t // STAGES) & 1)
        wb = words.index(st).load(BOX_L)                        # [(b, r), n]
        wb = gl.reshape(wb, [NB, 16, 2, 8, 2])                  # [b, r, wq, i, h]
        wb = gl.permute(wb, [0, 2, 4, 3, 1])                    # [b, wq, h, i, r]
        w = gl.convert_layout(gl.reshape(wb, [BLOCK_N, 16]), W_L)
        s = _to_mma_rows(gl.reshape(scl.index(st).slice(0, 1).load(VEC_L), [BLOCK_N]), BLOCK_N)
        s = gl.convert_layout(s, gl.SliceLayout(1, MMA)).to(gl.float32)
        if HAS_ZERO:
            z = _to_mma_rows(gl.reshape(zps.index(st).slice(0, 1).load(VEC_L), [BLOCK_N]),
                             BLOCK_N)
            z = gl.convert_layout(z, gl.SliceLayout(1, W_L)).to(gl.int32)
        else:
            z = gl.full([BLOCK_N], 8, gl.int32, layout=gl.SliceLayout(1, W_L))
        zz = gl.broadcast(w, gluon_w4._magic_bits(z, F16)[:, None])[1]
        if F16:   # the FMA decode (9 instructions a word against 11); exact in fp16 only
            zh = gl.broadcast(w, gluon_w4._fma_bits(z)[:, None])[1]
            a = gluon_w4._operand_a_fma(w, zz, zh, BLOCK_N, A_L)
        else:
            a = gluon_w4._operand_a(w, zz, BLOCK_N, A_L, F16)
        x1 = xs.index(xt).load(gl.SliceLayout(1, X_L))
        x = gl.broadcast(gl.expand_dims(x1, 1), xzero)[0]
        return a, _operand_b_paired(x, B_L), s

    @gluon.jit
    def _accumulate(acc, words, scl, zps, full, empty, xs, xzero, t, xt,
                    BLOCK_N: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr,
                    HAS_ZERO: gl.constexpr, F16: gl.constexpr):
        """acc plus ring tile t's product with the staged row's tile xt, its scales
        applied; then this thread releases the slot (its shared loads are complete)."""
        NB: gl.constexpr = BLOCK_N // BOX_N
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, 8])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        a, b, s = _tile(words, scl, zps, full, xs, xzero, t, xt, BLOCK_N, STAGES, HAS_ZERO,
                        F16, MMA, A_L, B_L, gluon_w4.words_layout(BLOCK_N, WARPS),
                        gluon_w4.acts_layout(WARPS), box_layout(NB, WARPS),
                        vec_layout(BLOCK_N, WARPS))
        prod = gluon_w4.mma_v2(a, b, gl.zeros([BLOCK_N, gluon_w4.ROWS], gl.float32,
                                              layout=MMA))
        acc = acc + prod * s[:, None]
        async_copy.mbarrier_arrive(empty.index(t % STAGES), increment_count=False)
        return acc

    @gluon.jit
    def _consume(x_ptr, b_ptr, part_ptr, res_ptr, cnt_ptr, words, scl, zps, full, empty, xs2,
                 M, N, K, stride_os, stride_om, k_start, k_end, n0, pid_n, pid_s, splits,
                 HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                 WARPS: gl.constexpr, F16: gl.constexpr, STAGES: gl.constexpr,
                 XS_TILES: gl.constexpr, ACT: gl.constexpr, SPLITS_PAD: gl.constexpr,
                 FUSED: gl.constexpr, PDL: gl.constexpr):
        """The math warps: the row staged once, then each tile from its slot as soon as
        its copies land; every thread releases the slot after its product (the loads it
        read are then complete), WARPS x 32 arrivals a round."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, 8])
        X_L: gl.constexpr = gluon_w4.acts_layout(WARPS)
        gluon_w4.pdl_wait(PDL)
        _stage_row_paired(xs2, x_ptr, k_start, k_end, K, XS_TILES, WARPS, ACT)
        xs = gluon_w4._row_view(xs2, XS_TILES, gluon_w4.REINTERPRET)
        xzero = gl.zeros([BK, gluon_w4.ROWS], x_ptr.dtype.element_ty, layout=X_L)
        m = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        sn = n0 + 16 * (m // 16) + 2 * (m % 8) + (m % 16) // 8
        acc = gl.zeros([BLOCK_N, gluon_w4.ROWS], gl.float32, layout=MMA)
        n_tiles = (k_end - k_start) // BK
        for t in range(n_tiles):
            acc = _accumulate(acc, words, scl, zps, full, empty, xs, xzero, t, t, BLOCK_N,
                              WARPS, STAGES, HAS_ZERO, F16)
        gluon_w4._finish(acc, sn, pid_n, pid_s, M, N, b_ptr, part_ptr, res_ptr, cnt_ptr,
                         stride_os, stride_om, splits, HAS_BIAS, SPLITS_PAD, FUSED, MMA)

    @gluon.jit
    def _ring_buffers(x_ptr, w_desc, s_desc, z_desc, BLOCK_N: gl.constexpr,
                      WARPS: gl.constexpr, STAGES: gl.constexpr, XS_TILES: gl.constexpr):
        """The program's shared memory: the ring's slots (words, scales, zero points) and
        their full / empty mbarriers, initialized; the staged row."""
        NB: gl.constexpr = BLOCK_N // BOX_N
        words = gl.allocate_shared_memory(gl.int32, [STAGES, NB * 16, BOX_N], w_desc.layout)
        # a TMA destination starts on 128 bytes: a tile's scales and zero points are
        # padded to that with unused rows
        SR: gl.constexpr = max(1, 128 // (BLOCK_N * s_desc.dtype.primitive_bitwidth // 8))
        ZR: gl.constexpr = max(1, 128 // (BLOCK_N * z_desc.dtype.primitive_bitwidth // 8))
        scl = gl.allocate_shared_memory(s_desc.dtype, [STAGES, SR, BLOCK_N], s_desc.layout)
        zps = gl.allocate_shared_memory(z_desc.dtype, [STAGES, ZR, BLOCK_N], z_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        xs2 = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [XS_TILES, BK],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=WARPS * 32)
        fence_async_shared()
        return words, scl, zps, full, empty, xs2

    @gluon.jit(do_not_specialize=["M", "splits"])
    def _w4_gemv_tma_kernel(x_ptr, w_desc, s_desc, z_desc, b_ptr, part_ptr, res_ptr, cnt_ptr,
                            M, N, K, stride_xm, stride_os, stride_om, k_per_split, splits,
                            w_rows, s_rows, GROUP: gl.constexpr, HAS_ZERO: gl.constexpr,
                            HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                            WARPS: gl.constexpr, F16: gl.constexpr, STAGES: gl.constexpr,
                            XS_TILES: gl.constexpr, ACT: gl.constexpr,
                            SPLITS_PAD: gl.constexpr, FUSED: gl.constexpr,
                            PDL: gl.constexpr, BLOCKED: gl.constexpr):
        """One program: BLOCK_N (16 x WARPS) output columns over one K split, one input
        row (M = 1) staged in shared memory (XS_TILES: a power of two, at least the
        split's tiles); the weights through a ring of STAGES tiles (a split of at most
        STAGES tiles is requested whole at the start)."""
        NB: gl.constexpr = BLOCK_N // BOX_N
        words, scl, zps, full, empty, xs2 = _ring_buffers(x_ptr, w_desc, s_desc, z_desc,
                                                          BLOCK_N, WARPS, STAGES, XS_TILES)
        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        k_start = pid_s * k_per_split
        k_end = gl.minimum(K, k_start + k_per_split)
        n0 = pid_n * BLOCK_N
        gl.warp_specialize(
            [(_consume, (x_ptr, b_ptr, part_ptr, res_ptr, cnt_ptr, words, scl, zps, full, empty,
                         xs2, M, N, K, stride_os, stride_om, k_start, k_end, n0, pid_n, pid_s,
                         splits, HAS_ZERO, HAS_BIAS, BLOCK_N, WARPS, F16, STAGES, XS_TILES, ACT,
                         SPLITS_PAD, FUSED, PDL)),
             (_produce, (w_desc, s_desc, z_desc, words, scl, zps, full, empty, k_start, k_end,
                         pid_n, w_rows, s_rows, GROUP, NB, HAS_ZERO, STAGES, BLOCKED))],
            [1], [PRODUCER_REGS])

    # -- stream-K: every program the same number of K tiles (the layout A/B's twin) -------
    # The shipped grid gives gate_up 592 programs of 28 tiles on 132 SMs, 5 an SM on 64 of
    # them and 4 on the rest: the busiest SM streams 11% more than the mean (down: 616, 7%).
    # Here P programs take equal ranges of the (column tile, K tile) sequence; a range
    # that crosses column tiles leaves each crossed tile a partial sum, which the tile's
    # last program to arrive adds up (`gluon_w4._finish`'s split-K sum). `stream_owner`
    # and `stream_shape` are the arithmetic, in Python for the plan and the tests
    # (`_owner` is `stream_owner`'s formula).

    @gluon.jit
    def _owner(g, T, P):
        """The program whose range holds global tile g (`stream_owner`)."""
        return ((g + 1) * P - 1) // T

    @gluon.jit
    def _produce_stream(w_desc, s_desc, z_desc, words, scl, zps, full, empty, g0, g1,
                        tiles_k, w_rows, s_rows, GROUP: gl.constexpr, NB: gl.constexpr,
                        HAS_ZERO: gl.constexpr, STAGES: gl.constexpr,
                        BLOCKED: gl.constexpr, BLOCK_N: gl.constexpr):
        """`_produce` over the program's range of global tiles [g0, g1): tile g is K tile
        g % tiles_k of column tile g // tiles_k."""
        for t in range(g1 - g0):
            g = g0 + t
            b = g // tiles_k
            st = t % STAGES
            mbarrier.wait(empty.index(st), ((t // STAGES) & 1) ^ 1)
            wr0, sr0, c0 = _origin(b, w_rows, s_rows, BLOCK_N, BLOCKED)
            _issue(w_desc, s_desc, z_desc, words.index(st), scl.index(st), zps.index(st),
                   full.index(st), (g - b * tiles_k) * BK, wr0, sr0, c0, GROUP, NB, HAS_ZERO)

    @gluon.jit
    def _consume_stream(x_ptr, b_ptr, part_ptr, res_ptr, cnt_ptr, words, scl, zps, full, empty,
                        xs2, M, N, K, stride_os, stride_om, g0, g1, tiles_k, T, P, pid,
                        HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr,
                        WARPS: gl.constexpr, F16: gl.constexpr, STAGES: gl.constexpr,
                        XS_TILES: gl.constexpr, ACT: gl.constexpr, SPLITS_PAD: gl.constexpr,
                        PDL: gl.constexpr):
        """`_consume` over the program's range, one segment a column tile it crosses: the
        segment's part of the row staged (after every math warp finished the segment
        before), its tiles multiplied, its sum stored whole where the segment is the
        column tile's only one, else as one of the tile's partial sums."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, 8])
        X_L: gl.constexpr = gluon_w4.acts_layout(WARPS)
        gluon_w4.pdl_wait(PDL)
        xs = gluon_w4._row_view(xs2, XS_TILES, gluon_w4.REINTERPRET)
        xzero = gl.zeros([BK, gluon_w4.ROWS], x_ptr.dtype.element_ty, layout=X_L)
        m = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        col = 16 * (m // 16) + 2 * (m % 8) + (m % 16) // 8
        om = gl.arange(0, gluon_w4.ROWS, layout=gl.SliceLayout(0, MMA))
        b0 = g0 // tiles_k
        for si in range((g1 - 1) // tiles_k - b0 + 1):
            b = b0 + si
            s0 = gl.maximum(g0, b * tiles_k)
            s1 = gl.minimum(g1, b * tiles_k + tiles_k)
            kt0 = s0 - b * tiles_k
            gluon_w4._barrier()   # the segment before read its row
            _stage_row_paired(xs2, x_ptr, kt0 * BK, (kt0 + s1 - s0) * BK, K, XS_TILES, WARPS,
                              ACT)
            acc = gl.zeros([BLOCK_N, gluon_w4.ROWS], gl.float32, layout=MMA)
            for j in range(s1 - s0):
                acc = _accumulate(acc, words, scl, zps, full, empty, xs, xzero, s0 - g0 + j, j,
                                  BLOCK_N, WARPS, STAGES, HAS_ZERO, F16)
            first = _owner(b * tiles_k, T, P)
            parts = _owner(b * tiles_k + tiles_k - 1, T, P) - first + 1
            sn = b * BLOCK_N + col
            if parts == 1:
                if HAS_BIAS:
                    acc += gl.load(b_ptr + sn, mask=sn < N, other=0.0).to(gl.float32)[:, None]
                offs = om.to(gl.int64)[None, :] * stride_om + sn[:, None]
                gl.store(res_ptr + offs, acc.to(res_ptr.dtype.element_ty),
                         mask=(om < M)[None, :] & (sn < N)[:, None])
            else:
                gluon_w4._finish(acc, sn, b, pid - first, M, N, b_ptr, part_ptr, res_ptr,
                                 cnt_ptr, stride_os, stride_om, parts, HAS_BIAS, SPLITS_PAD,
                                 True, MMA)

    @gluon.jit(do_not_specialize=["M", "T", "P"])
    def _w4_gemv_tma_stream_kernel(x_ptr, w_desc, s_desc, z_desc, b_ptr, part_ptr, res_ptr,
                                   cnt_ptr, M, N, K, stride_xm, stride_os, stride_om, tiles_k,
                                   T, P, w_rows, s_rows, GROUP: gl.constexpr,
                                   HAS_ZERO: gl.constexpr, HAS_BIAS: gl.constexpr,
                                   BLOCK_N: gl.constexpr, WARPS: gl.constexpr,
                                   F16: gl.constexpr, STAGES: gl.constexpr,
                                   XS_TILES: gl.constexpr, ACT: gl.constexpr,
                                   SPLITS_PAD: gl.constexpr, PDL: gl.constexpr,
                                   BLOCKED: gl.constexpr):
        """`_w4_gemv_tma_kernel` in stream-K form: program p of P takes global tiles
        [p T / P, (p + 1) T / P) of the T = column tiles x tiles_k (XS_TILES: a power of
        two, at least a range's length); partial sums go to `part_ptr` (slot: the
        program's rank among its column tile's), summed by the tile's last arrival
        (`cnt_ptr`, one counter a column tile) into `res_ptr`."""
        NB: gl.constexpr = BLOCK_N // BOX_N
        words, scl, zps, full, empty, xs2 = _ring_buffers(x_ptr, w_desc, s_desc, z_desc,
                                                          BLOCK_N, WARPS, STAGES, XS_TILES)
        pid = gl.program_id(0)
        g0 = pid * T // P
        g1 = (pid + 1) * T // P
        gl.warp_specialize(
            [(_consume_stream, (x_ptr, b_ptr, part_ptr, res_ptr, cnt_ptr, words, scl, zps, full,
                                empty, xs2, M, N, K, stride_os, stride_om, g0, g1, tiles_k, T,
                                P, pid, HAS_ZERO, HAS_BIAS, BLOCK_N, WARPS, F16, STAGES,
                                XS_TILES, ACT, SPLITS_PAD, PDL)),
             (_produce_stream, (w_desc, s_desc, z_desc, words, scl, zps, full, empty, g0, g1,
                                tiles_k, w_rows, s_rows, GROUP, NB, HAS_ZERO, STAGES, BLOCKED,
                                BLOCK_N))],
            [1], [PRODUCER_REGS])


def stream_owner(g: int, tiles: int, programs: int) -> int:
    """The program of `programs` whose stream-K range holds global tile g of `tiles`
    (program p: [p tiles // programs, (p + 1) tiles // programs))."""
    return ((g + 1) * programs - 1) // tiles


@functools.lru_cache(maxsize=256)   # a plan is made at every launch
def stream_shape(tiles_n: int, tiles_k: int, programs: int) -> tuple[int, int, int]:
    """(programs, most partial sums a column tile gets, longest segment in tiles) of the
    stream-K grid over `tiles_n` column tiles of `tiles_k` K tiles, at most `programs`
    programs (none empty)."""
    total = tiles_n * tiles_k
    p = max(1, min(programs, total))
    parts = max(stream_owner((b + 1) * tiles_k - 1, total, p)
                - stream_owner(b * tiles_k, total, p) + 1 for b in range(tiles_n))
    longest = min(tiles_k, -(-total // p))
    return p, parts, longest


def block_columns(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  block_n: int) -> tuple:
    """The layer's words, scales and zero points with each `block_n`-column tile's rows
    stored together (`[N / block_n x rows, block_n]`), so one program streams one
    contiguous range instead of 256-byte pieces a row apart across the whole matrix (the
    kernel's BLOCKED form; K a multiple of 128, so no box crosses into the next tile)."""
    def blocked(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        rows, n = t.shape
        return (t.view(rows, n // block_n, block_n).permute(1, 0, 2).contiguous()
                .view(n // block_n * rows, block_n))
    assert qweight.shape[0] % 16 == 0 and qweight.shape[1] % block_n == 0
    return blocked(qweight), blocked(scales), blocked(zeros)


_BLOCKED: dict = {}


def blocked_copy(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 block_n: int) -> tuple:
    """`block_columns` of a layer, made on its first call and kept: a second copy of the
    layer's weights beside the checkpoint's, which every other kernel still reads. For
    timing the layout in the engine (a "tma" plan's "blocked" key) before any kernel but
    this one reads it; a server would store the layer once, blocked."""
    key = (qweight.data_ptr(), tuple(qweight.shape), scales.data_ptr(),
           None if zeros is None else zeros.data_ptr(), block_n)
    if key not in _BLOCKED:
        _BLOCKED[key] = block_columns(qweight, scales, zeros, block_n)
    return _BLOCKED[key]


def aligned(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> bool:
    """Whether TMA can read these tensors: contiguous from 16-byte aligned addresses,
    int32 words, 16-bit scales, uint8 zero points (the caller checked the shapes:
    `gluon_w4.fits`)."""
    ts = (qweight, scales) if zeros is None else (qweight, scales, zeros)
    return (IMPORTED and qweight.dtype == torch.int32
            and scales.dtype in (torch.float16, torch.bfloat16)
            and (zeros is None or zeros.dtype == torch.uint8)
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in ts))


class _Address:
    """What a descriptor needs of its tensor (the launcher encodes the address, the
    specialization reads the dtype), without a reference to it: a cached descriptor
    must not keep a finished engine's weights alive."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, t: torch.Tensor):
        self._ptr, self.dtype = t.data_ptr(), t.dtype

    def data_ptr(self) -> int:
        return self._ptr


_DESCRIPTORS: dict = {}


def _desc(t: torch.Tensor, block: list[int], swizzle: int) -> "TensorDescriptor":
    """One tensor's descriptor, kept per (address, shape, dtype): it describes nothing
    else, so a later tensor at the same address with the same shape and dtype is
    described by it exactly (a decode step builds none: 112 GEMVs a step)."""
    key = (t.data_ptr(), tuple(t.shape), t.dtype, tuple(block), swizzle)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        if len(_DESCRIPTORS) >= 4096:   # tests make many short-lived weights
            _DESCRIPTORS.clear()
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle,
                                      element_bitwidth=t.element_size() * 8, rank=2)
        desc = _DESCRIPTORS[key] = TensorDescriptor(_Address(t), list(t.shape),
                                                    list(t.stride()), list(block), layout)
    return desc


def descriptors(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                block_n: int) -> tuple:
    """TMA descriptors of one layer's words, scales and zero points (the scales stand
    in for absent zero points: never read)."""
    s = _desc(scales, [1, block_n], 0)
    return (_desc(qweight, [16, BOX_N.value], 128), s,
            _desc(zeros, [1, block_n], 0) if zeros is not None else s)
