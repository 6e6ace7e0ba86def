"""Online benchmark through a real OpenAI-compatible HTTP server: pagefleet or vLLM.

Starts the server as a subprocess (same model directory, same flags), waits for
/health, then runs closed-loop streaming workloads with one asyncio client (httpx):
`users` workers each send a request as soon as their previous one finished. Prompts
are token ids (no tokenizer differences between servers), outputs are forced with
`ignore_eos`. Every workload first warms up with other random tokens of the same
shapes, so no measured request finds its own prompt in the prefix cache.

Per request: TTFT (first streamed text), TPOT ((E2E - TTFT) / (tokens - 1)), E2E.
Per workload: output tokens/s over the measured phase's wall time, p50/p95s; the mixed
workload reports short and long requests apart.

    python benchmarks/online_bench.py --server pagefleet --model DIR --out results.json
    python benchmarks/online_bench.py --server vllm --model DIR --out results.json

Workloads (names for --workloads):
  u1, u10, u64, u256   N users, 512 in / 256 out
  prefix               64 users, a 1,536-token system prompt shared by all + 64 own
                       tokens, 128 out
  mixed                48 users; 10% long (6,000 in / 256 out), 90% short (96 / 64)
  longdoc              16 users, 16,000-token documents, 128 out
  sampled              64 users, 512/256, Qwen2.5-Instruct's sampling defaults
                       (temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

VOCAB_LO, VOCAB_HI = 10, 151000      # ids clear of Qwen's special tokens
SAMPLED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
GREEDY = {"temperature": 0.0}


@dataclass
class Workload:
    name: str
    users: int
    requests: int
    warmup: int
    make: object                       # (rng, i) -> (prompt ids, max_tokens, kind)
    sampling: dict = field(default_factory=lambda: dict(GREEDY))


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def set_vocab(hi: int) -> None:
    """Draw prompt ids below `hi` (a small local model)."""
    global VOCAB_HI
    VOCAB_HI = hi


def fixed(n_in: int, n_out: int):
    return lambda rng, i: (_rand(rng, n_in), n_out, "all")


def shared_prefix(rng: random.Random):
    system = _rand(rng, 1536)          # one per phase: warm-up and measured differ
    return lambda r, i: (system + _rand(r, 64), 128, "all")


def mixed(rng, i):
    if i % 10 == 3:
        return _rand(rng, 6000), 256, "long"
    return _rand(rng, 96), 64, "short"


def workloads(scale: float) -> dict[str, Workload]:
    def n(x: int) -> int:
        return max(1, int(round(x * scale)))
    return {
        "u1": Workload("u1", 1, n(3), 1, fixed(512, 256)),
        "u10": Workload("u10", 10, n(30), 10, fixed(512, 256)),
        "u64": Workload("u64", 64, n(192), 64, fixed(512, 256)),
        "u256": Workload("u256", 256, n(512), 256, fixed(512, 256)),
        "prefix": Workload("prefix", 64, n(192), 64, None),
        "mixed": Workload("mixed", 48, n(240), 48, mixed),
        "longdoc": Workload("longdoc", 16, n(32), 8, fixed(16000, 128)),
        "sampled": Workload("sampled", 64, n(192), 64, fixed(512, 256), dict(SAMPLED)),
    }


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      max_tokens: int, sampling: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **sampling}
    t0 = time.perf_counter()
    ttft = None
    n_out = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code, "body": (await r.aread())[:300].decode(errors="replace")}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n_out = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices", ()):
                if ch.get("text") and ttft is None:
                    ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    tpot = (e2e - ttft) / (n_out - 1) if ttft is not None and n_out > 1 else None
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "n_out": n_out}


async def _run_jobs(url: str, model: str, wl: Workload, jobs: list, users: int,
                    start_at: float) -> tuple[list[tuple[str, dict]], float, float]:
    """`users` closed-loop workers over `jobs`, from the wall-clock time `start_at`:
    (results, start, end) in time.time()."""
    results: list[tuple[str, dict]] = []
    next_job = 0
    limits = httpx.Limits(max_connections=users + 8, max_keepalive_connections=users + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        async def worker():
            nonlocal next_job
            while next_job < len(jobs):
                prompt, max_tokens, kind = jobs[next_job]
                next_job += 1
                results.append((kind, await one_request(client, url, model, prompt, max_tokens,
                                                        wl.sampling)))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        await asyncio.gather(*[worker() for _ in range(min(users, len(jobs)))])
        return results, t0, time.time()


def _client_proc(args: tuple, conn) -> None:
    """One client process: its share of the users and jobs; sends back the results and
    its own CPU seconds (is the client the bottleneck?)."""
    import resource
    url, model, wl, jobs, users, start_at = args
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    results, t0, t1 = asyncio.run(_run_jobs(url, model, wl, jobs, users, start_at))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    conn.send((results, t0, t1, cpu))
    conn.close()


def _proc_tree_cpu(pid: int | None) -> dict[str, float]:
    """CPU seconds so far of `pid` and its descendants, by command (Linux /proc)."""
    if pid is None or not Path("/proc").exists():
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, str, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2:].split()
        stats[int(d.name)] = (int(rest[1]), cmd, (int(rest[11]) + int(rest[12])) / tick)
    tree, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in stats and p not in tree:
            tree[p] = stats[p]
            todo.extend(c for c, (pp, _, _) in stats.items() if pp == p)
    return {f"{p} {cmd[:60]}": cpu for p, (_, cmd, cpu) in tree.items()}


async def run_phase(url: str, model: str, wl: Workload, count: int, seed: int,
                    procs: int = 1, server_pid: int | None = None) -> dict:
    """The workload's closed loop over `count` requests, its users spread over `procs`
    client processes (one asyncio process parses ~10K SSE chunks/s at most, and the
    server must be what is measured), all starting at once."""
    rng = random.Random(seed)
    make = wl.make if wl.make is not None else shared_prefix(rng)
    jobs = [make(rng, i) for i in range(count)]
    procs = max(1, min(procs, wl.users, len(jobs)))
    srv0 = _proc_tree_cpu(server_pid)
    if procs == 1:
        import resource
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        results, t0, t1 = await _run_jobs(url, model, wl, jobs, wl.users, time.time())
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpus = [(r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)]
    else:
        import multiprocessing as mp
        ctx = mp.get_context("fork")
        start_at = time.time() + 0.5
        children = []
        for k in range(procs):
            users = wl.users // procs + (1 if k < wl.users % procs else 0)
            parent, child = ctx.Pipe(duplex=False)
            pr = ctx.Process(target=_client_proc,
                             args=((url, model, wl, jobs[k::procs], users, start_at), child))
            pr.start()
            children.append((pr, parent))
        results, starts, ends, cpus = [], [], [], []
        for pr, parent in children:
            res_k, a, b, cpu = await asyncio.to_thread(parent.recv)
            pr.join()
            results += res_k
            starts.append(a)
            ends.append(b)
            cpus.append(cpu)
        t0, t1 = min(starts), max(ends)
    wall = t1 - t0
    srv1 = _proc_tree_cpu(server_pid)
    out: dict = {"wall_s": wall, "requests": len(results), "client_procs": procs,
                 "client_cpu_frac": [round(c / wall, 3) for c in cpus] if wall else None}
    if srv1:
        out["server_cpu_frac"] = {k: round((v - srv0.get(k, 0.0)) / wall, 3)
                                  for k, v in srv1.items() if v - srv0.get(k, 0.0) > 0.01 * wall}
    errors = [r for _, r in results if "error" in r]
    if errors:
        out["errors"] = len(errors)
        out["first_error"] = errors[0]
    ok = [(k, r) for k, r in results if "error" not in r]
    total_out = sum(r["n_out"] for _, r in ok)
    out["output_tok_per_s"] = total_out / wall if wall else 0.0
    out["output_tokens"] = total_out
    for kind in sorted({k for k, _ in ok}):
        rs = [r for k, r in ok if k == kind]
        ttft = [r["ttft"] for r in rs if r["ttft"] is not None]
        tpot = [r["tpot"] for r in rs if r["tpot"] is not None]
        e2e = [r["e2e"] for r in rs]
        out[kind] = {"n": len(rs), "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p95_ms": 1e3 * pct(ttft, 95),
                     "tpot_p50_ms": 1e3 * pct(tpot, 50) if tpot else None,
                     "tpot_p95_ms": 1e3 * pct(tpot, 95) if tpot else None,
                     "e2e_p50_ms": 1e3 * pct(e2e, 50), "e2e_p95_ms": 1e3 * pct(e2e, 95)}
    return out


def start_server(args) -> tuple[subprocess.Popen, float]:
    flags = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--gpu-memory-utilization", str(args.gpu_memory_utilization),
             "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(args.port)]
    if args.server == "pagefleet":
        cmd = [sys.executable, "-m", "pagefleet.server.cli", "serve", args.model, *flags]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, *flags,
               "--enable-prefix-caching"]   # 0.26 logs no requests by default
    cmd += args.extra
    log = open(args.server_log, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {args.server_log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > args.start_timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError("server did not become healthy in time")
        time.sleep(0.25)
    return proc, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", choices=("pagefleet", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="u1,u10,u64,u256,prefix,mixed,longdoc,sampled")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies request counts")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--start-timeout", type=float, default=400)
    ap.add_argument("--server-log", default="/tmp/online-server.log")
    ap.add_argument("--max-token-id", type=int, default=VOCAB_HI)
    ap.add_argument("--client-procs", type=int, default=4,
                    help="client processes the users are spread over (1: the old one-process client)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                    help="more server flags (last)")
    args = ap.parse_args()
    set_vocab(args.max_token_id)
    res: dict = {"server": args.server, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 "flags": {k: getattr(args, k) for k in ("max_model_len", "max_num_seqs",
                                                          "max_num_batched_tokens",
                                                          "gpu_memory_utilization", "extra")}}
    proc, startup = start_server(args)
    res["startup_s"] = startup
    print(f"{args.server}: healthy after {startup:.1f} s", flush=True)
    url = f"http://127.0.0.1:{args.port}"
    wls = workloads(args.scale)
    try:
        for i, name in enumerate(args.workloads.split(",")):
            wl = wls[name]
            t0 = time.time()
            asyncio.run(run_phase(url, "bench", wl, wl.warmup, seed=1000 + i, procs=args.client_procs))
            res[name] = asyncio.run(run_phase(url, "bench", wl, wl.requests, seed=2000 + i,
                                              procs=args.client_procs, server_pid=proc.pid))
            res[name]["phase_s"] = time.time() - t0
            print(f"{name}: {json.dumps(res[name])}", flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print_table(res)


def print_table(res: dict) -> None:
    print(f"\n== {res['server']} (startup {res['startup_s']:.1f} s)")
    for name, r in res.items():
        if not isinstance(r, dict) or "output_tok_per_s" not in r:
            continue
        parts = [f"{name:8s} {r['output_tok_per_s']:8.0f} tok/s"]
        for kind in ("all", "short", "long"):
            if kind in r:
                k = r[kind]
                parts.append(f"{kind}: TTFT p50/p95 {k['ttft_p50_ms']:.0f}/{k['ttft_p95_ms']:.0f} ms, "
                             f"TPOT p50 {k['tpot_p50_ms'] or 0:.2f} ms, E2E p95 {k['e2e_p95_ms']:.0f} ms")
        if r.get("errors"):
            parts.append(f"ERRORS {r['errors']}")
        print(" | ".join(parts))


if __name__ == "__main__":
    main()
