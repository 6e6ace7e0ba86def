"""Compile the quantized-GEMM, attention and rotary + KV-write Triton kernels for sm_90 (H100/H200) on a machine
without a GPU: Triton's own front end and the ptxas it ships, with the launch configs
that `triton_quant` ships. The interpreter runs kernel bodies as Python and accepts code
the compiler refuses (a constexpr reassigned in an unrolled loop cost a device call on
2026-12-01); this catches that class here. Run as a script with TRITON_INTERPRET=0 by
tests/server/test_kernels_compile.py; prints one line per kernel, exits 1 on a failure."""

from __future__ import annotations

import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagefleet.server.ops import gluon_attention as ga
from pagefleet.server.ops import gluon_w4 as gw
from pagefleet.server.ops import gluon_w4_tma as gt
from pagefleet.server.ops import triton_attention as ta
from pagefleet.server.ops import triton_layernorm as tln
from pagefleet.server.ops import triton_logits as tlg
from pagefleet.server.ops import triton_quant as tq
from pagefleet.server.ops import triton_rotary as tr


def signature(fn, ptrs: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Arguments typed by name (`ptrs`), constexprs as such, other pointers float32,
    every other argument an i32. A constexpr the kernel declares but `constexprs` lacks
    is an error: typed i32 it would compile as a runtime branch, not the shipped code."""
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: constexprs {missing} not given")
    return {a: ("constexpr" if a in constexprs else ptrs.get(a) or (
                "*fp32" if a.endswith("_ptr") else "i32")) for a in fn.arg_names}


def main() -> int:
    print(f"triton {triton.__version__} from {triton.__file__}")   # which one compiled
    target = GPUTarget("cuda", 90, 32)
    w4, f8, pf = tq.W4_CONFIG, tq.FP8_CONFIG, ta.PREFILL_CONFIG
    # cu_seqlens and context lengths arrive as int64, as the runner stages them
    attn = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "cu_ptr": "*i64",
            "ctx_ptr": "*i64", "bt_ptr": "*i32", "out_ptr": "*bf16",
            "qk_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32"}
    # out_ptr: float32 split-K partials; res_ptr: the result their last program sums
    int4 = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*bf16",
            "res_ptr": "*bf16", "cnt_ptr": "*i32"}
    fp8 = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "as_ptr": "*fp32",
           "b_ptr": "*bf16", "res_ptr": "*bf16", "cnt_ptr": "*i32"}
    one = {"SPLITS_PAD": 1, "FUSED": False}    # one split, or partials summed after
    fused = {"SPLITS_PAD": 4, "FUSED": True}   # summed by each tile's last program
    rope = {"pos_ptr": "*i64", "slot_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16",
            "v_ptr": "*bf16", "qo_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
            "k_scale": "fp32", "v_scale": "fp32"}
    rope_cx = {"HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 4, "QUANT": False,
               "EARLY": tr.ROTARY_CONFIG["inputs_early"]}
    dc = ta.DECODE_CONFIG
    dec = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "bt_ptr": "*i32",
           "ctx_ptr": "*i64", "out_ptr": "*bf16", "ml_ptr": "*fp32", "acc_ptr": "*fp32",
           "cnt_ptr": "*i32", "qk_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32"}
    dec_cx = {"NUM_HEADS": 28, "GROUP": 7, "GROUP_PAD": 16, "D": 128, "BLOCK_D": 128, "BS": 16,
              "BLOCK_N": dc["block_n"], "FP8": False, "F32": False,
              "PAGE_AHEAD": dc["page_ahead"], "FUSED": False, "SPLITS_PAD": 1,
              "KV_EARLY": dc["kv_early"]}
    g128 = {"GROUP": 128, "EVEN": True}   # the group size, and tiles that divide the shape
    cases = [
        ("w4 gemv, 128-row groups", tq._w4_gemv_kernel, int4, {**g128, "HAS_ZERO": True,
         "HAS_BIAS": False, "BLOCK_N": w4["gemv_block_n"],
         "BLOCK_K": tq._gemv_tile(w4["gemv_block_k"], 128, 4096)[0],
         "GPT": tq._gemv_tile(w4["gemv_block_k"], 128, 4096)[1], "XVEC": w4["gemv_xvec"],
         "PREFETCH": w4["gemv_prefetch"], "PRMT": w4["gemv_prmt"], **one},
         w4["gemv_warps"], w4["gemv_stages"]),
        ("w4 gemv, vector activation loads, words only a tile ahead", tq._w4_gemv_kernel, int4,
         {**g128, "HAS_ZERO": True,
         "HAS_BIAS": False, "BLOCK_N": w4["gemv_block_n"],
         "BLOCK_K": tq._gemv_tile(w4["gemv_block_k"], 128, 4096)[0],
         "GPT": tq._gemv_tile(w4["gemv_block_k"], 128, 4096)[1], "XVEC": True,
         "PREFETCH": 1, "PRMT": not w4["gemv_prmt"], **fused},
         w4["gemv_warps"], w4["gemv_stages"]),
        ("w4 gemv, words not prefetched, ragged", tq._w4_gemv_kernel, int4, {
         "GROUP": 128, "EVEN": False, "HAS_ZERO": True,
         "HAS_BIAS": True, "BLOCK_N": w4["gemv_block_n"],
         "BLOCK_K": tq._gemv_tile(w4["gemv_block_k"], 128, 4096)[0],
         "GPT": tq._gemv_tile(w4["gemv_block_k"], 128, 4096)[1], "XVEC": w4["gemv_xvec"],
         "PREFETCH": 0, "PRMT": w4["gemv_prmt"], **fused},
         w4["gemv_warps"], w4["gemv_stages"]),
        ("w4 gemv symmetric, per channel", tq._w4_gemv_kernel, int4, {
         "GROUP": 4096, "EVEN": True, "HAS_ZERO": False,
         "HAS_BIAS": True, "BLOCK_N": w4["gemv_block_n"], "BLOCK_K": w4["gemv_block_k"],
         "GPT": 1, "XVEC": w4["gemv_xvec"],
         "PREFETCH": w4["gemv_prefetch"], "PRMT": w4["gemv_prmt"], **fused},
         w4["gemv_warps"], w4["gemv_stages"]),
    ] + [
        (f"w4 gemv, {name} layers' config", tq._w4_gemv_kernel, int4, {**g128, "HAS_ZERO": True,
         "HAS_BIAS": False, "BLOCK_N": c["gemv_block_n"],
         "BLOCK_K": tq._gemv_tile(c["gemv_block_k"], 128, 4096)[0],
         "GPT": tq._gemv_tile(c["gemv_block_k"], 128, 4096)[1], "XVEC": c["gemv_xvec"],
         "PREFETCH": c["gemv_prefetch"], "PRMT": c["gemv_prmt"], **one},
         c["gemv_warps"], c["gemv_stages"])
        for name, c in (("wide", {**w4, **w4["gemv_wide"]}), ("deep", {**w4, **w4["gemv_deep"]}))
    ] + [
        ("w4 gemm", tq._w4_gemm_kernel, int4, {"HAS_ZERO": True, "HAS_BIAS": False, "BLOCK_M": 16,
         "BLOCK_N": w4["gemm_block_n"], "BLOCK_K": w4["gemm_block_k"], "F32": False, **fused},
         w4["gemm_warps"], w4["gemm_stages"]),
        ("w4 gemm, words once in nibble planes", tq._w4_gemm_planes_kernel, int4, {
         "GROUP": 128, "HAS_ZERO": True, "HAS_BIAS": False, "BLOCK_M": 16,
         "BLOCK_N": w4["gemm_block_n"], "BLOCK_K": w4["gemm_block_k"], "F32": False, **fused},
         w4["gemm_warps"], w4["gemm_stages"]),
    ] + [
        (f"w4 tensor-core gemv, {'fp16' if f16 else 'bf16'}, {bm}-row operand",
         tq._w4_gemv_tc_kernel, {**int4, "x_ptr": "*fp16" if f16 else "*bf16"},
         {"GROUP": 128, "EVEN": not f16, "HAS_ZERO": not f16, "HAS_BIAS": f16, "BLOCK_M": bm,
          "BLOCK_N": w4["gemv_tc_block_n"], "F16": f16, "ASM": True, "F32": False,
          **(fused if bm == 8 else one)},
         w4["gemv_tc_warps"], w4["gemv_tc_stages"])
        for f16, bm in ((False, 8), (True, 16))
    ] + [
        ("w4 dequant", tq._w4_dequant_kernel, {**int4, "out_ptr": "*bf16"},
         {"HAS_ZERO": True, "BLOCK_R": w4["dequant_block_r"], "BLOCK_N": w4["dequant_block_n"]},
         4, 2),
        ("split-K reduce", tq._splitk_reduce_kernel, {"b_ptr": "*bf16", "out_ptr": "*bf16"},
         {"SPLITS": 4, "HAS_BIAS": True, "BLOCK": 1024}, 4, 2),
        ("fp8 gemv", tq._fp8_gemv_kernel, fp8, {"ROW_SCALE": True, "HAS_BIAS": False,
         "BLOCK_N": f8["gemv_block_n"], "BLOCK_K": f8["gemv_block_k"], "ACT": False,
         "PREFETCH": f8["gemv_prefetch"], "XB": f8["gemv_xb"], "KCHUNK": f8["gemv_kchunk"],
         **one},
         f8["gemv_warps"], f8["gemv_stages"]),
        ("fp8 gemv, SiLU-and-mul in the activation load", tq._fp8_gemv_kernel, fp8, {
         "ROW_SCALE": True, "HAS_BIAS": False, "BLOCK_N": f8["gemv_block_n"],
         "BLOCK_K": f8["gemv_block_k"], "ACT": True, "PREFETCH": f8["gemv_prefetch"],
         "XB": False, "KCHUNK": 16, **fused}, f8["gemv_warps"], f8["gemv_stages"]),
        # its deferred one-row sum (FP8_CONFIG["deferred_sum"]): fixed point into the
        # layer's int64 row (the partials, result and counters all that row)
        ("fp8 gemv, SiLU in the load, deferred sum", tq._fp8_gemv_kernel,
         {**fp8, "out_ptr": "*i64", "res_ptr": "*i64", "cnt_ptr": "*i64"}, {
         "ROW_SCALE": True, "HAS_BIAS": False, "BLOCK_N": f8["gemv_block_n"],
         "BLOCK_K": f8["gemv_block_k"], "ACT": True, "PREFETCH": f8["gemv_prefetch"],
         "XB": False, "KCHUNK": f8["gemv_kchunk"], "SPLITS_PAD": 1, "FUSED": 2},
         f8["gemv_warps"], f8["gemv_stages"]),
        ("fp8 gemv, weights prefetched, activations in their layout", tq._fp8_gemv_kernel,
         fp8, {"ROW_SCALE": True, "HAS_BIAS": False, "BLOCK_N": f8["gemv_block_n"],
               "BLOCK_K": f8["gemv_block_k"], "ACT": False, "PREFETCH": True, "XB": True,
               "KCHUNK": f8["gemv_kchunk"], **fused},
         f8["gemv_warps"], f8["gemv_stages"]),
        ("fp8 w8a16 gemm", tq._fp8_gemm_kernel, fp8, {"ROW_SCALE": False, "W8A8": False,
         "HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": f8["gemm_block_n"],
         "BLOCK_K": f8["gemm_block_k"], "F32": False, **fused}, f8["gemm_warps"],
         f8["gemm_stages"]),
        ("fp8 w8a8 gemm", tq._fp8_gemm_kernel, {**fp8, "x_ptr": "*fp8e4nv"}, {"ROW_SCALE": True,
         "W8A8": True, "HAS_BIAS": False, "BLOCK_M": f8["w8a8_block_m"],
         "BLOCK_N": f8["w8a8_block_n"], "BLOCK_K": f8["w8a8_block_k"], "F32": False, **one},
         f8["w8a8_warps"], f8["w8a8_stages"]),
        ("prefill attention", ta._prefill_kernel, attn, {
         "GROUP": 7, "D": 128, "BLOCK_D": 128, "BS": 16, "BLOCK_M": pf["block_m"],
         "BLOCK_N": pf["block_n"], "BLOCK_B": ta.PREFILL_SEQ_BLOCK, "FP8": False, "F32": False,
         "LONGEST_FIRST": True, "PAGE_AHEAD": pf["page_ahead"],
         "WARP_SPEC": pf["warp_specialize"], "TMA": False},
         pf["num_warps"], pf["num_stages"]),
        ("prefill attention, fp8 cache", ta._prefill_kernel,
         {**attn, "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}, {
         "GROUP": 7, "D": 128, "BLOCK_D": 128, "BS": 16, "BLOCK_M": pf["block_m"],
         "BLOCK_N": pf["block_n"], "BLOCK_B": ta.PREFILL_SEQ_BLOCK, "FP8": True, "F32": False,
         "LONGEST_FIRST": True, "PAGE_AHEAD": pf["page_ahead"],
         "WARP_SPEC": pf["warp_specialize"], "TMA": False},
         pf["num_warps"], pf["num_stages"]),
        # 128-token pages: a key tile is one TMA box (tensor descriptors, not pointers)
        ("prefill attention, TMA tiles", ta._prefill_kernel,
         {**attn, "kc_ptr": f"tensordesc<bf16[{pf['block_n']}, 128]>",
          "vc_ptr": f"tensordesc<bf16[{pf['block_n']}, 128]>"}, {
         "GROUP": 7, "D": 128, "BLOCK_D": 128, "BS": 128, "BLOCK_M": pf["block_m"],
         "BLOCK_N": pf["block_n"], "BLOCK_B": ta.PREFILL_SEQ_BLOCK, "FP8": False, "F32": False,
         "LONGEST_FIRST": True, "PAGE_AHEAD": pf["page_ahead"],
         "WARP_SPEC": pf["warp_specialize"], "TMA": True},
         pf["num_warps"], pf["num_stages"]),
        ("fp8 act quant", tq._fp8_act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv"},
         {"STATIC": False, "BLOCK": f8["act_block"]}, 4, 2),
        ("decode attention, split", ta._decode_kernel, dec, {**dec_cx, "DIRECT": False},
         dc["num_warps"], dc["num_stages"]),
        ("decode attention, split, merged by the last program", ta._decode_kernel, dec,
         {**dec_cx, "DIRECT": False, "FUSED": True, "SPLITS_PAD": 32}, dc["num_warps"],
         dc["num_stages"]),
        ("decode attention, direct", ta._decode_kernel, dec, {**dec_cx, "DIRECT": True},
         dc["num_warps"], dc["num_stages"]),
        ("decode reduce", ta._decode_reduce_kernel, dec, {"NUM_HEADS": 28, "D": 128,
         "BLOCK_D": 128, "BLOCK_N": dc["block_n"], "SPLITS_PAD": 8,
         "KV_EARLY": dc["kv_early"]}, 4, 2),
        # Qwen2.5-7B's heads; positions and slots arrive as int64 staging slices
        ("rotary + KV write", tr._rotary_store_kernel, rope, rope_cx, 4, 2),
        ("rotary + KV write, fp8 cache", tr._rotary_store_kernel,
         {**rope, "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}, {**rope_cx, "QUANT": True}, 4, 2),
        # PAGEFLEET_PDL=early's mode (wait, then let the next kernel launch):
        # griddepcontrol.launch_dependents compiles too
        ("rotary + KV write, PDL early", tr._rotary_store_kernel, rope, {**rope_cx, "PDL": 2},
         4, 2),
        # the roles released before their wait by default (triton_common.EAGER_OPS):
        # launch_dependents ahead of griddepcontrol.wait
        ("rotary + KV write, PDL eager", tr._rotary_store_kernel, rope, {**rope_cx, "PDL": 3},
         4, 2),
        ("decode attention, split, PDL eager", ta._decode_kernel, dec,
         {**dec_cx, "DIRECT": False, "PDL": 3}, dc["num_warps"], dc["num_stages"]),
        ("decode reduce, PDL eager", ta._decode_reduce_kernel, dec, {"NUM_HEADS": 28, "D": 128,
         "BLOCK_D": 128, "BLOCK_N": dc["block_n"], "SPLITS_PAD": 8,
         "KV_EARLY": dc["kv_early"], "PDL": 3}, 4, 2),
        # a deferred one-row GEMV sum's readers (ops/deferred.py): the rotary + KV write
        # of Qwen2.5-7B's q/k/v row (with its bias), the add + RMSNorm of o's / down's
        ("rotary + KV write, deferred q/k/v row", tr._rotary_store_deferred_kernel,
         {"pos_ptr": "*i64", "slot_ptr": "*i64", "acc_ptr": "*i64", "b_ptr": "*bf16",
          "qo_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "k_scale": "fp32",
          "v_scale": "fp32"},
         {"HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 4, "QUANT": False, "HAS_BIAS": True,
          "BLOCK_ROW": 8192}, 8, 2),
        ("add + rmsnorm, deferred row", tln._rms_norm_kernel,
         {"x_ptr": "*i64", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
          "res_out_ptr": "*bf16", "b_ptr": "*bf16", "eps": "fp32"},
         {"N": 3584, "BLOCK": 4096, "ADD": True, "EARLY": True, "DEFERRED": True,
          "HAS_BIAS": False}, 8, 1),
        # the decode logits GEMV (launched plainly, after the forward's graph)
        ("logits gemv, one row", tlg._logits_gemv_kernel,
         {"x_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*fp32"},
         {"ROWS": 1, "BLOCK_N": tlg.LOGITS_CONFIG["block_n"],
          "BLOCK_K": tlg.LOGITS_CONFIG["block_k"]},
         tlg.LOGITS_CONFIG["warps"], tlg.LOGITS_CONFIG["stages"]),
    ]
    failed = 0
    for name, fn, ptrs, cx, warps, stages in cases:
        if "PDL" in fn.arg_names:   # as launched on sm_90: programmatic dependent launch
            cx = {"PDL": 1, **cx}
        try:
            src = ASTSource(fn=fn, signature=signature(fn, ptrs, cx), constexprs=cx)
            triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages,
                                                        "launch_pdl": True})
            print(f"ok {name}")
        except Exception as e:   # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAILED {name}: {e!r}"[:2000])
    failed += not metadata_dtype_costs_nothing(target, attn, pf)
    failed += not attention_copies_stay_in_flight(target, attn, pf, dec, dec_cx, dc)
    failed += not gemv_registers_stay_few(target, int4, fp8, w4, f8)
    failed += not gluon_prefill_splits_registers(target)
    failed += not gluon_gemv_feeds_mma_in_registers(target, w4)
    failed += not gluon_tma_gemv_streams_by_tma(target, w4)
    failed += not gluon_tma_stream_k_compiles(target, w4)
    failed += not gluon_gemvs_defer_their_sum(target, w4)
    failed += not deferred_norm_reads_before_rearming(target)
    failed += not step_inputs_read_before_the_wait(target, dec, dec_cx, dc, rope, rope_cx)
    return 1 if failed else 0


def step_inputs_read_before_the_wait(target, dec: dict, dec_cx: dict, dc: dict, rope: dict,
                                     rope_cx: dict) -> bool:
    """The decode attention (DECODE_CONFIG["kv_early"]), the rotary + KV write
    (ROTARY_CONFIG["inputs_early"]) and the RMSNorm with its weight early
    (NORM_CONFIG["weight_early"]) issue the reads that do not depend on the kernel
    before them ahead of griddepcontrol.wait: in their PTX some global load comes before
    the wait (the attention's: the context length, the page id, the first K/V tile), and
    the wait still comes before the loads of what that kernel writes."""
    import re
    name = "step inputs and cached keys read before the PDL wait"
    cases = {"decode attention": (ta._decode_kernel, dec, {**dec_cx, "DIRECT": False},
                                  dc["num_warps"], dc["num_stages"]),
             "rotary + KV write": (tr._rotary_store_kernel, rope, rope_cx, 4, 2),
             # the norm's weight (NORM_CONFIG["weight_early"]), Qwen2.5-7B's row
             "add + rmsnorm, weight early": (
                 tln._rms_norm_kernel, {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16",
                                        "out_ptr": "*bf16", "res_out_ptr": "*bf16",
                                        "b_ptr": "*bf16", "eps": "fp32"},
                 {"N": 3584, "BLOCK": 4096, "ADD": True, "EARLY": True, "DEFERRED": False,
                  "HAS_BIAS": False}, 8, 1)}
    seen = {}
    try:
        for key, (fn, ptrs, cx, warps, stages) in cases.items():
            cx = {**cx, "PDL": 2}
            src = ASTSource(fn=fn, signature=signature(fn, ptrs, cx), constexprs=cx)
            ptx = triton.compile(src, target=target, options={
                "num_warps": warps, "num_stages": stages, "launch_pdl": True}).asm["ptx"]
            wait = ptx.find("griddepcontrol.wait")
            seen[key] = (wait > 0, len(re.findall(r"ld\.global", ptx[:max(wait, 0)])),
                         len(re.findall(r"ld\.global", ptx[max(wait, 0):])))
    except Exception as e:   # noqa: BLE001 - reported like the others
        print(f"FAILED {name}: {e!r}"[:2000])
        return False
    ok = all(w and before > 0 and after > 0 for w, before, after in seen.values())
    print(f"{'ok' if ok else 'FAILED'} {name} (wait found, loads before, loads after): {seen}")
    return ok


def gemv_registers_stay_few(target, int4: dict, fp8: dict, w4: dict, f8: dict) -> bool:
    """The B=1 GEMVs as shipped hold few registers a thread, so many programs stay
    resident and many weight bytes are in flight: the fp8 one took 126-134 with its
    accumulator as wide as the tile (4 programs an SM; a B=1 step's GEMVs 2.21 ms on the
    H200) and 64 with each thread's products summed every step (`gemv_kchunk`; 1.90 ms);
    the int4 one 124 at 32 x 512 tiles and 47 at 16 x 256 (2.75 against 2.53 ms)."""
    name = "B=1 GEMVs: registers a thread (occupancy)"
    bk4, gpt = tq._gemv_tile(w4["gemv_block_k"], 128, 4096)
    cases = {
        "fp8": (tq._fp8_gemv_kernel, fp8, {
            "ROW_SCALE": True, "HAS_BIAS": False, "BLOCK_N": f8["gemv_block_n"],
            "BLOCK_K": f8["gemv_block_k"], "ACT": True, "PREFETCH": f8["gemv_prefetch"],
            "XB": False, "KCHUNK": f8["gemv_kchunk"], "SPLITS_PAD": 4, "FUSED": True},
            f8["gemv_warps"], f8["gemv_stages"], ["x_ptr", "w_ptr", "K", "stride_xm",
                                                  "k_per_split"]),
        "w4": (tq._w4_gemv_kernel, int4, {
            "GROUP": 128, "EVEN": True, "HAS_ZERO": True, "HAS_BIAS": False,
            "BLOCK_N": w4["gemv_block_n"], "BLOCK_K": bk4, "GPT": gpt, "XVEC": w4["gemv_xvec"],
            "PREFETCH": w4["gemv_prefetch"], "PRMT": w4["gemv_prmt"],
            "SPLITS_PAD": 4, "FUSED": True}, w4["gemv_warps"], w4["gemv_stages"],
            ["x_ptr", "qw_ptr", "N", "stride_xm", "k_per_split"]),
    }
    try:
        got = {k: ptxas_usage(target, fn, ptrs, cx, warps, stages, aligned)
               for k, (fn, ptrs, cx, warps, stages, aligned) in cases.items()}
    except Exception as e:   # noqa: BLE001 - reported like the others
        print(f"FAILED {name}: {e!r}"[:2000])
        return False
    if any(regs < 0 or regs > 96 or spills for regs, spills in got.values()):
        print(f"FAILED {name}: (registers, spill bytes) {got}")
        return False
    print(f"ok {name} {got}")
    return True


def _compile_logged(source, target, options: dict) -> tuple[str, str]:
    """`source` compiled afresh for `target`: its PTX, and ptxas's log (registers,
    spills), which ptxas prints to stdout."""
    import contextlib
    import io

    from triton import knobs
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        ptx = triton.compile(source, target=target, options=options).asm["ptx"]
    return ptx, log.getvalue()


def ptxas_usage(target, fn, ptrs: dict, cx: dict, warps: int, stages: int,
                aligned: list[str]) -> tuple[int, int]:
    """(registers, spill-store bytes) as ptxas reports them, for a launch whose
    `aligned` arguments Triton would specialize as multiples of 16."""
    import re

    cx = {**cx, "PDL": 1}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=signature(fn, ptrs, cx), constexprs=cx, attrs=attrs)
    _, text = _compile_logged(src, target, {"num_warps": warps, "num_stages": stages,
                                            "launch_pdl": True})
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def metadata_dtype_costs_nothing(target, attn: dict, pf: dict) -> bool:
    """The prefill kernel reads the step's int64 metadata once and indexes in int32: with
    int64 index math it held 254 registers against 226 at 64-row tiles, and at the shipped
    128-row tiles it spilled 1,092 B against 360 B."""
    name = "prefill attention: int64 step metadata, the registers of int32"
    cx = {"GROUP": 7, "D": 128, "BLOCK_D": 128, "BS": 16, "BLOCK_M": pf["block_m"],
          "BLOCK_N": pf["block_n"], "BLOCK_B": ta.PREFILL_SEQ_BLOCK, "FP8": False, "F32": False,
          "LONGEST_FIRST": True, "PAGE_AHEAD": pf["page_ahead"],
          "WARP_SPEC": pf["warp_specialize"], "TMA": False}
    aligned = ["q_ptr", "kc_ptr", "vc_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_ot",
               "stride_oh", "stride_bt", "stride_cblk", "stride_ctok", "stride_ch"]
    try:
        got = {dt: ptxas_usage(target, ta._prefill_kernel, {**attn, "cu_ptr": f"*{dt}",
                                                            "ctx_ptr": f"*{dt}"}, cx,
                               pf["num_warps"], pf["num_stages"], aligned)
               for dt in ("i32", "i64")}
    except Exception as e:   # noqa: BLE001 - reported like the others
        print(f"FAILED {name}: {e!r}"[:2000])
        return False
    if got["i64"] != got["i32"] or got["i64"][0] < 0 or got["i64"][1] > 512:
        print(f"FAILED {name}: (registers, spill bytes) {got}")
        return False
    print(f"ok {name} ({got['i64'][0]} registers, {got['i64'][1]} B spilled)")
    return True


def attention_copies_stay_in_flight(target, attn: dict, pf: dict, dec: dict, dec_cx: dict,
                                    dc: dict) -> bool:
    """The attention kernels that ship page_ahead (the prefill one; the decode one ran
    slower with it) keep K/V copies in flight across key tiles: some
    `cp.async.wait_group` in their PTX waits for fewer than all copies. With each tile's
    page ids read in the tile's own step (page_ahead off) every wait was `wait_group 0`:
    the pipeliner waited for all copies, the next tiles' too, at the top of every step."""
    import re
    name = "attention key loops: K/V copies stay in flight (page ids one tile ahead)"
    attn_cx = {"GROUP": 7, "D": 128, "BLOCK_D": 128, "BS": 16, "BLOCK_M": pf["block_m"],
               "BLOCK_N": pf["block_n"], "BLOCK_B": ta.PREFILL_SEQ_BLOCK, "FP8": False,
               "F32": False, "LONGEST_FIRST": True, "PAGE_AHEAD": pf["page_ahead"],
               "WARP_SPEC": pf["warp_specialize"], "TMA": False, "PDL": 1}
    # Aligned as Triton specializes the real launches (16-byte pointers and strides):
    # otherwise the loads are not vectorized and there is no cp.async to look at.
    cases = [(ta._prefill_kernel, attn, attn_cx, pf, ["q_ptr", "kc_ptr", "vc_ptr", "out_ptr",
              "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt", "stride_cblk",
              "stride_ctok", "stride_ch"]),
             (ta._decode_kernel, dec, {**dec_cx, "DIRECT": False, "PDL": 1}, dc,
              ["q_ptr", "kc_ptr", "vc_ptr", "out_ptr", "ml_ptr", "acc_ptr", "stride_qb",
               "stride_qh", "stride_ob", "stride_oh", "stride_bt", "stride_cblk", "stride_ctok",
               "stride_ch"])]
    waits = {}
    try:
        for fn, ptrs, cx, cfg, aligned in cases:
            if not cfg["page_ahead"]:   # shipped off for this kernel (timed slower)
                continue
            attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
            src = ASTSource(fn=fn, signature=signature(fn, ptrs, cx), constexprs=cx, attrs=attrs)
            ptx = triton.compile(src, target=target, options={
                "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                "launch_pdl": True}).asm["ptx"]
            waits[fn.__name__] = sorted({int(w) for w in
                                         re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)})
    except Exception as e:   # noqa: BLE001 - reported like the others
        print(f"FAILED {name}: {e!r}"[:2000])
        return False
    if not all(w and max(w) >= 1 for w in waits.values()):
        print(f"FAILED {name}: cp.async.wait_group counts {waits}")
        return False
    print(f"ok {name} ({waits})")
    return True


def gluon_prefill_splits_registers(target) -> bool:
    """The Gluon ping-pong prefill kernel (ops/gluon_attention.py, sm_90 only, not run by
    the interpreter) compiles with the shipped PINGPONG_CONFIG, its partitions get their
    registers (setmaxnreg: each math warpgroup `math_regs`, the producer `load_regs`),
    and ptxas serializes no wgmma (its C7512 warning: a register budget the partitions do
    not fit, e.g. the producer asking for as many as the math warpgroups, makes it wait
    for every wgmma and loses what the kernel is for)."""
    import re

    name = "prefill attention, Gluon ping-pong: registers split, no wgmma serialized"
    if not ga.IMPORTED:
        print(f"FAILED {name}: triton.experimental.gluon did not import")
        return False
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    cfg, fn = ga.PINGPONG_CONFIG, ga._prefill_pingpong_kernel
    layout = gl.NVMMASharedLayout.get_default_for([cfg["block_n"], 128], gl.bfloat16)
    desc = f"tensordesc<bf16[{cfg['block_n']}, 128],{layout!r}>"
    ptrs = {"q_ptr": "*bf16", "vc_ptr": "*bf16", "cu_ptr": "*i64", "ctx_ptr": "*i64",
            "bt_ptr": "*i32", "out_ptr": "*bf16", "qk_scale": "fp32", "k_desc": desc,
            "v_desc": desc}
    cx = {"GROUP": 7, "D": 128, "BS": 128, "BLOCK_N": cfg["block_n"],
          "BLOCK_B": ta.PREFILL_SEQ_BLOCK, "STAGES": cfg["stages"],
          "PINGPONG": cfg["pingpong"], "MATH_REGS": cfg["math_regs"],
          "LOAD_REGS": cfg["load_regs"], "LW": cfg["load_warps"], "num_warps": 4}
    # aligned as Triton specializes the real launches (16-byte pointers and strides)
    aligned = ["q_ptr", "vc_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_ot",
               "stride_oh", "stride_bt", "stride_cblk", "stride_ctok", "stride_ch"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    sig = {a: "constexpr" if a in cx else ptrs.get(a, "i32") for a in fn.arg_names}
    try:
        ptx, log = _compile_logged(GluonASTSource(fn, sig, cx, attrs), target, {"num_warps": 4})
    except Exception as e:   # noqa: BLE001 - reported like the others
        print(f"FAILED {name}: {e!r}"[:2000])
        return False
    regs = {int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
    serialized = [ln for ln in log.splitlines() if "serialized" in ln]
    if not {cfg["math_regs"], cfg["load_regs"]} <= regs or serialized:
        print(f"FAILED {name}: setmaxnreg {sorted(regs)}, {serialized[:2]}")
        return False
    print(f"ok {name} (setmaxnreg {sorted(regs)})")
    return True


def gluon_gemv_feeds_mma_in_registers(target, w4: dict) -> bool:
    """The Gluon w4 GEMVs (ops/gluon_w4.py, sm_90 only, not run by the interpreter: the
    register kernel one tile deep, at one row with the row staged in shared memory and
    the shipped depth, the down projection's with the SiLU computed as it stages the row,
    at more rows the shipped depth, and the cp.async ring kernel at the shipped stages)
    compile with the shipped W4_CONFIG for fp16 and bf16, zero points
    or none, their K splits summed in the kernel or after: each operand reaches its MMA
    fragments with no value moving between threads (the kernels' `convert_layout(...,
    assert_trivial=True)` fails the compile otherwise), the MMAs are mma.sync m16n8k16,
    the ring's copies and the staged row's are cp.async (and nothing else's; the SiLU
    row's are loads, with the SiLU's exponential),
    and ptxas spills nothing and stays at or under 96 registers (occupancy: each thread's
    words are its bytes in flight; the merging o GEMV under what keeps the plan's
    programs an SM resident)."""
    import re

    name = "w4 GEMVs, Gluon: MMA operands built in registers, few registers, no spills"
    if not gw.IMPORTED:
        print(f"FAILED {name}: triton.experimental.gluon did not import")
        return False
    from triton.experimental.gluon._runtime import GluonASTSource
    bn, warps = w4["gemv_mma_block_n"], w4["gemv_mma_warps"]
    # (every constexpr named: one left out of the signature compiles as an argument)
    pre = {"PRELOAD": w4["gemv_mma_preload"], "ACT": False, "BLOCKED": False}
    one = w4["gemv_mma_one_row"]["unsplit"]
    kernels = {"registers": (gw._w4_gemv_mma_kernel, {**pre, "DEPTH": 1, "XS_TILES": 0}),
               # one row: staged in shared memory (by cp.async), weights tiles deep
               "one row": (gw._w4_gemv_mma_kernel, {**pre, "DEPTH": one["depth"],
                                                    "XS_TILES": 32}),
               # down at one row: silu(gate) * up computed as the row is staged
               "one row silu": (gw._w4_gemv_mma_kernel, {**pre, "DEPTH": 1, "XS_TILES": 16,
                                                         "ACT": True}),
               # q/k/v and o at one row in the blocked layout (the layout A/B's form)
               "one row blocked": (gw._w4_gemv_mma_kernel, {**pre, "DEPTH": 1, "XS_TILES": 0,
                                                            "BLOCKED": True}),
               "rows deep": (gw._w4_gemv_mma_kernel,
                             {**pre, "DEPTH": w4["gemv_mma_rows"]["unsplit"]["depth"],
                              "XS_TILES": 0}),
               "ring": (gw._w4_gemv_ring_kernel, {"STAGES": w4["gemv_mma_stages"]})}
    got = {}
    for (kind, (fn, own)), (dt, zero, fused) in itertools.product(
            kernels.items(), (("fp16", True, True), ("bf16", False, False))):
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
                 for a in REGISTER_GEMV_ALIGNED}
        ptrs = register_gemv_types(dt)
        cx = {"GROUP": 128, "HAS_ZERO": zero, "HAS_BIAS": True, "BLOCK_N": bn, "WARPS": warps,
              "F16": dt == "fp16", "SPLITS_PAD": 4 if fused else 1, "FUSED": fused,
              "PDL": 1, **own}
        sig = {a: "constexpr" if a in cx else ptrs.get(a, "i32") for a in fn.arg_names}
        try:
            ptx, log = _compile_logged(GluonASTSource(fn, sig, cx, attrs), target,
                                       {"num_warps": warps})
        except Exception as e:   # noqa: BLE001 - reported like the others
            print(f"FAILED {name} ({kind}, {dt}): {e!r}"[:2000])
            return False
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.search(r"(\d+) bytes spill stores", log)
        copies = len(re.findall(r"cp\.async\.c[ag]", ptx))
        exps = len(re.findall(r"ex2\.approx", ptx))
        got[kind, dt] = (int(regs.group(1)) if regs else -1,
                         int(spills.group(1)) if spills else -1,
                         len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)),
                         bool(copies) == (kind in ("ring", "one row"))
                         and bool(exps) == (kind == "one row silu"))
    if any(r < 0 or r > 96 or sp or not mma or not cp for (r, sp, mma, cp) in got.values()):
        print(f"FAILED {name}: (registers, spill bytes, mma.sync, cp.async and SiLU where "
              f"due) {got}")
        return False
    print(f"ok {name} {got}")
    return True


# The register (and ring) GEMV's arguments as a real launch types them: its activations,
# outputs and bias in the row's dtype, the words int32, fp16 scales, uint8 zero points,
# and the arguments Triton specializes as multiples of 16.
REGISTER_GEMV_ALIGNED = ["x_ptr", "qw_ptr", "s_ptr", "z_ptr", "part_ptr", "res_ptr", "N", "K",
                         "stride_xm", "stride_os", "stride_om", "k_per_split"]


def register_gemv_types(dt: str) -> dict[str, str]:
    """The register GEMV's pointer types for `dt` ("fp16" or "bf16") activations."""
    return {"x_ptr": f"*{dt}", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8",
            "b_ptr": f"*{dt}", "part_ptr": "*fp32", "res_ptr": f"*{dt}", "cnt_ptr": "*i32"}


# The TMA GEMV's arguments as a real launch types them: its activations, outputs and
# counters as pointers, the words, scales and zero points as TMA descriptors
# (`gluon_w4_tma.descriptors`), and the arguments Triton specializes as multiples of 16.
TMA_GEMV_ALIGNED = ["x_ptr", "part_ptr", "res_ptr", "N", "K", "stride_xm", "stride_os",
                    "stride_om", "k_per_split"]


def tma_gemv_types(dt: str, bn: int, zero: bool) -> dict[str, str]:
    """The TMA GEMV's pointer and descriptor types for `dt` ("fp16" or "bf16")
    activations, `bn`-column tiles, uint8 zero points or none (the scales stand in)."""
    nvmma = ("NVMMASharedLayout(swizzle_byte_width={}, element_bitwidth={}, rank=2, "
             "transposed=False, fp4_padded=False, cga_layout=[])")
    return {"x_ptr": f"*{dt}", "b_ptr": f"*{dt}", "part_ptr": "*fp32", "res_ptr": f"*{dt}",
            "cnt_ptr": "*i32",
            "w_desc": f"tensordesc<i32[16, 32],{nvmma.format(128, 32)}>",
            "s_desc": f"tensordesc<{dt}[1, {bn}],{nvmma.format(0, 16)}>",
            "z_desc": (f"tensordesc<u8[1, {bn}],{nvmma.format(0, 8)}>" if zero else
                       f"tensordesc<{dt}[1, {bn}],{nvmma.format(0, 16)}>")}


def _compile_tma_gemv(target, fn, cx: dict, dt: str, zero: bool, maxnreg: int,
                      over: dict | None = None) -> tuple[str, int, int]:
    """A TMA GEMV entry compiled as a launch types it (`tma_gemv_types`, TMA_GEMV_ALIGNED
    where it has the argument; `over`: other types): (PTX, most registers a thread,
    spill-store bytes; -1 where ptxas did not say)."""
    import re

    from triton.experimental.gluon._runtime import GluonASTSource
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in TMA_GEMV_ALIGNED if a in fn.arg_names}
    ptrs = {**tma_gemv_types(dt, cx["BLOCK_N"], zero), **(over or {})}
    sig = {a: "constexpr" if a in cx else ptrs.get(a, "i32") for a in fn.arg_names}
    ptx, log = _compile_logged(GluonASTSource(fn, sig, cx, attrs), target,
                               {"num_warps": cx["WARPS"], "maxnreg": maxnreg})
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    spills = re.search(r"(\d+) bytes spill stores", log)
    return ptx, max(regs) if regs else -1, int(spills.group(1)) if spills else -1


# A deferred sum's launch (ops/deferred.py): the partials, result and counters all the
# layer's int64 accumulator row.
DEFERRED_TYPES = {"part_ptr": "*i64", "res_ptr": "*i64", "cnt_ptr": "*i64"}


def gluon_gemvs_defer_their_sum(target, w4: dict) -> bool:
    """The one-row GEMVs that defer their split sum (FUSED 2: q/k/v and o on the register
    kernel, down on the TMA kernel with its SiLU) compile for fp16 and bf16: each split
    adds its fixed-point partial by a relaxed 64-bit atomic add, and nothing of the
    arrival protocol is left (no acq_rel atomic, no counter exchange), within the
    register budgets of their tensor forms and without spills."""
    import re

    from triton.experimental.gluon._runtime import GluonASTSource
    name = "w4 GEMVs, Gluon, deferred sum: fixed-point atomic adds, no arrival counter"
    if not (gw.IMPORTED and gt.IMPORTED):
        print(f"FAILED {name}: triton.experimental.gluon did not import")
        return False
    bn, warps = w4["gemv_mma_block_n"], w4["gemv_mma_warps"]
    got = {}
    try:
        for dt, zero in (("fp16", True), ("bf16", False)):
            fn = gw._w4_gemv_mma_kernel
            cx = {"GROUP": 128, "HAS_ZERO": zero, "HAS_BIAS": False, "BLOCK_N": bn,
                  "WARPS": warps, "F16": dt == "fp16", "SPLITS_PAD": 1, "FUSED": 2, "PDL": 1,
                  "PRELOAD": w4["gemv_mma_preload"], "ACT": False, "BLOCKED": False,
                  "DEPTH": 1, "XS_TILES": 0}
            attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
                     for a in REGISTER_GEMV_ALIGNED}
            ptrs = {**register_gemv_types(dt), **DEFERRED_TYPES}
            sig = {a: "constexpr" if a in cx else ptrs.get(a, "i32") for a in fn.arg_names}
            ptx, log = _compile_logged(GluonASTSource(fn, sig, cx, attrs), target,
                                       {"num_warps": warps})
            regs = re.search(r"Used (\d+) registers", log)
            spills = re.search(r"(\d+) bytes spill stores", log)
            got["registers", dt] = (int(regs.group(1)) if regs else -1,
                                    int(spills.group(1)) if spills else -1, ptx)
            t = w4["gemv_mma_one_row"]["deep"]["tma"]
            plan = tq._tma_plan(18944, t, w4)
            cx = {"GROUP": 128, "HAS_ZERO": zero, "HAS_BIAS": False, "BLOCK_N": bn,
                  "WARPS": warps, "F16": dt == "fp16", "STAGES": plan.stages,
                  "XS_TILES": plan.xs_tiles, "ACT": True, "SPLITS_PAD": 1, "FUSED": 2,
                  "PDL": 1, "BLOCKED": False}
            ptx, regs, spills = _compile_tma_gemv(target, gt._w4_gemv_tma_kernel, cx, dt, zero,
                                                  plan.maxnreg, DEFERRED_TYPES)
            got["tma", dt] = (regs, spills, ptx)
    except Exception as e:   # noqa: BLE001 - reported like the others
        print(f"FAILED {name}: {e!r}"[:2000])
        return False
    summary = {}
    for key, (regs, spills, ptx) in got.items():
        adds = re.findall(r"(?:atom|red)\.global\.gpu\.relaxed\.add\.u64", ptx)
        summary[key] = (regs, spills, len(adds), "acq_rel" in ptx or ".exch." in ptx)
    ok = all(regs >= 0 and spills == 0 and adds > 0 and not protocol
             for regs, spills, adds, protocol in summary.values())
    print(f"{'ok' if ok else 'FAILED'} {name} (registers, spill bytes, 64-bit adds, "
          f"arrival protocol left): {summary}")
    return ok


def deferred_norm_reads_before_rearming(target) -> bool:
    """The add + RMSNorm reading a deferred row (o's, down's) issues every global load
    (the row, the residual; the weight before the PDL wait) ahead of the barrier that
    re-arms the row: a load after it would add a trip to L2 to the reader's latency."""
    import re
    name = "add + rmsnorm, deferred row: every load before the re-arming barrier"
    fn = tln._rms_norm_kernel
    ptrs = {"x_ptr": "*i64", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "res_out_ptr": "*bf16", "b_ptr": "*bf16", "eps": "fp32"}
    cx = {"N": 3584, "BLOCK": 4096, "ADD": True, "EARLY": True, "DEFERRED": True,
          "HAS_BIAS": False, "PDL": 1}
    try:
        src = ASTSource(fn=fn, signature=signature(fn, ptrs, cx), constexprs=cx)
        ptx = triton.compile(src, target=target, options={"num_warps": 8,
                                                          "launch_pdl": True}).asm["ptx"]
    except Exception as e:   # noqa: BLE001 - reported like the others
        print(f"FAILED {name}: {e!r}"[:2000])
        return False
    bar = ptx.find("bar.sync")
    before = sorted(set(re.findall(r"ld\.global\.\w+", ptx[:max(bar, 0)])))
    after = len(re.findall(r"ld\.global", ptx[max(bar, 0):]))
    ok = bar > 0 and after == 0 and "ld.global.b64" in before
    print(f"{'ok' if ok else 'FAILED'} {name} (loads before: {before}, after: {after})")
    return ok


def gluon_tma_gemv_streams_by_tma(target, w4: dict) -> bool:
    """The one-row TMA GEMV (ops/gluon_w4_tma.py) at the shipped plans of its layer
    classes (gate_up unsplit, down in splits with the SiLU computed as it stages the row)
    compiles for fp16 with zero points (split-K summed in the kernel) and bf16 without
    (summed after), and gate_up's in the blocked layout's A/B form: the weights come by
    TMA (cp.async.bulk.tensor) and are waited for on mbarriers, the MMAs are mma.sync
    m16n8k16 with every operand built in registers (`assert_trivial` layouts), fp16
    decodes by the packed-FMA form (bf16 cannot), the SiLU's exponential only where it is
    due, and ptxas spills nothing within the plan's register cap."""
    import re

    name = "w4 GEMV, Gluon TMA: weights by TMA, MMA operands in registers, no spills"
    if not gt.IMPORTED:
        print(f"FAILED {name}: triton.experimental.gluon did not import")
        return False
    bn, warps = w4["gemv_mma_block_n"], w4["gemv_mma_warps"]
    fn = gt._w4_gemv_tma_kernel
    got = {}
    cases = [(cls, form, False) for cls, form in itertools.product(
        ("unsplit", "deep"), (("fp16", True, True), ("bf16", False, False)))]
    cases.append(("unsplit", ("fp16", True, True), True))   # the blocked layout's A/B form
    for cls, (dt, zero, fused), blocked in cases:
        t = w4["gemv_mma_one_row"][cls]["tma"]
        plan = tq._tma_plan(18944 if cls == "deep" else 3584, t, w4)
        cx = {"GROUP": 128, "HAS_ZERO": zero, "HAS_BIAS": True, "BLOCK_N": bn, "WARPS": warps,
              "F16": dt == "fp16", "STAGES": plan.stages, "XS_TILES": plan.xs_tiles,
              "ACT": cls == "deep", "SPLITS_PAD": 4 if fused else 1, "FUSED": fused,
              "PDL": 1, "BLOCKED": blocked}
        try:
            ptx, regs, spills = _compile_tma_gemv(target, fn, cx, dt, zero, plan.maxnreg)
        except Exception as e:   # noqa: BLE001 - reported like the others
            print(f"FAILED {name} ({cls}, {dt}): {e!r}"[:2000])
            return False
        ok = (0 <= regs <= plan.maxnreg and spills == 0
              and len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) >= 2
              and "mbarrier.try_wait" in ptx
              and bool(re.search(r"mma\.sync\.aligned\.m16n8k16", ptx))
              and ("fma.rn.f16x2" in ptx) == (dt == "fp16")
              and ("ex2.approx" in ptx) == (cls == "deep"))
        got[cls, dt, *(("blocked",) if blocked else ())] = (regs, ok)
    if not all(ok for _, ok in got.values()):
        print(f"FAILED {name}: (registers, checks) {got}")
        return False
    print(f"ok {name} {got}")
    return True


def gluon_tma_stream_k_compiles(target, w4: dict) -> bool:
    """The TMA GEMV's stream-K form (`gluon_w4_tma._w4_gemv_tma_stream_kernel`, the
    balance A/B's; a "tma" plan's "stream" key) at gate_up's and down's plans (down with
    the SiLU staged, both layouts): weights by TMA, waits on mbarriers, mma.sync, the
    partial sums' arrival counter, no spills within the register cap."""
    import re

    name = "w4 GEMV, Gluon TMA stream-K: compiles within the plan's registers"
    bn, warps = w4["gemv_mma_block_n"], w4["gemv_mma_warps"]
    fn = gt._w4_gemv_tma_stream_kernel
    got = {}
    for cls, n, k, blocked in (("unsplit", 37888, 3584, False), ("deep", 3584, 18944, False),
                               ("unsplit", 37888, 3584, True)):
        t = {**w4["gemv_mma_one_row"][cls]["tma"], "stream": 5}
        cfg = {**w4, "gemv_mma_one_row": {**w4["gemv_mma_one_row"], cls: {"tma": t}}}
        plan = tq.mma_plan(1, n, k, 132, cfg)
        cx = {"GROUP": 128, "HAS_ZERO": True, "HAS_BIAS": True, "BLOCK_N": bn, "WARPS": warps,
              "F16": True, "STAGES": plan.stages, "XS_TILES": plan.xs_tiles,
              "ACT": cls == "deep", "SPLITS_PAD": triton.next_power_of_2(plan.splits),
              "PDL": 1, "BLOCKED": blocked}
        try:
            ptx, regs, spills = _compile_tma_gemv(target, fn, cx, "fp16", True, plan.maxnreg)
        except Exception as e:   # noqa: BLE001 - reported like the others
            print(f"FAILED {name} ({cls}): {e!r}"[:2000])
            return False
        ok = (plan.stream > 0 and 0 <= regs <= plan.maxnreg and spills == 0
              and len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) >= 2
              and "mbarrier.try_wait" in ptx and "atom.global" in ptx
              and bool(re.search(r"mma\.sync\.aligned\.m16n8k16", ptx)))
        got[cls, "blocked" if blocked else "checkpoint"] = (plan.stream, plan.splits, regs, ok)
    if not all(v[-1] for v in got.values()):
        print(f"FAILED {name}: (programs, partial sums, registers, checks) {got}")
        return False
    print(f"ok {name} {got}")
    return True


if __name__ == "__main__":
    sys.exit(main())
