"""Is the one-row w4 GEMV bound by DRAM or by the busiest multiprocessor's programs?

gate_up at Qwen2.5-7B's shape is 592 programs of 28 K tiles, one wave at up to 5 an SM:
64 SMs run 5, 68 run 4, so the busiest SM has 11% more bytes to stream than the mean
(down: 616 programs, 88 SMs at 5, 44 at 4, 7%). If each SM streams at its own capped
rate, the GEMV takes as long as its busiest SM, and a grid that gives every SM the same
bytes would be up to that much faster; if the kernel is bound by DRAM alone, the grid's
balance does not matter. This tells the two apart by the shape: each (N, K) below gets
28 distinct random AWQ layers (so nothing is served from L2), the 28 GEMVs in one CUDA
graph, us a GEMV, beside a kernel that only reads the same bytes.

    DRAM-bound:  us a GEMV proportional to N (to the bytes)
    SM-bound:    us a GEMV proportional to the busiest SM's programs (flat from 529 to
                 660 programs of gate_up's width, 20% less at 528)

    OUT=$OUT python3 benchmarks/gemv_balance.py        # $OUT/gemv_balance.json

Beside each, the same layers in `gluon_w4_tma.block_columns`'s layout (each program's
column tile stored contiguously; "blocked"): whether the checkpoint's layout, where a
program reads 256-byte pieces a whole row (N x 4 bytes) apart, costs DRAM efficiency once
the programs drift apart (the copies-only kernel, which keeps them in step, streamed at
the read floor). And the same layers through the stream-K form
(`_w4_gemv_tma_stream_kernel`, BALANCE_STREAM programs an SM, 5 by default: every SM the
same tiles; not the same bits where a column tile's sum is split, so how far it moved
the output is recorded).

BALANCE_SHAPES='[["label", N, K], ...]' replaces the shapes; BALANCE_CONFIG='{...}' sets
W4_CONFIG keys first.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_step_ab import _read_floor_kernel  # noqa: E402
from gpu_bench import graph_ms, log  # noqa: E402

LAYERS = 28
# gate_up's width at 528 (4 an SM), 592 (shipped) and 660 (5 an SM) programs; down's
# at 528, 616 (shipped) and 660 programs (14-tile splits: 11 a column tile)
SHAPES = [["gate_up 592", 37888, 3584], ["down 616", 3584, 18944],
          ["gate_up 528", 33792, 3584], ["gate_up 660", 42240, 3584],
          ["down 528", 3072, 18944], ["down 660", 3840, 18944]]


def _programs(tq, n: int, k: int, sms: int) -> int:
    plan = tq.mma_plan(1, n, k, sms, tq.W4_CONFIG)
    return (n // tq.W4_CONFIG["gemv_mma_block_n"]) * plan.splits


def main() -> None:
    import torch

    from pagefleet.server.ops import gluon_w4_tma as gt
    from pagefleet.server.ops import triton_quant as tq
    bn = tq.W4_CONFIG["gemv_mma_block_n"]
    tq.W4_CONFIG.update(json.loads(os.environ.get("BALANCE_CONFIG") or "{}"))
    stream_row = copy.deepcopy(tq.W4_CONFIG["gemv_mma_one_row"])
    for cls in ("unsplit", "deep"):   # every SM the same tiles (stream-K, 5 programs an SM)
        stream_row[cls]["tma"]["stream"] = int(os.environ.get("BALANCE_STREAM", "5"))
    shapes = json.loads(os.environ.get("BALANCE_SHAPES") or "null") or SHAPES
    out_dir = Path(os.environ.get("OUT", "/tmp/pagefleet-bench"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    read = _read_floor_kernel()
    sink = torch.empty(sms * 8, device="cuda", dtype=torch.int32)
    torch.manual_seed(0)
    rows = []
    for label, n, k in shapes:
        layers = [(torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), device="cuda",
                                 dtype=torch.int32),
                   (torch.rand(k // 128, n, device="cuda") * 0.01 + 0.001).half(),
                   torch.randint(0, 16, (k // 128, n), device="cuda", dtype=torch.uint8))
                  for _ in range(LAYERS)]
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)

        blocked = [gt.block_columns(qw, s, z, bn) for qw, s, z in layers]

        def gemvs():
            for qw, s, z in layers:
                tq.w4a16_linear(x, qw, s, z, 128)

        def gemvs_blocked():
            return [tq._w4_gemv_mma(x, qw, s, z, 128, None, blocked=(k, n))
                    for qw, s, z in blocked]

        def gemvs_stream():
            shipped = tq.W4_CONFIG["gemv_mma_one_row"]
            tq.W4_CONFIG["gemv_mma_one_row"] = stream_row
            try:
                return [tq.w4a16_linear(x, qw, s, z, 128) for qw, s, z in layers]
            finally:
                tq.W4_CONFIG["gemv_mma_one_row"] = shipped

        def reads():
            for qw, _s, _z in layers:
                w = qw.reshape(-1)
                read[(sms * 8,)](w, sink, w.numel(), BLOCK=1024)

        row = {"label": label, "N": n, "K": k, "programs": _programs(tq, n, k, sms)}
        row["blocked_same_bits"] = all(
            torch.equal(a, tq.w4a16_linear(x, *layers[i], 128))
            for i, a in enumerate(gemvs_blocked()))
        row["stream_off_reference"] = max(
            ((a.float() - tq.w4a16_linear(x, *layers[i], 128).float()).abs().max()
             / tq.w4a16_linear(x, *layers[i], 128).float().abs().max()).item()
            for i, a in enumerate(gemvs_stream()))
        for name, fn in (("gemv", gemvs), ("blocked", gemvs_blocked), ("stream", gemvs_stream),
                         ("read", reads)):
            row[f"{name}_us"] = graph_ms(fn, reps=1) * 1e3 / LAYERS
        mb = n * k / 2 / 1e6
        row["words_MB"] = mb
        row["gemv_us_per_MB"] = row["gemv_us"] / mb
        row["blocked_us_per_MB"] = row["blocked_us"] / mb
        row["stream_us_per_MB"] = row["stream_us"] / mb
        row["read_us_per_MB"] = row["read_us"] / mb
        rows.append(row)
        log(f"{label:12s} {row['programs']:4d} programs {mb:6.1f} MB  gemv {row['gemv_us']:6.2f} us"
            f" ({row['gemv_us_per_MB']:.4f} us/MB)  blocked {row['blocked_us']:6.2f} us"
            f" (same bits {row['blocked_same_bits']})  stream {row['stream_us']:6.2f} us"
            f" (off {row['stream_off_reference']:.1e})  read {row['read_us']:6.2f} us"
            f" ({row['read_us_per_MB']:.4f} us/MB)")
        (out_dir / "gemv_balance.json").write_text(json.dumps(rows, indent=1))
        del layers, blocked
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
