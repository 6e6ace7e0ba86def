"""`pagefleet bench serve` against a real test server (issue: 6), and its pure parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagefleet.server.bench.cli import main as bench_main
from pagefleet.server.bench.datasets import random_dataset
from pagefleet.server.bench.report import RequestResult, format_report, summarize
from tests.server.helpers_serve import ThreadServer, metric

PAGEFLEET = str(Path(sys.executable).with_name("pagefleet"))

FIGURES = ["completed", "failed", "duration", "request_throughput", "output_throughput",
           "total_token_throughput", "total_input_tokens", "total_output_tokens"] + [
    f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99")]


@pytest.fixture(scope="module")
def srv(tiny_models):
    server = ThreadServer(tiny_models("qwen3"), max_num_seqs=8).start()
    yield server
    server.stop()


@pytest.mark.parametrize("endpoint,extra", [
    ("/v1/completions", ["--request-rate", "inf", "--max-concurrency", "4"]),
    ("/v1/chat/completions", ["--dataset", "prefix", "--prefix-len", "64",
                              "--request-rate", "200", "--seed", "3"]),
])
def test_bench_serve_json(srv, tmp_path, capsys, endpoint, extra):
    out = tmp_path / "result.json"
    queries_before = metric(srv.metrics(), "vllm:prefix_cache_hits_total")
    rc = bench_main(["serve", "--base-url", srv.url, "--endpoint", endpoint,
                     "--num-prompts", "12", "--random-input-len", "24",
                     "--random-output-len", "8", "--random-range-ratio", "0.25",
                     "--ignore-eos", "--result-json", str(out), "--disable-tqdm", *extra])
    assert rc == 0
    report = capsys.readouterr().out
    assert "Serving Benchmark Result" in report and "P99 TTFT (ms)" in report
    data = json.loads(out.read_text())
    for key in FIGURES:
        assert key in data, key
    assert data["completed"] == 12 and data["failed"] == 0 and data["model_id"] == "tiny"
    assert 12 * 6 <= data["total_output_tokens"] <= 12 * 10      # 8 ± 25 %, ignore_eos
    assert data["mean_ttft_ms"] > 0 and data["mean_e2el_ms"] >= data["mean_ttft_ms"]
    assert data["p99_e2el_ms"] >= data["median_e2el_ms"] > 0
    if "--prefix-len" in extra:
        assert metric(srv.metrics(), "vllm:prefix_cache_hits_total") > queries_before


def test_bench_spreads_requests_over_client_processes(srv, tmp_path, capsys):
    """--num-client-procs 3: every request is sent once, by one of three processes, each
    with its share of the concurrency limit; the report gives each one's CPU share."""
    out = tmp_path / "procs.json"
    rc = bench_main(["serve", "--base-url", srv.url, "--num-prompts", "10",
                     "--random-input-len", "16", "--random-output-len", "6", "--ignore-eos",
                     "--max-concurrency", "4", "--num-client-procs", "3",
                     "--result-json", str(out), "--disable-tqdm"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["completed"] == 10 and data["failed"] == 0
    assert data["total_output_tokens"] == 60 and data["num_client_procs"] == 3
    assert len(data["client_cpu_util"]) == 3 and all(c >= 0 for c in data["client_cpu_util"])
    assert data["duration"] > 0 and data["output_throughput"] == pytest.approx(60 / data["duration"])
    assert "Client CPU per process" in capsys.readouterr().out
    # More processes than --max-concurrency: as many processes as slots, one slot each.
    rc = bench_main(["serve", "--base-url", srv.url, "--num-prompts", "4",
                     "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos",
                     "--max-concurrency", "2", "--num-client-procs", "3",
                     "--result-json", str(out), "--disable-tqdm"])
    data = json.loads(out.read_text())
    assert rc == 0 and data["completed"] == 4 and data["num_client_procs"] == 2


def test_saturated_client_is_called_out():
    rs = [RequestResult(success=True, prompt_len=4, output_tokens=2, ttft=0.1, itl=[0.1],
                        latency=0.2)]
    s = summarize(rs, duration=1.0)
    s.update(client_cpu_util=[0.97, 0.4], client_saturated=True)
    text = format_report(s)
    assert "0.97 0.40" in text and "WARNING: a client process was busy" in text
    s.update(client_cpu_util=[0.3], client_saturated=False)
    assert "WARNING" not in format_report(s)


def test_bench_counts_failures(srv, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench_main(["serve", "--base-url", srv.url, "--model", "wrong-model",
                     "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4",
                     "--result-json", str(out), "--disable-tqdm"])
    assert rc == 1
    data = json.loads(out.read_text())
    assert data["completed"] == 0 and data["failed"] == 3 and data["errors_by_status"] == {"404": 3}


def test_dataset_lengths_and_shared_prefix():
    ds = random_dataset(50, 100, 20, 0.5, seed=1, prefix_len=30, num_prefixes=2)
    assert all(80 <= s.expected_input_len <= 180 and 10 <= s.output_len <= 30 for s in ds)
    heads = {s.prompt.split()[:30].__str__() for s in ds}
    assert len(heads) == 2


def test_summary_percentiles():
    rs = [RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=t, itl=[0.1] * 4,
                        latency=t + 0.4) for t in (0.1, 0.2, 0.3)]
    rs.append(RequestResult(success=False, status=429, error="HTTP 429"))
    s = summarize(rs, duration=2.0)
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors_by_status"] == {"429": 1}
    assert s["median_ttft_ms"] == pytest.approx(200) and s["mean_tpot_ms"] == pytest.approx(100)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 7.5


def test_vllm_bench_serve_flags_run_with_the_same_meaning(srv, tmp_path, capsys):
    """A `vllm bench serve` command line (audit G8): --host/--port instead of a URL,
    --backend openai-chat picks the chat endpoint, --tokenizer is accepted (the server
    sizes the prompts), --save-result --result-dir --result-filename write the JSON,
    --percentile-metrics/--metric-percentiles pick the report's rows and the p{X} keys,
    --random-prefix-len and --metadata as vLLM's."""
    rc = bench_main(["serve", "--backend", "openai-chat", "--host", "127.0.0.1",
                     "--port", str(srv.port), "--model", "tiny", "--tokenizer", "some/tokenizer",
                     "--dataset-name", "random", "--random-input-len", "16",
                     "--random-output-len", "4", "--random-prefix-len", "8", "--num-prompts", "4",
                     "--ignore-eos", "--burstiness", "1.0", "--save-result",
                     "--result-dir", str(tmp_path / "res"), "--result-filename", "run.json",
                     "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9",
                     "--metadata", "tag=seed000", "--disable-tqdm"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "--tokenizer" in err and "server's tokenizer" in err
    data = json.loads((tmp_path / "res" / "run.json").read_text())
    assert data["completed"] == 4 and data["endpoint"] == "/v1/chat/completions"
    assert data["backend"] == "openai-chat" and data["base_url"] == srv.url
    assert data["prefix_len"] == 8 and data["tag"] == "seed000"
    assert data["p50_ttft_ms"] > 0 and data["p99.9_e2el_ms"] >= data["p50_e2el_ms"]
    assert "P50 TTFT (ms)" in out and "P99.9 E2EL (ms)" in out
    assert "TPOT (ms)" not in out and "ITL (ms)" not in out     # not asked for
    # --save-result alone: vLLM's file name, in the working directory.
    capsys.readouterr()
    rc = bench_main(["serve", "--port", str(srv.port), "--num-prompts", "2",
                     "--random-input-len", "8", "--random-output-len", "2", "--max-concurrency",
                     "2", "--save-result", "--result-dir", str(tmp_path / "named"),
                     "--disable-tqdm"])
    assert rc == 0
    (saved,) = (tmp_path / "named").iterdir()
    assert saved.name.startswith("vllm-infqps-concurrency2-tiny-") and saved.suffix == ".json"


@pytest.mark.parametrize("argv,needles", [
    (["--tokenizer", "x", "--input-len", "512", "--output-len", "256", "--max-num-seqs", "32",
      "--max-num-batched-tokens", "4096"],
     ["--input-len: use --random-input-len", "--output-len: use --random-output-len",
      "--max-num-seqs: a server flag", "--max-num-batched-tokens: a server flag"]),
    (["--dataset-path", "sharegpt.json"], ["--dataset-path: only the synthetic datasets"]),
    (["--goodput=ttft:100"], ["--goodput: not a pagefleet bench serve flag"]),
    (["--burstiness", "0.5"], ["--burstiness 0.5: only 1.0"]),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"],
     ["--backend openai-chat sends to /v1/chat/completions"]),
    (["--percentile-metrics", "ttft,goodput"], ["--percentile-metrics ttft,goodput: choose"]),
])
def test_flags_without_a_counterpart_are_refused_by_name(argv, needles):
    """Seed 000's `vllm bench serve ... --input-len 512 ... --max-num-seqs 32` used to
    get argparse's bare 'unrecognized arguments'; now each flag is named with what to
    use instead, before any request is sent (the port here is closed)."""
    proc = subprocess.run([PAGEFLEET, "bench", "serve", "--port", "9", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("pagefleet bench serve: error: "), proc.stderr
    assert "unrecognized arguments" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
