"""Quantized-GEMV launch configs A/B'd inside the engine's decode step, on one GPU.

Its first GPU run (H200, 2026-12-03, fifth session) agreed with `run_quant.sh --phases
engine_awq`'s `gpu_forward_ms` (which replays the runner's own graph of the same
forward): B=1 2.19-2.20 ms on both, repeating within ~0.01 ms round to round; it picked
the tensor-core GEMV's row range (BENCHMARKS.md).

`gemv_step_ab.py` times a step's GEMVs back to back; the engine runs norms, rotary and
attention between them, and the two have disagreed (BENCHMARKS.md, 2026-12-03 fourth
session: 8 programs an SM for qkv / o slower back to back, 2.5% faster in the engine;
tiled words the other way round). This times the engine's own decode forward for each
variant, in turn, over several rounds, with one model load: a variant updates
W4_CONFIG / FP8_CONFIG (and DECODE_CONFIG), and the decode forward at batch B is timed
from a CUDA graph of its own (`gpu_bench.graph_ms`: kernels compile on its warm-up call,
outside the capture). Rows alternate variants round by round, so drift on the machine
(clocks, heat) falls on every variant alike.

    bash benchmarks/run_quant.sh --phases build,quantize    # the AWQ checkpoint, once
    ENGINE_AB_VARIANTS='[{}, {"W4_CONFIG": {"gemv_programs_per_sm": 12}}]' \
        OUT=$OUT python3 benchmarks/engine_gemv_ab.py [--model DIR] [--batches 1,2] \
        [--rounds 3] [--quantization fp8] [--trace]

--trace adds each kernel role's share of the forward per variant and batch (`_trace`):
which layer a GEMV change moved, and what the rest of the step costs.

Output: a table (median of each variant's rounds, and every round) and
$OUT/engine_gemv_ab.json. The first variant is the reference for `same_tokens`: each
variant's greedy next tokens at batch B from the same decode state (a variant that only
moves loads gives the same; one that sums in another order may flip a near-tie of the
random-weight model), and for `same_bits`: the forward's output equal bit for bit in
every round, replayed with this step's new keys and values poisoned first
(`_poison_new_slots`), so a kernel that reads them too early shows; and
`output_off_reference`, how far (max |difference| over max |reference|) a variant that
sums in another order moved that output."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import graph_ms, log  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/pagefleet-bench"))
# run_quant.sh writes the AWQ checkpoint to /dev/shm where it has room, else /tmp
AWQ_DIR = os.environ.get("PAGEFLEET_BENCH_AWQ") or next(
    (d for d in ("/dev/shm/qwen2.5-7b-random-awq", "/tmp/qwen2.5-7b-random-awq")
     if Path(d, "config.json").exists()), "/tmp/qwen2.5-7b-random-awq")
CONFIGS = ("W4_CONFIG", "FP8_CONFIG", "DECODE_CONFIG", "ROTARY_CONFIG", "NORM_CONFIG")


def _config_dicts() -> dict:
    from pagefleet.server.ops import (triton_attention, triton_layernorm, triton_quant,
                                      triton_rotary)
    return {"W4_CONFIG": triton_quant.W4_CONFIG, "FP8_CONFIG": triton_quant.FP8_CONFIG,
            "DECODE_CONFIG": triton_attention.DECODE_CONFIG,
            "ROTARY_CONFIG": triton_rotary.ROTARY_CONFIG,
            "NORM_CONFIG": triton_layernorm.NORM_CONFIG}


_PROCESS: dict = {}   # the process's PDL mode and eager roles, read before any variant
_ABLATE: set[str] = set()   # the current variant's kernels left out ("ABLATE")
_ROLES_ABLATABLE = {"rmsnorm": ("triton_layernorm", ("_rms_norm_kernel",)),
                    # at one row the q/k/v sum is deferred: its rotary is the second kernel
                    "rotary": ("triton_rotary", ("_rotary_store_kernel",
                                                 "_rotary_store_deferred_kernel")),
                    "merge": ("triton_attention", ("_decode_reduce_kernel",))}


class _Ablatable:
    """A kernel whose launches are skipped while its role (or "role@tag", the layer half
    it runs in) is in _ABLATE: the forward's time without it, an upper bound on what
    fusing it into a neighbour could save (the outputs are then wrong)."""

    def __init__(self, role: str, kernel) -> None:
        self.role, self.kernel = role, kernel

    def __getitem__(self, grid):
        from pagefleet.server.ops import triton_common
        if self.role in _ABLATE or f"{self.role}@{triton_common.OP_TAG}" in _ABLATE:
            return lambda *a, **k: None
        return self.kernel[grid]


def _install_hooks() -> None:
    """The layer halves tag their launches (triton_common.OP_TAG: "in" for the input norm,
    q/k/v and rotary, "out" for o, the second norm and the MLP) so a variant can name
    one of the two norms; the ablatable kernels wrapped."""
    import importlib

    from pagefleet.server.models import decoder
    from pagefleet.server.ops import triton_common

    def tagged(fn, tag):
        def run(*a, **k):
            triton_common.OP_TAG = tag
            try:
                return fn(*a, **k)
            finally:
                triton_common.OP_TAG = ""
        return run
    for cls in vars(decoder).values():
        if isinstance(cls, type) and hasattr(cls, "attn_in") and hasattr(cls, "attn_out"):
            cls.attn_in = tagged(cls.attn_in, "in")
            cls.attn_out = tagged(cls.attn_out, "out")
    for role, (mod, names) in _ROLES_ABLATABLE.items():
        m = importlib.import_module(f"pagefleet.server.ops.{mod}")
        for name in names:
            setattr(m, name, _Ablatable(role, getattr(m, name)))


def _apply(variant: dict, shipped: dict) -> None:
    """The shipped configs with the variant's keys over them. "PDL": a PAGEFLEET_PDL mode
    ("0", "1", "early", "eager") for this variant's launches instead of the process's;
    "PDL_EAGER": kernel roles released before their wait (triton_common.EAGER_OPS, e.g.
    ["merge", "rmsnorm@out"]); "ABLATE": kernel roles left out (`_Ablatable`)."""
    from pagefleet.server.ops import triton_common
    extra = {"PDL", "PDL_EAGER", "ABLATE"}
    unknown = set(variant) - set(CONFIGS) - extra
    if unknown:
        raise SystemExit(f"variant keys must be among {CONFIGS} or {sorted(extra)}, "
                         f"got {sorted(unknown)}")
    if not _PROCESS:
        _PROCESS.update(pdl=triton_common.pdl(), eager=set(triton_common.EAGER_OPS))
        _install_hooks()
    modes = {"0": triton_common.PDL_OFF, "1": triton_common.PDL_WAIT,
             "early": triton_common.PDL_EARLY, "eager": triton_common.PDL_EAGER}
    triton_common._PDL = modes[variant["PDL"]] if "PDL" in variant else _PROCESS["pdl"]
    triton_common.EAGER_OPS.clear()
    triton_common.EAGER_OPS.update(variant.get("PDL_EAGER", _PROCESS["eager"]))
    bad = set(r.split("@")[0] for r in variant.get("ABLATE", ())) - set(_ROLES_ABLATABLE)
    if bad:
        raise SystemExit(f"ABLATE roles must be among {sorted(_ROLES_ABLATABLE)}, "
                         f"got {sorted(bad)}")
    _ABLATE.clear()
    _ABLATE.update(variant.get("ABLATE", ()))
    for name, cfg in _config_dicts().items():
        cfg.clear()
        cfg.update(shipped[name])
        bad = set(variant.get(name, {})) - set(cfg)
        if bad:
            raise SystemExit(f"{name} has no keys {sorted(bad)}")
        cfg.update(variant.get(name, {}))
    from pagefleet.server.ops import triton_quant
    errors = triton_quant.plan_key_errors(triton_quant.W4_CONFIG)
    if errors:   # else the variant would time the shipped kernel under its own name
        raise SystemExit(f"variant {json.dumps(variant)[:200]}: {'; '.join(errors)}")


def _decode_state(llm, batch: int, prompt_len: int, seed: int) -> list[str]:
    """`batch` requests past their prefill, so the runner's static decode buffers hold a
    real batch-`batch` step (what `_decode_forward` reads)."""
    from pagefleet.server import SamplingParams
    eng = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)   # stays in decode
    ids = [f"ab{batch}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, [rng.randrange(0, 150000) for _ in range(prompt_len)], params)
    while any(len(eng.scheduler.requests[r].output_token_ids) < 2 for r in ids):
        eng.step()
    return ids


def _time_variant(runner, batch: int, ctx: int):
    """(ms of one decode forward replayed from a graph of its own, its greedy next tokens,
    its output). The output is a replay of a graph captured here after this step's new
    keys and values were overwritten with NaN in every layer's cache: a kernel that read
    them before the kernel writing them had finished (a PDL race) gives NaN or other
    bits than the reference variant."""
    import torch
    pad = next(b for b in runner._decode_sizes if b >= batch)
    width = runner._graph_width(pad, ctx)
    with torch.inference_mode():
        # the deferred one-row sums' rows (ops/deferred.py; inference tensors): a reader
        # an ablation skipped, or a variant that raised, left one armed
        for mod in runner.model.modules():
            slot = getattr(mod, "deferred", None)
            if slot is not None and slot.acc is not None:
                slot.acc.zero_()
        ms = graph_ms(lambda: runner._decode_forward(pad, width), reps=1, n=50)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = runner._decode_forward(pad, width)
        _poison_new_slots(runner, pad)
        g.replay()
        torch.cuda.synchronize()
        hidden = out[:batch].clone()
        tokens = runner.model.compute_logits(hidden).argmax(-1).tolist()
    return ms, tokens, hidden


def _poison_new_slots(runner, pad: int) -> None:
    """NaN into the cache slots this decode step writes (every layer, keys and values)."""
    slots = runner._g_tok[2, :pad].long()
    slots = slots[slots >= 0]
    for mod in runner.model.modules():
        for name in ("k_cache", "v_cache"):
            cache = getattr(mod, name, None)
            if cache is not None and hasattr(cache, "view") and cache.dim() == 4:
                cache.view(-1, *cache.shape[2:])[slots] = float("nan")


# a decode forward's kernels by role; the GEMVs (one kernel name) take their layer role from
# their order in the layer
_ROLES = (("_rms_norm", "rmsnorm"), ("_rotary", "rotary+kv store"),
          ("_decode_reduce", "attn merge"), ("_decode_kernel", "attention"),
          ("_silu", "silu_and_mul"))
_GEMV_ROLES = ("qkv", "o", "gate_up", "down")


def _trace(runner, batch: int, ctx: int, reps: int = 5) -> dict:
    """Each kernel role's cost in one decode forward replayed from a graph: the time from
    the end of the kernel before to its own end (under PDL a kernel starts early and
    waits, so its duration overlaps the one before; the ends do not), summed per step,
    and the role's number of kernels. From a chrome trace of `reps` replays."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile
    pad = next(b for b in runner._decode_sizes if b >= batch)
    width = runner._graph_width(pad, ctx)
    with torch.inference_mode():
        runner._decode_forward(pad, width)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            runner._decode_forward(pad, width)
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per = len(kernels) // reps
    cost: dict[str, float] = {}
    count: dict[str, int] = {}
    for rep in range(reps):
        run = kernels[rep * per:(rep + 1) * per]
        gemvs = 0
        prev_end = run[0]["ts"]
        for e in run:
            name = e["name"]
            if "gemv" in name or "gemm" in name:
                role = "gemv " + _GEMV_ROLES[gemvs % 4]
                gemvs += 1
            else:
                role = next((label for key, label in _ROLES if key in name), "other")
            end = e["ts"] + e["dur"]
            cost[role] = cost.get(role, 0.0) + max(0.0, end - prev_end) / reps
            count[role] = count.get(role, 0) + (rep == 0)
            prev_end = max(prev_end, end)
    total = sum(cost.values())
    return {"step_us": round(total, 1), "roles": {k: {"us": round(v, 1), "kernels": count[k]}
                                                  for k, v in sorted(cost.items(),
                                                                     key=lambda x: -x[1])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=AWQ_DIR, help="checkpoint (default: run_quant's AWQ)")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 for a bf16 checkpoint")
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--trace", action="store_true",
                    help="also each kernel role's cost a step, per variant (_trace)")
    args = ap.parse_args()
    variants = json.loads(os.environ.get("ENGINE_AB_VARIANTS", "[{}]"))
    import torch

    from pagefleet.server import LLM
    if not torch.cuda.is_available():
        raise SystemExit("engine_gemv_ab.py times CUDA graphs: it needs a GPU")
    OUT.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, max_model_len=4096, max_num_seqs=64, quantization=args.quantization)
    runner = llm.engine.runner
    shipped = {name: dict(cfg) for name, cfg in _config_dicts().items()}
    rows: list[dict] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = _decode_state(llm, batch, args.prompt_len, seed=batch)
        ctx = max(len(llm.engine.scheduler.requests[r].all_token_ids) for r in ids)
        times: dict[int, list[float]] = {i: [] for i in range(len(variants))}
        tokens: dict[int, list[int]] = {}
        same_bits: dict[int, bool] = {}
        off: dict[int, float] = {}    # max |output - reference| / max |reference|
        failed: dict[int, str] = {}   # a variant that raised is left out after (its error)
        ref = None
        for rnd in range(args.rounds):
            for i, var in enumerate(variants):
                if i in failed:
                    continue
                _apply(var, shipped)
                try:
                    ms, tok, hidden = _time_variant(runner, batch, ctx)
                except Exception as e:  # noqa: BLE001 - one variant's failure ends only it
                    failed[i] = repr(e)[:300]
                    log(f"B={batch} round {rnd} {json.dumps(var) or 'shipped'}: FAILED {failed[i]}")
                    continue
                times[i].append(ms)
                tokens.setdefault(i, tok)
                ref = hidden if ref is None else ref
                same_bits[i] = same_bits.get(i, True) and bool(torch.equal(hidden, ref))
                off[i] = max(off.get(i, 0.0), ((hidden.float() - ref.float()).abs().max()
                                               / ref.float().abs().max()).item())
                log(f"B={batch} round {rnd} {json.dumps(var) or 'shipped'}: {ms:.4f} ms")
        traces = {}
        if args.trace:
            for i, var in enumerate(variants):
                if i in failed:
                    continue
                _apply(var, shipped)
                try:
                    traces[i] = _trace(runner, batch, ctx)
                except Exception as e:  # noqa: BLE001 - the timings above still stand
                    traces[i] = {"error": repr(e)[:300], "roles": {}, "step_us": 0.0}
                log(f"B={batch} {json.dumps(var) or 'shipped'} trace {json.dumps(traces[i])}")
        _apply({}, shipped)
        for i, var in enumerate(variants):
            if i in failed:
                rows.append({"batch": batch, "variant": var or "shipped", "error": failed[i],
                             "median_ms": float("nan"), "rounds_ms": times[i],
                             "same_tokens": False, "same_bits": False, "trace": None})
                continue
            rows.append({"batch": batch, "variant": var or "shipped",
                         "median_ms": statistics.median(times[i]), "rounds_ms": times[i],
                         "same_tokens": tokens[i] == tokens.get(0), "same_bits": same_bits[i],
                         "output_off_reference": off[i],
                         "trace": traces.get(i)})
        for r in ids:
            llm.engine.abort_request(r)
        (OUT / "engine_gemv_ab.json").write_text(json.dumps({"rows": rows}, indent=1))
    for r in rows:
        print(f"B={r['batch']:<3} {json.dumps(r['variant'])[:80]:80s} {r['median_ms']:.4f} ms  "
              f"rounds {' '.join(f'{x:.4f}' for x in r['rounds_ms'])}  "
              f"same tokens {r['same_tokens']} same bits {r['same_bits']}"
              + (f" off {r['output_off_reference']:.1e}" if "output_off_reference" in r else "")
              + (f"  FAILED {r['error']}" if "error" in r else ""))
        if r["trace"]:
            print("      " + "  ".join(f"{k} {v['us']:.0f}us/{v['kernels']}"
                                       for k, v in r["trace"]["roles"].items())
                  + f"  (sum {r['trace']['step_us']:.0f} us)")


if __name__ == "__main__":
    main()
