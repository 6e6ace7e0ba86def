"""What the Triton kernel modules share: the interpreter switch, the device's
multiprocessor count (launch sizing), and the dot product every GEMM-like kernel uses."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter (TRITON_INTERPRET=1, the CI path) computes bf16 `tl.dot`
# wrongly: there the dot operands are upcast to float32 first (after the same rounding
# the GPU path does), which leaves the tested function unchanged.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (looked up once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@triton.jit
def dot(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")   # float32 models: no tf32 rounding
    else:
        return tl.dot(a, b)
