"""Quantized linear layers, torch twins (the CPU path and the kernels' test oracle).

Weight layouts (built by `server/models/quantization/` at load time):

- w4a16: `qweight` int32 `[K // 8, N]` (nibble i of word `[r, n]` = row `8r + i`),
  `scales` `[G, N]` (the checkpoint's float16/bfloat16), `zeros` uint8 `[G, N]` or None
  (every zero point 8: symmetric), group `g = k // group_size`; `w[k, n] = (q - z) * s`.
- fp8: `weight` float8_e4m3fn `[N, K]`, `weight_scale` float32 `[ceil(N / bn), ceil(K /
  bk)]` for a `block = (bn, bk)` (per output channel: `(1, K)`, shape `[N, 1]`);
  `w[n, k] = weight[n, k] * weight_scale[n // bn, k // bk]`.

`fp8_linear` here is weight-only (w8a16: dequantize, then an ordinary matmul), which
is exactly the dequantized model; `fp8_w8a8_linear` quantizes the activations per token
(dynamic, e4m3, scale = row amax / 448) or with a static per-tensor scale, as the GPU's
large-batch path does, and is the twin of that path.
"""

from __future__ import annotations

import torch

from pagefleet.server.ops.int4_packing import unpack_rows

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def w4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[K, N]` weight in `dtype` (computed in float32, rounded once)."""
    q = unpack_rows(qweight).to(torch.float32)
    k = q.shape[0]
    g = torch.arange(k, device=q.device) // group_size
    s = scales.to(torch.float32)[g]
    z = 8.0 if zeros is None else zeros.to(torch.float32)[g]
    return ((q - z) * s).to(dtype)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group_size: int,
                 bias: torch.Tensor | None = None, deferred=None) -> torch.Tensor:
    """`x [M, K] @ dequantized w [K, N] (+ bias)` in x's dtype. (`deferred`: taken and
    ignored, as by every path but the GPU's one-row GEMV: `ops/deferred.py`.)"""
    w = w4_dequantize(qweight, scales, zeros, group_size, x.dtype)
    out = x @ w
    return out if bias is None else out + bias


def fp8_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[N, K]` weight in `dtype` from e4m3 values and their (block) scales."""
    n, k = weight.shape
    bn, bk = block
    s = weight_scale.to(torch.float32)
    s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.to(torch.float32) * s).to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               block: tuple[int, int], input_scale: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, deferred=None) -> torch.Tensor:
    """Weight-only fp8 (w8a16): `x @ dequantized(weight).T (+ bias)` in x's dtype.
    (`deferred`: taken and ignored, as by `w4a16_linear`.)"""
    del input_scale   # activations stay in x's dtype on this path
    out = x @ fp8_dequantize(weight, weight_scale, block, x.dtype).t()
    return out if bias is None else out + bias


def quantize_fp8_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[M, K]`, float32 scales `[M, 1]`): dynamic per-token scales (row amax /
    448), or the static per-tensor `input_scale` for every row."""
    xf = x.to(torch.float32)
    if input_scale is None:
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    else:
        scale = input_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.contiguous()


def fp8_gemm_a8(q: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                weight_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """e4m3 activations `q` (row scales `a_scale [M, 1]`) x fp8 weights, float32
    accumulation, scales applied after."""
    w = fp8_dequantize(weight, weight_scale, block, torch.float32)
    out = (q.to(torch.float32) @ w.t()) * a_scale
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def fp8_w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    block: tuple[int, int], input_scale: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 activations (per token, or the static scale) x fp8 weights."""
    q, a_scale = quantize_fp8_per_token(x, input_scale)
    return fp8_gemm_a8(q, a_scale, weight, weight_scale, block, bias, x.dtype)


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3 of a `[N, K]` weight: (values, float32 scales `[N, 1]`),
    scale = row amax / 448 (a zero row gets scale 1)."""
    wf = w.to(torch.float32)
    amax = wf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
