"""A one-row GEMV's split-K sum finished by the kernel that reads it (`DeferredSum`).

Why: at one decode row the 4-bit GEMVs split K across many programs (q/k/v and o in
14 splits, down in 11) and each output tile's last program to arrive summed the
partials: a partial store, a barrier, an `acq_rel` arrival counter, then the last
program's loads of every partial and its store -- about three trips to L2 on each
GEMV's critical path. A timing probe that let every split add its partial by an atomic
and leave took the AWQ B=1 decode forward from 1.804 to 1.696 ms on an H100 (BENCHMARKS.md,
2026-12-05, twenty-seventh session; q/k/v -46 us, o -50, down -41 a step).

Float atomics would make the sum's order (and bits) change run to run. Here each split
adds its partial as a fixed-point int64 (`round toward zero(partial x 2^30)`, exact
integer adds: the sum is the same whatever order the adds land in), into a zeroed
accumulator row that belongs to the layer (`DeferredSlot`). The kernel that consumes the
GEMV's output (the rotary + KV write for q/k/v, the fused add + RMSNorm for o and down)
reads the row, converts it (`float(sum) x 2^-30`, + bias, rounded to the activation
dtype: where the GEMV rounded before), and stores zeros back, so the row is zero again
for the next call. Deterministic, and within fixed-point resolution (2^-30 a partial) of
the float32 sum it replaces (not the same bits).

Range: a partial's magnitude must stay under 2^33 (8.6e9), far above any activation a
16-bit model can hold. Only the one-row Gluon GEMVs (CUDA, sm_90) make one, and only
for layers whose output goes straight to a consumer that reads it (`DeferredSlot` set by
the decoder: no tensor-parallel all-reduce between, no q/k norm); any other op takes
`value(x)` first, which is this module's torch twin of the consumers' read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("pagefleet.engine")

SCALE = float(1 << 30)     # fixed-point units a 1.0


class DeferredSlot:
    """A layer's accumulator row: int64 `[1, N]`, zero between calls (every consumer
    zeroes what it read). Made on the first eager one-row call, never inside a CUDA
    graph capture (a buffer made there would belong to the graph's pool).

    `armed`: a sum was handed out (`DeferredSum`) and not yet taken by a reader. Found
    set when the next call asks for the row, the read never happened (an exception
    between the GEMV and its reader, in an eager forward): the row still holds that
    sum, and adding onto it would corrupt every later output of the layer, silently, so
    it is zeroed first (with a warning). Python bookkeeping only: a graph replay runs the
    captured producer and reader together."""

    def __init__(self) -> None:
        self.acc: torch.Tensor | None = None
        self.armed = False

    def buffer(self, n: int, device: torch.device) -> torch.Tensor | None:
        def capturing() -> bool:
            return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        acc = self.acc
        if acc is not None and acc.shape[1] == n and acc.device == device:
            if self.armed and not capturing():
                log.warning("a deferred GEMV sum was never read (an error between the GEMV "
                            "and its reader?): its accumulator is zeroed before reuse")
                acc.zero_()
                self.armed = False
            return acc
        if capturing():
            return None
        self.acc = torch.zeros(1, n, dtype=torch.int64, device=device)
        self.armed = False
        return self.acc

    def hand_out(self, bias: torch.Tensor | None, dtype: torch.dtype) -> "DeferredSum":
        """The sum a launch just added into this row, for its reader."""
        self.armed = True
        return DeferredSum(self.acc, bias, dtype, self)


@dataclass(eq=False)
class DeferredSum:
    """A GEMV's one output row, still as the fixed-point sum of its splits in `acc`
    (int64 `[1, N]`); `bias` and `dtype` are the GEMV's, applied by the reader."""

    acc: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    slot: DeferredSlot | None = None

    @property
    def shape(self) -> torch.Size:
        return self.acc.shape

    def taken(self) -> None:
        """A reader was launched on this row (it re-arms the row on the device)."""
        if self.slot is not None:
            self.slot.armed = False

    def materialize(self) -> torch.Tensor:
        """The row as the GEMV would have returned it (the consumers' conversion, in
        torch), and the accumulator zeroed for its next call."""
        v = self.acc.to(torch.float32) * (1.0 / SCALE)
        if self.bias is not None:
            v = v + self.bias.to(torch.float32)
        out = v.to(self.dtype)
        self.acc.zero_()
        self.taken()
        return out


def value(x: "torch.Tensor | DeferredSum") -> torch.Tensor:
    """x itself, or a deferred row made a tensor (and its accumulator re-armed)."""
    return x.materialize() if isinstance(x, DeferredSum) else x


def fixed_point(partials: torch.Tensor) -> torch.Tensor:
    """The int64 sum the GEMV's splits add up, from their float32 partials `[S, 1, N]`
    (the kernel's arithmetic: each partial x 2^30, truncated toward zero): for tests and
    the twin ops that stand in for the GPU kernel."""
    return (partials.to(torch.float32) * SCALE).to(torch.int64).sum(0)


def qkv_heads(qkv: DeferredSum, heads: int, kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A deferred q/k/v row made a tensor: q `[1, heads, head_dim]`, k and v `[1, kv_heads,
    head_dim]` (for a reader that takes tensors)."""
    q, k, v = qkv.materialize().split([heads * head_dim, kv_heads * head_dim,
                                       kv_heads * head_dim], dim=-1)
    return (q.reshape(1, heads, head_dim), k.reshape(1, kv_heads, head_dim),
            v.reshape(1, kv_heads, head_dim))


def one_row(x: torch.Tensor, slot: "DeferredSlot | None") -> dict:
    """The `deferred=` keyword a quantized method passes its op: only for one row with a
    slot (the only call a sum can be deferred in), so an op bundle whose linear takes no
    `deferred` serves every other call."""
    return {"deferred": slot} if slot is not None and x.shape[0] == 1 else {}
