"""Apply a packed token bitmask to logits (torch twin of `triton_bitmask.py`).

The bitmask is xgrammar's layout: int32 words, bit `j % 32` of word `j // 32` set when
token `j` is allowed. It is *compact*: row `i` of the bitmask is for logits row
`row_indices[i]`, so a batch where only a few requests have a grammar copies and reads
only those rows. Disallowed logits become -inf in place.

Nothing here reads a device value back on the host (no `.item()`, no boolean-mask
indexing, no `nonzero`): the step loop calls it on the device with no sync.
"""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        row_indices: torch.Tensor | None = None) -> None:
    """Set `logits[row_indices[i], j] = -inf` where bit j of `bitmask[i]` is 0.

    logits: `[batch, vocab]` (any float dtype); bitmask: `[n, ceil(vocab / 32)]` int32
    on the same device; row_indices: `[n]` int tensor on the same device, or None when
    the bitmask rows are the logits rows (`n == batch`). Tokens past the bitmask's
    coverage are masked too: a bitmask narrower than the vocabulary must never let
    padded ids through.
    """
    n, vocab = bitmask.shape[0], logits.shape[-1]
    if n == 0 or vocab == 0:
        return
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1              # [n, words, 32]
    allowed = bits.reshape(n, -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        pad = torch.zeros(n, vocab - allowed.shape[1], dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    if row_indices is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = row_indices.long()
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
