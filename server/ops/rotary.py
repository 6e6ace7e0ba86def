"""Rotary position embedding, neox layout (first half / second half), with HF's
`default` and `llama3` frequency rules. cos/sin are precomputed per position in float32
exactly as HF computes them, so positions rotate bit-identically."""

from __future__ import annotations

import math

import torch


def inv_freq_for(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported "
                     "(supported: default, llama3)")


def cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                  scaling: dict | None) -> torch.Tensor:
    """`[max_positions, head_dim]`: cos of the half-dims, then sin (float32)."""
    inv_freq = inv_freq_for(head_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # Same arithmetic as HF: x * cos + rotate_half(x) * sin with cos/sin duplicated.
    cos2 = torch.cat([cos, cos], dim=-1)
    sin2 = torch.cat([sin, sin], dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos2 + rot * sin2


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[tokens, heads, head_dim]`, k `[tokens, kv_heads, head_dim]` -> rotated copies."""
    cs = cos_sin[positions]
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
