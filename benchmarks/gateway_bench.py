"""Round-robin vs the gateway's prefix routing on a prefix-heavy multi-turn workload.

The seed report's scenario (000): a fixed ~1.5K-token system prompt in front of every
request, several conversations of several turns each, several replicas. Round robin
spreads a conversation's turns over the replicas, so each replica recomputes history
that another one holds; the gateway routes each turn to the replica that holds the
longest prefix of its block-hash chain.

Everything is real and runs on the CPU: N `pagefleet serve` backends with a tiny random
model (real tokenizer and chat template), `pagefleet gateway` in front of them (once
with `--routing round-robin`, once with the default `--routing prefix`), and streaming
chat clients that send each conversation's turns in order, feeding every reply back as
the assistant message. Backends are restarted between the two runs (cold caches), and
each run gets its own system prompts and questions of the same lengths.

Reported per run: TTFT (client side, first SSE event) p50/p90/p99, prompt tokens the
fleet computed (the backends' `vllm:prefix_cache_queries_total` minus `_hits_total`),
the prefix-cache hit rate, wall time, and the gateway's own time per request before
the upstream call (its `Server-Timing: gateway;dur=` header) p50/p99. After the
gateway run, an idle-fleet phase sends requests one at a time through the gateway and
straight to the replica it picked, for the latency the gateway adds (p50/p99).

    python benchmarks/gateway_bench.py                       # defaults below, ~5 min
    python benchmarks/gateway_bench.py --system-prompts 6 --conversations 24 --turns 4 \
        --backends 3 --system-tokens 1500 --kv-blocks 400 --out /tmp/gw.json

Defaults: six ~1.5K-token system prompts (six teams sharing the platform, as in seed
002) that do not all fit one replica's KV cache (400 blocks = 6,400 tokens), four
conversations per system prompt, four turns each, six clients at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

WORDS = ("model token cache block batch queue request server memory prefix chunk decode "
         "prefill latency throughput kernel attention layer head vector matrix sample "
         "greedy paged pool hash scheduler runner engine stream reply client user system "
         "assistant hello world question answer long short fast slow first last next red "
         "green blue one two three four five six seven eight nine ten data time deploy "
         "scale replica pod node cluster service metric alert limit budget policy").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exe() -> str:
    return str(Path(sys.executable).with_name("pagefleet"))


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{what} not ready after {timeout:.0f}s")


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name:
            total += float(m.group(3))
    return total


class Fleet:
    """N backends (restartable) and one gateway process."""

    def __init__(self, model: Path, args, workdir: Path) -> None:
        self.model, self.args, self.workdir = model, args, workdir
        self.ports = [free_port() for _ in range(args.backends)]
        self.procs: list[subprocess.Popen] = []
        self.gw: subprocess.Popen | None = None
        self.gw_url = ""

    def start_backends(self) -> None:
        a = self.args
        for i, port in enumerate(self.ports):
            log = open(self.workdir / f"backend-{i}.log", "ab")
            self.procs.append(subprocess.Popen(
                [exe(), "serve", str(self.model), "--served-model-name", "bench",
                 "--max-model-len", str(a.max_model_len), "--num-gpu-blocks-override",
                 str(a.kv_blocks), "--max-num-seqs", "32", "--host", "127.0.0.1",
                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT))
        for i, (port, p) in enumerate(zip(self.ports, self.procs)):
            wait_http(f"http://127.0.0.1:{port}/health", p, f"backend {i}")

    def stop_backends(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []

    def start_gateway(self, routing: str) -> None:
        models = self.workdir / "models.yaml"
        models.write_text(yaml.safe_dump({"models": [{
            "name": "bench", "tokenizer": str(self.model),
            "pools": [{"name": "bench", "max_model_len": self.args.max_model_len,
                       "endpoints": [{"name": f"b{i}", "url": f"http://127.0.0.1:{p}"}
                                     for i, p in enumerate(self.ports)]}]}]}))
        port = free_port()
        log = open(self.workdir / f"gateway-{routing}.log", "wb")
        self.gw = subprocess.Popen(
            [exe(), "gateway", "--models-file", str(models), "--routing", routing,
             "--host", "127.0.0.1", "--port", str(port), "--health-interval", "0.5"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PAGEFLEET_LOG_LEVEL": "WARNING"})
        self.gw_url = f"http://127.0.0.1:{port}"
        wait_http(self.gw_url + "/health", self.gw, "gateway")
        deadline = time.monotonic() + 60
        while not httpx.get(self.gw_url + "/v1/models").json()["data"]:
            if time.monotonic() > deadline:
                raise SystemExit("gateway has no ready backend")
            time.sleep(0.2)
        while metric(httpx.get(self.gw_url + "/metrics").text,
                     "pagefleet_gateway_pool_ready_endpoints") < len(self.ports):
            time.sleep(0.2)

    def endpoint_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[int(name[1:])]}"

    def stop_gateway(self) -> None:
        if self.gw is not None:
            self.gw.send_signal(signal.SIGTERM)
            self.gw.wait(60)
            self.gw = None

    def cache_counters(self) -> tuple[float, float]:
        q = h = 0.0
        for port in self.ports:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            q += metric(text, "vllm:prefix_cache_queries_total")
            h += metric(text, "vllm:prefix_cache_hits_total")
        return q, h


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_workload(seed: int, args, tok) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """System prompts of ~system_tokens tokens, and per conversation (system index,
    user messages of its turns)."""
    rng = random.Random(seed)
    systems = []
    for i in range(args.system_prompts):
        text = f"You are the support assistant of team {seed}-{i}. Rules follow. "
        while len(tok.encode(text)) < args.system_tokens:
            text += words(rng, 50) + ". "
        systems.append(text)
    convs = [(c % args.system_prompts, [words(rng, args.user_words) for _ in range(args.turns)])
             for c in range(args.conversations)]
    return systems, convs


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


async def run_workload(url: str, systems, convs, args) -> dict:
    ttfts: list[float] = []
    overheads: list[float] = []
    errors = 0
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        async def conversation(ci: int) -> None:
            nonlocal errors
            s, users = convs[ci]
            messages = [{"role": "system", "content": systems[s]}]
            for user in users:
                messages.append({"role": "user", "content": user})
                body = {"model": "bench", "messages": messages, "max_tokens": args.max_tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                async with sem:
                    t0 = time.perf_counter()
                    reply, first = [], None
                    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            errors += 1
                            await r.aread()
                            return
                        m = re.search(r"gateway;dur=([\d.]+)", r.headers.get("server-timing", ""))
                        if m:
                            overheads.append(float(m.group(1)) / 1000)
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            if first is None:
                                first = time.perf_counter() - t0
                            delta = json.loads(line[6:])["choices"]
                            if delta:
                                reply.append(delta[0]["delta"].get("content") or "")
                    ttfts.append(first)
                messages.append({"role": "assistant", "content": "".join(reply)})

        t0 = time.perf_counter()
        await asyncio.gather(*[conversation(i) for i in range(len(convs))])
        wall = time.perf_counter() - t0
    return {"ttft": ttfts, "overhead": overheads, "errors": errors, "wall_s": wall}


async def measure_added_latency(fleet: Fleet, systems: list[str], args) -> dict:
    """With the fleet otherwise idle: the same requests one at a time through the
    gateway and straight to the replica the gateway picked (caches warm for both; the
    order alternates so neither side gets the warmer cache), so the TTFT difference is
    what the gateway adds from the client's side: its own work plus the extra hop."""
    rng = random.Random(99)
    own, added = [], []
    async with httpx.AsyncClient(timeout=600) as c:
        async def ttft(url: str, body: dict) -> tuple[float, httpx.Headers]:
            t0 = time.perf_counter()
            async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return time.perf_counter() - t0, r.headers
            raise RuntimeError("empty stream")

        for i in range(args.latency_requests):
            body = {"model": "bench", "max_tokens": 1, "temperature": 0, "stream": True,
                    "messages": [{"role": "system", "content": systems[i % len(systems)]},
                                 {"role": "user", "content": words(rng, args.user_words)}]}
            await ttft(fleet.gw_url, body)                    # warm the replica's cache
            _, h = await ttft(fleet.gw_url, body)
            direct_url = fleet.endpoint_url(h["x-pagefleet-endpoint"])
            pair = [(fleet.gw_url, "gw"), (direct_url, "direct")]
            if i % 2:
                pair.reverse()
            got = {}
            for url, side in pair:
                got[side], headers = await ttft(url, body)
                if side == "gw":
                    m = re.search(r"gateway;dur=([\d.]+)", headers.get("server-timing", ""))
                    own.append(float(m.group(1)) / 1000)
            added.append(got["gw"] - got["direct"])
    return {"requests": len(added),
            "gateway_own_ms": {"p50": round(pct(own, 50) * 1e3, 3), "p99": round(pct(own, 99) * 1e3, 3)},
            "added_ttft_ms": {"p50": round(pct(added, 50) * 1e3, 3),
                              "p99": round(pct(added, 99) * 1e3, 3)}}


def run_mode(fleet: Fleet, routing: str, seed: int, args, tok) -> dict:
    systems, convs = make_workload(seed, args, tok)
    fleet.start_backends()
    try:
        fleet.start_gateway(routing)
        try:
            q0, h0 = fleet.cache_counters()
            res = asyncio.run(run_workload(fleet.gw_url, systems, convs, args))
            q1, h1 = fleet.cache_counters()
            idle = asyncio.run(measure_added_latency(fleet, systems, args)) \
                if routing == "prefix" and args.latency_requests else None
        finally:
            fleet.stop_gateway()
    finally:
        fleet.stop_backends()
    queries, hits = q1 - q0, h1 - h0
    t, o = res["ttft"], res["overhead"]
    return {"routing": routing, "requests": len(t), "errors": res["errors"],
            "wall_s": round(res["wall_s"], 2),
            "ttft_ms": {"p50": round(pct(t, 50) * 1e3, 1), "p90": round(pct(t, 90) * 1e3, 1),
                        "p99": round(pct(t, 99) * 1e3, 1),
                        "mean": round(statistics.fmean(t) * 1e3, 1) if t else None},
            "prompt_tokens": int(queries), "prompt_tokens_computed": int(queries - hits),
            "hit_rate": round(hits / queries, 4) if queries else None,
            "gateway_overhead_ms": {"p50": round(pct(o, 50) * 1e3, 3),
                                    "p99": round(pct(o, 99) * 1e3, 3)},
            "idle_latency": idle, "loadavg_after": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", type=int, default=3)
    ap.add_argument("--system-prompts", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-words", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--latency-requests", type=int, default=40,
                    help="requests of the idle added-latency phase (0: skip)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-blocks", type=int, default=400,
                    help="KV blocks per backend (16 tokens each)")
    ap.add_argument("--model", default=None, help="model dir (default: a tiny qwen3 built here)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    if args.model:
        model = Path(args.model)
    else:
        from pagefleet.server.testing import build_tiny_model

        model = build_tiny_model(work / "model", "qwen3", max_position_embeddings=8192)
    tok = AutoTokenizer.from_pretrained(str(model))
    fleet = Fleet(model, args, work)
    results = [run_mode(fleet, "round-robin", 11, args, tok),
               run_mode(fleet, "prefix", 12, args, tok)]
    out = {"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename,
           "cpus": os.cpu_count(), "settings": vars(args), "results": results}
    print(json.dumps(out, indent=2))
    rr, px = results
    print(f"\n{'':28}{'round-robin':>14}{'gateway':>14}")
    for label, key in [("TTFT p50 (ms)", ("ttft_ms", "p50")), ("TTFT p90 (ms)", ("ttft_ms", "p90")),
                       ("TTFT p99 (ms)", ("ttft_ms", "p99")),
                       ("prompt tokens computed", ("prompt_tokens_computed",)),
                       ("prefix-cache hit rate", ("hit_rate",)), ("wall (s)", ("wall_s",)),
                       ("gateway own time p50 (ms)", ("gateway_overhead_ms", "p50")),
                       ("gateway own time p99 (ms)", ("gateway_overhead_ms", "p99"))]:
        def get(r):
            v = r
            for k in key:
                v = v[k]
            return v
        print(f"{label:28}{get(rr)!s:>14}{get(px)!s:>14}")
    if px.get("idle_latency"):
        il = px["idle_latency"]
        print(f"\nidle fleet, {il['requests']} requests one at a time: gateway's own time "
              f"p50 {il['gateway_own_ms']['p50']} ms / p99 {il['gateway_own_ms']['p99']} ms; "
              f"TTFT added vs direct p50 {il['added_ttft_ms']['p50']} ms / "
              f"p99 {il['added_ttft_ms']['p99']} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0 if not rr["errors"] and not px["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
