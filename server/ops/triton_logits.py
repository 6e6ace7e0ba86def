"""The logits projection at decode (twin: `logits.py`): a plain Triton GEMV at one row
(`LOGITS_CONFIG["max_rows"]`), cuBLAS above.

Why: a decode step at batch 1 reads the whole lm_head (Qwen2.5-7B: 152,064 x 3,584,
1.09 GB), the largest single weight of the step. cuBLAS runs it at 0.260 ms on an H200
(4.2 TB/s), this GEMV, streaming 8-row strips with evict-first loads, at 0.241 (4.5 TB/s;
BENCHMARKS.md, eighteenth session). It also writes float32 straight away, which saves
the engine's separate `.float()` pass. Each value is rounded to the activation dtype
before it is widened, as the twin (and HF transformers' 16-bit lm_head) rounds it, so
greedy ties break alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.server.ops import logits as twin

# rows up to which the GEMV runs (cuBLAS above); its strip and K tile; warps; stages
LOGITS_CONFIG = {"max_rows": 1, "block_n": 8, "block_k": 512, "warps": 4, "stages": 3}


@triton.jit
def _logits_gemv_kernel(x_ptr, w_ptr, o_ptr, N, K, stride_x, stride_w,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Output columns [pid * BLOCK_N, +BLOCK_N) of each of the ROWS input rows, float32
    sums (the strip is read again for each row: one row is what it serves)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    for r in tl.static_range(ROWS):
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            kmask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptr + r * stride_x + kk, mask=kmask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        out = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(o_ptr + r * N + rn, out, mask=nmask)


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 `[rows, vocab]`, as `logits.logits`: the GEMV for up to
    LOGITS_CONFIG["max_rows"] rows of a 16-bit model, cuBLAS otherwise."""
    cfg = LOGITS_CONFIG
    m = hidden.shape[0]
    if (m == 0 or m > cfg["max_rows"] or hidden.dtype not in (torch.float16, torch.bfloat16)
            or weight.dtype != hidden.dtype or hidden.stride(-1) != 1
            or weight.stride(-1) != 1):
        return twin.logits(hidden, weight)
    n, k = weight.shape
    out = torch.empty(m, n, dtype=torch.float32, device=hidden.device)
    _logits_gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        hidden, weight, out, n, k, hidden.stride(0), weight.stride(0), ROWS=m,
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["warps"],
        num_stages=cfg["stages"])
    return out
