"""How far the folded w4 decode (W4_CONFIG "fold", "fold_mma": words decoded to `bias +
q`, the bias and zero point taken off once a tile and row) moves a GEMV's result, in a
float32 emulation of the kernels' arithmetic on the CPU, against the exact decode the
kernels ship and against what HF transformers and vLLM multiply (weights dequantized
to fp16).

Each way is emulated as the Gluon kernels sum: products exact in float32, 16 products a
step (one m16n8k16 MMA) into a float32 accumulator that starts from zero (exact) or from
-(C + z S) (folded), the group's scale applied to each 128-row tile's sum. Printed, per
activation distribution: the median relative error, the mean and largest error in
units of the fp16 output's last place, and the share of outputs whose fp16 rounding is
the exact result's.

    .venv/bin/python benchmarks/fold_numerics.py      # a few seconds
"""

from __future__ import annotations

import torch

K, N = 3584, 4096


def _tiles(a: torch.Tensor, x: torch.Tensor, start: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """sum over 128-row tiles of scale x (start + 8 steps of 16 products), float32."""
    acc = torch.zeros(a.shape[0])
    for t in range(a.shape[1] // 128):
        prod = start[:, t].clone()
        for c in range(8):
            sl = slice(128 * t + 16 * c, 128 * t + 16 * c + 16)
            prod = prod + (a[:, sl] * x[sl]).sum(1)
        acc = acc + prod * s[:, t].float()
    return acc


def run(scale: float, outliers: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(K, generator=g) * scale
    if outliers:
        x[torch.randint(0, K, (8,), generator=g)] *= 100
    x = x.half()
    q = torch.randint(0, 16, (N, K), generator=g)
    z = torch.randint(0, 16, (N, K // 128), generator=g)
    s = (torch.rand(N, K // 128, generator=g) * 0.02 + 0.001).half()
    zk, sk = z.repeat_interleave(128, 1), s.double().repeat_interleave(128, 1)
    exact = ((q - zk).double() * sk) @ x.double()
    xf = x.float()
    odd = torch.arange(K) % 2 == 1
    ways = {"exact decode (shipped)": _tiles((q - zk).float(), xf, torch.zeros(N, K // 128), s)}
    for fold, bias in ((1, torch.where(odd, 64.0, 1024.0)), (2, torch.full((K,), 64.0))):
        c = torch.stack([(bias * xf)[128 * t:128 * t + 128].sum() for t in range(K // 128)])
        sm = torch.stack([xf[128 * t:128 * t + 128].sum() for t in range(K // 128)])
        start = -(c[None, :] + z.float() * sm[None, :])
        ways[f"folded, fold {fold}"] = _tiles(bias + q.float(), xf, start, s)
    w16 = ((q - zk).float() * s.float().repeat_interleave(128, 1)).half().float()
    ways["weights dequantized to fp16 (HF, vLLM)"] = w16 @ xf
    ulp = exact.abs().half().double().clamp(min=6e-5) * 2 ** -10
    print(f"activations ~N(0, {scale}){' with 8 outliers x100' if outliers else ''}:")
    for name, v in ways.items():
        e = (v.double() - exact).abs()
        rel = (e / exact.abs().clamp(min=1e-6)).median().item()
        same = (v.half() == exact.half()).float().mean().item()
        print(f"  {name:40s} median rel {rel:.1e}  mean / max err {(e / ulp).mean():.4f} / "
              f"{(e / ulp).max():.1f} ulp16  fp16 as the exact result's {same:.2%}")


if __name__ == "__main__":
    for sc, out in ((1.0, False), (1.0, True), (0.05, False), (5.0, True)):
        run(sc, out)
