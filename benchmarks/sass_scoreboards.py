"""Which scoreboard each global load of the Gluon w4 GEMV sets, and which instructions
wait on it, from the sm_90 SASS's control bits, without a GPU.

Why: a load's result is ready when the scoreboard it was issued on drains, and a wait
on that scoreboard waits for every load on it. 2026-12-04 (thirteenth session): ptxas
puts all of the GEMV loop's LDGs (words, scales, zero points, every prefetched tile) on
one scoreboard, so a warp's first use of a tile waits for all of its loads in flight:
the register prefetch batches tiles into one memory latency instead of pipelining them
(which is why two- and three-deep prefetches of earlier sessions did not help until the
activations stopped waiting on L2 too; BENCHMARKS.md). cp.async (LDGSTS) copies are
counted by DEPBAR.LE instead, in order, which does pipeline.

    TRITON_INTERPRET=0 .venv/bin/python benchmarks/sass_scoreboards.py \\
        ['{"DEPTH": 3, "XS_TILES": 32}']

Prints the kernel's loads and every instruction that waits on a load scoreboard, with
the scoreboard it sets (`sets`) and the ones it waits for (`waits`). The control bits
of an sm_70+ instruction are the top 23 bits of its 128-bit encoding: 4 stall cycles,
yield, the write scoreboard (7: none), the read scoreboard, a 6-bit wait mask, reuse.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_loop import compile_cubin, disassemble  # noqa: E402  (puts tests/server on the path)
from compile_sm90 import REGISTER_GEMV_ALIGNED, register_gemv_types  # noqa: E402


def control_bits(cubin: bytes) -> list[tuple[str, str, int, int]]:
    """(address, instruction, write scoreboard or 7, wait mask) per instruction."""
    lines = disassemble(cubin, "-hex").splitlines()
    rows = []
    for i, line in enumerate(lines[:-1]):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x[0-9a-f]+ \*/", line)
        hi = re.search(r"/\* (0x[0-9a-f]+) \*/", lines[i + 1])
        if m and hi:
            ctrl = int(hi.group(1), 16) >> 41
            rows.append((m.group(1), m.group(2), (ctrl >> 5) & 7, (ctrl >> 11) & 0x3F))
    return rows


def kernel_case(extra: dict) -> tuple:
    """The register kernel as read here: (fn, ptrs, constexprs, warps, aligned), with
    `extra` constexprs over the defaults."""
    from pagefleet.server.ops import gluon_w4 as gw
    from pagefleet.server.ops.triton_quant import W4_CONFIG
    fn = gw._w4_gemv_mma_kernel
    ptrs = register_gemv_types("fp16")
    warps = W4_CONFIG["gemv_mma_warps"]
    cx = {"GROUP": 128, "HAS_ZERO": True, "HAS_BIAS": False,
          "BLOCK_N": W4_CONFIG["gemv_mma_block_n"], "WARPS": warps, "F16": True,
          "SPLITS_PAD": 1, "FUSED": False, "PDL": 1, "PRELOAD": True, "DEPTH": 1,
          "XS_TILES": 0, "ACT": False, "BLOCKED": False,
          **extra}
    return fn, ptrs, cx, warps, REGISTER_GEMV_ALIGNED


def main() -> None:
    extra = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"DEPTH": 1, "XS_TILES": 0}
    fn, ptrs, cx, warps, aligned = kernel_case(extra)
    rows = control_bits(compile_cubin(fn, ptrs, cx, warps, 1, aligned))
    load_sbs = {sb for _, ins, sb, _ in rows if ins.split()[0].lstrip("@!P0123456789 ")
                .startswith("LDG") and sb != 7}
    print(f"{extra}: LDG scoreboards {sorted(load_sbs)}")
    for addr, ins, sb, wait in rows:
        waits = [b for b in range(6) if wait >> b & 1]
        if "LDG" in ins or "DEPBAR" in ins or "BRA" in ins or set(waits) & load_sbs:
            print(f"{addr} {ins[:64]:64s} sets {sb if sb != 7 else '-'} waits {waits or ''}")


if __name__ == "__main__":
    main()
