"""Paged attention in Triton: KV-cache write, decode (split-K with a reduction pass) and
varlen prefill over the paged cache. Same signatures as the torch twins in
`attention.py`, which are the oracle (tests/server/test_kernels*.py).

Layout: per layer `[num_blocks, block_size, num_kv_heads, head_dim]` (contiguous), a
token at position p of a sequence in block `block_table[p // block_size]`, row
`p % block_size`. fp8 caches (e4m3) hold `value / scale` and are dequantised on load.

No kernel reads a device value back to the host, so the decode path can be captured in
a CUDA graph: the decode grid depends only on the batch size and the block table's
width (both static per captured graph).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagefleet.server.ops import gluon_attention
from pagefleet.server.ops.triton_common import arrival_counters, last_arrival
from pagefleet.server.ops.triton_common import launch_opts, pdl_wait
from pagefleet.server.ops.triton_common import INTERPRET as _INTERPRET
from pagefleet.server.ops.triton_common import dot as _dot
from pagefleet.server.ops.triton_common import sm_count

# Launch parameters; benchmarks/ sweeps them on the GPU, tests shrink them.
DECODE_CONFIG = {
    "block_n": 64,          # tokens per K/V tile
    # H200, 2026-12-02 (night; profile_serving.py dattn, 28 layers' own caches per graph):
    # 4 warps and 64-token splits, against 2 warps and 128: 5.8 against 8.1 us a layer at
    # B=1 over 1K, 135.6 against 145.2 at 16 x 16K, 39.5 against 42.1 at 64 x 1K, equal at
    # 256 x 768; B=1 over 16K 16.8 against 15.4 (within that run's noise)
    "num_warps": 4,
    "num_stages": 3,
    # Splitting a row's context (see `decode_plan`): each row picks its split count on the
    # device from its own context, so one captured grid serves every context in its bucket.
    "target_programs": None,  # None: 2 x multiprocessors; batch x kv heads at least that: no split
    "split_programs": None,   # None: 4 x multiprocessors, the programs a split batch aims at
    "min_partition": 64,      # fewest tokens per split (a short context gets fewer splits)
    "max_partition": 1024,    # most (a long one gets more splits than the batch asks for)
    # Page ids one tile ahead, as the prefill kernel reads them: slower here (H200,
    # 2026-12-02: 51 against 43 us at 64 x 1K, 108 against 99 at 256 x 768), off.
    "page_ahead": False,
    # fused_merge: a split row's last program to finish merges the splits of its KV head's
    # query heads (arrival counters, triton_common.last_arrival) instead of a second
    # kernel (`_merge_group`: the merge pass's arithmetic per head, the same bits in the
    # interpreter and on an H200, splitk_graph_check.py). Only up to
    # fused_merge_max_splits splits (its [splits, head_dim] tiles stay in registers).
    # H200, 2026-12-03 (profile_serving.py dattn, us a layer): 12.2 against 5.8 at B=1
    # over 1K, 148 against 138 at 16 x 16K, equal elsewhere. 2026-12-04 (sixteenth
    # session), the engine's AWQ decode forward (engine_gemv_ab.py, 1K context): merging
    # head by head, 16 us a layer for attention against 7.5 for attention + merge pass;
    # with every head's loads issued before any store, 10.7: B=1 1.756 against 1.671 ms,
    # B=8 2.946 against 2.801. Off.
    "fused_merge": False,
    "fused_merge_max_splits": 32,
    # What the decode kernels read that the kernel before them does not write, read
    # before their PDL wait: the context lengths, and (attention) the block table and each
    # split's first K/V tile, the row's new key (written by the rotary kernel just before)
    # read again after the wait. A B=1 step's attention otherwise starts a chain of
    # dependent reads (length, page, keys) only when the rotary kernel is done. Split
    # launches only (a batch too small to fill the GPU alone, see `decode_plan`): the
    # early tile costs registers (sm_90: 154 against 96 split, 156 against 128 direct),
    # and a batch that fills the GPU is long past its first tile's latency.
    "kv_early": True,
}
# H200, 2026-12-02 (evening, BENCHMARKS.md): 128 x 128 tiles, 8 warps, 3 stages with the
# page ids read a tile ahead run a lone 8,192-token chunk over 16K of context in 3.15 ms
# against 3.4 for the 128 x 64, 4-warp tiles shipped before (and 4.0 for 64 x 64), and the
# 16K-document engine run at 250 against 244 out tok/s. Short chunks (16 x 512 tokens)
# are ~4% slower with them: 0.007 ms a layer, noise in such a step.
PREFILL_CONFIG = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3,
                  # Heads vary fastest in launch order and a sequence's last query tiles
                  # (the most keys) launch first, so the long tiles of a causal prefill do
                  # not trail at the end of the grid. H200, 2026-12-02 (BENCHMARKS.md):
                  # 3.16 against 3.30 ms for a lone 8,192-token chunk over 16K, 1.14 against
                  # 1.24 ms over 8K; no shape slower.
                  "longest_first": True,
                  # Page ids read one key tile ahead (see `_prefill_kernel`): the K/V
                  # copies stay pipelined. H200, 2026-12-02 (evening): with 128 x 128
                  # tiles, 8 warps, 3 stages, 3.14 against 3.37 ms (8K over 16K), 1.07
                  # against 1.13 (8K over 8K), 1.08 against 1.18 (2K over 16K) for the
                  # 128 x 64, 4-warp tiles without it; those tiles lose with it (5.04
                  # ms: 255 registers).
                  "page_ahead": True,
                  # Triton's Hopper warp specialization on the unmasked key loop (load
                  # warps feeding math warps, as FlashAttention-3 splits them). H200,
                  # 2026-12-03 (profile_serving.py attn): 1.09 against 1.07 ms (8K over
                  # 8K), 3.12 against 3.17 (8K over 16K), 1.09 both (2K over 16K): no
                  # gain, off; with 128 x 64 tiles at 4 warps it does not compile.
                  "warp_specialize": False,
                  # Key and value tiles by TMA bulk copies (one box a tile) instead of
                  # per-thread loads, where a cache page holds whole key tiles
                  # (--block-size 128) and the cache is 16- or 8-bit. H200, 2026-12-03
                  # (seventh session, profile_serving.py attn, graph-replayed, 128-token
                  # pages against the 16-token pages' per-key loads): 2.91-3.08 against
                  # 3.08-3.15 ms (8K over 16K), 0.98 against 1.07 (8K over 8K), 1.01
                  # against 1.09 (2K over 16K), bit-identical outputs; the 16-document
                  # engine run 248-249 against 245-246 out tok/s. (FlashAttention-3's
                  # in-warpgroup order in Gluon, S[j] in flight across the softmax, with
                  # these TMA tiles: bit-identical and slower, 2.98 against 2.89 ms at 8K
                  # over 16K; eighth session, results/2026-12-03h-gluon-prefill-tma.patch.)
                  "tma": True,
                  # The Gluon kernel with two math warpgroups in partitions of their own
                  # (FlashAttention-3's ping-pong) fed by a TMA producer
                  # (ops/gluon_attention.py) where it applies: sm_90, a 16-bit cache,
                  # pages of whole 128-key tiles. H200, 2026-12-04: bit-identical to
                  # this kernel on every check; alone (gluon_pingpong_ab.py,
                  # graph-replayed) 0.79 against 0.99 ms at 8K over 8K on one machine,
                  # equal within noise (0.80-0.85 both) on another; in the 16-document
                  # engine run, where it shares the GPU with the GEMMs, 260 against 252
                  # and 256 against 247 out tok/s on the two (BENCHMARKS.md).
                  "gluon_pingpong": True}
# Specializations: Triton compiles a kernel again for every new constexpr value and for
# every new "is it 1 / a multiple of 16 / 16-byte aligned" pattern of its arguments
# (ops/jit_variants.py). The step metadata (slot mapping, context lengths, block-table
# rows, cu_seqlens) are slices of the staging buffer at arbitrary offsets, and the
# number of prefill sequences changes every step; specializing on them compiled a new
# prefill variant (0.3-0.7 s on an H200, every stream stalled) dozens of times while
# serving. So those pointers are not specialized on alignment (they are read a scalar
# at a time), and the prefill kernel's sequence search runs over at least
# PREFILL_SEQ_BLOCK sequences: one variant up to 256 prefills in a step.
PREFILL_SEQ_BLOCK = 256

_LOG2E = 1.4426950408889634


def _programs(key: str, device: torch.device, per_sm: int) -> int:
    """DECODE_CONFIG[key], or `per_sm` programs per multiprocessor (4 per_sm on a CPU)."""
    if DECODE_CONFIG[key] is not None:
        return DECODE_CONFIG[key]
    return per_sm * (sm_count(device) if device.type == "cuda" else 4)


def _target_programs(device: torch.device) -> int:
    return _programs("target_programs", device, 2)


def _split_programs(device: torch.device) -> int:
    return _programs("split_programs", device, 4)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _block_d(head_dim: int) -> int:
    """The decode kernel's head-dim tile (its split accumulators' row length)."""
    return max(16, _pow2(head_dim))


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# -- KV cache write ----------------------------------------------------------------------

@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kvcache_kernel(key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale, v_scale,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_D: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & ((h * 0 + slot) >= 0) & (d < D)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if QUANT:
        k = k.to(tl.float32) / k_scale
        v = v.to(tl.float32) / v_scale
    dst = slot * (H * D) + h * D + d
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write K/V `[num_tokens, num_kv_heads, head_dim]` into the cache's flat slots
    (slot -1 skipped; fp8 caches store value / scale)."""
    n, h, d = key.shape
    if n == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    _store_kvcache_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        H=h, D=d, BLOCK_H=_pow2(h), BLOCK_D=_pow2(d), QUANT=k_cache.dtype != key.dtype, num_warps=1,
        **launch_opts())


# -- decode ------------------------------------------------------------------------------

@triton.jit
def _row_partition(ctx, want, min_part, max_part, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split of a row with `ctx` tokens: `want` splits (what the batch needs
    to fill the GPU), more for a context longer than `want x max_part`, fewer for one
    shorter than `want x min_part`, never more than the grid's `num_splits`; a multiple
    of BLOCK_N. The reduction pass computes the same, so both agree on the splits used."""
    s = tl.minimum(tl.maximum(want, tl.cdiv(ctx, max_part)), tl.cdiv(ctx, min_part))
    s = tl.maximum(tl.minimum(s, num_splits), 1)
    return tl.maximum(tl.cdiv(tl.cdiv(ctx, s), BLOCK_N) * BLOCK_N, BLOCK_N)


# What the decode kernels read before their PDL wait, with `kv_early` (tests/server/
# test_pdl.py holds them to it): the context lengths and block tables (step inputs,
# written before the forward's first kernel) and the cached keys and values (the
# kernel before writes only each row's new one, which is read again after the wait).
EARLY_READS = {"_decode_kernel": ("ctx_ptr", "bt_ptr", "kc_ptr", "vc_ptr"),
               "_decode_reduce_kernel": ("ctx_ptr",)}


# The split plan's integers change with the batch: not specialized (a new "is it 1 or a
# multiple of 16" pattern would compile a variant inside a serving step).
@triton.jit(do_not_specialize=["want", "min_part", "max_part", "num_splits"],
            do_not_specialize_on_alignment=["bt_ptr", "ctx_ptr"])
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, ml_ptr, acc_ptr, cnt_ptr,
                   qk_scale, k_scale, v_scale, want, min_part, max_part, num_splits,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                   stride_cblk, stride_ctok, stride_ch,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
                   BLOCK_N: tl.constexpr, FP8: tl.constexpr, DIRECT: tl.constexpr,
                   F32: tl.constexpr, PAGE_AHEAD: tl.constexpr, FUSED: tl.constexpr,
                   SPLITS_PAD: tl.constexpr, KV_EARLY: tl.constexpr, PDL: tl.constexpr):
    if not KV_EARLY:
        pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    if DIRECT:
        lo = 0
        hi = ctx
    else:
        part = _row_partition(ctx, want, min_part, max_part, num_splits, BLOCK_N)
        lo = sp * part
        hi = tl.minimum(lo + part, ctx)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    gmask = g < GROUP
    heads = kvh * GROUP + g
    n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    first = lo
    if KV_EARLY:
        # The split's first K/V tile is read before the PDL wait: the kernel before (the
        # rotary + KV write) writes only each row's new key, at ctx - 1, and this step's
        # inputs (context lengths, block tables) were written before the forward began
        # (`KV_EARLY` in DECODE_CONFIG). After the wait the new key's row is read again.
        tok0, tmask0, off0, k0, v0 = _first_tile(kc_ptr, vc_ptr, bt_row, lo, hi, n, d, dmask,
                                                 kvh, BS, BLOCK_N, stride_cblk, stride_ctok,
                                                 stride_ch)
        pdl_wait(PDL)
        new = (tmask0 & (tok0 == ctx - 1))[:, None] & dmask[None, :]
        k0 = tl.where(new, tl.load(kc_ptr + off0[:, None] + d[None, :], mask=new, other=0.0), k0)
        v0 = tl.where(new, tl.load(vc_ptr + off0[:, None] + d[None, :], mask=new, other=0.0), v0)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if KV_EARLY:
        if lo < hi:
            p0, m_i, alpha0, l_i = _scores(q, k0, tmask0, m_i, l_i, qk_scale, k_scale, FP8, F32)
            acc = _accumulate(acc, p0, alpha0, v0, v_scale, q.dtype, FP8, F32)
        first = lo + BLOCK_N
    # Page ids one tile ahead, as in `_prefill_kernel` (PAGE_AHEAD there): the K/V loads
    # then stay pipelined instead of waiting for all copies in flight every step.
    if PAGE_AHEAD:
        page_next = _pages(bt_row, first, hi, BS, BLOCK_N)
    for start in range(first, hi, BLOCK_N):
        tok = start + n
        tmask = tok < hi
        if PAGE_AHEAD:
            page = page_next
            page_next = _pages(bt_row, start + BLOCK_N, hi, BS, BLOCK_N)
        else:
            page = _pages(bt_row, start, hi, BS, BLOCK_N)
        off = _kv_offsets(page, tok, kvh, BS, stride_cblk, stride_ctok, stride_ch)
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=tmask[:, None] & dmask[None, :],
                    other=0.0)
        p, m_i, alpha, l_i = _scores(q, k, tmask, m_i, l_i, qk_scale, k_scale, FP8, F32)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=tmask[:, None] & dmask[None, :],
                    other=0.0)
        acc = _accumulate(acc, p, alpha, v, v_scale, q.dtype, FP8, F32)
    if DIRECT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        row = (b * NUM_HEADS + heads).to(tl.int64) * num_splits + sp
        smask = gmask & ((g * 0 + lo) < ctx)
        tl.store(ml_ptr + row * 2, m_i, mask=smask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=smask)
        tl.store(acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=smask[:, None])
        if FUSED:
            # The row's splits that hold keys count in; the last merges them. An empty row
            # (a CUDA-graph padding row) is merged by its split 0: zeros, as the merge pass
            # writes them.
            used = tl.cdiv(ctx, part)
            merge = sp == 0
            if used > 0:
                merge = sp < 0
                if sp < used:
                    merge = last_arrival(cnt_ptr + b * tl.num_programs(1) + kvh, used)
            if merge:
                _merge_group(ml_ptr, acc_ptr, out_ptr, b, kvh, used, num_splits, stride_ob,
                             stride_oh, NUM_HEADS, GROUP, GROUP_PAD, D, BLOCK_D, SPLITS_PAD)


@triton.jit
def _merge_group(ml_ptr, acc_ptr, out_ptr, b, kvh, used, num_splits, stride_ob, stride_oh,
                 NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """`_merge_splits` for the GROUP query heads of KV head `kvh` at once, as one program
    (the row's last split to finish) merges them: every head's (max, sum) in one load and
    every head's accumulators requested before any output is stored, so the merge costs
    about one trip to L2 rather than two a head (merging head by head, with a store
    between, took ~16 us a layer at B=1 on an H200: BENCHMARKS.md, 2026-12-04,
    sixteenth session). The same arithmetic per head as `_merge_splits`: the same bits."""
    g = tl.arange(0, GROUP_PAD)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    smask = s < used
    heads = kvh * GROUP + g
    rows = (b * NUM_HEADS + heads).to(tl.int64)[:, None] * num_splits + s[None, :]
    mask = gmask[:, None] & smask[None, :]
    m = tl.load(ml_ptr + rows * 2, mask=mask, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(ml_ptr + rows * 2 + 1, mask=mask, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(mask, tl.exp2(m - m_max[:, None]), 0.0)
    denom = tl.sum(w * l, 1)
    denom = tl.where(denom == 0.0, 1.0, denom)
    o = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for gi in tl.static_range(GROUP):
        row = (b * NUM_HEADS + kvh * GROUP + gi).to(tl.int64) * num_splits + s
        acc = tl.load(acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None],
                      other=0.0, cache_modifier=".cg")
        wg = tl.sum(tl.where(g[:, None] == gi, w, 0.0), 0)          # head gi's weights
        og = tl.sum(acc * wg[:, None], 0) / tl.sum(tl.where(g == gi, denom, 0.0), 0)
        o = tl.where(g[:, None] == gi, og[None, :], o)
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (d < D)[None, :])


@triton.jit
def _merge_splits(ml_ptr, acc_ptr, out_ptr, b, h, used, num_splits, stride_ob, stride_oh,
                  NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLITS_PAD: tl.constexpr):
    """Head `h` of row `b`: its `used` splits' (max, sum, accumulator) merged into the
    output (zeros for a row without keys). `.cg` loads: the splits were written by other
    programs, maybe on other multiprocessors, in this kernel (fused) or the one before."""
    s = tl.arange(0, SPLITS_PAD)
    smask = s < used
    row = (b * NUM_HEADS + h).to(tl.int64) * num_splits + s
    m = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(smask, tl.exp2(m - m_max), 0.0)
    denom = tl.sum(w * l, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0,
                  cache_modifier=".cg")
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < D)


@triton.jit(do_not_specialize=["want", "min_part", "max_part", "num_splits"],
            do_not_specialize_on_alignment=["ctx_ptr"])
def _decode_reduce_kernel(ml_ptr, acc_ptr, ctx_ptr, out_ptr, want, min_part, max_part,
                          num_splits, stride_ob, stride_oh,
                          NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          KV_EARLY: tl.constexpr, PDL: tl.constexpr):
    if not KV_EARLY:
        pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)   # a step input: no kernel of the forward writes it
    used = tl.cdiv(ctx, _row_partition(ctx, want, min_part, max_part, num_splits, BLOCK_N))
    if KV_EARLY:
        pdl_wait(PDL)
    _merge_splits(ml_ptr, acc_ptr, out_ptr, b, h, used, num_splits, stride_ob, stride_oh,
                  NUM_HEADS, D, BLOCK_D, SPLITS_PAD)


@dataclass(frozen=True)
class DecodePlan:
    """How a decode launch splits contexts: the grid's split count (1: no split, each
    program reads its row's whole context) and what each row's split count is chosen
    from on the device (`_row_partition`)."""

    splits: int
    want: int = 1
    min_part: int = 1
    max_part: int = 1


def decode_plan(batch: int, num_kv_heads: int, max_ctx: int, device: torch.device) -> DecodePlan:
    """The split plan for a decode launch over block tables `max_ctx` tokens wide. Depends
    only on static sizes (batch, width), never on device values: a CUDA graph holds it.

    A batch with batch x kv heads >= `target_programs` fills the GPU alone: no split.
    Below that, rows aim at `split_programs` programs in all (H200, 2026-12-02 sweep:
    B=64 over 1,700 tokens ran 62.5 us a layer in 2 splits against 68.4 in the 4 the old
    width-based plan gave, B=16 over 6,000 tokens 56 us in 6-8 against 63 in 47). Each
    row's count comes from its own context, bounded by min/max tokens per split, so a
    900-token row in a 2K-wide graph does not take a 1,700-token row's splits."""
    max_ctx = max(max_ctx, 1)
    progs = batch * num_kv_heads
    if progs >= _target_programs(device):
        return DecodePlan(1)
    cfg = DECODE_CONFIG
    block_n = cfg["block_n"]
    lo = -(-max(cfg["min_partition"], block_n) // block_n) * block_n
    hi = max(-(-cfg["max_partition"] // block_n) * block_n, lo)
    want = max(1, _split_programs(device) // progs)
    splits = max(1, min(max(want, triton.cdiv(max_ctx, hi)), triton.cdiv(max_ctx, lo)))
    return DecodePlan(splits, want, lo, hi)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: q `[batch, num_heads, head_dim]` over its context.
    One program serves all query heads of a KV head; long contexts are split along the
    sequence and merged by a second pass. `out` (optional) receives the result."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    cfg = DECODE_CONFIG
    block_n = cfg["block_n"]
    block_d = _block_d(head_dim)
    plan = decode_plan(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device)
    splits = plan.splits
    direct = splits == 1
    cnt = None
    if direct:
        ml = acc = out   # unused
    else:
        ml = torch.empty(batch * num_heads * splits * 2, dtype=torch.float32, device=q.device)
        acc = torch.empty(batch * num_heads * splits * block_d, dtype=torch.float32,
                          device=q.device)
        if cfg["fused_merge"] and splits <= cfg["fused_merge_max_splits"]:
            cnt = arrival_counters(q.device, batch * num_kv_heads)
    fused = cnt is not None
    early = bool(cfg["kv_early"]) and not direct
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, ml, acc,
        cnt if fused else ml, float(scale) * _LOG2E, float(k_scale), float(v_scale),
        plan.want, plan.min_part, plan.max_part, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(16, _pow2(group)), D=head_dim,
        BLOCK_D=block_d, BS=block_size, BLOCK_N=block_n, FP8=_is_fp8(k_cache.dtype),
        DIRECT=direct, F32=_INTERPRET, PAGE_AHEAD=bool(cfg["page_ahead"]), FUSED=fused,
        SPLITS_PAD=_pow2(splits) if fused else 1, KV_EARLY=early,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **launch_opts("attention"))
    if not direct and not fused:
        _decode_reduce_kernel[(batch, num_heads)](
            ml, acc, context_lens, out, plan.want, plan.min_part, plan.max_part, splits,
            out.stride(0), out.stride(1), NUM_HEADS=num_heads, D=head_dim, BLOCK_D=block_d,
            BLOCK_N=block_n, SPLITS_PAD=_pow2(splits), KV_EARLY=early, num_warps=4,
            **launch_opts("merge"))
    return out


# -- prefill (varlen, over the paged cache) ------------------------------------------------

@triton.jit
def _prefill_tile(q, acc, m_i, l_i, start, kv_end, q_pos, page, kc_ptr, vc_ptr, d, dmask, kvh,
                  stride_cblk, stride_ctok, stride_ch, qk_scale, k_scale, v_scale,
                  BS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr,
                  F32: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N), whose cache pages are
    `page` (one per key, or the tile's one page: `_pages`). MASKED: the causal mask and
    the context end apply; else every key is visible to every row of the tile and the
    selects are left out. TMA: kc_ptr / vc_ptr are tensor descriptors (`_kv_descriptor`)."""
    tok = start + tl.arange(0, BLOCK_N)
    tmask = tok < kv_end
    if TMA:
        # kc_ptr / vc_ptr are tensor descriptors over the cache as [blocks x BS, kv heads
        # x D]: a key tile is one box of one page (BS a multiple of BLOCK_N).
        row0 = (page * BS + start % BS).to(tl.int32)
        k = kc_ptr.load([row0, kvh * D])
    else:
        off = page.to(tl.int64) * stride_cblk + (tok % BS) * stride_ctok + kvh * stride_ch
        kv_mask = tmask[:, None] & dmask[None, :] if MASKED else dmask[None, :]
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if FP8:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
    # Raw scores; the scale (log2 e folded in) goes into the exponent's FMA below, not
    # a multiply of its own over the whole tile (m_i is kept in scaled units).
    s = _dot(q, tl.trans(k), F32)
    if MASKED:
        ok = (tok[None, :] <= q_pos[:, None]) & tmask[None, :]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:
        v = vc_ptr.load([row0, kvh * D])
        if MASKED:   # past the context: whatever the page holds (may be NaN), not 0
            v = tl.where(tmask[:, None], v, tl.zeros_like(v))
    else:
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if FP8:
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32)
    return acc, m_new, l_i


@triton.jit
def _kv_offsets(page, tok, kvh, BS: tl.constexpr, stride_cblk, stride_ctok, stride_ch):
    """The cache offsets of KV head `kvh`'s keys `tok` on their pages (`_pages`)."""
    return page.to(tl.int64) * stride_cblk + (tok % BS) * stride_ctok + kvh * stride_ch


@triton.jit
def _first_tile(kc_ptr, vc_ptr, bt_row, lo, hi, n, d, dmask, kvh, BS: tl.constexpr,
                BLOCK_N: tl.constexpr, stride_cblk, stride_ctok, stride_ch):
    """A split's first K/V tile, as `kv_early` reads it before the PDL wait: (its
    tokens, their mask, their cache offsets, keys, values)."""
    tok = lo + n
    tmask = tok < hi
    off = _kv_offsets(_pages(bt_row, lo, hi, BS, BLOCK_N), tok, kvh, BS, stride_cblk,
                      stride_ctok, stride_ch)
    kv_mask = tmask[:, None] & dmask[None, :]
    k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return tok, tmask, off, k, v


@triton.jit
def _scores(q, k, tmask, m_i, l_i, qk_scale, k_scale, FP8: tl.constexpr, F32: tl.constexpr):
    """A K tile into the online softmax: (p, new max, rescale of the old terms, new sum)."""
    if FP8:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
    s = _dot(q, tl.trans(k), F32) * qk_scale
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, m_new, alpha, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _accumulate(acc, p, alpha, v, v_scale, dt: tl.constexpr, FP8: tl.constexpr,
                F32: tl.constexpr):
    """Its V tile into the accumulator."""
    if FP8:
        v = (v.to(tl.float32) * v_scale).to(dt)
    return acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32)


@triton.jit
def _pages(bt_row, start, end, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache page of each key in [start, start + BLOCK_N) (0 past `end`). When a
    page holds whole key tiles (BS a multiple of BLOCK_N; tiles start at multiples of
    BLOCK_N), one scalar: the tile's addresses are then that page's base plus offsets
    that do not change from tile to tile, instead of a page-id load and an address
    product per key."""
    if BS % BLOCK_N == 0:
        return tl.load(bt_row + start // BS, mask=start < end, other=0)
    else:
        tok = start + tl.arange(0, BLOCK_N)
        return tl.load(bt_row + tok // BS, mask=tok < end, other=0)


@triton.jit(do_not_specialize=["num_seqs"],
            do_not_specialize_on_alignment=["cu_ptr", "ctx_ptr", "bt_ptr"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, cu_ptr, ctx_ptr, bt_ptr, out_ptr,
                    qk_scale, k_scale, v_scale, num_seqs,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_cblk, stride_ctok, stride_ch,
                    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                    FP8: tl.constexpr, F32: tl.constexpr, LONGEST_FIRST: tl.constexpr,
                    PAGE_AHEAD: tl.constexpr, WARP_SPEC: tl.constexpr, TMA: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_wait(PDL)
    if LONGEST_FIRST:
        pid = tl.num_programs(1) - 1 - tl.program_id(1)
        h = tl.program_id(0)
    else:
        pid = tl.program_id(0)
        h = tl.program_id(1)
    kvh = h // GROUP
    # Sequence b owns tiles [cu[b] // BLOCK_M + b, cu[b+1] // BLOCK_M + b + 1): enough
    # for its rows, and found without reading anything back on the host.
    bi = tl.arange(0, BLOCK_B)
    # The step metadata arrives as int64 (the runner stages it so); positions fit in
    # int32, and int64 index math held 254 of 255 registers on sm_90 (226 in int32; with
    # 128-row tiles, 1 KB of spills against 360 B): read once, used in int32.
    cu_b = tl.load(cu_ptr + bi, mask=bi < num_seqs, other=2147483647).to(tl.int32)
    first_tile = tl.where(bi < num_seqs, cu_b // BLOCK_M + bi, 2147483647)
    b = tl.sum((first_tile <= pid).to(tl.int32), 0) - 1
    q_start = tl.load(cu_ptr + b).to(tl.int32)
    q_end = tl.load(cu_ptr + b + 1).to(tl.int32)
    tile = pid - (q_start // BLOCK_M + b)
    rows = q_start + tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_end
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    q_len = q_end - q_start
    q_pos = ctx - q_len + (rows - q_start)          # absolute position of each query
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(tl.max(tl.where(rmask, q_pos, -1), 0) + 1, ctx)
    # Key tiles that every row of this query tile may see (at or before its first row's
    # position) need no mask: most of a long context. Only the diagonal ones are masked.
    full_end = tl.minimum((ctx - q_len + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N, kv_end)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    # The key tiles every row sees. PAGE_AHEAD: each tile's page ids are read one tile
    # ahead into registers. Read in the tile's own step, they made the K/V loads depend
    # on a load of the same iteration, and Triton's pipeliner then waited for every copy
    # in flight (cp.async.wait_group 0) at the top of each step: one memory latency per
    # tile. Read ahead, the K/V copies take their addresses from registers and the
    # pipeline keeps num_stages - 1 tiles in flight (wait_group 2; sm_90 PTX, Triton 3.9).
    if PAGE_AHEAD:
        page_next = _pages(bt_row, 0, full_end, BS, BLOCK_N)
    for start in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPEC):
        if PAGE_AHEAD:
            page = page_next
            page_next = _pages(bt_row, start + BLOCK_N, full_end, BS, BLOCK_N)
        else:
            page = _pages(bt_row, start, full_end, BS, BLOCK_N)
        acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, start, kv_end, q_pos, page, kc_ptr,
                                      vc_ptr, d, dmask, kvh, stride_cblk, stride_ctok, stride_ch,
                                      qk_scale, k_scale, v_scale, BS, BLOCK_N, D, FP8, F32, TMA, False)
    # The diagonal tiles (a few per query tile).
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, start, kv_end, q_pos,
                                      _pages(bt_row, start, kv_end, BS, BLOCK_N), kc_ptr,
                                      vc_ptr, d, dmask, kvh, stride_cblk, stride_ctok, stride_ch,
                                      qk_scale, k_scale, v_scale, BS, BLOCK_N, D, FP8, F32, TMA, True)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a packed batch of new tokens over their cached context (the
    new tokens are the last `q_len` of each sequence's `context_lens`). `out`
    (optional) receives the result."""
    total, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    if total == 0 or num_seqs == 0:
        return out
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    cfg = PREFILL_CONFIG
    if cfg["gluon_pingpong"] and k_scale == 1.0 and v_scale == 1.0:
        if gluon_attention.usable(q, k_cache):
            return gluon_attention.paged_prefill_attention(
                q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, out,
                PREFILL_SEQ_BLOCK)
    block_m = cfg["block_m"]
    tiles = total // block_m + num_seqs
    grid = (num_heads, tiles) if cfg["longest_first"] else (tiles, num_heads)
    tma = _use_tma(cfg["tma"], k_cache, cfg["block_n"])
    kc, vc = (_kv_descriptor(k_cache, cfg["block_n"]), _kv_descriptor(v_cache, cfg["block_n"])) \
        if tma else (k_cache, v_cache)
    _prefill_kernel[grid](
        q, kc, vc, cu_seqlens_q, context_lens, block_tables, out,
        float(scale) * _LOG2E, float(k_scale), float(v_scale), num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // num_kv_heads, D=head_dim, BLOCK_D=_block_d(head_dim),
        BS=block_size, BLOCK_M=block_m,
        BLOCK_N=cfg["block_n"], BLOCK_B=max(_pow2(num_seqs), PREFILL_SEQ_BLOCK), FP8=_is_fp8(k_cache.dtype), F32=_INTERPRET,
        LONGEST_FIRST=bool(cfg["longest_first"]), PAGE_AHEAD=bool(cfg["page_ahead"]),
        WARP_SPEC=bool(cfg["warp_specialize"]), TMA=tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_opts())
    return out


def _use_tma(want: bool, cache: torch.Tensor, block_n: int) -> bool:
    """Key tiles by TMA (Hopper's bulk tensor copies) where asked and possible: a page
    holds whole tiles, the head is one power-of-two box, and the GPU has TMA (or the
    interpreter runs the kernel)."""
    _, block_size, _, head_dim = cache.shape
    if not want or block_size % block_n or head_dim != _pow2(head_dim) or head_dim < 16:
        return False
    if cache.element_size() > 2:   # float32 tiles: the boxes of 3 stages overflow shared memory
        return False
    if _INTERPRET:
        return True
    return cache.is_cuda and _has_tma(cache.device.index if cache.device.index is not None
                                      else torch.cuda.current_device())


@functools.cache
def _has_tma(device_index: int) -> bool:
    """Hopper and later (asked once per device: this runs for every layer of a step)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _kv_descriptor(cache: torch.Tensor, block_n: int):
    """A TMA descriptor over one layer's cache seen as [blocks x block_size, kv heads x
    head_dim]: a key tile of one KV head is the box at (page x block_size + offset,
    head x head_dim)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    nb, bs, hk, d = cache.shape
    return TensorDescriptor.from_tensor(cache.view(nb * bs, hk * d), [block_n, d])
