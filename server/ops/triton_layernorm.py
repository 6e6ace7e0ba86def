"""RMSNorm and fused residual-add + RMSNorm in Triton (twins: `layernorm.py`).

Rounds where the twin rounds: the normalised value is cast to the activation dtype
before the weight multiply, and the residual sum is rounded to the activation dtype
before it is normalised, so low-precision outputs follow the torch path closely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.server.ops.triton_common import launch_opts, pdl_wait


# "weight_early": the kernel reads the norm's weight before its PDL wait. At one decode
# row the weight is a DRAM miss every step (the step's weights stream through L2
# between two reads of it), and read after the wait its latency follows the row's
# loads; before it, it hides under the kernel before's tail. H200, 2026-12-05
# (twenty-second session, engine_gemv_ab.py, one machine): the AWQ B=1 decode forward
# 1.556 against 1.563 ms, the same bits; the norms' own time 100 -> 68 us a step.
NORM_CONFIG = {"weight_early": True}
# What a kernel reads before its PDL wait (tests/server/test_pdl.py holds it to this):
# the norm's weight, which no kernel of the forward writes.
EARLY_READS = {"_rms_norm_kernel": ("w_ptr",)}


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, n_inner,
                     stride_x0, stride_x1, stride_r0, stride_r1, N: tl.constexpr,
                     BLOCK: tl.constexpr, ADD: tl.constexpr, EARLY: tl.constexpr,
                     PDL: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if EARLY:   # the weight before the wait (NORM_CONFIG)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    row = tl.program_id(0)
    outer = row // n_inner
    inner = row % n_inner
    x = tl.load(x_ptr + outer.to(tl.int64) * stride_x0 + inner * stride_x1 + cols, mask=mask,
                other=0.0)
    if ADD:
        r = tl.load(res_ptr + outer.to(tl.int64) * stride_r0 + inner * stride_r1 + cols,
                    mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row.to(tl.int64) * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    y = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    if not EARLY:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * N + cols, (w * y).to(out_ptr.dtype.element_ty),
             mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, n_inner, stride_outer, stride_inner) for a 2-D or 3-D x with unit last stride."""
    assert x.stride(-1) == 1
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    x2 = x.reshape(-1, x.shape[-1])
    return x2.shape[0], 1, x2.stride(0), 0


def _launch(x, residual, weight, eps, add):
    n = x.shape[-1]
    if x.dim() > 3:
        x = x.reshape(-1, n)
        residual = residual.reshape(-1, n) if add else None
    rows, n_inner, s0, s1 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if add else out
    r0, r1 = (_rows(residual)[2:] if add else (0, 0))
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x, residual if add else x, weight, out, res_out, float(eps), n_inner, s0, s1, r0, r1,
            N=n, BLOCK=block, ADD=add, EARLY=bool(NORM_CONFIG["weight_early"]),
            num_warps=min(max(block // 512, 1), 8),
            **launch_opts("rmsnorm"))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if weight.dtype != x.dtype:
        from pagefleet.server.ops import layernorm
        return layernorm.rms_norm(x, weight, eps)
    return _launch(x, None, weight, eps, False)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    if weight.dtype != x.dtype or residual.dtype != x.dtype or residual.shape != x.shape:
        from pagefleet.server.ops import layernorm
        return layernorm.fused_add_rms_norm(x, residual, weight, eps)
    return _launch(x, residual, weight, eps, True)
