"""Does launching a GEMM block the host while the GPU is busy? (issue 9)

On 2026-12-02 a mixed engine step (64 decodes + 8,128 prompt tokens) returned only after
about its own GPU time, the host's time spent inside `aten::mm`, while the same step
launched onto an idle GPU returned in 26 ms (BENCHMARKS.md). This isolates the GEMMs from
the engine: one Qwen2.5-7B layer's four projections at M prompt tokens, 28 times over,
launched onto an idle GPU and onto one kept busy by `torch.cuda._sleep`, through classic
cuBLAS and through cuBLASLt, alone and after a CUDA graph replay. For each variant: host
time of the launch loop (no synchronization inside it), the GPU time of the work, the
slowest single launches, and the allocator's device allocations and retries.

    OUT=$OUT python3 benchmarks/host_block.py [PHASES]   (default: gemms)

Phases: gemms, first_use, fresh_cublas, fresh_cublaslt, kernels, lt_vs_classic,
engine_coverage (benchmarks/README.md says what each measures).

Found on 2026-12-02 (second call): the engine's one blocked launch is the lm_head GEMM
at an M not seen before (79, 92, 107 sampling rows), not the big GEMMs. `first_use`
launches lm_head- and MLP-shaped GEMMs at new and repeated M onto a busy GPU (is it a
first-use cost, such as loading a kernel's module, which waits for the device?);
`kernels` lists which cuBLAS kernel each M gets (how many a warm-up must cover).
Results in $OUT/host_block*.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp/pagefleet-host-block"))
H, I, QKV, LAYERS = 3584, 18944, 4608, 28


def weights(dev):
    g = torch.Generator(device=dev).manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02)
    return {"qkv": w(QKV, H), "qkv_b": torch.zeros(QKV, device=dev, dtype=torch.bfloat16),
            "o": w(H, H), "gate_up": w(2 * I, H), "down": w(H, I)}


def layer(x, W, timings):
    """One layer's GEMMs as the engine issues them (F.linear: addmm with the qkv bias,
    mm for the rest), each launch timed on the host."""
    def t(fn):
        a = time.perf_counter()
        r = fn()
        timings.append(time.perf_counter() - a)
        return r
    F = torch.nn.functional
    qkv = t(lambda: F.linear(x, W["qkv"], W["qkv_b"]))
    o = t(lambda: F.linear(qkv[:, :H], W["o"]))
    gu = t(lambda: F.linear(o, W["gate_up"]))
    d = t(lambda: F.linear(gu[:, :I], W["down"]))
    return d


def run(x, W, busy_ms: float, graph=None) -> dict:
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    if busy_ms:
        torch.cuda._sleep(int(busy_ms * 1.9e6))   # ~1.9 GHz: cycles for busy_ms
    if graph is not None:
        graph.replay()
    timings: list[float] = []
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    h = x
    for _ in range(LAYERS):
        h = layer(h, W, timings)
    b.record()
    host_ms = 1e3 * (time.perf_counter() - t0)
    b.synchronize()
    stats1 = torch.cuda.memory_stats()
    slow = sorted(range(len(timings)), key=lambda i: -timings[i])[:5]
    return {"host_ms": round(host_ms, 2), "gpu_ms": round(a.elapsed_time(b), 2),
            "slowest_launches": [(i, ["qkv", "o", "gate_up", "down"][i % 4],
                                  round(1e3 * timings[i], 3)) for i in slow],
            "device_allocs": stats1["num_device_alloc"] - stats0["num_device_alloc"],
            "alloc_retries": stats1["num_alloc_retries"] - stats0["num_alloc_retries"]}


def busy_launch_ms(fn, busy_ms: float = 40) -> float:
    """Host time of one launch of fn while the GPU works through busy_ms of sleep."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(busy_ms * 1.9e6))
    t0 = time.perf_counter()
    fn()
    ms = 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(ms, 3)


def first_use() -> dict:
    dev = torch.device("cuda")
    F = torch.nn.functional
    head = torch.randn(152064, H, device=dev, dtype=torch.bfloat16) * 0.02
    gu = torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(8192, H, device=dev, dtype=torch.bfloat16)
    res: dict = {"CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING")}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, w, ms in (("lm_head", head, (79, 92, 79, 107, 16, 16, 200, 200, 131, 131, 33, 33)),
                            ("gate_up", gu, (6224, 6224, 2668, 2668, 7999, 7999, 1100, 1100))):
            rows = []
            for m in ms:
                rows.append((m, busy_launch_ms(lambda: F.linear(x[:m], w))))
            res[f"{lib}/{name}"] = rows
            print(f"first_use {res['CUDA_MODULE_LOADING']} {lib:9s} {name:8s} (M, host ms): {rows}",
                  flush=True)
    # After running every M once (a warm-up over all of them), are new launches free?
    torch.backends.cuda.preferred_blas_library("cublas")
    t0 = time.perf_counter()
    for m in range(1, 513):
        F.linear(x[:m], head)
    torch.cuda.synchronize()
    res["warm_all_lm_head_s"] = round(time.perf_counter() - t0, 2)
    res["after_warm_lm_head"] = [(m, busy_launch_ms(lambda: F.linear(x[:m], head)))
                                 for m in (3, 45, 77, 150, 255, 300, 511)]
    print(f"first_use after warming M=1..512 ({res['warm_all_lm_head_s']} s): "
          f"{res['after_warm_lm_head']}", flush=True)
    return res


def first_use_fresh(lib: str) -> dict:
    """In a process that has run no GEMM yet: per M, the host time of a launch onto a busy
    GPU through `lib` only. M values that share a kernel (lm_head 73-80, 9-16: see
    `kernels`) tell a per-kernel first use (a kernel's module loaded lazily) from a
    per-shape one."""
    dev = torch.device("cuda")
    torch.empty(1, device=dev)
    torch.backends.cuda.preferred_blas_library(lib)
    F = torch.nn.functional
    head = torch.randn(152064, H, device=dev, dtype=torch.bfloat16) * 0.02
    gu = torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(8192, H, device=dev, dtype=torch.bfloat16)
    res = {"lib": lib, "backend_now": str(torch.backends.cuda.preferred_blas_library())}
    res["lm_head"] = [(m, busy_launch_ms(lambda: F.linear(x[:m], head)))
                      for m in (79, 74, 76, 80, 79, 81, 88, 16, 9, 12, 16, 200, 201, 300)]
    res["gate_up"] = [(m, busy_launch_ms(lambda: F.linear(x[:m], gu)))
                      for m in (2668, 2667, 2669, 2600, 2668, 1100, 1101, 1088, 5000, 5001)]
    print(f"fresh {lib} ({res['backend_now']}): lm_head {res['lm_head']}\n"
          f"fresh {lib}: gate_up {res['gate_up']}", flush=True)
    return res


def lt_vs_classic() -> dict:
    """GPU time of one step's linear layers (28 x the four projections) plus lm_head per M,
    classic cuBLAS against cuBLASLt (graph-replayed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_bench import graph_ms
    dev = torch.device("cuda")
    F = torch.nn.functional
    W = weights(dev)
    head = torch.randn(152064, H, device=dev, dtype=torch.bfloat16) * 0.02
    res = {}
    for m in (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        row = {}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            xh = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
            xi = torch.randn(m, I, device=dev, dtype=torch.bfloat16)
            reps = 3 if m >= 2048 else 10
            t = (graph_ms(lambda: F.linear(xh, W["qkv"], W["qkv_b"]), reps=reps, n=10)
                 + graph_ms(lambda: F.linear(xh, W["o"]), reps=reps, n=10)
                 + graph_ms(lambda: F.linear(xh, W["gate_up"]), reps=reps, n=10)
                 + graph_ms(lambda: F.linear(xi, W["down"]), reps=reps, n=10))
            hd = graph_ms(lambda: F.linear(xh[:min(m, 256)], head), reps=reps, n=10)
            row[lib] = round(LAYERS * t + hd, 3)
        res[m] = row
        print(f"linears per step M={m:5d}: cublas {row['cublas']:8.3f} ms  cublaslt "
              f"{row['cublaslt']:8.3f} ms  ({row['cublaslt'] / row['cublas']:.3f}x)", flush=True)
    return res


def engine_coverage() -> dict:
    """After the engine's startup (with server/engine/gemm_warmup.py's sweep): launches of
    layer 0's projections and lm_head at random token / row counts onto a busy GPU. A
    launch that takes > 5 ms waited for the device: a kernel the sweep missed."""
    import logging
    import random
    from pagefleet.server import LLM
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_dir = os.environ.get("PAGEFLEET_BENCH_MODEL", "/dev/shm/qwen2.5-7b-random")
    t0 = time.perf_counter()
    llm = LLM(model_dir, max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=8192,
              gpu_memory_utilization=0.9)
    load_s = time.perf_counter() - t0
    model = llm.engine.core.runner.model
    layer = model.layers[0]
    projs = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
             "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
    head = model.head_weight
    dev = head.device
    x = torch.randn(8192, I, device=dev, dtype=head.dtype)
    rng = random.Random(7)
    blocked, n = [], 0
    with torch.inference_mode():
        for m in [rng.randint(1, 8192) for _ in range(150)]:
            for name, pj in projs.items():
                ms = busy_launch_ms(lambda: pj(x[:m, :pj.input_size_per_partition]), busy_ms=20)
                n += 1
                if ms > 5:
                    blocked.append((name, m, ms))
        for m in [rng.randint(1, 256) for _ in range(100)]:
            ms = busy_launch_ms(lambda: torch.nn.functional.linear(x[:m, :H], head), busy_ms=20)
            n += 1
            if ms > 5:
                blocked.append(("lm_head", m, ms))
    res = {"load_s": round(load_s, 1), "launches": n, "blocked": blocked}
    print(f"engine_coverage: engine up in {load_s:.1f} s; {len(blocked)} of {n} random-shape "
          f"launches waited for the device: {blocked[:20]}", flush=True)
    return res


def kernels() -> dict:
    """cuBLAS kernel per M: lm_head at M = 1..512, gate_up/down at M = 64..8192 step 64."""
    from torch.profiler import ProfilerActivity, profile
    dev = torch.device("cuda")
    F = torch.nn.functional
    head = torch.randn(152064, H, device=dev, dtype=torch.bfloat16) * 0.02
    W = weights(dev)
    x = torch.randn(8192, I, device=dev, dtype=torch.bfloat16)
    res: dict = {}
    for name, w, ms in (("lm_head", head, range(1, 513)),
                        ("gate_up", W["gate_up"], range(64, 8193, 64)),
                        ("down", W["down"], range(64, 8193, 64)),
                        ("o", W["o"], range(64, 8193, 64))):
        k = w.shape[1]
        per_m = {}
        for m in ms:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                F.linear(x[:m, :k], w)
                torch.cuda.synchronize()
            names = [e.name for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA]
            per_m[m] = "|".join(n[:60] for n in names)
        distinct = sorted(set(per_m.values()))
        runs, last = [], None
        for m in ms:   # M ranges sharing a kernel
            if per_m[m] != last:
                runs.append([m, m, distinct.index(per_m[m])])
                last = per_m[m]
            else:
                runs[-1][1] = m
        res[name] = {"distinct": distinct, "runs": runs}
        print(f"kernels {name}: {len(distinct)} distinct over {len(list(ms))} M values, "
              f"{len(runs)} runs: {runs[:40]}", flush=True)
    return res


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    phases = sys.argv[1].split(",") if len(sys.argv) > 1 else ["gemms"]
    if "first_use" in phases:
        (OUT / f"host_block_first_use_{os.environ.get('CUDA_MODULE_LOADING', 'default')}.json"
         ).write_text(json.dumps(first_use(), indent=1))
    if "kernels" in phases:
        (OUT / "host_block_kernels.json").write_text(json.dumps(kernels(), indent=1))
    for lib in ("cublas", "cublaslt"):
        if f"fresh_{lib}" in phases:
            (OUT / f"host_block_fresh_{lib}.json").write_text(json.dumps(first_use_fresh(lib)))
    if "engine_coverage" in phases:
        (OUT / "host_block_engine_coverage.json").write_text(json.dumps(engine_coverage()))
    if "lt_vs_classic" in phases:
        (OUT / "host_block_lt_vs_classic.json").write_text(json.dumps(lt_vs_classic(), indent=1))
    if "gemms" in phases:
        gemms()


def gemms() -> None:
    dev = torch.device("cuda")
    W = weights(dev)
    res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    # A decode-sized graph to replay ahead of the eager launches (the engine's mixed step
    # follows a decode step's graph replay).
    xs = torch.randn(64, H, device=dev, dtype=torch.bfloat16)
    layer(xs, W, [])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(LAYERS):
            layer(xs, W, [])
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for m in (8192, 8128, 4160):
            x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
            run(x, W, 0)   # warm-up: heuristics, workspaces, the allocator's blocks
            for name, busy, graph in (("idle", 0, None), ("busy", 100, None),
                                      ("busy_after_graph", 100, g), ("idle_again", 0, None)):
                r = run(x, W, busy, graph)
                res[f"{lib}/M={m}/{name}"] = r
                print(f"{lib:9s} M={m:5d} {name:17s} host {r['host_ms']:8.2f} ms  gpu "
                      f"{r['gpu_ms']:8.2f} ms  allocs {r['device_allocs']} retries "
                      f"{r['alloc_retries']}  slowest {r['slowest_launches'][:2]}", flush=True)
    (OUT / "host_block.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
