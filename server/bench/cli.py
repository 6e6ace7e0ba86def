"""`pagefleet bench serve`: a load generator in the spirit of `vllm bench serve`.

Sends `--num-prompts` streamed requests at `--request-rate` (inf: all at once; else
Poisson arrivals) with at most `--max-concurrency` in flight, then prints vLLM's report
(TTFT, TPOT, ITL, E2EL mean/median/p99, throughput) and optionally writes it as JSON.

The client measures itself too: one Python process parsing a JSON chunk per token tops
out near 7,000 streamed tokens/s (an H200 serving a 7B model outruns it: pagefleet's own
benchmark read 5,206 tok/s where 8,631 was served). The report gives each client
process's CPU share and warns when one was near a full core; `--num-client-procs N`
spreads the requests (and the rate and concurrency limits) over N processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import sys
import time
from datetime import datetime

import httpx

from pagefleet.server.bench.client import request_body, send
from pagefleet.server.bench.datasets import random_dataset
from pagefleet.server.bench.report import format_report, summarize


# `vllm bench serve` flags with no counterpart here, and what to use instead. Any other
# unknown flag is refused too, by name (not argparse's bare "unrecognized arguments").
SERVER_FLAG = "a server flag: set it on `pagefleet serve`"
NOT_HERE = {
    "--input-len": "use --random-input-len (--input-len is `vllm bench throughput/latency`'s)",
    "--output-len": "use --random-output-len (--output-len is `vllm bench throughput/latency`'s)",
    "--dataset-path": "only the synthetic datasets are built in (--dataset-name random|prefix)",
    **{f: SERVER_FLAG for f in (
        "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization",
        "--max-model-len", "--tensor-parallel-size", "-tp", "--enable-prefix-caching",
        "--no-enable-prefix-caching", "--enable-chunked-prefill", "--kv-cache-dtype",
        "--dtype", "--quantization", "--enforce-eager", "--block-size", "--served-model-name")},
}
BACKENDS = {"vllm": "/v1/completions", "openai": "/v1/completions",
            "openai-chat": "/v1/chat/completions"}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet bench serve",
                                description="Benchmark an OpenAI-compatible server. "
                                "`vllm bench serve`'s flags for the same things are accepted "
                                "(--host/--port, --backend, --save-result/--result-dir/"
                                "--result-filename, --percentile-metrics, --metric-percentiles, "
                                "--random-prefix-len, --tokenizer, --metadata).")
    p.add_argument("--base-url", default=None,
                   help="Server root, e.g. http://127.0.0.1:8000 (default: from --host and "
                        "--port)")
    p.add_argument("--host", default="127.0.0.1", help="Server host when --base-url is not "
                   "given (as vllm bench serve)")
    p.add_argument("--port", type=int, default=8000, help="Server port when --base-url is "
                   "not given (as vllm bench serve)")
    p.add_argument("--model", default=None, help="Model name (default: the server's first "
                   "model from /v1/models)")
    p.add_argument("--endpoint", default=None,
                   choices=("/v1/completions", "/v1/chat/completions"),
                   help="Default: /v1/completions, or the --backend's")
    p.add_argument("--backend", default=None, choices=tuple(BACKENDS),
                   help="vllm bench serve's client backend: vllm and openai send to "
                        "/v1/completions, openai-chat to /v1/chat/completions")
    p.add_argument("--tokenizer", default=None,
                   help="Accepted for vllm bench serve scripts; prompts are sized with the "
                        "server's own tokenizer (/tokenize) and token counts are the server's")
    p.add_argument("--tokenizer-mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--trust-remote-code", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                   choices=("random", "prefix"),
                   help="random: random prompts. prefix: random prompts after shared "
                        "prefixes of --prefix-len tokens (prefix-cache runs)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths are drawn uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", "--random-prefix-len", dest="prefix_len", type=int,
                   default=0, help="Tokens of shared prefix before each prompt (default 256 "
                   "for --dataset prefix)")
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
    p.add_argument("--burstiness", type=float, default=None,
                   help="Only 1.0: Poisson arrivals, the default (as vllm bench serve)")
    p.add_argument("--result-json", default=None, help="Write the figures to this file")
    p.add_argument("--save-result", action="store_true",
                   help="Write the figures as JSON to --result-dir/--result-filename "
                        "(default name as vllm bench serve: "
                        "BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    p.add_argument("--result-dir", default=None, help="Folder for --save-result")
    p.add_argument("--result-filename", default=None, help="File name for --save-result")
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="Added to the JSON result")
    p.add_argument("--percentile-metrics", default=None,
                   help="Comma-separated metrics the report gives percentiles of, from "
                        "ttft,tpot,itl,e2el (default: all four)")
    p.add_argument("--metric-percentiles", default="99",
                   help="Comma-separated percentiles, e.g. 50,90,99 (default 99); the JSON "
                        "gets p{X}_{metric}_ms keys")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bar")
    p.add_argument("--timeout", type=float, default=600.0, help="Per-request timeout (s)")
    p.add_argument("--num-client-procs", type=int, default=1,
                   help="Client processes the requests, the request rate and the concurrency "
                        "limit are spread over (one saturates near 7,000 tokens/s)")
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


SATURATED = 0.85   # a client process busier than this measured itself, not the server


async def _send_all(url: str, endpoint: str, model: str, headers: dict, samples: list,
                    rate: float, limit: int, seed: int, timeout: float, start_at: float,
                    ignore_eos: bool, progress: Progress) -> tuple[list, float, float]:
    """This process's share: (results, first send, last result) in time.time()."""
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    rng = random.Random(seed)
    sem = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0),
                                 limits=limits) as client:
        async def one(sample):
            async with sem:
                res = await send(client, url, request_body(endpoint, model, sample.prompt,
                                                           sample.output_len, ignore_eos),
                                 headers)
            progress.update()
            return res

        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        tasks = []
        for sample in samples:
            tasks.append(asyncio.create_task(one(sample)))
            if math.isfinite(rate) and rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), t0, time.time()


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _client_proc(job: tuple, conn) -> None:
    """A child client process (spawned: the parent may run threads, which fork does not
    carry safely): waits for the common start time, sends its share, then answers with
    its results, its first send and last result (time.time()) and its CPU seconds."""
    conn.send("ready")          # imported and running: the parent then names the start
    start_at = conn.recv()
    cpu0 = _cpu_seconds()
    results, t0, t1 = asyncio.run(_send_all(*job[:-1], start_at, job[-1], Progress(0, False)))
    conn.send((results, t0, t1, _cpu_seconds() - cpu0))
    conn.close()


async def _run_procs(n: int, url: str, args, model: str, headers: dict, samples: list,
                     limit: int) -> tuple[list, float, list[float]]:
    """The samples over `n` client processes (round robin; each gets 1/n of the rate and
    of the concurrency limit, n <= limit), all starting at one wall-clock time."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    children = []
    try:
        for k in range(n):
            job = (url, args.endpoint, model, headers, samples[k::n], args.request_rate / n,
                   limit // n + (1 if k < limit % n else 0), args.seed + k,
                   args.timeout, args.ignore_eos)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_proc, args=(job, child), daemon=True)
            proc.start()
            child.close()
            children.append((proc, parent))
        for proc, parent in children:
            try:
                await asyncio.to_thread(parent.recv)   # "ready"
            except EOFError as e:
                raise OSError(f"a client process exited with {proc.exitcode}") from e
        start_at = time.time() + 0.05
        for _, parent in children:
            parent.send(start_at)
        results, starts, ends, cpu = [], [], [], []
        for proc, parent in children:
            try:
                res, a, b, c = await asyncio.to_thread(parent.recv)
            except EOFError as e:   # the child died before it could answer
                raise OSError(f"a client process exited with {proc.exitcode}") from e
            results += res
            starts.append(a)
            ends.append(b)
            cpu.append(c)
    finally:
        for proc, _ in children:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    duration = max(ends) - min(starts)
    return results, duration, [c / duration if duration > 0 else 0.0 for c in cpu]


class BenchArgsError(ValueError):
    """A command line that cannot run: main prints it after `pagefleet bench serve:
    error:` and exits 2."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(args, notices) with vllm bench serve's flags mapped onto ours; BenchArgsError
    naming each flag that has no counterpart here."""
    parser = bench_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:
        flags = [a.split("=", 1)[0] for a in rest if a.startswith("-") and a != "-"
                 and not a.lstrip("-").replace(".", "", 1).isdigit()]
        if not flags:
            raise BenchArgsError(f"unexpected argument(s): {' '.join(rest)}")
        why = [f"{f}: {NOT_HERE.get(f, 'not a pagefleet bench serve flag (see --help)')}"
               for f in dict.fromkeys(flags)]
        raise BenchArgsError(f"unsupported flag{'s' if len(why) > 1 else ''}: "
                             f"{'; '.join(why)}")
    notices = []
    if args.burstiness is not None and args.burstiness != 1.0:
        raise BenchArgsError(f"--burstiness {args.burstiness:g}: only 1.0 (Poisson arrivals, "
                             "the default) is supported")
    if args.backend is not None:
        implied = BACKENDS[args.backend]
        if args.endpoint is not None and args.endpoint != implied:
            raise BenchArgsError(f"--backend {args.backend} sends to {implied}, not "
                                 f"--endpoint {args.endpoint}")
        args.endpoint = implied
    args.endpoint = args.endpoint or "/v1/completions"
    if args.base_url is None:
        from pagefleet.server.api.serve import http_url

        args.base_url = http_url(args.host, args.port)
    if args.tokenizer or args.tokenizer_mode or args.trust_remote_code:
        notices.append("--tokenizer/--tokenizer-mode/--trust-remote-code are accepted for "
                       "vllm bench serve scripts: prompts are sized with the server's "
                       "tokenizer (/tokenize) and token counts are the server's usage")
    if (args.result_dir or args.result_filename) and not args.save_result:
        notices.append("--result-dir/--result-filename take effect with --save-result "
                       "(as in vllm bench serve); nothing is saved")
    metrics = PERCENTILE_METRICS
    if args.percentile_metrics is not None:
        metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
        bad = [m for m in metrics if m not in PERCENTILE_METRICS]
        if bad or not metrics:
            raise BenchArgsError(f"--percentile-metrics {args.percentile_metrics}: choose from "
                                 f"{','.join(PERCENTILE_METRICS)}")
    args.percentile_metrics = metrics
    try:
        args.metric_percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise BenchArgsError(f"--metric-percentiles {args.metric_percentiles}: expected "
                             "numbers, e.g. 50,90,99") from None
    if not args.metric_percentiles or not all(0 < p < 100 for p in args.metric_percentiles):
        raise BenchArgsError(f"--metric-percentiles {args.metric_percentiles}: each must be "
                             "in (0, 100)")
    if args.metadata:
        bad = [m for m in args.metadata if "=" not in m]
        if bad:
            raise BenchArgsError(f"--metadata {bad[0]}: expected KEY=VALUE")
    return args, notices


def saved_result_path(args: argparse.Namespace, summary: dict) -> str | None:
    """Where the JSON goes: --result-json, else --save-result's file as vllm bench serve
    names it (BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json in --result-dir)."""
    if args.result_json:
        return args.result_json
    if not args.save_result:
        return None
    name = args.result_filename
    if not name:
        rate = args.request_rate
        concurrency = (f"-concurrency{args.max_concurrency}"
                       if args.max_concurrency is not None else "")
        name = (f"{args.backend or 'vllm'}-{rate}qps{concurrency}-"
                f"{summary['model_id'].split('/')[-1]}-{summary['date']}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


async def run_benchmark(args: argparse.Namespace) -> dict:
    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("PAGEFLEET_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0)) as client:
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
    limit = max(1, args.max_concurrency or args.num_prompts)
    procs = max(1, min(args.num_client_procs, len(samples), limit))   # each one >= 1 slot
    if procs == 1:
        cpu0 = _cpu_seconds()
        results, t0, t1 = await _send_all(
            url, args.endpoint, model, headers, samples, args.request_rate, limit, args.seed,
            args.timeout, time.time(), args.ignore_eos,
            Progress(len(samples), not args.disable_tqdm))
        duration = t1 - t0
        cpu = [(_cpu_seconds() - cpu0) / duration if duration > 0 else 0.0]
    else:
        results, duration, cpu = await _run_procs(procs, url, args, model, headers, samples,
                                                  limit)
    summary = summarize(results, duration, getattr(args, "metric_percentiles", (99.0,)))
    summary.update({
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend or ("openai-chat" if "chat" in args.endpoint else "openai"),
        "base_url": base, "endpoint": args.endpoint, "model_id": model,
        "dataset": args.dataset, "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio, "prefix_len": prefix_len,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos,
        "num_client_procs": procs, "client_cpu_util": [round(c, 3) for c in cpu],
        "client_saturated": max(cpu) > SATURATED,
        "errors": sorted({r.error for r in results if not r.success})[:20],
    })
    for item in getattr(args, "metadata", None) or ():
        key, _, value = item.partition("=")
        summary[key.strip()] = value.strip()
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: pagefleet bench serve [--help] ...")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"pagefleet bench: unknown benchmark {argv[0]!r}; expected: serve", file=sys.stderr)
        return 2
    try:
        args, notices = parse_args(argv[1:])
    except BenchArgsError as e:
        print(f"pagefleet bench serve: error: {e}", file=sys.stderr)
        return 2
    for notice in notices:
        print(f"pagefleet bench serve: note: {notice}", file=sys.stderr)
    if args.num_prompts < 1:
        print("pagefleet bench serve: --num-prompts must be >= 1", file=sys.stderr)
        return 2
    if args.num_client_procs < 1:
        print("pagefleet bench serve: --num-client-procs must be >= 1", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(run_benchmark(args))
    except (httpx.HTTPError, OSError, ValueError) as e:
        print(f"pagefleet bench serve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_report(summary, args.percentile_metrics, args.metric_percentiles))
    path = saved_result_path(args, summary)
    if path:
        with open(path, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0 if summary["completed"] > 0 else 1
