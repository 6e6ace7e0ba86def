"""SiLU-and-mul in Triton (twin: `activation.py`); rounds like the twin (silu(gate)
rounded to the activation dtype, then the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.server.ops.triton_common import launch_opts, pdl_wait


@triton.jit
def silu_mul(gate, up, dt: tl.constexpr):
    """silu(gate) * up from float32 inputs, rounded to `dt` where the twin rounds (the
    activation, then the product); returned in float32. The one definition of that
    rounding: the fp8 GEMV that takes SiLU in its load (triton_quant) calls it too, so
    both give the same bits."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    return (act * up).to(dt).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * d + cols, silu_mul(gate, up, dt).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x is `[..., 2 * d]` = [gate | up]; returns silu(gate) * up, `[..., d]`."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows and d:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x2, out, d, x2.stride(0),
                                                             BLOCK=block, num_warps=4,
                                                             **launch_opts("silu"))
    return out
