"""Quantized weights on one GPU (issue 15), in one call: kernels against their torch
twins at Qwen2.5-7B's shapes, a launch-config sweep, GEMM/GEMV timings for bf16 vs fp8
vs w4a16 at B = 1/16/64/256 and an 8192-token prefill, then the engine's decode step
(B = 1) and an offline throughput run for bf16, fp8 (quantized at load), AWQ and
llm-compressor's W4A16 (compressed-tensors, bf16 scales).

    bash benchmarks/run_quant.sh                       # everything, one device call
    bash benchmarks/run_quant.sh --phases ceilings,build,quantize,kernels   # or in two calls
    bash benchmarks/run_quant.sh --phases ceilings,engine_bf16,engine_fp8,engine_awq
    bash benchmarks/run_quant.sh --phases build,quantize --awq-dir /data/qwen7b-awq
                                                       # only write the AWQ checkpoint (for vLLM)

The checkpoints stay in /dev/shm while the machine is warm, so a second call reuses them
(the engine phases take the kernels phase's tuned configs from $OUT, or from
/tmp/pagefleet-quant-tuned.json left by an earlier call, or `--tuned JSON`; else the
defaults in server/ops/triton_quant.py). Each phase's wall
time is in the result; the lean defaults (offline 256 x 512/256) keep the whole run
within one 600 s call.

Phases (each in its own process with a timeout, so one failure costs only itself):
ceilings, build (bf16 random-weight model, benchmarks/build_model.py), quantize (the AWQ
checkpoint, pagefleet.server.testing_quant, on the GPU), quantize_w4a16 (the W4A16 one),
kernels, engine_bf16, engine_fp8, engine_awq, engine_w4a16. The kernels phase picks launch configs (W4_CONFIG/FP8_CONFIG
in server/ops/triton_quant.py) that the engine phases then use. Results:
$OUT/quant_result.json, $OUT/quant_part_*.json; a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import (QWEN7B, StepTimer, _engine_decode, _engine_throughput,  # noqa: E402
                       cuda_safe_twins, graph_ms, log, median_ms, rel_err, reset_prefix_cache)

OUT = Path(os.environ.get("OUT", "/tmp/pagefleet-bench"))
MODEL_DIR = Path(os.environ.get("PAGEFLEET_BENCH_MODEL", "/tmp/qwen2.5-7b-random"))
AWQ_DIR = Path(os.environ.get("PAGEFLEET_BENCH_AWQ", "/tmp/qwen2.5-7b-random-awq"))
# llm-compressor's W4A16 (compressed-tensors pack-quantized, group 128, symmetric, bf16
# scales): beside AWQ's directory
W4A16_DIR = Path(os.environ.get("PAGEFLEET_BENCH_W4A16", str(AWQ_DIR) + "-w4a16"))
TUNED_KEEP = Path("/tmp/pagefleet-quant-tuned.json")   # outlives $OUT while the machine is warm
GiB = 1 << 30
C = QWEN7B
Q, KV = C["heads"] * C["head_dim"], C["kv_heads"] * C["head_dim"]
# (N, K) of each linear layer, once per decoder layer
SHAPES = {"qkv": (Q + 2 * KV, C["hidden"]), "o": (C["hidden"], Q),
          "gate_up": (2 * C["intermediate"], C["hidden"]), "down": (C["hidden"], C["intermediate"])}
ROWS = (1, 16, 64, 256, 8192)


def write_part(name: str, data: dict) -> None:
    (OUT / f"quant_part_{name}.json").write_text(json.dumps(data, indent=1, default=str))


def timed(fn, m: int) -> float:
    """GPU ms of one call, from a CUDA graph (fewer reps for the big prefill GEMMs)."""
    return graph_ms(fn, reps=3, n=10) if m >= 4096 else graph_ms(fn, reps=10, n=30)


# -- phase: ceilings / build / quantize -------------------------------------------------------

def phase_ceilings(args) -> dict:
    import torch
    n = GiB
    src = torch.empty(n, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), n=30)
    props = torch.cuda.get_device_properties(0)
    import triton
    return {"copy_bw_Bps": 2 * n / (ms / 1e3), "gpu": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__}


def phase_build(args) -> dict:
    from build_model import build
    if (MODEL_DIR / "model.safetensors.index.json").exists():
        return {"model_dir": str(MODEL_DIR), "reused": True}
    t0 = time.time()
    build(MODEL_DIR)
    return {"model_dir": str(MODEL_DIR), "build_s": time.time() - t0}


def _quantize(args, key: str, dst: Path, fmt: str, **kw) -> dict:
    """The bf16 model written to `dst` as `fmt` (reused while the machine keeps it)."""
    from pagefleet.server.testing_quant import quantize_checkpoint
    if (dst / "config.json").exists() and not args.requantize:
        return {key: str(dst), "reused": True}
    t0 = time.time()
    quantize_checkpoint(MODEL_DIR, dst, fmt, group_size=128, device="cuda", **kw)
    size = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    return {key: str(dst), "quantize_s": time.time() - t0, "bytes": size,
            "config": json.loads((dst / "config.json").read_text())["quantization_config"]}


def phase_quantize(args) -> dict:
    return _quantize(args, "awq_dir", AWQ_DIR, "awq")


def phase_quantize_w4a16(args) -> dict:
    """The same bf16 model as llm-compressor's W4A16 (served by the int4 kernels with bf16
    activations and scales, where AWQ's are fp16)."""
    return _quantize(args, "w4a16_dir", W4A16_DIR, "compressed-tensors", scheme="w4a16",
                     sym=True)


# -- phase: kernels ----------------------------------------------------------------------------

def _weights(n: int, k: int):
    """Random bf16 weight and its fp8 (per-row and 128x128 block) and int4 forms."""
    import torch
    from pagefleet.server.ops import quant
    from pagefleet.server.testing_quant import hf_fp8_quantize
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    fp8_w, fp8_s = quant.quantize_fp8_rows(w)
    blk = hf_fp8_quantize(w.float(), (128, 128))[0]
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), device="cuda", dtype=torch.int32,
                            generator=g)
    groups = -(-k // 128)
    scales = (0.001 + 0.002 * torch.rand(groups, n, device="cuda", generator=g)).half()
    zeros = torch.randint(0, 16, (groups, n), device="cuda", generator=g).to(torch.uint8)
    return {"bf16": w, "fp8": (fp8_w, fp8_s, (1, k)),
            "fp8_block": (blk["weight"], blk["weight_scale_inv"], (128, 128)),
            "w4": (qweight, scales, zeros, 128)}


def phase_kernels(args) -> dict:
    import torch
    from pagefleet.server.ops import quant, triton_quant as tq
    res: dict = {"checks": [], "timings": [], "sweeps": {}, "tuned": {}}
    bf16 = torch.bfloat16
    w4_default, fp8_default = dict(tq.W4_CONFIG), dict(tq.FP8_CONFIG)

    def check(name, run, ref, tol):
        """`run()` makes the kernel's output; a kernel that fails is a failed check."""
        try:
            e = rel_err(run().float(), ref.float())
        except Exception as exc:
            res["checks"].append({"kernel": name, "error": repr(exc)[:400], "ok": False})
            log(f"check {name}: {exc!r}"[:400])
            return
        ok = e == e and e <= tol
        res["checks"].append({"kernel": name, "rel_err": e, "tol": tol, "ok": ok})
        if not ok:
            log(f"check {name}: rel err {e:.2e} (tol {tol}) FAIL")

    weights = {name: _weights(*nk) for name, nk in SHAPES.items()}
    torch.manual_seed(0)
    # 1. Correctness against the twins at real shapes.
    for name, (n, k) in SHAPES.items():
        W = weights[name]
        for m in (1, 16, 41, 256, 8192 if name == "o" else 517):
            x = torch.randn(m, k, device="cuda", dtype=bf16)
            qw, s, z, gs = W["w4"]
            ref = quant.w4a16_linear(x.float(), qw, s, z, gs).to(bf16)
            for path, gm, dm in (("gemv", 10 ** 9, 10 ** 9), ("gemm", 0, 10 ** 9),
                                 ("gemm_planes", 0, 10 ** 9), ("dequant", 0, 0)):
                if path == "gemv" and m > 16:
                    continue
                tq.W4_CONFIG["gemv_max_m"], tq.W4_CONFIG["dequant_min_m"] = gm, dm
                tq.W4_CONFIG["gemm_planes"] = path == "gemm_planes"
                check(f"w4a16 {path} {name} M={m}", lambda: tq.w4a16_linear(x, qw, s, z, gs), ref,
                      1e-2)
            tq.W4_CONFIG.update(w4_default)
            check(f"w4a16 symmetric {name} M={m}", lambda: tq.w4a16_linear(x, qw, s, None, gs),
                  quant.w4a16_linear(x.float(), qw, s, None, gs), 1e-2)
            for kind in ("fp8", "fp8_block"):
                fw, fs, blk = W[kind]
                ref = quant.fp8_linear(x.float(), fw, fs, blk)
                for gemv in ((True, False) if m <= 16 else (False,)):
                    check(f"{kind} w8a16 {'gemv' if gemv else 'gemm'} {name} M={m}",
                          lambda: tq.fp8_w8a16_linear(x, fw, fs, blk, gemv=gemv), ref, 1e-2)
                q, a_s = quant.quantize_fp8_per_token(x)
                ref8 = quant.fp8_gemm_a8(q, a_s, fw, fs, blk, None, torch.float32)
                check(f"{kind} w8a8 triton {name} M={m}",
                      lambda: tq.fp8_gemm_a8(q, a_s, fw, fs, blk, None, bf16, scaled_mm=False),
                      ref8, 1e-2)
                if kind == "fp8":
                    check(f"fp8 w8a8 scaled_mm {name} M={m}",
                          lambda: tq.fp8_gemm_a8(q, a_s, fw, fs, blk, None, bf16, scaled_mm=True),
                          ref8, 1e-2)
            try:
                qa, sa = tq.quantize_fp8_per_token(x)
                qb, sb = quant.quantize_fp8_per_token(x)
                same = bool(torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)))
                res["checks"].append({"kernel": f"act quant {name} M={m}", "exact": same,
                                      "scale_rel_err": rel_err(sa, sb), "ok": same})
            except Exception as exc:
                res["checks"].append({"kernel": f"act quant {name} M={m}", "ok": False,
                                      "error": repr(exc)[:400]})
    write_part("kernels", res)

    # 2. Sweeps at decode shapes: total ms over the four layer shapes.
    def total(fn_for, m: int) -> float:
        t = 0.0
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=bf16)
            try:
                t += timed(fn_for(weights[name], x), m)
            except Exception as e:   # a config that does not compile here
                log(f"sweep variant failed: {e!r}"[:300])
                return float("nan")
        return t

    def sweep(label, cfg, variants, fn_for, rows):
        base = dict(cfg)
        out = []
        for var in variants:
            cfg.update(var)
            out.append({**var, **{f"M={m}": total(fn_for, m) for m in rows}})
            cfg.clear()
            cfg.update(base)
        res["sweeps"][label] = out
        ok = [o for o in out if all(o[f"M={m}"] == o[f"M={m}"] for m in rows)]
        best = min(ok, key=lambda o: sum(o[f"M={m}"] for m in rows)) if ok else None
        if best:
            log(f"sweep {label}: best {best}")
        return {k: best[k] for k in variants[0]} if best else {}

    w4_fn = lambda W, x: (lambda: tq.w4a16_linear(x, *W["w4"]))          # noqa: E731
    fp8_fn = lambda W, x: (lambda: tq.fp8_linear(x, *W["fp8"]))           # noqa: E731
    # The base config, which the per-shape overrides (gemv_wide / gemv_deep, kept) leave
    # to the layers they do not cover. One layer's weights timed over and over partly
    # sit in L2, so the overrides were picked by gemv_step_ab.py GEMV_SHAPES=1 (28
    # distinct layers a shape), not here.
    tuned_w4 = sweep("w4 gemv", tq.W4_CONFIG, [
        dict(gemv_block_n=bn, gemv_block_k=bk, gemv_warps=nw, gemv_programs_per_sm=pps,
             gemv_xvec=xv, max_split=ms)
        # 16 x 256 at 12 programs an SM shipped (2026-12-02 night: 47 registers a thread
        # against 124 at 32 x 512, a step's GEMVs 2.53 against 2.75 ms, gemv_step_ab.py);
        # gemv_xvec: one vector load per word row's activations; max_split 1: narrower
        # tiles instead of split-K
        for bn, bk, nw, pps, xv, ms in (
            (16, 256, 4, 12, False, 32), (16, 256, 4, 8, False, 32), (32, 256, 4, 8, False, 32),
            (16, 512, 4, 8, False, 32), (32, 512, 4, 4, False, 32), (64, 512, 4, 4, False, 32),
            (16, 256, 4, 12, True, 32), (32, 512, 4, 4, True, 32), (16, 512, 4, 4, False, 1))],
        w4_fn, (1,))
    tq.W4_CONFIG.update(tuned_w4)
    # gemm_planes: each word loaded once and split into nibble planes, N on the MMA's
    # wide side (10.3 against 15.6 SASS instructions a weight at 16 rows; 0.138 against
    # 0.242 ms a layer at 16 rows on the H200, 2026-12-03: shipped)
    tuned_w4.update(sweep("w4 gemm", tq.W4_CONFIG, [
        dict(gemm_block_n=bn, gemm_block_k=bk, gemm_warps=nw, gemm_stages=st, gemm_planes=pl)
        for bn, bk, nw, st in ((128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3),
                               (64, 128, 4, 4)) for pl in (False, True)], w4_fn, (16, 64, 256)))
    tq.W4_CONFIG.update(tuned_w4)
    tuned_fp8 = sweep("fp8 gemv", tq.FP8_CONFIG, [
        dict(gemv_block_n=bn, gemv_block_k=bk, gemv_warps=nw, gemv_programs_per_sm=pps,
             max_split=ms, gemv_kchunk=kc, gemv_prefetch=pf, gemv_xb=xb)
        # gemv_kchunk: each thread's contiguous products summed every step (64 registers
        # a thread instead of 126-134); 32 x 256 at 8 programs an SM shipped (2026-12-02
        # night: a step's GEMVs 1.90 against 2.21 ms, gemv_step_ab.py); gemv_prefetch /
        # gemv_xb: where the weight and activation loads sit (both slower there)
        for bn, bk, nw, pps, ms, kc, pf, xb in (
            (32, 256, 4, 8, 32, 16, False, False), (32, 256, 4, 8, 32, 8, False, False),
            (32, 256, 4, 6, 32, 16, False, False), (32, 512, 4, 8, 32, 16, False, False),
            (16, 512, 4, 8, 32, 16, False, False), (16, 256, 4, 8, 32, 16, False, False),
            (16, 512, 4, 4, 32, 1, False, False), (8, 1024, 4, 8, 32, 16, False, False),
            (32, 256, 4, 8, 32, 16, False, True), (16, 512, 4, 4, 32, 1, True, False))],
        fp8_fn, (1,))
    tq.FP8_CONFIG.update(tuned_fp8)
    tuned_fp8.update(sweep("fp8 w8a16 gemm", tq.FP8_CONFIG, [
        dict(gemm_block_n=bn, gemm_block_k=bk, gemm_warps=nw)
        for bn, bk, nw in ((128, 64, 4), (64, 128, 4), (128, 128, 8))], fp8_fn, (16,)))
    tq.FP8_CONFIG.update(tuned_fp8)
    write_part("kernels", res)

    # 3. Path crossovers: the GEMV up to which batch, w8a16 up to which, from timings.
    def per_path(m: int) -> dict:
        out = {}
        xs = {name: torch.randn(m, k, device="cuda", dtype=bf16) for name, (n, k) in SHAPES.items()}

        def tot(make) -> float:
            try:
                return sum(timed(make(weights[nm], xs[nm]), m) for nm in SHAPES)
            except Exception as e:
                log(f"path at M={m} failed: {e!r}"[:300])
                return float("nan")
        out["bf16"] = tot(lambda W, x: (lambda: torch.nn.functional.linear(x, W["bf16"])))
        for gm, dm, label in ((10 ** 9, 10 ** 9, "w4 gemv"), (0, 10 ** 9, "w4 gemm"),
                              (0, 0, "w4 dequant+mm")):
            if (label == "w4 gemv" and m > 16) or (label == "w4 dequant+mm" and m < 16):
                continue
            tq.W4_CONFIG["gemv_max_m"], tq.W4_CONFIG["dequant_min_m"] = gm, dm
            out[label] = tot(lambda W, x: (lambda: tq.w4a16_linear(x, *W["w4"])))
        tq.W4_CONFIG["gemv_max_m"] = w4_default["gemv_max_m"]
        tq.W4_CONFIG["dequant_min_m"] = w4_default["dequant_min_m"]
        if m <= 16:
            out["fp8 w8a16 gemv"] = tot(lambda W, x: (
                lambda: tq.fp8_w8a16_linear(x, *W["fp8"], gemv=True)))
        out["fp8 w8a16 gemm"] = tot(lambda W, x: (
            lambda: tq.fp8_w8a16_linear(x, *W["fp8"], gemv=False)))
        out["fp8 w8a8 scaled_mm"] = tot(lambda W, x: (
            lambda: tq.fp8_w8a8_linear(x, *W["fp8"])))
        tq.FP8_CONFIG["scaled_mm"] = False
        out["fp8 w8a8 triton"] = tot(lambda W, x: (lambda: tq.fp8_w8a8_linear(x, *W["fp8"])))
        out["fp8 block w8a8 triton"] = tot(lambda W, x: (
            lambda: tq.fp8_w8a8_linear(x, *W["fp8_block"])))
        tq.FP8_CONFIG["scaled_mm"] = True
        return out

    paths = {m: per_path(m) for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 8192)}
    res["paths_ms_per_layer"] = paths
    gv = [m for m in paths if "w4 gemv" in paths[m] and paths[m]["w4 gemv"] < paths[m]["w4 gemm"]]
    tuned_w4["gemv_max_m"] = max(gv) if gv else 0
    # Dequantize-then-cuBLAS from the smallest batch where it wins there and at every
    # larger one measured.
    dq = [m for m in paths if "w4 dequant+mm" in paths[m]]
    tuned_w4["dequant_min_m"] = next(
        (m for m in dq if all(paths[b]["w4 dequant+mm"] < paths[b]["w4 gemm"] for b in dq if b >= m)),
        10 ** 9)
    gv8 = [m for m in paths if "fp8 w8a16 gemv" in paths[m]
           and paths[m]["fp8 w8a16 gemv"] < paths[m]["fp8 w8a16 gemm"]]
    tuned_fp8["gemv_max_m"] = max(gv8) if gv8 else 0
    w16 = [m for m in paths if min(paths[m].get("fp8 w8a16 gemv", 1e9), paths[m]["fp8 w8a16 gemm"])
           <= min(paths[m]["fp8 w8a8 scaled_mm"], paths[m]["fp8 w8a8 triton"])]
    tuned_fp8["w8a16_max_m"] = max([m for m in w16 if m < 8192] or [0])
    tuned_fp8["scaled_mm"] = all(paths[m]["fp8 w8a8 scaled_mm"] <= paths[m]["fp8 w8a8 triton"]
                                 for m in (256, 8192))
    res["tuned"] = {"W4_CONFIG": tuned_w4, "FP8_CONFIG": tuned_fp8}
    TUNED_KEEP.write_text(json.dumps(res["tuned"]))
    res["defaults"] = {"W4_CONFIG": w4_default, "FP8_CONFIG": fp8_default}
    # 4. The tuned dispatchers per batch, per decoder layer and per 28-layer step.
    tq.W4_CONFIG.update(tuned_w4)
    tq.FP8_CONFIG.update(tuned_fp8)
    for m in ROWS:
        row = {"M": m}
        for label, make in (("bf16", lambda W, x: (lambda: torch.nn.functional.linear(x, W["bf16"]))),
                            ("fp8", lambda W, x: (lambda: tq.fp8_linear(x, *W["fp8"]))),
                            ("w4a16", lambda W, x: (lambda: tq.w4a16_linear(x, *W["w4"])))):
            per = {}
            for name, (n, k) in SHAPES.items():
                x = torch.randn(m, k, device="cuda", dtype=bf16)
                per[name] = timed(make(weights[name], x), m)
            row[label] = per
            row[label + "_step_ms"] = C["layers"] * sum(per.values())
        res["timings"].append(row)
        log(f"linear layers per step, M={m}: bf16 {row['bf16_step_ms']:.2f} ms, fp8 "
            f"{row['fp8_step_ms']:.2f} ms, w4a16 {row['w4a16_step_ms']:.2f} ms")
    bytes_per_layer = {"bf16": sum(n * k * 2 for n, k in SHAPES.values()),
                       "fp8": sum(n * k + 4 * n for n, k in SHAPES.values()),
                       "w4a16": sum(n * k // 2 + (-(-k // 128)) * n * 3 for n, k in SHAPES.values())}
    res["weight_bytes_per_step"] = {k: C["layers"] * v for k, v in bytes_per_layer.items()}
    res["scaled_mm_refused"] = sorted(map(list, tq._SCALED_MM_REFUSED))
    res["all_ok"] = all(c["ok"] for c in res["checks"])
    return res


# -- phase: engine ------------------------------------------------------------------------------

def engine_phase(fmt: str):
    def run(args) -> dict:
        import logging
        from pagefleet.server import LLM, SamplingParams
        from pagefleet.server.ops import triton_quant as tq
        from pagefleet.server.ops.triton_ops import TritonOps
        res: dict = {"format": fmt}
        t: dict = {}
        part = OUT / "quant_part_kernels.json"
        if args.tuned:
            t, res["tuned_from"] = json.loads(args.tuned), "--tuned"
        elif part.exists() and json.loads(part.read_text()).get("tuned"):
            t, res["tuned_from"] = json.loads(part.read_text())["tuned"], str(part)
        elif TUNED_KEEP.exists():
            t, res["tuned_from"] = json.loads(TUNED_KEEP.read_text()), str(TUNED_KEEP)
        from pagefleet.server.ops import triton_attention as ta
        if not args.no_tuned:
            tq.W4_CONFIG.update(t.get("W4_CONFIG", {}))
            if errors := tq.plan_key_errors(tq.W4_CONFIG):
                raise SystemExit(f"tuned W4_CONFIG: {'; '.join(errors)}")
            tq.FP8_CONFIG.update(t.get("FP8_CONFIG", {}))
            ta.DECODE_CONFIG.update(t.get("DECODE_CONFIG", {}))   # --tuned only: not swept here
        res["W4_CONFIG"], res["FP8_CONFIG"] = dict(tq.W4_CONFIG), dict(tq.FP8_CONFIG)
        res["DECODE_CONFIG"] = dict(ta.DECODE_CONFIG)
        lines: list[str] = []

        class Grab(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        logging.getLogger("pagefleet").addHandler(Grab())
        logging.getLogger("pagefleet").setLevel(logging.INFO)
        model = {"awq": AWQ_DIR, "w4a16": W4A16_DIR}.get(fmt, MODEL_DIR)
        t0 = time.time()
        llm = LLM(str(model), max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  quantization="fp8" if fmt == "fp8" else None)
        res["startup_s"] = time.time() - t0
        res["startup_log"] = list(lines)
        for ln in lines:
            log(f"{fmt} startup: {ln}")
        runner = llm.engine.runner
        res["kv_blocks"] = runner.layout.num_blocks
        res["dtype"] = str(runner.dtype)
        params_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        embed_bytes = runner.model.embed_tokens.numel() * runner.model.embed_tokens.element_size()
        res["weights_bytes"] = params_bytes
        kv_per_token = 2 * C["layers"] * C["kv_heads"] * C["head_dim"] * 2
        rng = random.Random(0)

        def rand_prompt(n):
            return [rng.randrange(0, 151600) for _ in range(n)]

        def greedy(n, **kw):
            return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)

        StepTimer(llm)
        if fmt != "bf16" and args.parity_tokens:
            try:   # greedy tokens, Triton kernels (graphs) vs the torch twins on the GPU
                prompts = [rand_prompt(n) for n in (7, 513)]
                a = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(args.parity_tokens))]
                reset_prefix_cache(llm.engine.kv)
                runner.set_ops(cuda_safe_twins())
                b = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(args.parity_tokens))]
                reset_prefix_cache(llm.engine.kv)
                runner.set_ops(TritonOps)
                res["parity"] = {"identical_sequences": sum(x == y for x, y in zip(a, b)),
                                 "prompts": len(prompts),
                                 "token_match_frac": sum(u == v for x, y in zip(a, b)
                                                         for u, v in zip(x, y)) / sum(map(len, b)),
                                 "distinct_tokens": [len(set(x)) for x in a]}
                log(f"{fmt} parity: {res['parity']}")
            except Exception:
                traceback.print_exc()
                res["parity"] = {"error": traceback.format_exc()}
                runner.set_ops(TritonOps)
        write_part(f"engine_{fmt}", res)
        try:
            _engine_decode(llm, res, rand_prompt, greedy, args, params_bytes, embed_bytes,
                           kv_per_token)
        except Exception:
            traceback.print_exc()
            res["decode_error"] = traceback.format_exc()
        write_part(f"engine_{fmt}", res)
        try:
            _engine_throughput(llm, res, rand_prompt, greedy, args, llm.engine._bench_timer)
        except Exception:
            traceback.print_exc()
            res["throughput_error"] = traceback.format_exc()
        return res
    return run


PHASES = {"ceilings": phase_ceilings, "build": phase_build, "quantize": phase_quantize,
          "quantize_w4a16": phase_quantize_w4a16,
          "kernels": phase_kernels, "engine_bf16": engine_phase("bf16"),
          "engine_fp8": engine_phase("fp8"), "engine_awq": engine_phase("awq"),
          "engine_w4a16": engine_phase("w4a16")}
TIMEOUTS = {"ceilings": 40, "build": 150, "quantize": 200, "quantize_w4a16": 200, "kernels": 240,
            "engine_bf16": 180, "engine_fp8": 180, "engine_awq": 180, "engine_w4a16": 180}


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--awq-dir", default=None, help="where the AWQ checkpoint is written/read")
    ap.add_argument("--requantize", action="store_true", help="rewrite an existing AWQ dir")
    ap.add_argument("--copy-bw", type=float, default=4.26e12)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--parity-tokens", type=int, default=24)
    ap.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--profile-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    ap.add_argument("--no-tuned", action="store_true", help="engine phases: the default configs")
    ap.add_argument("--tuned", default="", help='engine phases: {"W4_CONFIG": {...}, '
                    '"FP8_CONFIG": {...}, "DECODE_CONFIG": {...}} (default: the kernels phase\'s pick)')
    ap.add_argument("--timeout", type=lambda s: dict(kv.split("=") for kv in s.split(",")),
                    default={})
    return ap.parse_args(argv)


def run_phase(name: str, args) -> None:
    try:
        data = PHASES[name](args)
    except Exception:
        traceback.print_exc()
        data = {"error": traceback.format_exc()}
    write_part(name, data)


def main() -> None:
    global AWQ_DIR
    args = parse()
    if args.awq_dir:
        AWQ_DIR = Path(args.awq_dir)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.phase:
        return run_phase(args.phase, args)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:],
                    "model_dir": str(MODEL_DIR), "awq_dir": str(AWQ_DIR)}
    timeouts = dict(TIMEOUTS, **{k: int(v) for k, v in args.timeout.items()})
    for name in args.phases.split(","):
        log(f"== phase {name}")
        t0 = time.time()
        cmd = [sys.executable, __file__, "--phase", name] + sys.argv[1:]
        try:
            subprocess.run(cmd, timeout=timeouts[name], check=False)
        except subprocess.TimeoutExpired:
            log(f"phase {name} timed out after {timeouts[name]} s")
        part = OUT / f"quant_part_{name}.json"
        result[name] = json.loads(part.read_text()) if part.exists() else {"error": "no result"}
        result[name]["phase_s"] = time.time() - t0
        if name == "ceilings" and "copy_bw_Bps" in result[name]:
            sys.argv += ["--copy-bw", str(result[name]["copy_bw_Bps"])]
        (OUT / "quant_result.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)


def print_table(r: dict) -> None:
    print("\n==== pagefleet quantization benchmark ====")
    c = r.get("ceilings", {})
    if "copy_bw_Bps" in c:
        print(f"{c['gpu']}: copy {c['copy_bw_Bps'] / 1e12:.2f} TB/s (torch {c['torch']}, "
              f"triton {c['triton']})")
    q = r.get("quantize", {})
    if "awq_dir" in q:
        print(f"AWQ checkpoint: {q['awq_dir']}" + (f" ({q['bytes'] / GiB:.2f} GiB, "
              f"{q['quantize_s']:.0f} s)" if "bytes" in q else " (reused)"))
    k = r.get("kernels", {})
    if "checks" in k:
        bad = [x for x in k["checks"] if not x["ok"]]
        errs = [x["rel_err"] for x in k["checks"] if "rel_err" in x]
        print(f"kernel checks: {len(k['checks']) - len(bad)}/{len(k['checks'])} ok; worst rel "
              f"err {max(errs):.2e}" + (f"; FAILED {[b['kernel'] for b in bad][:8]}" if bad else ""))
    if k.get("tuned"):
        print(f"tuned: {json.dumps(k['tuned'])}")
    for row in k.get("timings", []):
        print(f"  linear layers / step M={row['M']:>5}: bf16 {row['bf16_step_ms']:7.2f} ms  fp8 "
              f"{row['fp8_step_ms']:7.2f} ms ({row['fp8_step_ms'] / row['bf16_step_ms']:.2f}x)  "
              f"w4a16 {row['w4a16_step_ms']:7.2f} ms ({row['w4a16_step_ms'] / row['bf16_step_ms']:.2f}x)")
    base = {}
    for fmt in ("bf16", "fp8", "awq", "w4a16"):
        e = r.get(f"engine_{fmt}", {})
        d = (e.get("decode") or {}).get("1") or (e.get("decode") or {}).get(1)
        t = e.get("throughput")
        if d:
            base.setdefault("step", d.get("total_ms"))
            print(f"engine {fmt:>5}: B=1 step {d.get('total_ms', float('nan')):.2f} ms "
                  f"({d.get('total_ms', 0) / base['step']:.2f}x bf16; GPU {d['gpu_step_ms']:.2f} "
                  f"ms; weights read {d['weights_read_GB']:.2f} GB, roofline {d['roofline_ms']:.2f} "
                  f"ms, GPU/roofline {d['gpu_over_roofline']:.2f}); weights "
                  f"{e['weights_bytes'] / GiB:.2f} GiB, KV blocks {e['kv_blocks']}")
        if t:
            base.setdefault("tput", t["output_tok_per_s"])
            print(f"engine {fmt:>4}: offline {t['requests']}x{t['input_len']}/{t['output_len']} "
                  f"{t['output_tok_per_s']:.0f} out tok/s ({t['output_tok_per_s'] / base['tput']:.2f}x bf16)")
        if e.get("parity") and "prompts" in e["parity"]:
            p = e["parity"]
            print(f"engine {fmt:>4}: triton==torch twins {p['identical_sequences']}/{p['prompts']} "
                  f"seqs, token match {p['token_match_frac']:.3f}")
    for name in PHASES:
        if name in r and "error" in r[name]:
            print(f"phase {name} ERROR: {str(r[name]['error'])[-500:]}")
        for key in ("decode_error", "throughput_error"):
            if name in r and key in r[name]:
                print(f"phase {name} {key}: {str(r[name][key])[-400:]}")


if __name__ == "__main__":
    main()
