"""Rotary embedding (neox layout) in Triton (twin: `rotary.py`), alone and fused with
the KV-cache write (`rotary_and_store`, twin: the two ops in a row).

Reads cos/sin from the same float32 `[max_pos, head_dim]` cache (cos of the half-dims,
then sin), so `default` and `llama3` scaling are whatever the cache holds. Rounds like
the twin: cos/sin cast to the activation dtype, each product and the sum rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.server.ops.deferred import DeferredSum, qkv_heads
from pagefleet.server.ops.triton_common import launch_opts, pdl_wait
from pagefleet.server.ops.triton_layernorm import deferred_row, rearm

# "inputs_early": `_rotary_store_kernel` reads its position, cos/sin and slot before the
# PDL wait (see there).
ROTARY_CONFIG = {"inputs_early": True,
                 # warps of the one program reading a deferred q/k/v row (36 KB of int64
                 # at Qwen2.5-7B's shape; an A/B key, unmeasured beyond 8)
                 "deferred_warps": 8}
# What a kernel reads before its PDL wait (tests/server/test_pdl.py holds it to this):
# step inputs and the constant cos/sin table, which no kernel of the forward writes.
EARLY_READS = {"_rotary_store_kernel": ("pos_ptr", "cs_ptr", "slot_ptr"),
               "_rotary_store_deferred_kernel": ("pos_ptr", "cs_ptr", "slot_ptr")}


@triton.jit
def _rotated(x_ptr, cos, sin, t, stride_t, stride_h, H, dt, HALF: tl.constexpr,
             BLOCK_H: tl.constexpr):
    """Token t's heads, rotated: (first halves, second halves, head index, mask)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, HALF)[None, :]
    mask = h < H
    base = x_ptr + t.to(tl.int64) * stride_t + h * stride_h + c
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate_pair(x1, x2, cos, sin, dt)
    return o1, o2, h, mask


@triton.jit
def _rotate_pair(x1, x2, cos, sin, dt):
    """The rotation of (first halves, second halves), each product and the sum rounded
    to `dt` as the twin rounds."""
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _store_kv(kc_ptr, vc_ptr, k1, k2, v1, v2, slot, h, mask, k_scale, v_scale, HK,
              HALF: tl.constexpr, QUANT: tl.constexpr):
    """k (rotated) and v into the cache slot (an fp8 cache: value / scale, rounded once
    to the cache dtype, as store_kvcache)."""
    if QUANT:
        k1 = k1.to(tl.float32) / k_scale
        k2 = k2.to(tl.float32) / k_scale
        v1 = v1.to(tl.float32) / v_scale
        v2 = v2.to(tl.float32) / v_scale
    c = tl.arange(0, HALF)[None, :]
    dst = slot * (HK * 2 * HALF) + h * (2 * HALF) + c
    cdt = kc_ptr.dtype.element_ty
    tl.store(kc_ptr + dst, k1.to(cdt), mask=mask)
    tl.store(kc_ptr + dst + HALF, k2.to(cdt), mask=mask)
    tl.store(vc_ptr + dst, v1.to(cdt), mask=mask)
    tl.store(vc_ptr + dst + HALF, v2.to(cdt), mask=mask)


@triton.jit
def _rotate(x_ptr, o_ptr, cos, sin, t, stride_t, stride_h, H, HALF: tl.constexpr,
            BLOCK_H: tl.constexpr):
    o1, o2, h, mask = _rotated(x_ptr, cos, sin, t, stride_t, stride_h, H,
                               o_ptr.dtype.element_ty, HALF, BLOCK_H)
    c = tl.arange(0, HALF)[None, :]
    obase = o_ptr + t.to(tl.int64) * (H * 2 * HALF) + h * (2 * HALF) + c
    tl.store(obase, o1, mask=mask)
    tl.store(obase + HALF, o2, mask=mask)


@triton.jit
def _cos_sin(pos_ptr, cs_ptr, t, dt, HALF: tl.constexpr):
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF)[None, :]
    cos = tl.load(cs_ptr + pos * (2 * HALF) + c).to(dt).to(tl.float32)
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + c).to(dt).to(tl.float32)
    return cos, sin


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])   # staging slices: any offset
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cs_ptr, qo_ptr, ko_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, HQ, HK,
                   HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    cos, sin = _cos_sin(pos_ptr, cs_ptr, t, qo_ptr.dtype.element_ty, HALF)
    _rotate(q_ptr, qo_ptr, cos, sin, t, stride_qt, stride_qh, HQ, HALF, BLOCK_HQ)
    _rotate(k_ptr, ko_ptr, cos, sin, t, stride_kt, stride_kh, HK, HALF, BLOCK_HK)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])   # staging slices
def _rotary_store_kernel(pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, qo_ptr, kc_ptr, vc_ptr,
                         k_scale, v_scale, stride_qt, stride_qh, stride_kt, stride_kh,
                         stride_vt, stride_vh, HQ, HK, HALF: tl.constexpr,
                         BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, QUANT: tl.constexpr,
                         EARLY: tl.constexpr, PDL: tl.constexpr):
    """Rotary on q (to qo) and k, and k and v written straight into the cache slot:
    the rotated k never goes through memory, and one launch does what two did. EARLY:
    the position, its cos/sin and the slot (step inputs and a constant table, which no
    kernel of the forward writes) are read before the PDL wait, so only q/k/v wait."""
    t = tl.program_id(0)
    dt = qo_ptr.dtype.element_ty
    if not EARLY:
        pdl_wait(PDL)
    cos, sin = _cos_sin(pos_ptr, cs_ptr, t, dt, HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if EARLY:
        pdl_wait(PDL)
    _rotate(q_ptr, qo_ptr, cos, sin, t, stride_qt, stride_qh, HQ, HALF, BLOCK_HQ)
    k1, k2, h, mask = _rotated(k_ptr, cos, sin, t, stride_kt, stride_kh, HK, dt, HALF, BLOCK_HK)
    mask = mask & ((h * 0 + slot) >= 0)          # slot -1: padding, nothing written
    c = tl.arange(0, HALF)[None, :]
    v_base = v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + c
    v1 = tl.load(v_base, mask=mask, other=0.0)
    v2 = tl.load(v_base + HALF, mask=mask, other=0.0)
    _store_kv(kc_ptr, vc_ptr, k1, k2, v1, v2, slot, h, mask, k_scale, v_scale, HK, HALF,
              QUANT)


@triton.jit
def _deferred_heads(acc_ptr, b_ptr, base, H, dt, HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """Heads [0, H) of a deferred q/k/v row from column `base`: (first halves, second
    halves) as the GEMV would have stored them (`triton_layernorm.deferred_row`), as
    float32."""
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, HALF)[None, :]
    mask = h < H
    offs = base + h * (2 * HALF) + c
    x1 = deferred_row(acc_ptr, b_ptr, offs, mask, dt, HAS_BIAS).to(tl.float32)
    x2 = deferred_row(acc_ptr, b_ptr, offs + HALF, mask, dt, HAS_BIAS).to(tl.float32)
    return x1, x2, h, mask


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])   # staging slices
def _rotary_store_deferred_kernel(pos_ptr, slot_ptr, acc_ptr, b_ptr, cs_ptr, qo_ptr, kc_ptr,
                                  vc_ptr, k_scale, v_scale, HQ, HK, HALF: tl.constexpr,
                                  BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                                  QUANT: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  BLOCK_ROW: tl.constexpr, PDL: tl.constexpr):
    """`_rotary_store_kernel` (EARLY) for one token whose q/k/v row is a deferred sum
    (`ops/deferred.py`: int64 `[1, (HQ + 2 HK) x head_dim]` at acc_ptr, the bias at
    b_ptr): the row finished as it is read (and re-armed), then the same roundings,
    rotation and cache writes."""
    dt = qo_ptr.dtype.element_ty
    cos, sin = _cos_sin(pos_ptr, cs_ptr, 0, dt, HALF)
    slot = tl.load(slot_ptr).to(tl.int64)
    pdl_wait(PDL)
    q1, q2, hq, qmask = _deferred_heads(acc_ptr, b_ptr, 0, HQ, dt, HAS_BIAS, HALF, BLOCK_HQ)
    c = tl.arange(0, HALF)[None, :]
    o1, o2 = _rotate_pair(q1, q2, cos, sin, dt)
    tl.store(qo_ptr + hq * (2 * HALF) + c, o1, mask=qmask)
    tl.store(qo_ptr + hq * (2 * HALF) + c + HALF, o2, mask=qmask)
    k1, k2, h, kmask = _deferred_heads(acc_ptr, b_ptr, HQ * 2 * HALF, HK, dt, HAS_BIAS, HALF,
                                       BLOCK_HK)
    k1, k2 = _rotate_pair(k1, k2, cos, sin, dt)
    v1, v2, h, kmask = _deferred_heads(acc_ptr, b_ptr, (HQ + HK) * 2 * HALF, HK, dt, HAS_BIAS,
                                       HALF, BLOCK_HK)
    rearm(acc_ptr, (HQ + 2 * HK) * 2 * HALF, BLOCK_ROW)
    _store_kv(kc_ptr, vc_ptr, k1, k2, v1, v2, slot, h, kmask & ((h * 0 + slot) >= 0), k_scale,
              v_scale, HK, HALF, QUANT)


def _unsupported(d: int, cos_sin: torch.Tensor) -> bool:
    """Head sizes the kernels do not take (odd, or a half that is not a power of two)."""
    return bool(d % 2 or (d // 2) & (d // 2 - 1) or cos_sin.shape[-1] != d)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[tokens, heads, head_dim]`, k `[tokens, kv_heads, head_dim]` -> rotated copies."""
    n, hq, d = q.shape
    hk = k.shape[1]
    if _unsupported(d, cos_sin):
        from pagefleet.server.ops import rotary
        return rotary.rotary_embedding(positions, q, k, cos_sin)
    assert q.stride(2) == 1 and k.stride(2) == 1
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if n:
        cs = cos_sin if cos_sin.is_contiguous() else cos_sin.contiguous()
        _rotary_kernel[(n,)](positions, q, k, cs, qo, ko, q.stride(0), q.stride(1),
                             k.stride(0), k.stride(1), hq, hk, HALF=d // 2,
                             BLOCK_HQ=triton.next_power_of_2(hq),
                             BLOCK_HK=triton.next_power_of_2(hk), num_warps=4,
                             **launch_opts("rotary"))
    return qo, ko


def rotary_and_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """`rotary_embedding` then `store_kvcache` in one kernel: returns rotated q; k
    (rotated) and v go to the cache's flat slots (slot -1 skipped; an fp8 cache holds
    value / scale). Same roundings as the two ops, so the same bits land in the cache."""
    n, hq, d = q.shape
    hk = k.shape[1]
    if _unsupported(d, cos_sin):
        from pagefleet.server.ops import triton_attention
        q, k = rotary_embedding(positions, q, k, cos_sin)
        triton_attention.store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return q
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n:
        cs = cos_sin if cos_sin.is_contiguous() else cos_sin.contiguous()
        _rotary_store_kernel[(n,)](
            positions, slot_mapping, q, k, v, cs, qo, k_cache, v_cache, float(k_scale),
            float(v_scale), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), hq, hk, HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq),
            BLOCK_HK=triton.next_power_of_2(hk), QUANT=k_cache.dtype != k.dtype,
            EARLY=bool(ROTARY_CONFIG["inputs_early"]), num_warps=4, **launch_opts("rotary"))
    return qo


def rotary_and_store_deferred(positions: torch.Tensor, qkv: DeferredSum, heads: int,
                              kv_heads: int, head_dim: int, cos_sin: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, k_scale: float = 1.0,
                              v_scale: float = 1.0) -> torch.Tensor:
    """`rotary_and_store` of one token whose q/k/v row is a deferred sum: the kernel
    finishes the sum as it reads it (`ops/deferred.py`); the same bits as the row made a
    tensor, then `rotary_and_store`."""
    if _unsupported(head_dim, cos_sin) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        q, k, v = qkv_heads(qkv, heads, kv_heads, head_dim)
        return rotary_and_store(positions, q, k, v, cos_sin, k_cache, v_cache, slot_mapping,
                                k_scale, v_scale)
    qo = torch.empty(1, heads, head_dim, dtype=qkv.dtype, device=qkv.acc.device)
    cs = cos_sin if cos_sin.is_contiguous() else cos_sin.contiguous()
    _rotary_store_deferred_kernel[(1,)](
        positions, slot_mapping, qkv.acc, qkv.bias if qkv.bias is not None else qo, cs, qo,
        k_cache, v_cache, float(k_scale), float(v_scale), heads, kv_heads,
        HALF=head_dim // 2, BLOCK_HQ=triton.next_power_of_2(heads),
        BLOCK_HK=triton.next_power_of_2(kv_heads), QUANT=k_cache.dtype != qkv.dtype,
        HAS_BIAS=qkv.bias is not None, BLOCK_ROW=triton.next_power_of_2(qkv.shape[1]),
        num_warps=int(ROTARY_CONFIG["deferred_warps"]), **launch_opts("rotary"))
    qkv.taken()
    return qo
