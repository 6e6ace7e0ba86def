"""Rotary position embedding, neox layout (first half / second half), with HF's
`default`, `linear`, `llama3` and `yarn` frequency rules. cos/sin are precomputed per
position in float32 exactly as HF computes them (transformers' `modeling_rope_utils` and
the models' rotary embedding forward, YaRN's attention factor included), so positions
rotate bit-identically."""

from __future__ import annotations

import math

import torch

from pagefleet.server.models.config import SUPPORTED_ROPE_TYPES, rope_type_of


def yarn_get_mscale(scale: float = 1, mscale: float = 1) -> float:
    """YaRN's attention scale (transformers' `yarn_get_mscale`): 0.1 * mscale * ln(scale) + 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`, the same float32 operations in the same
    order (and the same float64 Python arithmetic for the correction range)."""
    base, dim = theta, head_dim
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    mscale = scaling.get("mscale")
    mscale_all_dim = scaling.get("mscale_all_dim")
    original = scaling["original_max_position_embeddings"]
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale)
                                     / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                     # as HF: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq, attention_factor


def rope_parameters(head_dim: int, theta: float,
                    scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies `[head_dim // 2]` float32, the factor cos and sin are
    multiplied by): HF's `ROPE_INIT_FUNCTIONS[rope_type](config)`. `scaling` as
    `ModelConfig.rope_scaling` holds it (original_max_position_embeddings filled in)."""
    rope_type = rope_type_of(scaling)
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        inv_freq /= scaling["factor"]
        return inv_freq, 1.0
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
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported "
                     f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                  scaling: dict | None) -> torch.Tensor:
    """`[max_positions, head_dim]`: cos of the half-dims, then sin (float32), each
    multiplied by the rope type's attention factor (YaRN's; 1 for the others: exact)."""
    inv_freq, attention_factor = rope_parameters(head_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


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
