"""Apply a packed token bitmask to logits in Triton (twin: `bitmask.py`, same layout and
signature). One program per (bitmask row, vocab block): it reads the row's logits index
on the device, so the host never learns which rows are masked beyond what it sent."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit(do_not_specialize_on_alignment=["bitmask_ptr", "rows_ptr"])
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, words,
                          stride_logits, stride_bitmask, HAS_ROWS: tl.constexpr,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word = tl.load(bitmask_ptr + i.to(tl.int64) * stride_bitmask + cols // 32,
                   mask=in_vocab & (cols < words * 32), other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + cols, neg_inf, mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        row_indices: torch.Tensor | None = None) -> None:
    """Set `logits[row_indices[i], j] = -inf` where bit j of `bitmask[i]` is 0 (see the
    twin for the contract). No host sync: the launch grid depends on shapes only."""
    n, vocab = bitmask.shape[0], logits.shape[-1]
    if n == 0 or vocab == 0:
        return
    assert bitmask.dtype == torch.int32 and logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    rows = row_indices if row_indices is not None else bitmask   # dummy pointer when unused
    _apply_bitmask_kernel[(n, triton.cdiv(vocab, BLOCK))](
        logits, bitmask, rows, vocab, bitmask.shape[1], logits.stride(0), bitmask.stride(0),
        HAS_ROWS=row_indices is not None, BLOCK=BLOCK, num_warps=4)
