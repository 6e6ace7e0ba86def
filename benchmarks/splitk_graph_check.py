"""Split-K GEMVs summed by their last program, replayed from CUDA graphs on the GPU: each
replay's output bit for bit the eager call's, the eager call within rounding of the torch
twin, and every arrival counter back at zero after (what the next launch or replay counts
on). The CPU tests run the same kernels in the interpreter, where programs run one after
another; this is the concurrent case.

    OUT=$OUT python3 benchmarks/splitk_graph_check.py     # prints one line per case; exit 1 on a failure
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch

    from pagefleet.server.ops import quant, triton_common
    from pagefleet.server.ops import triton_quant as tq
    failed = 0
    torch.manual_seed(0)
    for n, k in ((3584, 3584), (3584, 18944), (4608, 3584)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quant.quantize_fp8_rows(w)
        qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), device="cuda", dtype=torch.int32)
        s = (torch.rand(k // 128, n, device="cuda") * 0.01 + 0.001).half()
        z = torch.randint(0, 16, (k // 128, n), device="cuda", dtype=torch.uint8)
        for m in (1, 2, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xh = x.half()
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            cases = {
                "fp8": (lambda: tq.fp8_linear(x, wq, ws, (1, k), None, b),
                        lambda: quant.fp8_linear(x.float(), wq, ws, (1, k), None, b.float())),
                "w4": (lambda: tq.w4a16_linear(xh, qw, s, z, 128, b.half()),
                       lambda: quant.w4a16_linear(xh.float(), qw, s, z, 128, b.float())),
            }
            for name, (fn, twin) in cases.items():
                eager = fn()
                ref = twin()
                err = ((eager.double() - ref.double()).norm() / ref.double().norm()).item()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = fn()
                same = True
                for _ in range(3):
                    out.fill_(float("nan"))
                    g.replay()
                    torch.cuda.synchronize()
                    same &= bool(torch.equal(out, eager))
                cnt = triton_common.arrival_counters(x.device, 1)
                zero = cnt is not None and not bool(cnt.any())
                ok = same and zero and err < 2e-2
                failed += not ok
                print(f"{'ok' if ok else 'FAILED'} {name} {m}x{k} -> {n}: replays equal eager "
                      f"{same}, counters zero {zero}, rel err vs twin {err:.2e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
