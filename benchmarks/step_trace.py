"""Where does a closed-loop serving run lose GPU time? (issue 9)

The online 64-user run is a closed loop: each user sends its next request when the last
one ends, so most steps decode 64 rows and every few steps one or two 512-token prompts
join (a mixed step, run eagerly). This replays that loop at the engine level (no HTTP,
the server's hold rule on) and records, for every step, CUDA events around its forward
and its sampling and the host time of its launch. From them:

- GPU busy time per step kind (decode from a CUDA graph, mixed or eager);
- the GPU's idle gap before each step's forward: the host was late with it (its own
  launch, or the resolve and scheduling before it, ran longer than the step ahead);
- out tokens/s over the loop, to set beside the online figure of the same shapes.

    OUT=$OUT python3 benchmarks/step_trace.py [PHASES]   (default: u64,prefix)

Phases: u64 (64 users, 512 in / 256 out), prefix (64 users, a 1,536-token prompt shared
by all + 64 own, 128 out), decode_sweep (the decode kernel at the prefix workload's
context, ~1.7K, B = 64..128, shared and distinct blocks, by split), decode_plan (tokens
per split by batch 1..64 and context 900 / 1,700 / 6,000 at the graphs' widths). The model is
benchmarks/build_model.py's (PAGEFLEET_BENCH_MODEL). Results: $OUT/trace_<phase>.json.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import phase_runner  # noqa: E402
from phase_runner import log  # noqa: E402
OUT = Path(os.environ.get("OUT", "/tmp/pagefleet-trace"))
BIG = Path(os.environ.get("PAGEFLEET_BENCH_MODEL", "/dev/shm/qwen2.5-7b-random"))
FLAGS = dict(max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9)


class Tracer:
    """CUDA events around each launched step's forward (start) and sampling (end)."""

    def __init__(self, core) -> None:
        import torch
        self.torch = torch
        self.steps: list[dict] = []
        self.on = False
        runner, orig_exec, orig_sample = core.runner, core.runner.execute, core._sample

        def execute(step):
            if not self.on:
                return orig_exec(step)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            t0 = time.perf_counter()
            out = orig_exec(step)
            self.steps.append({"tokens": step.num_tokens, "decodes": step.num_decodes,
                               "padded": step.padded, "launch_ms": 1e3 * (time.perf_counter() - t0),
                               "ev0": ev})
            return out

        def sample(launched):
            orig_sample(launched)
            if self.on and self.steps and "ev1" not in self.steps[-1]:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.steps[-1]["ev1"] = ev

        runner.execute = execute
        core._sample = sample

    def summary(self) -> dict:
        self.torch.cuda.synchronize()
        rows, prev = [], None
        for s in self.steps:
            if "ev1" not in s:
                continue
            kind = "graph" if s["padded"] else ("mixed" if s["tokens"] > s["decodes"] else "eager")
            r = {"kind": kind, "tokens": s["tokens"], "launch_ms": s["launch_ms"],
                 "gpu_ms": s["ev0"].elapsed_time(s["ev1"]),
                 "gap_ms": prev["ev1"].elapsed_time(s["ev0"]) if prev is not None else 0.0}
            rows.append(r)
            prev = s
        out: dict = {"steps": len(rows)}
        for kind in ("graph", "mixed", "eager"):
            sel = [r for r in rows if r["kind"] == kind]
            if not sel:
                continue
            out[kind] = {
                "count": len(sel),
                "gpu_ms_median": statistics.median(r["gpu_ms"] for r in sel),
                "gpu_ms_sum": sum(r["gpu_ms"] for r in sel),
                "launch_ms_median": statistics.median(r["launch_ms"] for r in sel),
                "launch_ms_p90": sorted(r["launch_ms"] for r in sel)[int(0.9 * (len(sel) - 1))],
                "gap_before_ms_sum": sum(r["gap_ms"] for r in sel),
                "gap_before_ms_median": statistics.median(r["gap_ms"] for r in sel),
                "tokens_median": statistics.median(r["tokens"] for r in sel)}
        # The step after a mixed one: is the gap there (the host resolved/scheduled late)?
        after = [rows[i + 1]["gap_ms"] for i in range(len(rows) - 1) if rows[i]["kind"] == "mixed"]
        if after:
            out["gap_after_mixed_ms_sum"] = sum(after)
        out["gpu_busy_ms"] = sum(r["gpu_ms"] for r in rows)
        out["gap_ms_total"] = sum(r["gap_ms"] for r in rows)
        out["sample"] = rows[40:70]
        return out


def closed_loop(eng, users: int, total: int, make, max_tokens: int, tag: str,
                tracer: Tracer | None) -> dict:
    """`users` requests in flight; each finished one is replaced until `total` ran."""
    from pagefleet.server import SamplingParams
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind="delta")
    sent = 0
    for _ in range(users):
        eng.add_request(f"{tag}-{sent}", make(sent), p)
        sent += 1
    if tracer is not None:
        tracer.steps.clear()
        tracer.on = True
    t0 = time.perf_counter()
    out_tokens = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            out_tokens += len(o.outputs[0].token_ids) if o.outputs else 0
            if o.finished and sent < total:
                eng.add_request(f"{tag}-{sent}", make(sent), p)
                sent += 1
    wall = time.perf_counter() - t0
    res = {"requests": sent, "wall_s": wall, "out_tokens": out_tokens,
           "out_tok_s": out_tokens / wall}
    if tracer is not None:
        tracer.on = False
        res["trace"] = tracer.summary()
    log(f"{tag}: {json.dumps({k: v for k, v in res.items() if k != 'trace'})}")
    if tracer is not None:
        log(f"{tag} trace: {json.dumps({k: v for k, v in res['trace'].items() if k != 'sample'})}")
    return res


def _engine():
    from pagefleet.server import LLM
    from pagefleet.server.engine.core import HOLD_AFTER_PROMPT_TOKENS
    llm = LLM(str(BIG), max_model_len=8192, **FLAGS)
    eng = llm.engine
    eng.core.hold_after_prompt_tokens = HOLD_AFTER_PROMPT_TOKENS   # as `pagefleet serve`
    return eng


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 151000) for _ in range(n)]


def phase_u64() -> dict:
    eng = _engine()
    tracer = Tracer(eng.core)
    res = {}
    rng = random.Random(1)
    res["warm"] = closed_loop(eng, 64, 96, lambda i: rand_tokens(rng, 512), 256, "warm", None)
    rng2 = random.Random(2)
    res["run"] = closed_loop(eng, 64, 320, lambda i: rand_tokens(rng2, 512), 256, "u64", tracer)
    return res


def phase_prefix() -> dict:
    eng = _engine()
    tracer = Tracer(eng.core)
    res = {}
    rng = random.Random(3)
    warm_sys = rand_tokens(rng, 1536)
    res["warm"] = closed_loop(eng, 64, 96, lambda i: warm_sys + rand_tokens(rng, 64), 128,
                              "pwarm", None)
    run_sys = rand_tokens(rng, 1536)
    res["run"] = closed_loop(eng, 64, 448, lambda i: run_sys + rand_tokens(rng, 64), 128,
                             "prefix", tracer)
    return res


def phase_decode_sweep() -> dict:
    """The decode kernel at ~1.7K context: each batch with the split the engine plans,
    forced splits and none; block tables shared (the prefix workload: one 1,536-token
    prefix in the same blocks) and distinct."""
    import torch
    from gpu_bench import graph_ms
    from pagefleet.server.ops import triton_attention as ta
    hq, hk, d, bs = 28, 4, 128, 16
    base = dict(ta.DECODE_CONFIG)
    res = []
    for shared in (True, False):
        for batch in (64, 72, 96, 128):
            nblk = 1760 // bs
            nb = batch * nblk + 8
            kc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
            bt = torch.randperm(nb - 8, device="cuda")[:batch * nblk].view(batch, nblk).int()
            if shared:
                bt[:, :96] = bt[0, :96]
            bt = torch.cat([bt, torch.zeros(batch, 128 - nblk, dtype=torch.int32, device="cuda")], 1)
            ctx = torch.randint(1600, 1760, (batch,), dtype=torch.int32, device="cuda")
            q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            kv_bytes = int(ctx.sum().item()) * hk * d * 2 * 2
            for label, over in (("plan", {}), ("none", {"target_programs": 1}),
                                ("p256", {"target_programs": 1 << 20, "split_programs": 1, "min_partition": 256, "max_partition": 256}),
                                ("p512", {"target_programs": 1 << 20, "split_programs": 1, "min_partition": 512, "max_partition": 512}),
                                ("p1024", {"target_programs": 1 << 20, "split_programs": 1, "min_partition": 1024, "max_partition": 1024}),
                                ("p512w4", {"target_programs": 1 << 20, "split_programs": 1, "min_partition": 512, "max_partition": 512, "num_warps": 4}),
                                ("nonew4", {"target_programs": 1, "num_warps": 4})):
                ta.DECODE_CONFIG.update(over)
                try:
                    ms = graph_ms(lambda: ta.paged_decode_attention(q, kc, vc, bt, ctx, d ** -0.5))
                except Exception as e:  # noqa: BLE001
                    ms = float("nan")
                    log(f"{label}: {e!r}")
                ta.DECODE_CONFIG.clear()
                ta.DECODE_CONFIG.update(base)
                row = {"shared": shared, "batch": batch, "variant": label, "ms": ms,
                       "GBps_logical": kv_bytes / (ms / 1e3) / 1e9 if ms == ms else None}
                log(f"decode {row}")
                res.append(row)
    return {"rows": res, "config": base}


def phase_decode_plan() -> dict:
    """Tokens per split for the decode kernel by batch and context, at the block-table
    widths the decode graphs use (2K and 8K buckets): the engine's plan against fixed
    partitions and no split, distinct blocks per row."""
    import torch
    from gpu_bench import graph_ms
    from pagefleet.server.ops import triton_attention as ta
    hq, hk, d, bs = 28, 4, 128, 16
    base = dict(ta.DECODE_CONFIG)
    res = []
    for batch in (1, 4, 16, 32, 48, 64):
        for ctx_len, width in ((900, 2048), (1700, 2048), (6000, 8192)):
            nblk = -(-ctx_len // bs)
            nb = batch * nblk + 8
            kc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
            bt = torch.randperm(nb - 8, device="cuda")[:batch * nblk].view(batch, nblk).int()
            bt = torch.cat([bt, torch.zeros(batch, width // bs - nblk, dtype=torch.int32,
                                            device="cuda")], 1)
            ctx = torch.full((batch,), ctx_len, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            plan = ta.decode_plan(batch, hk, width, q.device)
            row = {"batch": batch, "ctx": ctx_len, "width": width, "plan": str(plan)}
            for part in ("plan", 128, 256, 512, 1024, 2048, "none"):
                if part == "plan":
                    over = {}
                elif part == "none":
                    over = {"target_programs": 1}
                else:   # exactly `part` tokens per split
                    over = {"target_programs": 1 << 20, "split_programs": 1,
                            "min_partition": part, "max_partition": part}
                ta.DECODE_CONFIG.update(over)
                try:
                    row[str(part)] = round(1e3 * graph_ms(
                        lambda: ta.paged_decode_attention(q, kc, vc, bt, ctx, d ** -0.5)), 2)
                except Exception as e:  # noqa: BLE001
                    row[str(part)] = repr(e)[:80]
                ta.DECODE_CONFIG.clear()
                ta.DECODE_CONFIG.update(base)
            times = {k: v for k, v in row.items() if k in ("128", "256", "512", "1024", "2048", "none")
                     and isinstance(v, float)}
            row["best"] = min(times, key=times.get) if times else None
            log(f"decode_plan (us) {row}")
            res.append(row)
    return {"rows": res, "config": base}


PHASES = {"u64": (phase_u64, 240), "prefix": (phase_prefix, 240),
          "decode_sweep": (phase_decode_sweep, 200), "decode_plan": (phase_decode_plan, 200)}


def main() -> None:
    phase_runner.main(__file__, PHASES, OUT, "trace", ["u64", "prefix"])


if __name__ == "__main__":
    main()
