"""RMSNorm and fused residual-add + RMSNorm in Triton (twins: `layernorm.py`).

Rounds where the twin rounds: the normalised value is cast to the activation dtype
before the weight multiply, and the residual sum is rounded to the activation dtype
before it is normalised, so low-precision outputs follow the torch path closely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.server.ops.deferred import DeferredSum
from pagefleet.server.ops.triton_common import launch_opts, pdl_wait


# "weight_early": the kernel reads the norm's weight before its PDL wait. At one decode
# row the weight is a DRAM miss every step (the step's weights stream through L2
# between two reads of it), and read after the wait its latency follows the row's
# loads; before it, it hides under the kernel before's tail. H200, 2026-12-05
# (twenty-second session, engine_gemv_ab.py, one machine): the AWQ B=1 decode forward
# 1.556 against 1.563 ms, the same bits; the norms' own time 100 -> 68 us a step.
NORM_CONFIG = {"weight_early": True,
               # warps of the norm reading a deferred row (ops/deferred.py), against 8 as
               # the plain norm's: the AWQ B=1 decode forward (engine_gemv_ab.py,
               # twenty-eighth session, 2026-12-05) H200 1.484 against 1.500 ms, H100
               # 1.682 / 1.696 / 1.713 against 1.686 / 1.701 / 1.717 (three calls)
               "deferred_warps": 16}
# What a kernel reads before its PDL wait (tests/server/test_pdl.py holds it to this):
# the norm's weight, which no kernel of the forward writes.
EARLY_READS = {"_rms_norm_kernel": ("w_ptr",)}


@triton.jit
def deferred_row(acc_ptr, b_ptr, offs, mask, dt, HAS_BIAS: tl.constexpr):
    """A deferred GEMV row's values at `offs` (`ops/deferred.py`): the fixed-point sum
    converted, the bias added, rounded to `dt` where the GEMV rounded. The reader then
    re-arms the row (`rearm`)."""
    fixed = tl.load(acc_ptr + offs, mask=mask, other=0)
    v = fixed.to(tl.float32) * (1.0 / 1073741824.0)   # 2^-30 (deferred.SCALE)
    if HAS_BIAS:
        v += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return v.to(dt)


@triton.jit
def rearm(acc_ptr, n, BLOCK: tl.constexpr):
    """Zeros over a deferred row's first n entries (the whole row, one program), so the
    layer's accumulator is zero for its next call. After a barrier: a layout may hold an
    element in several threads, and every one of them must have read it first."""
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK)
    tl.store(acc_ptr + offs, tl.zeros([BLOCK], dtype=tl.int64), mask=offs < n)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, b_ptr, eps, n_inner,
                     stride_x0, stride_x1, stride_r0, stride_r1, N: tl.constexpr,
                     BLOCK: tl.constexpr, ADD: tl.constexpr, EARLY: tl.constexpr,
                     DEFERRED: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """DEFERRED: x is a one-row deferred sum (int64 at x_ptr, bias at b_ptr: `deferred_row`)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if EARLY:   # the weight before the wait (NORM_CONFIG)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    row = tl.program_id(0)
    outer = row // n_inner
    inner = row % n_inner
    if ADD:   # issued with x's loads (a deferred row's barrier would hold it back)
        r = tl.load(res_ptr + outer.to(tl.int64) * stride_r0 + inner * stride_r1 + cols,
                    mask=mask, other=0.0)
    if DEFERRED:
        x = deferred_row(x_ptr, b_ptr, cols, mask, out_ptr.dtype.element_ty, HAS_BIAS)
        rearm(x_ptr, N, BLOCK)
    else:
        x = tl.load(x_ptr + outer.to(tl.int64) * stride_x0 + inner * stride_x1 + cols,
                    mask=mask, other=0.0)
    if ADD:
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


def _launch(x, residual, weight, eps, add, deferred: DeferredSum | None = None):
    if deferred is not None:   # one row: the accumulator stands for x
        x, bias = deferred.acc, deferred.bias
    n = x.shape[-1]
    if x.dim() > 3:
        x = x.reshape(-1, n)
        residual = residual.reshape(-1, n) if add else None
    rows, n_inner, s0, s1 = _rows(x)
    dtype = deferred.dtype if deferred is not None else x.dtype
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    res_out = torch.empty_like(out) if add else out
    r0, r1 = (_rows(residual)[2:] if add else (0, 0))
    if rows:
        block = triton.next_power_of_2(n)
        has_bias = deferred is not None and bias is not None
        _rms_norm_kernel[(rows,)](
            x, residual if add else x, weight, out, res_out, bias if has_bias else weight,
            float(eps), n_inner, s0, s1, r0, r1,
            N=n, BLOCK=block, ADD=add, EARLY=bool(NORM_CONFIG["weight_early"]),
            DEFERRED=deferred is not None, HAS_BIAS=has_bias,
            num_warps=(int(NORM_CONFIG["deferred_warps"]) if deferred is not None
                       else min(max(block // 512, 1), 8)),
            **launch_opts("rmsnorm", one_row=rows == 1))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if weight.dtype != x.dtype:
        from pagefleet.server.ops import layernorm
        return layernorm.rms_norm(x, weight, eps)
    return _launch(x, None, weight, eps, False)[0]


def fused_add_rms_norm(x: "torch.Tensor | DeferredSum", residual: torch.Tensor,
                       weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual). x may be a deferred one-row GEMV
    sum, which the kernel finishes as it reads it (`ops/deferred.py`)."""
    if isinstance(x, DeferredSum):
        if (weight.dtype == x.dtype == residual.dtype and residual.dim() == 2
                and tuple(residual.shape) == tuple(x.shape) and residual.stride(-1) == 1):
            out = _launch(None, residual, weight, eps, True, x)
            x.taken()
            return out
        x = x.materialize()
    if weight.dtype != x.dtype or residual.dtype != x.dtype or residual.shape != x.shape:
        from pagefleet.server.ops import layernorm
        return layernorm.fused_add_rms_norm(x, residual, weight, eps)
    return _launch(x, residual, weight, eps, True)
