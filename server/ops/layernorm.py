"""RMSNorm, plain and fused with the residual add (torch twins).

Computed in float32 and cast back, as HF's Llama/Qwen RMSNorm does, so that low
precision runs round the same way the reference does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


# Columns a sum of squares of `SummedRow` covers: the 4-bit GEMV's output tile (its twin
# here sums the same blocks; the norm reads however many there are).
SUM_BLOCK = 64


class SummedRow(NamedTuple):
    """The residual stream's next value as a projection that adds into it leaves it at one
    decode row: `row` (`[1, hidden]`, the sum already rounded as `fused_add_rms_norm`
    rounds it) and `sums` (float32, the sum of squares of each block of its columns),
    from which the next RMSNorm takes its scale with no pass over the row of its own
    (TritonOps: the o and down projections write it, q/k/v and gate_up norm as they
    stage their row; `triton_quant.w4a16_linear_add`)."""

    row: torch.Tensor
    sums: torch.Tensor


def add_summed(y: torch.Tensor, residual: torch.Tensor, block: int = SUM_BLOCK) -> SummedRow:
    """y + residual with its block sums of squares (the twin of what the 4-bit GEMVs'
    residual add leaves)."""
    row = y + residual
    f = row.float().reshape(-1)
    f = torch.nn.functional.pad(f, (0, -f.numel() % block))
    return SummedRow(row, f.reshape(-1, block).pow(2).sum(1))


def rms_norm_summed(s: SummedRow, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(s.row)` with the mean square taken from the block sums."""
    rstd = torch.rsqrt(s.sums.sum() / s.row.shape[-1] + eps)
    return weight * (s.row.float() * rstd).to(s.row.dtype)
