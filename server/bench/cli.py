"""`pagefleet bench serve`: a load generator in the spirit of `vllm bench serve`.

Sends `--num-prompts` streamed requests at `--request-rate` (inf: all at once; else
Poisson arrivals) with at most `--max-concurrency` in flight, then prints vLLM's report
(TTFT, TPOT, ITL, E2EL mean/median/p99, throughput) and optionally writes it as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from datetime import datetime

import httpx

from pagefleet.server.bench.client import request_body, send
from pagefleet.server.bench.datasets import random_dataset
from pagefleet.server.bench.report import format_report, summarize


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet bench serve",
                                description="Benchmark an OpenAI-compatible server.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="Model name (default: the server's first "
                   "model from /v1/models)")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                   choices=("random", "prefix"),
                   help="random: random prompts. prefix: random prompts after shared "
                        "prefixes of --prefix-len tokens (prefix-cache runs)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths are drawn uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="Tokens of shared prefix before each prompt (default 256 for "
                        "--dataset prefix)")
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="Distinct shared prefixes (requests cycle through them)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="Most requests in flight at once")
    p.add_argument("--ignore-eos", action="store_true",
                   help="Ask the server to ignore EOS so outputs have the asked length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None,
                   help="Bearer key (default: $OPENAI_API_KEY or $PAGEFLEET_API_KEY)")
    p.add_argument("--result-json", default=None, help="Write the figures to this file")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bar")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout (s)")
    return p


class Progress:
    """A dependency-free progress bar on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.t0 = time.perf_counter()

    def update(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{rate:.1f} req/s")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def _tokens_per_word(client: httpx.AsyncClient, base: str, model: str,
                           headers: dict) -> float:
    from pagefleet.server.bench.datasets import WORDS

    sample = " ".join(WORDS)
    try:
        r = await client.post(f"{base}/tokenize", json={"model": model, "prompt": sample,
                                                        "add_special_tokens": False},
                              headers=headers)
        if r.status_code == 200:
            return max(r.json()["count"] / len(WORDS), 0.1)
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    return 1.0


async def run_benchmark(args: argparse.Namespace) -> dict:
    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("PAGEFLEET_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limit = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=max(limit, 1), max_keepalive_connections=max(limit, 1))
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0),
                                 limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(f"{base}/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        prefix_len = args.prefix_len or (256 if args.dataset == "prefix" else 0)
        tpw = await _tokens_per_word(client, base, model, headers)
        samples = random_dataset(args.num_prompts, args.random_input_len,
                                 args.random_output_len, args.random_range_ratio,
                                 seed=args.seed, prefix_len=prefix_len,
                                 num_prefixes=args.num_prefixes, tokens_per_word=tpw)
        url = base + args.endpoint
        sem = asyncio.Semaphore(limit)
        progress = Progress(len(samples), not args.disable_tqdm)
        rng = random.Random(args.seed)

        async def one(sample):
            async with sem:
                res = await send(client, url, request_body(args.endpoint, model, sample.prompt,
                                                           sample.output_len, args.ignore_eos),
                                 headers)
            progress.update()
            return res

        t0 = time.perf_counter()
        tasks = []
        for sample in samples:
            tasks.append(asyncio.create_task(one(sample)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    summary = summarize(results, duration)
    summary.update({
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if "chat" in args.endpoint else "openai",
        "base_url": base, "endpoint": args.endpoint, "model_id": model,
        "dataset": args.dataset, "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio, "prefix_len": prefix_len,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos,
        "errors": sorted({r.error for r in results if not r.success})[:20],
    })
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: pagefleet bench serve [--help] ...")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"pagefleet bench: unknown benchmark {argv[0]!r}; expected: serve", file=sys.stderr)
        return 2
    args = bench_parser().parse_args(argv[1:])
    if args.num_prompts < 1:
        print("pagefleet bench serve: --num-prompts must be >= 1", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(run_benchmark(args))
    except (httpx.HTTPError, OSError, ValueError) as e:
        print(f"pagefleet bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_report(summary))
    if args.result_json:
        with open(args.result_json, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0 if summary["completed"] > 0 else 1
