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

from pagefleet.server.ops.triton_common import launch_opts, pdl_wait

# "inputs_early": `_rotary_store_kernel` reads its position, cos/sin and slot before the
# PDL wait (see there).
ROTARY_CONFIG = {"inputs_early": True}
# What a kernel reads before its PDL wait (tests/server/test_pdl.py holds it to this):
# step inputs and the constant cos/sin table, which no kernel of the forward writes.
EARLY_READS = {"_rotary_store_kernel": ("pos_ptr", "cs_ptr", "slot_ptr")}


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
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    return o1, o2, h, mask


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
    if QUANT:   # as store_kvcache: value / scale, rounded once to the cache dtype
        k1 = k1.to(tl.float32) / k_scale
        k2 = k2.to(tl.float32) / k_scale
        v1 = v1.to(tl.float32) / v_scale
        v2 = v2.to(tl.float32) / v_scale
    dst = slot * (HK * 2 * HALF) + h * (2 * HALF) + c
    cdt = kc_ptr.dtype.element_ty
    tl.store(kc_ptr + dst, k1.to(cdt), mask=mask)
    tl.store(kc_ptr + dst + HALF, k2.to(cdt), mask=mask)
    tl.store(vc_ptr + dst, v1.to(cdt), mask=mask)
    tl.store(vc_ptr + dst + HALF, v2.to(cdt), mask=mask)


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
