"""The shipped w4 GEMV at Qwen2.5-7B's layer shapes, one input row, for Nsight Compute:
why a layer takes longer than reading its bytes (stall reasons, DRAM and issue use).

The engine's trace (`engine_gemv_ab.py --trace`) says how long each layer's GEMV takes in
the decode step; this says what its warps wait on. Each named shape gets random 4-bit
weights and four calls (the first compiles); profile the last:

    ncu --clock-control none --kernel-name regex:w4_gemv --launch-skip 3 --launch-count 1 \\
        --metrics smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,... \\
        --csv python3 benchmarks/gemv_ncu.py gate_up

(`--clock-control none`: the device notes ask to leave the clocks alone; ncu runs on
the Firecracker H200s, not on gVisor.) GEMV_NCU_CONFIG='{"gemv_mma_ring_min_m": 1}' sets
W4_CONFIG keys first, to profile a variant. BENCHMARKS.md (2026-12-04, twelfth session)
has the metric list it was run with and the readings.
"""

from __future__ import annotations

import json
import os
import sys

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584),
          "down": (3584, 18944)}


def main() -> None:
    import torch

    from pagefleet.server.ops import triton_quant as tq
    tq.W4_CONFIG.update(json.loads(os.environ.get("GEMV_NCU_CONFIG") or "{}"))
    torch.manual_seed(0)
    for name in (sys.argv[1] if len(sys.argv) > 1 else "gate_up").split(","):
        n, k = SHAPES[name]
        qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), device="cuda", dtype=torch.int32)
        s = (torch.rand(k // 128, n, device="cuda") * 0.01).half()
        z = torch.randint(0, 16, s.shape, device="cuda", dtype=torch.uint8)
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        for _ in range(4):
            tq.w4a16_linear(x, qw, s, z, 128)
        torch.cuda.synchronize()
        print(name, "done", flush=True)


if __name__ == "__main__":
    main()
