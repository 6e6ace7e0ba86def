"""The logits projection, torch twin of `triton_logits`: the lm_head product in the
activation dtype (as HF transformers rounds it), returned as float32."""

from __future__ import annotations

import torch
from torch import nn


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 `[rows, vocab]` of `hidden @ weight.T`, rounded to hidden's dtype first."""
    return nn.functional.linear(hidden, weight).float()
