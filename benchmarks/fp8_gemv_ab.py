"""The fp8 B=1 GEMV's load placements side by side on one GPU (FP8_CONFIG's
gemv_prefetch and gemv_xb, server/ops/triton_quant.py): each variant's output against the
shipped one's (the arithmetic is the same, so bit for bit), and its time for the four
linear layers of a Qwen2.5-7B decoder layer at batch 1, graph-replayed, summed over 28
layers, with the bytes it reads per second.

    OUT=$OUT python3 benchmarks/fp8_gemv_ab.py      # prints a table; $OUT/fp8_gemv_ab.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import graph_ms, log  # noqa: E402

# (N, K) of the four linear layers of one Qwen2.5-7B decoder layer
SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
VARIANTS = [dict(gemv_prefetch=False, gemv_xb=False), dict(gemv_prefetch=True, gemv_xb=False),
            dict(gemv_prefetch=False, gemv_xb=True), dict(gemv_prefetch=True, gemv_xb=True)]


def main() -> None:
    import torch

    from pagefleet.server.ops import quant
    from pagefleet.server.ops import triton_quant as tq
    out_dir = Path(os.environ.get("OUT", "/tmp/pagefleet-bench"))
    out_dir.mkdir(parents=True, exist_ok=True)
    base = dict(tq.FP8_CONFIG)
    rows = []
    for n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        wq, ws = quant.quantize_fp8_rows(w)
        x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = None
        for var in VARIANTS:
            tq.FP8_CONFIG.update(var)
            row = {"n": n, "k": k, **var}
            try:
                fn = lambda: tq.fp8_linear(x, wq, ws, (1, k))   # noqa: E731
                out = fn()
                ref = out if ref is None else ref
                row["bit_identical"] = bool(torch.equal(out, ref))
                row["ms"] = graph_ms(fn, reps=5, n=50)
                row["TBps"] = n * k / (row["ms"] / 1e3) / 1e12
            except Exception as e:  # noqa: BLE001 - a variant that does not compile
                row["error"] = repr(e)[:300]
            tq.FP8_CONFIG.clear()
            tq.FP8_CONFIG.update(base)
            log(f"fp8 gemv {row}")
            rows.append(row)
    totals = {}
    for var in VARIANTS:
        key = f"prefetch={var['gemv_prefetch']} xb={var['gemv_xb']}"
        ms = [r.get("ms") for r in rows if all(r[a] == b for a, b in var.items())]
        if all(m is not None for m in ms):
            totals[key] = 28 * sum(ms)
    for key, ms in totals.items():
        print(f"{key:24s} 28 layers' GEMVs {ms:.3f} ms")
    (out_dir / "fp8_gemv_ab.json").write_text(json.dumps({"rows": rows, "per_step_ms": totals},
                                                         indent=1))


if __name__ == "__main__":
    main()
