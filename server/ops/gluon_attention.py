"""Varlen prefill attention over 128-token pages for Hopper (sm_90), in Gluon, with
FlashAttention-3's ping-pong of two math warpgroups.

Why a second prefill kernel: the Triton one (`triton_attention._prefill_kernel`, 8 warps
on a 128-row tile) runs both warpgroups in lockstep (its sm_90 SASS holds 5 CTA-wide
barriers a key tile), so the tensor cores sit idle while every warp computes its softmax:
~490 TFLOP/s on long chunks on one H200 (560-600 on another), where FlashAttention-3
reaches ~600. Earlier sessions moved the copies off the math warps (producer warps) and
overlapped one warpgroup's softmax with its own next GEMM (BENCHMARKS.md, 2026-12-03,
sixth and eighth sessions): neither was faster. What FlashAttention-3 has beyond those
is the schedule between two warpgroups:

- a CTA owns 128 query rows of one head; two math warpgroups (partitions of 4 warps) take
  64 rows each and a producer partition copies each key tile (one page: a TMA box) and
  value tile into a two-slot ring that both math warpgroups read;
- the math warpgroups take turns issuing their GEMMs (`turn` mbarriers): warpgroup 0
  issues S[j] = Q K[j]^T and O += P[j-1] V[j-1], lets warpgroup 1 issue its own, and runs
  its softmax of S[j] while warpgroup 1's GEMMs occupy the tensor cores, and so on;
- within a warpgroup, S[j] and P[j-1] V[j-1] are in flight together (the sixth session's
  in-warpgroup order).

The diagonal key tiles (past the first row's position, a few per tile) run in the same
ring with the causal mask on S; their values past the context are zeroed by the producer
before the consumers read them (a page's slots past the context hold whatever was there:
0 x NaN would poison the sum).

Gluon does not run under TRITON_INTERPRET; `usable` keeps this kernel to sm_90 GPUs,
and tests/server/test_kernels_compile.py compiles it for sm_90 on the CPU.
"""

from __future__ import annotations

import torch
import triton

from pagefleet.server.ops import gluon_common

try:   # Gluon ships with Triton 3.4+ and its API still moves: any import failure = off
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # 3.9 / 3.6
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier                   # the same
    IMPORTED = True
except ImportError:   # pragma: no cover - depends on the installed Triton
    IMPORTED = False

# IMPORTED: the kernel is defined (compile_sm90 compiles it whatever serves);
# AVAILABLE: it serves (a tested Triton release, PAGEFLEET_GLUON_PREFILL not 0).
AVAILABLE = (IMPORTED and gluon_common.supported_triton(triton.__version__)
             and gluon_common.env_switch("PAGEFLEET_GLUON_PREFILL"))

# Launch parameters. block_n must divide the page size (a key tile is one TMA box).
PINGPONG_CONFIG = {"block_n": 128, "stages": 2, "pingpong": True,
                   "math_regs": 232, "load_regs": 40, "load_warps": 4}
BLOCK_M = 128          # two math warpgroups of 64 rows


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """A tested Triton, sm_90, 16-bit activations and cache of one dtype, a head size of
    64 or 128, and pages that hold whole key tiles."""
    if not AVAILABLE or not q.is_cuda or not gluon_common.hopper(q.device.index):
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
            and q.shape[-1] in (64, 128) and k_cache.shape[1] % PINGPONG_CONFIG["block_n"] == 0)


if IMPORTED:

    @gluon.jit
    def _load_partition(k_smem, v_smem, k_full, v_full, k_empty, v_empty, k_desc, v_desc,
                        vc_ptr, bt_row, n_full, n_all, kv_end, kvh, stride_cblk, stride_ctok,
                        stride_ch, BS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                        STAGES: gl.constexpr, LW: gl.constexpr):
        """The producer: key tile t by one TMA box into slot t % STAGES once both math
        warpgroups released it; value tile t the same, except past the first row's
        position (the diagonal tiles), where its rows are loaded with the context mask
        (zero past it) and stored by these warps."""
        CH: gl.constexpr = 32
        BLK: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [LW, 1], [1, 0])
        ROW: gl.constexpr = gl.SliceLayout(1, BLK)
        COL: gl.constexpr = gl.SliceLayout(0, BLK)
        for t in range(n_all):
            s = t % STAGES
            ph = (t // STAGES) & 1
            start = t * BLOCK_N
            page = gl.load(bt_row + start // BS)
            row0 = page * BS + start % BS
            mbarrier.wait(k_empty.index(s), ph ^ 1)          # round 0 passes
            mbarrier.expect(k_full.index(s), BLOCK_N * D * 2)
            _tma_load(k_desc, [row0, kvh * D], k_full.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), ph ^ 1)
            if t < n_full:
                mbarrier.expect(v_full.index(s), BLOCK_N * D * 2)
                _tma_load(v_desc, [row0, kvh * D], v_full.index(s), v_smem.index(s))
            else:
                d = gl.arange(0, D, layout=COL)
                for c in gl.static_range(BLOCK_N // CH):
                    tok = start + c * CH + gl.arange(0, CH, layout=ROW)
                    off = page.to(gl.int64) * stride_cblk + (tok % BS) * stride_ctok \
                        + kvh * stride_ch
                    v = gl.load(vc_ptr + off[:, None] + d[None, :],
                                mask=(tok < kv_end)[:, None], other=0.0)
                    v_smem.index(s).slice(c * CH, CH).store(v)
                fence_async_shared()
                _barrier()
                mbarrier.arrive(v_full.index(s), count=1)

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, MASKED: gl.constexpr, ok):
        """The online softmax of one score tile: (row max, its rescale of the sums and of
        O, the probabilities, the row sums). Masked tiles keep rows that see nothing yet
        finite. The same arithmetic, in the same order, as `_prefill_kernel`'s loop body
        (the bit-identity rests on it); written twice because a Gluon kernel cannot call
        a `triton.jit` helper."""
        if MASKED:
            s = gl.where(ok, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            m_use = m_new
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s * qk_scale - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        return m_new, alpha, p, l_i

    @gluon.jit
    def _math_partition(q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn,
                        out_ptr, n_full, n_all, kv_end, pos0, f0, q_start, q_len, h, qk_scale,
                        stride_ot, stride_oh, WG: gl.constexpr, BLOCK_N: gl.constexpr,
                        D: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
        """One math warpgroup: rows [64 WG, 64 WG + 64) of the tile. Each turn (`turn`,
        PINGPONG) it issues S[t] and P[t-1] V[t-1], hands the turn to the other
        warpgroup, and computes the softmax of S[t] while the tensor cores run both
        warpgroups' GEMMs."""
        dtype: gl.constexpr = q_smem.dtype
        HM: gl.constexpr = 64
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, D, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        SROW: gl.constexpr = gl.SliceLayout(1, S_L)
        SCOL: gl.constexpr = gl.SliceLayout(0, S_L)
        OROW: gl.constexpr = gl.SliceLayout(1, O_L)
        q = q_smem.slice(WG * HM, HM)
        s_zero = gl.zeros([HM, BLOCK_N], gl.float32, S_L)
        o = gl.zeros([HM, D], gl.float32, O_L)
        m_i = gl.full([HM], float("-inf"), gl.float32, SROW)
        l_i = gl.zeros([HM], gl.float32, SROW)
        q_pos = pos0 + WG * HM + gl.arange(0, HM, layout=SROW)
        # Turn e of this warpgroup waits for the other's turn e - 1 (warpgroup 0's first
        # passes: the parity of a fresh barrier's previous phase).
        if n_all > 0:
            # Turn 0: S[0] alone.
            if PINGPONG:
                mbarrier.wait(turn.index(WG), WG ^ 1)
            mbarrier.wait(k_full.index(0), 0)
            s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - WG), count=1)
            s = warpgroup_mma_wait(0, deps=[s_tok])
            mbarrier.arrive(k_empty.index(0), count=1)
            tok = gl.arange(0, BLOCK_N, layout=SCOL)
            ok = (tok[None, :] <= q_pos[:, None]) & (tok < kv_end)[None, :]
            # masked (on a whole tile every key is visible: the same values)
            m_i, alpha, p, l_i = _softmax(s, m_i, l_i, qk_scale, True, ok)
            p_op = gl.convert_layout(p.to(dtype), P_L)
            # Turns 1 .. n_all - 1: S[t] and P[t-1] V[t-1].
            for t in range(1, n_all):
                s_i = t % STAGES
                sp = (t - 1) % STAGES
                if PINGPONG:
                    mbarrier.wait(turn.index(WG), (t & 1) ^ WG ^ 1)
                mbarrier.wait(k_full.index(s_i), (t // STAGES) & 1)
                s_tok = warpgroup_mma(q, k_smem.index(s_i).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
                mbarrier.wait(v_full.index(sp), ((t - 1) // STAGES) & 1)
                o_tok = warpgroup_mma(p_op, v_smem.index(sp), o, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - WG), count=1)
                s = warpgroup_mma_wait(1, deps=[s_tok])
                mbarrier.arrive(k_empty.index(s_i), count=1)
                if t < n_full:
                    m_i, alpha, p, l_i = _softmax(s, m_i, l_i, qk_scale, False, s)
                else:
                    tok = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=SCOL)
                    ok = (tok[None, :] <= q_pos[:, None]) & (tok < kv_end)[None, :]
                    m_i, alpha, p, l_i = _softmax(s, m_i, l_i, qk_scale, True, ok)
                o, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
                mbarrier.arrive(v_empty.index(sp), count=1)
                o = o * gl.convert_layout(alpha, OROW)[:, None]
                p_op = gl.convert_layout(p.to(dtype), P_L)
            # Turn n_all: the last P V.
            last = n_all - 1
            if PINGPONG:
                mbarrier.wait(turn.index(WG), (n_all & 1) ^ WG ^ 1)
            mbarrier.wait(v_full.index(last % STAGES), (last // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, v_smem.index(last % STAGES), o, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - WG), count=1)
            o = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(v_empty.index(last % STAGES), count=1)
        l_o = gl.convert_layout(l_i, OROW)
        o = o / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
        f_o = f0 + WG * HM + gl.arange(0, HM, layout=OROW)
        d_o = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
        gl.store(out_ptr + (q_start + f_o).to(gl.int64)[:, None] * stride_ot
                 + h * stride_oh + d_o[None, :], o.to(dtype), mask=(f_o < q_len)[:, None])

    # As for the Triton kernel: the step metadata are slices at arbitrary offsets and the
    # number of sequences changes every step; specializing on them recompiles mid-serving.
    @gluon.jit(do_not_specialize=["num_seqs"],
               do_not_specialize_on_alignment=["cu_ptr", "ctx_ptr", "bt_ptr"])
    def _prefill_pingpong_kernel(q_ptr, vc_ptr, k_desc, v_desc, cu_ptr, ctx_ptr, bt_ptr, out_ptr,
                                 qk_scale, num_seqs, stride_qt, stride_qh, stride_ot, stride_oh,
                                 stride_bt, stride_cblk, stride_ctok, stride_ch,
                                 GROUP: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                                 BLOCK_N: gl.constexpr, BLOCK_B: gl.constexpr,
                                 STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                                 MATH_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
                                 LW: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = 128
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        BLK: gl.constexpr = gl.BlockedLayout([1, 8], [256 // D, D // 8], [num_warps, 1], [1, 0])
        ROW: gl.constexpr = gl.SliceLayout(1, BLK)
        COL: gl.constexpr = gl.SliceLayout(0, BLK)
        VEC: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        QMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dtype)

        # Tiles in the Triton kernel's order: heads fastest, a sequence's last tiles first.
        pid = gl.num_programs(1) - 1 - gl.program_id(1)
        h = gl.program_id(0)
        kvh = h // GROUP
        # Sequence b owns tiles [cu[b] // BM + b, cu[b+1] // BM + b + 1).
        bi = gl.arange(0, BLOCK_B, layout=VEC)
        cu_b = gl.load(cu_ptr + bi, mask=bi < num_seqs, other=2147483647).to(gl.int32)
        first_tile = gl.where(bi < num_seqs, cu_b // BM + bi, 2147483647)
        b = gl.sum((first_tile <= pid).to(gl.int32), 0) - 1
        q_start = gl.load(cu_ptr + b).to(gl.int32)
        q_end = gl.load(cu_ptr + b + 1).to(gl.int32)
        tile = pid - (q_start // BM + b)
        ctx = gl.load(ctx_ptr + b).to(gl.int32)
        q_len = q_end - q_start
        f0 = tile * BM                                     # the tile's first row
        pos0 = ctx - q_len + f0                            # its position
        n_rows = gl.minimum(gl.maximum(q_len - f0, 0), BM)   # 0: a spare tile
        kv_end = gl.where(n_rows > 0, gl.minimum(pos0 + n_rows, ctx), 0)
        full_end = gl.minimum((pos0 + 1) // BLOCK_N * BLOCK_N, kv_end)
        n_full = full_end // BLOCK_N
        n_all = (kv_end + BLOCK_N - 1) // BLOCK_N
        bt_row = bt_ptr + b.to(gl.int64) * stride_bt

        f = f0 + gl.arange(0, BM, layout=ROW)
        d = gl.arange(0, D, layout=COL)
        q = gl.load(q_ptr + (q_start + f).to(gl.int64)[:, None] * stride_qt + h * stride_qh
                    + d[None, :], mask=(f < q_len)[:, None], other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BM, D], QMEM, q)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], SMEM)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], SMEM)
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)     # one arrival a math warpgroup
            mbarrier.init(v_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()
        _barrier()
        gl.warp_specialize(
            [(_math_partition, (q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn,
                                out_ptr, n_full, n_all, kv_end, pos0, f0, q_start, q_len, h,
                                qk_scale, stride_ot, stride_oh, 0, BLOCK_N, D, STAGES,
                                PINGPONG)),
             (_math_partition, (q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn,
                                out_ptr, n_full, n_all, kv_end, pos0, f0, q_start, q_len, h,
                                qk_scale, stride_ot, stride_oh, 1, BLOCK_N, D, STAGES,
                                PINGPONG)),
             (_load_partition, (k_smem, v_smem, k_full, v_full, k_empty, v_empty, k_desc, v_desc,
                                vc_ptr, bt_row, n_full, n_all, kv_end, kvh, stride_cblk,
                                stride_ctok, stride_ch, BS, BLOCK_N, D, STAGES, LW))],
            [4, LW], [MATH_REGS, LOAD_REGS])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, out: torch.Tensor,
                            seq_block: int) -> torch.Tensor:
    """`triton_attention.paged_prefill_attention`'s contract, where `usable` holds."""
    total, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    cfg = PINGPONG_CONFIG
    block_n = cfg["block_n"]
    tiles = total // BLOCK_M + num_seqs
    _prefill_pingpong_kernel[(num_heads, tiles)](
        q, v_cache, _descriptor(k_cache, block_n), _descriptor(v_cache, block_n),
        cu_seqlens_q, context_lens, block_tables, out,
        float(scale) * 1.4426950408889634, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=num_heads // num_kv_heads, D=head_dim, BS=block_size, BLOCK_N=block_n,
        BLOCK_B=max(triton.next_power_of_2(max(num_seqs, 1)), seq_block),
        STAGES=cfg["stages"], PINGPONG=bool(cfg["pingpong"]), MATH_REGS=cfg["math_regs"],
        LOAD_REGS=cfg["load_regs"], LW=cfg["load_warps"], num_warps=4)
    return out


def _descriptor(cache: torch.Tensor, block_n: int):
    """A TMA descriptor of one layer's cache as [slots, kv_heads x head_dim] rows, one key
    tile of one KV head a box. Made per call, as `triton_attention._kv_descriptor` is:
    a cache of them would keep every engine's KV cache alive after the engine."""
    nb, bs, hk, d = cache.shape
    elem = gl.bfloat16 if cache.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], elem)
    return TensorDescriptor(cache.view(nb * bs, hk * d), [nb * bs, hk * d], [hk * d, 1],
                            [block_n, d], layout)
