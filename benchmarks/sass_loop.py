"""Instructions per weight element in the quantized GEMVs' inner loop, without a GPU.

Compiles `_w4_gemv_kernel` and `_fp8_gemv_kernel` (server/ops/triton_quant.py) for
sm_90 with the launch configs they ship (Triton's front end, the ptxas and nvdisasm it
bundles), finds each kernel's innermost loop in the SASS and counts its instructions by
opcode. A decode GEMV at batch 1 that issues more instructions per weight byte than the
SMs retire in the time the bytes take to arrive is bound by issue, not by memory; this
is the cheap way to see which, and where the instructions go, before a device call.

    TRITON_INTERPRET=0 .venv/bin/python benchmarks/sass_loop.py [--json OUT]

2026-12-02: the w4 loop was 939 instructions per thread per iteration for 128 nibbles
(7.3 a nibble): 435 of them the dequantize-and-FMA itself (LOP3, FADD, FFMA), the rest
loading and converting the activations (LDG, PRMT, MOV, IMAD) once per 4 columns; with
`gemv_xvec` (one vector load per word row's 8 activations) 761 (5.9 a nibble).
2026-12-03 (16 x 256 tiles): 7.1 a nibble after each nibble's AND took a single
immediate (the mask carries the magic's bits; 7.6 before: ptxas loaded the second
constant every time). Column tiles a program sharing each K tile's activations reached
4.9 at four tiles but ran slower on the H200 (BENCHMARKS.md) and were removed.
2026-12-03, later: the shipped loop (prefetch on) was 242 a step (7.6 a nibble): ~22
of them a signed integer division for each tile's scale row (the group size was a
runtime argument), ~20 int64 address arithmetic and masks, and 16 reloads of 2^23 into
a register (ptxas folds the low half's AND + OR into each nibble's AND, which then needs
the magic in a register: only the high half's nibbles take one immediate). With the
group size compiled in, pointers advanced a tile a step and no masks where the tiles
divide the shape: 188 (5.9), 32 registers against 40; `gemv_prmt` (the low half by
one inline-PTX byte permute) 181, 40 registers.
2026-12-03 (third session): `gemv_prefetch` 2 (each tile's scales and zero points loaded
a step ahead too; at level 1 they were used ~30 instructions after their load) 201 a
step against 193 at level 1, and faster on the H200 all the same (BENCHMARKS.md).
2026-12-03 (fifth session): the tensor-core GEMV (`_w4_gemv_tc_kernel`, inline-PTX pair
decode into an MMA operand) 3.7 a nibble at 64 columns, 2.7 at 128; it wins from two
rows, where one operand serves every row, and loses at one.
2026-12-04: the Gluon tensor-core GEMV (`gluon_w4._w4_gemv_mma_kernel`, operands built
in registers, nothing through shared memory) 3.0-3.1 a nibble under Triton 3.6 (the
Triton one 4.3 there, the CUDA-core GEMV 5.7); 4% faster back to back at one row, 8-26%
in the engine's decode forward at 1-8 rows (BENCHMARKS.md).
2026-12-05 (twentieth session): the one-row TMA GEMV 142 instructions a K tile (gate_up;
down 130) for 8 HMMAs, 72 of them decoding 8 words. A folded decode and whole unrolled
rounds cut it to 81 / 82 and the register kernel's 183 to 161, and gained nothing in the
engine (twenty-first session: `results/2026-12-05b-fold_unroll.patch`, not kept): the
count does not bound these loops. The Gluon cases print instructions a K tile.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from compile_sm90 import (REGISTER_GEMV_ALIGNED, TMA_GEMV_ALIGNED,  # noqa: E402
                          register_gemv_types, signature, tma_gemv_types)

from pagefleet.server.ops import gluon_w4  # noqa: E402
from pagefleet.server.ops import triton_quant as tq  # noqa: E402

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


def compile_cubin(fn, ptrs: dict, cx: dict, warps: int, stages: int,
                  aligned: list[str], **options) -> bytes:
    """The kernel's cubin for sm_90, with `aligned` arguments specialized as multiples of
    16 (as Triton does for the real launch's pointers and sizes); `options` over the
    compile's (e.g. maxnreg)."""
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    if getattr(fn, "is_gluon", lambda: False)():   # a Gluon kernel (gluon_w4)
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(fn, signature(fn, ptrs, cx), cx, attrs)
    else:
        src = ASTSource(fn=fn, signature=signature(fn, ptrs, cx), constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages,
                                   **options}).asm["cubin"]


def disassemble(cubin: bytes, *flags: str) -> str:
    """nvdisasm's listing of a cubin (`-hex` adds each instruction's encoding)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(NVDISASM), "-c", *flags, f.name], capture_output=True,
                              text=True, check=True).stdout


def compile_sass(fn, ptrs: dict, cx: dict, warps: int, stages: int, aligned: list[str]) -> str:
    """The kernel's SASS for sm_90 (`compile_cubin`, disassembled)."""
    return disassemble(compile_cubin(fn, ptrs, cx, warps, stages, aligned))


def _backward_branches(sass: str) -> list[tuple[list[str], str]]:
    """Every backward branch's body (its target label to the branch) and the branch."""
    labels: dict[str, int] = {}
    instrs: list[str] = []
    for line in sass.splitlines():
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            instrs.append(m.group(1).strip())
    loops = []
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((instrs[labels[m.group(1)]:i + 1], ins))
    return loops


def innermost_loop(sass: str) -> list[str]:
    """The instructions of the longest backward-branch body (the K loop)."""
    return max((body for body, _ in _backward_branches(sass)), key=len, default=[])


def mma_loop(sass: str) -> list[str]:
    """The shortest body of a predicated backward branch with an HMMA in it: the Gluon
    GEMVs' K loop (their warp-specialized partitions add longer outer loops around it,
    and each mbarrier wait's out-of-line retry jumps back unpredicated)."""
    return min((body for body, latch in _backward_branches(sass)
                if latch.startswith("@") and any("HMMA" in x for x in body)),
               key=len, default=[])


def gluon_tile_cases() -> dict:
    """The one-row Gluon GEMVs' K loop a tile: the TMA kernel at gate_up's and down's
    plans (fp16, zero points, split-K summed in the kernel), the register kernel at
    q/k/v's and o's (one row) and at 2-7 rows (3 deep: three tiles an iteration). name ->
    (fn, ptrs, cx, warps, aligned, options, tiles an iteration)."""
    from pagefleet.server.ops import gluon_w4_tma as gt
    w4 = tq.W4_CONFIG
    bn, warps = w4["gemv_mma_block_n"], w4["gemv_mma_warps"]
    tma_ptrs = tma_gemv_types("fp16", bn, True)
    cases = {}
    for cls, k in (("unsplit", 3584), ("deep", 18944)):
        plan = tq._tma_plan(k, w4["gemv_mma_one_row"][cls]["tma"], w4)
        cx = {"GROUP": 128, "HAS_ZERO": True, "HAS_BIAS": False, "BLOCK_N": bn,
              "WARPS": warps, "F16": True, "STAGES": plan.stages, "XS_TILES": plan.xs_tiles,
              "ACT": cls == "deep", "SPLITS_PAD": 4, "FUSED": True, "PDL": 1, "BLOCKED": False}
        name = f"w4a16 Gluon TMA gemv, {'gate_up' if cls == 'unsplit' else 'down'}'s plan"
        cases[name] = (gt._w4_gemv_tma_kernel, tma_ptrs, cx, warps, TMA_GEMV_ALIGNED,
                       {"maxnreg": plan.maxnreg}, 1)
    reg_ptrs = register_gemv_types("fp16")
    for depth, rows in ((1, "one row (q/k/v, o)"), (3, "2-7 rows, 3 deep")):
        cx = {"GROUP": 128, "HAS_ZERO": True, "HAS_BIAS": False, "BLOCK_N": bn,
              "WARPS": warps, "F16": True, "PRELOAD": w4["gemv_mma_preload"],
              "SPLITS_PAD": 4, "FUSED": True, "PDL": 1, "DEPTH": depth, "XS_TILES": 0,
              "ACT": False, "BLOCKED": False}
        cases[f"w4a16 Gluon register gemv, {rows}"] = (
            gluon_w4._w4_gemv_mma_kernel, reg_ptrs, cx, warps, REGISTER_GEMV_ALIGNED, {}, depth)
    return cases


def opcodes(body: list[str]) -> dict[str, int]:
    ops = collections.Counter(
        (ins.split()[1] if ins.startswith("@") else ins.split()[0]).split(".")[0] for ins in body)
    return dict(ops.most_common())


def loop_cases() -> dict:
    """The loops counted per weight element: name -> (fn, ptrs, constexprs, warps,
    stages, aligned arguments, weights a thread an iteration)."""
    w4, f8 = tq.W4_CONFIG, tq.FP8_CONFIG
    bk, gpt = tq._gemv_tile(w4["gemv_block_k"], 128, 3584)
    sizes = ["N", "K", "stride_xm", "stride_os", "stride_om", "k_per_split"]
    int4 = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8",
            "b_ptr": "*bf16", "out_ptr": "*fp32"}
    cases = {
        # elements per thread per iteration: the tile over the program's threads
        f"w4a16 gemv (AWQ, group 128, gemv_xvec {xvec}, gemv_prefetch {pf}, gemv_prmt {prmt})": (
            tq._w4_gemv_kernel, int4,
            {"GROUP": 128, "EVEN": True, "HAS_ZERO": True, "HAS_BIAS": False,
             "BLOCK_N": w4["gemv_block_n"], "BLOCK_K": bk, "GPT": gpt, "XVEC": xvec,
             "PREFETCH": pf, "PRMT": prmt, "SPLITS_PAD": 4,
             "FUSED": True, "PDL": True},
            w4["gemv_warps"], w4["gemv_stages"],
            ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", *sizes],
            bk * w4["gemv_block_n"] / (32 * w4["gemv_warps"]))
        for xvec in (False, True) for pf in (0, 1, 2) for prmt in (False, True)}
    cases |= {
        f"fp8 w8a16 gemv (per-channel scales, prefetch {pf}, xb {xb})": (
            tq._fp8_gemv_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "b_ptr": "*bf16",
             "out_ptr": "*fp32"},
            {"ROW_SCALE": True, "HAS_BIAS": False, "BLOCK_N": f8["gemv_block_n"],
             "BLOCK_K": f8["gemv_block_k"], "ACT": False, "PREFETCH": pf, "XB": xb,
             "KCHUNK": f8["gemv_kchunk"], "SPLITS_PAD": 4, "FUSED": True, "PDL": True},
            f8["gemv_warps"], f8["gemv_stages"],
            ["x_ptr", "w_ptr", "ws_ptr", "out_ptr", "stride_ws", *sizes],
            f8["gemv_block_k"] * f8["gemv_block_n"] / (32 * f8["gemv_warps"]))
        for pf, xb in ((False, False), (True, False), (False, True), (True, True))}
    cases |= {
        f"w4a16 tensor-core gemv (AWQ, group 128, {bn} columns, {m}-row operand)": (
            tq._w4_gemv_tc_kernel, int4,
            {"GROUP": 128, "EVEN": True, "HAS_ZERO": True, "HAS_BIAS": False, "BLOCK_M": m,
             "BLOCK_N": bn, "F16": False, "ASM": True, "F32": False, "SPLITS_PAD": 4,
             "FUSED": True, "PDL": True},
            w4["gemv_tc_warps"], w4["gemv_tc_stages"],
            ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", *sizes],
            128 * bn / (32 * w4["gemv_tc_warps"]))
        for bn in (w4["gemv_tc_block_n"], 128) for m in (8, 16)}
    if gluon_w4.IMPORTED:
        bn, warps = w4["gemv_mma_block_n"], w4["gemv_mma_warps"]
        cases[f"w4a16 Gluon tensor-core gemv (AWQ, group 128, {bn} columns, fp16)"] = (
            gluon_w4._w4_gemv_mma_kernel,
            {**int4, "x_ptr": "*fp16", "b_ptr": "*fp16", "part_ptr": "*fp32",
             "res_ptr": "*fp16", "cnt_ptr": "*i32"},
            {"GROUP": 128, "HAS_ZERO": True, "HAS_BIAS": False, "BLOCK_N": bn, "WARPS": warps,
             "F16": True, "PRELOAD": w4["gemv_mma_preload"], "SPLITS_PAD": 4, "FUSED": True,
             "PDL": 1, "DEPTH": 1, "XS_TILES": 0, "ACT": False, "BLOCKED": False},
            warps, 1, ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "part_ptr", "res_ptr", *sizes],
            128 * bn / (32 * warps))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    result = {}
    for name, (fn, ptrs, cx, warps, stages, aligned, per_thread) in loop_cases().items():
        body = innermost_loop(compile_sass(fn, ptrs, cx, warps, stages, aligned))
        result[name] = {"loop_instructions": len(body), "weights_per_thread": per_thread,
                        "per_weight": round(len(body) / per_thread, 2), "opcodes": opcodes(body)}
        top = ", ".join(f"{k} {v}" for k, v in list(result[name]["opcodes"].items())[:10])
        print(f"{name}: {len(body)} instructions per iteration, {per_thread:.0f} weights per "
              f"thread, {len(body) / per_thread:.2f} per weight ({top})")
    if gluon_w4.IMPORTED:
        for name, (fn, ptrs, cx, warps, aligned, options, tiles) in gluon_tile_cases().items():
            body = mma_loop(disassemble(compile_cubin(fn, ptrs, cx, warps, 1, aligned,
                                                      **options)))
            result[name] = {"loop_instructions": len(body), "tiles_an_iteration": tiles,
                            "per_tile": round(len(body) / tiles, 1), "opcodes": opcodes(body)}
            top = ", ".join(f"{k} {v}" for k, v in list(result[name]["opcodes"].items())[:8])
            print(f"{name}: {len(body) / tiles:.1f} instructions a K tile ({top})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
