"""Rotary embedding (neox layout) in Triton (twin: `rotary.py`).

Reads cos/sin from the same float32 `[max_pos, head_dim]` cache (cos of the half-dims,
then sin), so `default` and `llama3` scaling are whatever the cache holds. Rounds like
the twin: cos/sin cast to the activation dtype, each product and the sum rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, o_ptr, cos, sin, t, stride_t, stride_h, H, HALF: tl.constexpr,
            BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, HALF)[None, :]
    mask = h < H
    base = x_ptr + t.to(tl.int64) * stride_t + h * stride_h + c
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    obase = o_ptr + t.to(tl.int64) * (H * 2 * HALF) + h * (2 * HALF) + c
    tl.store(obase, o1, mask=mask)
    tl.store(obase + HALF, o2, mask=mask)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])   # staging slices: any offset
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cs_ptr, qo_ptr, ko_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, HQ, HK,
                   HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF)[None, :]
    dt = qo_ptr.dtype.element_ty
    cos = tl.load(cs_ptr + pos * (2 * HALF) + c).to(dt).to(tl.float32)
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + c).to(dt).to(tl.float32)
    _rotate(q_ptr, qo_ptr, cos, sin, t, stride_qt, stride_qh, HQ, HALF, BLOCK_HQ)
    _rotate(k_ptr, ko_ptr, cos, sin, t, stride_kt, stride_kh, HK, HALF, BLOCK_HK)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[tokens, heads, head_dim]`, k `[tokens, kv_heads, head_dim]` -> rotated copies."""
    n, hq, d = q.shape
    hk = k.shape[1]
    if d % 2 or (d // 2) & (d // 2 - 1) or cos_sin.shape[-1] != d:
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
                             BLOCK_HK=triton.next_power_of_2(hk), num_warps=4)
    return qo, ko
