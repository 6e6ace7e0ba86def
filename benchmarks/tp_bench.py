"""Tensor parallelism on GPUs: the TP=1 path unchanged, and TP=N ready for a multi-GPU
node. See benchmarks/README.md ("Tensor parallel") for the exact `run` commands.

Phases (each in its own process, like gpu_bench.py; `--tp 1,2` picks the sizes):
- `nccl` (needs >= 2 GPUs): pagefleet's NCCL binding (`distributed/pynccl.py`) across
  `--nccl-world` processes: all-reduce correctness (eager and replayed from a CUDA
  graph with fresh inputs), broadcast and gather, then all-reduce latency/bandwidth at
  the decode sizes of a Qwen2.5-7B (B x 3584 bf16) and at 16-256 MiB (bus bandwidth as
  nccl-tests counts it), eager and inside a graph;
- `build`: the Qwen2.5-7B-shaped random bf16 checkpoint (gpu_bench's);
- `engine-tpN`: `LLM(..., tensor_parallel_size=N)` in bf16: startup log (per-rank and
  total KV), decode step time at B = 1/16/64/256 with 1K context, the offline workload
  (1,024 x 512 in / 256 out). For N = 1 it is gpu_bench's engine measurement (and the
  runner must be the plain one-GPU ModelRunner: no driver, no workers, no collectives);
- `parity32-tpN`: the same model in float32, greedy over 8 prompts (two sharing a
  300-token prefix); the parent compares every N against N = 1 token for token.

Results: $OUT/tp_result.json, $OUT/tp_part_*.json, a table last.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402  (the shared helpers: model build, step timer, offline run)
from gpu_bench import MODEL_DIR, OUT, QWEN7B, StepTimer, log, median_ms  # noqa: E402

MiB = 1 << 20


def write_part(name: str, data: dict) -> None:
    (OUT / f"tp_part_{name}.json").write_text(json.dumps(data, indent=1, default=str))


# -- phase: nccl ---------------------------------------------------------------------------

def nccl_rank(args) -> None:
    """One rank of the NCCL phase (a child process per GPU)."""
    import torch

    from pagefleet.server.distributed.comm import TPGroup, make_store

    rank, n = args.nccl_rank, args.nccl_world
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    store = make_store(rank, n, args.nccl_port, timeout_s=120)
    group = TPGroup(rank, n, store, dev, timeout_s=120)
    res: dict = {"world": n, "backend": group.backend}
    # Correctness: sums, broadcast, gather; then a graph replayed on fresh inputs.
    x = torch.full((1000,), float(rank + 1), device=dev, dtype=torch.bfloat16)
    want = n * (n + 1) / 2
    res["all_reduce_ok"] = bool((group.all_reduce(x) == want).all())
    b = torch.full((77,), rank, device=dev, dtype=torch.int64)
    group.broadcast(b)
    res["broadcast_ok"] = bool((b == 0).all())
    g = group.gather_cat(torch.full((3, 5), float(rank), device=dev), dim=-1)
    if rank == 0:
        res["gather_ok"] = bool(torch.equal(g, torch.arange(n, device=dev).float()
                                            .repeat_interleave(5).expand(3, -1)))
    inp = torch.zeros(4096, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = group.all_reduce(inp)
    ok = True
    for step in range(3):
        inp.fill_(float(rank + step))
        graph.replay()
        torch.cuda.synchronize()
        ok &= bool((out == sum(r + step for r in range(n))).all())
    res["graph_all_reduce_ok"] = ok
    # Timing. Decode sizes: one token row of Qwen2.5-7B's hidden per sequence.
    sizes = {f"decode B={bs}": bs * QWEN7B["hidden"] * 2 for bs in (1, 16, 64, 256)}
    sizes |= {f"{m} MiB": m * MiB for m in (16, 64, 256)}
    res["sizes"] = {}
    for name, nbytes in sizes.items():
        t = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
        eager = median_ms(lambda t=t: group.all_reduce(t), n=30)
        reps = 20 if nbytes < 64 * MiB else 4
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(reps):
                group.all_reduce(t)
        graphed = median_ms(gr.replay, n=10) / reps
        bus = 2 * (n - 1) / n * nbytes / (graphed / 1e3)
        res["sizes"][name] = {"bytes": nbytes, "eager_us": eager * 1e3, "graph_us": graphed * 1e3,
                              "bus_GBps": bus / 1e9}
        gr = t = None   # free the graph's pool before the next size
    # A decode step's worth at B=1: 2 all-reduces per layer + the embedding's.
    per = res["sizes"]["decode B=1"]["graph_us"]
    res["decode_b1_allreduce_us_per_step"] = per * (2 * QWEN7B["layers"] + 1)
    group.close()
    if rank == 0:
        write_part("nccl", res)


def phase_nccl(args) -> dict:
    import torch

    from pagefleet.server.distributed.comm import make_store

    n = min(args.nccl_world or torch.cuda.device_count(), torch.cuda.device_count())
    if n < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU visible; NCCL needs 2 or more"}
    store = make_store(0, 1)          # only to pick a free port for the ranks' own store
    port = store.port
    del store
    procs = [subprocess.Popen([sys.executable, __file__, "--nccl-rank", str(r), "--nccl-world",
                               str(n), "--nccl-port", str(port)]) for r in range(n)]
    codes = [p.wait(timeout=240) for p in procs]
    part = OUT / "tp_part_nccl.json"
    res = json.loads(part.read_text()) if part.exists() else {"error": "rank 0 wrote nothing"}
    res["exit_codes"] = codes
    return res


# -- phase: engine -------------------------------------------------------------------------

def _grab_logs() -> list[str]:
    import logging

    lines: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("pagefleet").addHandler(Grab())
    logging.getLogger("pagefleet").setLevel(logging.INFO)
    return lines


def _rand_prompt_fn(seed: int):
    rng = random.Random(seed)
    return lambda n: [rng.randrange(0, 151600) for _ in range(n)]


def _greedy(n, **kw):
    from pagefleet.server import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _decode(llm, args, rand_prompt) -> dict:
    """Median step time of pure-decode steps at batch B with 1K context (host-timed
    whole steps, as gpu_bench's total_ms: schedule + launch + the previous step's
    read-back, overlapped by async scheduling)."""
    eng = llm.engine
    timer = eng._bench_timer
    out = {}
    for batch in args.decode_batches:
        ids = []
        for k in range(batch):
            rid = f"dec{batch}-{k}"
            eng.add_request(rid, rand_prompt(1024), _greedy(400))
            ids.append(rid)
        while any(len(eng.scheduler.requests[r].output_token_ids) < 1 for r in ids):
            eng.step()
        for _ in range(3):
            eng.step()
        timer.reset()
        for _ in range(args.decode_steps):
            eng.step()
        steps = [s for s in timer.steps if s["batch"] == batch]
        out[batch] = {**StepTimer.summarize(steps), "steps": len(steps)}
        log(f"decode B={batch}: {out[batch]}")
        for r in ids:
            eng.abort_request(r)
        gpu_bench.reset_prefix_cache(eng.kv)
    return out


def phase_engine(args, tp: int) -> dict:
    from pagefleet.server import LLM
    from pagefleet.server.engine.runner import ModelRunner

    lines = _grab_logs()
    t0 = time.time()
    llm = LLM(str(MODEL_DIR), tensor_parallel_size=tp, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization)
    runner = llm.engine.runner
    res: dict = {"tp": tp, "startup_s": time.time() - t0, "startup_log": list(lines),
                 "runner": type(runner).__name__, "kv_blocks": runner.layout.num_blocks,
                 "weights_bytes_rank0": runner.weights_bytes}
    for ln in lines:
        log("startup: " + ln)
    if tp == 1:   # the one-GPU path: exactly the plain runner, nothing distributed
        res["one_gpu_path_plain"] = type(runner) is ModelRunner and runner.tp is None
    else:
        res["parallel"] = {k: v for k, v in llm.engine.core.parallel_info().items()
                           if k != "ranks"}
    write_part(f"engine-tp{tp}", res)
    timer = StepTimer(llm)
    rand_prompt = _rand_prompt_fn(0)
    try:
        res["decode"] = _decode(llm, args, rand_prompt)
    except Exception:
        traceback.print_exc()
        res["decode_error"] = traceback.format_exc()
    write_part(f"engine-tp{tp}", res)
    try:
        gpu_bench._engine_throughput(llm, res, rand_prompt, _greedy, args, timer)
    except Exception:
        traceback.print_exc()
        res["throughput_error"] = traceback.format_exc()
    llm.shutdown()
    return res


def phase_parity32(args, tp: int) -> dict:
    from pagefleet.server import LLM

    t0 = time.time()
    util = 0.45 if tp == 1 else 0.6
    llm = LLM(str(MODEL_DIR), tensor_parallel_size=tp, max_model_len=2048, max_num_seqs=16,
              max_num_batched_tokens=4096, dtype="float32", gpu_memory_utilization=util)
    res: dict = {"tp": tp, "load_s": time.time() - t0}
    rand_prompt = _rand_prompt_fn(7)
    shared = rand_prompt(300)
    prompts = [rand_prompt(n) for n in (1, 17, 100, 513, 1000, 37)]
    prompts += [shared + rand_prompt(n) for n in (5, 60)]
    outs = llm.generate(prompts, _greedy(args.parity_tokens))
    res["tokens"] = [o.outputs[0].token_ids for o in outs]
    res["distinct_tokens_per_seq"] = [len(set(t)) for t in res["tokens"]]
    res["s"] = time.time() - t0
    llm.shutdown()
    return res


# -- driver --------------------------------------------------------------------------------

def phase_list(args) -> list[str]:
    out = []
    for name in args.phases.split(","):
        if name in ("engine", "parity32"):
            out += [f"{name}-tp{n}" for n in args.tp]
        else:
            out.append(name)
    return out


def run_phase(name: str, args) -> None:
    try:
        if name == "nccl":
            data = phase_nccl(args)
        elif name == "build":
            data = gpu_bench.phase_build(args)
        else:
            kind, tp = name.rsplit("-tp", 1)
            data = {"engine": phase_engine, "parity32": phase_parity32}[kind](args, int(tp))
    except Exception:
        traceback.print_exc()
        data = {"error": traceback.format_exc()}
    write_part(name, data)


def compare_parity(result: dict) -> dict:
    base = result.get("parity32-tp1", {}).get("tokens")
    out = {}
    for name, part in result.items():
        if name.startswith("parity32-tp") and name != "parity32-tp1" and "tokens" in part:
            if base is None:
                out[name] = "no TP=1 reference in this run"
                continue
            toks = part["tokens"]
            out[name] = {
                "identical_sequences": sum(a == b for a, b in zip(toks, base)),
                "prompts": len(base),
                "token_match_frac": sum(u == v for a, b in zip(toks, base) for u, v in zip(a, b))
                / max(1, sum(len(b) for b in base)),
                "first_divergence": [next((k for k in range(len(b)) if a[k] != b[k]), None)
                                     for a, b in zip(toks, base)]}
    return out


def print_table(r: dict) -> None:
    print("\n==== pagefleet tensor-parallel benchmark ====")
    n = r.get("nccl", {})
    if "sizes" in n:
        print(f"NCCL over {n['world']} GPUs: all_reduce {n['all_reduce_ok']}, graph replay "
              f"{n['graph_all_reduce_ok']}, broadcast {n['broadcast_ok']}, gather "
              f"{n.get('gather_ok')}")
        for k, v in n["sizes"].items():
            print(f"  all_reduce {k}: eager {v['eager_us']:.1f} us, graph {v['graph_us']:.1f} us, "
                  f"bus {v['bus_GBps']:.0f} GB/s")
    elif n:
        print(f"NCCL: {n.get('skipped') or str(n.get('error'))[-300:]}")
    for name, e in r.items():
        if not name.startswith("engine-tp"):
            continue
        if "error" in e:
            print(f"{name} ERROR: {str(e['error'])[-600:]}")
            continue
        kv = next((ln for ln in e.get("startup_log", []) if ln.startswith("KV cache:")), "")
        print(f"{name}: {e.get('runner')} startup {e.get('startup_s', 0):.0f} s; {kv}"
              + (f"; plain one-GPU path {e['one_gpu_path_plain']}" if "one_gpu_path_plain" in e
                 else ""))
        for b, d in sorted(e.get("decode", {}).items(), key=lambda x: int(x[0])):
            print(f"  decode B={b}: step {d.get('total_ms', float('nan')):.2f} ms")
        t = e.get("throughput")
        if t:
            print(f"  offline {t['requests']}x{t['input_len']}/{t['output_len']}: "
                  f"{t['output_tok_per_s']:.0f} out tok/s ({t['elapsed_s']:.1f} s)")
    for name, c in r.get("parity32_vs_tp1", {}).items():
        print(f"{name} vs TP=1 (float32): {c}")


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", default="nccl,build,engine,parity32")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--parity-tokens", type=int, default=48)
    ap.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 16, 64, 256])
    ap.add_argument("--decode-steps", type=int, default=30)
    ap.add_argument("--nccl-world", type=int, default=0)
    ap.add_argument("--nccl-rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--nccl-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=lambda s: dict(kv.split("=") for kv in s.split(",")),
                    default={})
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.nccl_rank >= 0:
        return nccl_rank(args)
    if args.phase:
        return run_phase(args.phase, args)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:]}
    timeouts = {"nccl": 240, "build": 120, "engine": 300, "parity32": 200}
    timeouts.update({k: int(v) for k, v in args.timeout.items()})
    for name in phase_list(args):
        t0 = time.time()
        log(f"== phase {name}")
        limit = timeouts[name.split("-tp")[0]]
        try:
            subprocess.run([sys.executable, __file__, "--phase", name] + sys.argv[1:],
                           timeout=limit, check=False)
        except subprocess.TimeoutExpired:
            log(f"phase {name} timed out after {limit} s")
        part = OUT / f"tp_part_{name}.json"
        result[name] = json.loads(part.read_text()) if part.exists() else {"error": "no result"}
        result[name]["phase_s"] = time.time() - t0
        result["parity32_vs_tp1"] = compare_parity(result)
        (OUT / "tp_result.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)


if __name__ == "__main__":
    main()
