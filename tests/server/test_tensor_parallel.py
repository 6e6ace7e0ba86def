"""Tensor parallelism on the CPU (issue 14): real worker processes over gloo.

TP=2 greedy outputs equal HF transformers' (float32) on the four architectures, with
chunked prefill, forced preemption and prefix-cache hits; each rank loads exactly its
shard, reading only that from the files; a dead worker stops the server with a clear
error and no hang; the startup checks speak vLLM's words.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import threading
import time

import httpx
import pytest

from pagefleet.server import LLM, SamplingParams
from pagefleet.server.config import ConfigError, EngineConfig
from tests.server.helpers import assert_diverse, hf_greedy, random_prompts
from tests.server.helpers_serve import SubprocessServer, wait_for

# Same names and shapes as test_parity's (the session builds each model once), plus
# a Mistral with one KV head (replicated on both ranks) and tied embeddings.
TP_MODELS = {
    "llama": {"arch": "llama", "num_shards": 2},          # llama3 rope, sharded files
    "qwen2": {"arch": "qwen2"},                           # qkv bias
    "qwen3": {"arch": "qwen3"},                           # q/k norm, tied embeddings
    "mistral-kv1": {"arch": "mistral", "tie_word_embeddings": True, "num_kv_heads": 1},
}
LENGTHS = [1, 7, 33, 64, 120, 181, 257, 300]
MAX_NEW = [64, 40, 64, 17, 64, 33, 64, 50]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(TP_MODELS))
def test_tp2_greedy_matches_hf(tiny_models, name, caplog):
    """One TP=2 engine per architecture: 32-token chunks mixed with decodes, a pool
    small enough to force preemption, then prompts sharing a prefix (cache hits)."""
    model_dir = tiny_models(name, **TP_MODELS[name])
    prompts = random_prompts(1, LENGTHS, 512)
    shared = random_prompts(7, [150], 512)[0]
    prefixed = [shared + t for t in random_prompts(8, [1, 5, 16, 17, 40, 2], 512)]
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    ref_prefixed = hf_greedy(model_dir, prefixed, [24] * len(prefixed))
    assert_diverse(ref)
    assert_diverse(ref_prefixed)
    caplog.set_level(logging.INFO, logger="pagefleet")
    llm = LLM(model_dir, tensor_parallel_size=2, max_model_len=400, max_num_seqs=8,
              num_kv_blocks=30, max_num_batched_tokens=32)
    try:
        log_text = "\n".join(r.getMessage() for r in caplog.records)
        assert "KV cache per rank: rank 0 30 blocks" in log_text and "rank 1 30 blocks" in log_text
        assert "GiB over 2 ranks" in log_text
        budgets = []
        schedule = llm.engine.scheduler.schedule

        def observed():
            out = schedule()
            budgets.append((out.num_batched_tokens,
                            sum(s.num_new_tokens > 1 for s in out.scheduled), len(out.scheduled)))
            return out
        llm.engine.scheduler.schedule = observed
        assert tokens(llm.generate(prompts, [greedy(n) for n in MAX_NEW])) == ref
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        assert all(t <= 32 for t, _, _ in budgets)
        assert any(p and n > p for _, p, n in budgets)      # chunks mixed with decodes
        llm.engine.kv.check_whole()
        first = tokens(llm.generate(prefixed[:1], greedy(24)))
        rest = tokens(llm.generate(prefixed[1:], greedy(24)))
        assert first + rest == ref_prefixed
        assert llm.stats()["prefix_cache_hits"] > stats["prefix_cache_hits"]
        llm.engine.kv.check_whole()
        info = llm.engine.core.parallel_info()
        # 2 KV heads: one per rank; 1 KV head: both ranks hold it.
        assert [r["num_kv_heads"] for r in info["ranks"]] == [1, 1]
        assert info["backend"] == "gloo" and info["ranks"][1]["pid"] != os.getpid()
    finally:
        llm.shutdown()


def test_tp2_every_rank_takes_hf_overrides(tiny_models):
    """--hf-overrides reaches the worker ranks too: YaRN put on an unedited checkpoint
    serves, at TP=2, HF's tokens for the config.json edited as Qwen2.5's card says,
    past the original 64 positions."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    edited = tiny_models("qwen2-yarn", arch="qwen2", max_position_embeddings=64,
                         rope_scaling=yarn)
    plain = tiny_models("qwen2-plain64", arch="qwen2", max_position_embeddings=64)
    prompts = random_prompts(3, [50, 150, 200], 512)
    max_new = [64, 60, 50]
    ref = hf_greedy(edited, prompts, max_new)
    assert_diverse(ref)
    llm = LLM(plain, tensor_parallel_size=2, max_num_seqs=4,
              hf_overrides=json.dumps({"rope_scaling": yarn}))
    try:
        assert llm.engine.max_model_len == 256
        assert tokens(llm.generate(prompts, [greedy(n) for n in max_new])) == ref
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fmt,kw,flag", [
    ("awq", {"group_size": -1}, None),
    ("gptq", {"group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"}, "gptq_marlin"),
    ("compressed-tensors", {"strategy": "channel"}, None),
    # llm-compressor W4A16_ASYM, channel strategy: packed words, zero points, weight_shape
    ("compressed-tensors", {"scheme": "w4a16", "group_size": -1, "sym": False}, None)])
def test_tp2_quantized_checkpoints(tmp_path, fmt, kw, flag):
    """The quant methods' parameters shard too (int4 AWQ, GPTQ and W4A16 per channel, fp8
    per channel): greedy TP=2 equals HF on the dequantized weights the checkpoint means.
    (Grouped int4 needs each rank's input slice to hold whole groups, which the tiny
    models' intermediate size 2h+32 never allows at TP=2; real models' do.)"""
    from pagefleet.server.testing import build_tiny_model
    from pagefleet.server.testing_quant import quantize_checkpoint

    src = build_tiny_model(tmp_path / "src", "qwen2", seed=3, hidden_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2)
    ref = tmp_path / "ref"
    qdir = quantize_checkpoint(src, tmp_path / "q", fmt, dequantized_dir=ref, **kw)
    prompts = random_prompts(5, [3, 20, 41], 500)
    want = hf_greedy(ref, prompts, [24, 17, 24])
    assert_diverse(want)
    llm = LLM(qdir, tensor_parallel_size=2, max_model_len=256, max_num_seqs=4,
              kv_cache_memory=8 << 20, quantization=flag)
    try:
        assert tokens(llm.generate(prompts, [greedy(n) for n in (24, 17, 24)])) == want
        assert llm.engine.runner.model.quant is not None
    finally:
        llm.shutdown()


def test_gptq_act_order_is_refused_with_tp(tmp_path):
    from pagefleet.server.testing import build_tiny_model
    from pagefleet.server.testing_quant import quantize_checkpoint

    src = build_tiny_model(tmp_path / "src", "qwen2", hidden_size=128, num_layers=1,
                           num_heads=4, num_kv_heads=2)
    qdir = quantize_checkpoint(src, tmp_path / "q", "gptq", group_size=32, desc_act=True)
    with pytest.raises(ConfigError, match=r"act-order \(desc_act: true\) are not supported "
                                          "with --tensor-parallel-size 2"):
        LLM(qdir, tensor_parallel_size=2)


def test_tp2_sampling_and_logprobs_match_tp1(tiny_models):
    """What only rank 0 does (seeded sampling, penalties, logprobs) and what every rank
    must join (prompt logprobs: their logits are gathered too) give TP=1's results,
    with 40-token chunks so prompt logprobs span several steps."""
    model_dir = tiny_models("qwen3")
    prompts = random_prompts(21, [30, 90, 5], 512)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20,
                             ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, top_k=20, seed=5, repetition_penalty=1.3,
                             max_tokens=16, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1,
                             prompt_logprobs=0)]
    settings = dict(max_model_len=512, max_num_seqs=4, kv_cache_memory=8 << 20,
                    max_num_batched_tokens=40)
    one = LLM(model_dir, **settings).generate(prompts, params)
    llm = LLM(model_dir, tensor_parallel_size=2, **settings)
    try:
        two = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    assert tokens(two) == tokens(one)
    assert sum(len(set(t)) for t in tokens(one)) > 30

    def close(a, b):   # logprob dicts: the same tokens, values equal up to rounding
        return a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
    for x, y in zip(one, two):
        for a, b in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or []):
            assert close(_lp(a), _lp(b))
        assert (x.prompt_logprobs is None) == (y.prompt_logprobs is None)
        for a, b in zip(x.prompt_logprobs or [], y.prompt_logprobs or []):
            assert (a is None and b is None) or close(_lp(a), _lp(b))
    assert len(two[1].prompt_logprobs) == 90


def _lp(d: dict) -> dict:
    """{token: logprob} whatever the entry type (float or an object with .logprob)."""
    return {k: getattr(v, "logprob", v) for k, v in d.items()}


# -- loading: each rank its shard, and only that ------------------------------------------

H, INTER, LAYERS, HEADS, KV = 768, 768 * 2 + 32, 6, 12, 2


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """~130 MB of float32 weights in 6 files: large enough that the loading memory is
    measurable above the noise of a process."""
    from pagefleet.server.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tp-big") / "llama", "llama",
                            hidden_size=H, num_layers=LAYERS, num_heads=HEADS,
                            num_kv_heads=KV, num_shards=6)


def expected_shard(rank: int, n: int, vocab: int) -> dict[str, list[int]]:
    hd = H // HEADS
    kv_rows = max(1, KV // n) * hd
    shapes = {"embed_tokens": [-(-vocab // n), H], "lm_head": [-(-vocab // n), H],
              "norm.weight": [H]}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
                   p + "self_attn.qkv_proj.weight": [HEADS // n * hd + 2 * kv_rows, H],
                   p + "self_attn.o_proj.weight": [H, HEADS // n * hd],
                   p + "mlp.gate_up_proj.weight": [2 * INTER // n, H],
                   p + "mlp.down_proj.weight": [H, INTER // n]}
    return shapes


def test_each_rank_loads_only_its_shard(big_model):
    """Through the core process (a fresh process for rank 0 too, so its peak memory
    means something): every rank's parameters have exactly its shard's shapes, it read
    about its share of the checkpoint's bytes, and its memory grew by less than one
    full copy of the model while loading."""
    from pagefleet.server.engine.async_engine import AsyncEngine
    from pagefleet.server.engine.core_process import ServedEngine

    config = EngineConfig(model=str(big_model), tensor_parallel_size=2, max_model_len=256,
                          max_num_seqs=4, kv_cache_memory=8 << 20)
    served = ServedEngine(config, big_model)
    try:
        async def main():
            eng = AsyncEngine(served.core, served.ready, served.tokenizer)
            await eng.start()
            try:
                return await eng.call_utility("parallel_info")
            finally:
                eng._stopping = True
                eng._loop.remove_reader(served.core.proc.sentinel)
                eng._reader.cancel()
        info = asyncio.run(main())
    finally:
        served.core.shutdown()
    ranks = info["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    vocab = json.loads((big_model / "config.json").read_text())["vocab_size"]
    full = sum(4 * _numel(s) for s in expected_shard(0, 1, vocab).values())
    for r in ranks:
        shard = expected_shard(r["rank"], 2, vocab)
        assert r["params"] == shard
        load = r["load"]
        assert load["param_bytes"] == r["param_bytes"] == sum(
            4 * _numel(s) for s in shard.values())
        # It read its shard plus the replicated norms, not the checkpoint.
        assert load["bytes_read"] <= r["param_bytes"] < 0.6 * full
        assert load["checkpoint_bytes"] > full
        mib = 1 << 20
        print(f"rank {r['rank']}: memory grew {load['peak_rss_growth'] / mib:.1f} MiB while "
              f"loading; model {full / mib:.1f} MiB, read {load['bytes_read'] / mib:.1f} MiB")
        assert load["peak_rss_growth"] < full, (load, full)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_lazy_tensor_reads_only_the_narrowed_part(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pagefleet.server.models.lazy_tensor import LazyTensor, ReadStats

    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    stats = ReadStats()
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        lazy = LazyTensor(f.get_slice("w"), stats)
        assert lazy.shape == (64, 32) and lazy.dtype == torch.float32 and stats.bytes_read == 0
        cols = lazy.narrow(1, 16, 16).narrow(0, 8, 4)
        assert torch.equal(cols.to(torch.float64), w[8:12, 16:32].double())
        assert stats.bytes_read == 4 * 16 * 4
        assert torch.equal(torch.cat([lazy.narrow(0, 0, 2)]), w[:2])     # torch functions
        assert torch.equal(lazy.narrow(0, 3, 1).reshape(-1), w[3])        # tensor methods


# -- failures ---------------------------------------------------------------------------

def test_killing_a_worker_fails_every_request_and_exits(tiny_models, tmp_path):
    """`pagefleet serve -tp 2`: SIGKILL rank 1 mid-generation; every open request ends
    with an error naming the worker, and the server exits (non-zero) by itself."""
    model_dir = tiny_models("qwen3")
    srv = SubprocessServer([str(model_dir), "-tp", "2", "--device", "cpu",
                            "--distributed-executor-backend", "mp",
                            "--pipeline-parallel-size", "1", "--max-num-seqs", "4",
                            "--max-model-len", "2048", "--kv-cache-memory", str(16 << 20)],
                           tmp_path / "server.log").wait_ready()
    try:
        m = re.search(r"tensor-parallel worker rank 1 started \(pid (\d+)\)", srv.output())
        assert m, srv.output()
        worker = int(m.group(1))
        bodies: list[tuple[int, str]] = []
        first_tokens = threading.Semaphore(0)

        def stream(i: int) -> None:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
                    "model": str(model_dir), "prompt": f"request {i}", "max_tokens": 1500,
                    "ignore_eos": True, "stream": True}) as r:
                chunks = []
                for line in r.iter_lines():
                    chunks.append(line)
                    if len(chunks) == 3:
                        first_tokens.release()
                bodies.append((r.status_code, "\n".join(chunks)))
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for _ in threads:
            assert first_tokens.acquire(timeout=120), srv.output()
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(120)
        assert len(bodies) == 3
        for status, body in bodies:
            assert status == 200 and '"error"' in body, body[-500:]
            assert "tensor-parallel worker rank 1" in body and body.rstrip().endswith("[DONE]")
        wait_for(lambda: srv.proc.poll() is not None, 60, what="the server to exit")
        print(f"server exited {time.monotonic() - killed:.1f}s after the kill")
        assert srv.proc.returncode != 0
        out = srv.output()
        assert re.search(rf"tensor-parallel worker rank 1 \(pid {worker}\) was killed by SIGKILL",
                         out), out[-3000:]
    finally:
        srv.close()


def test_offline_engine_raises_when_a_worker_dies(tiny_models):
    from pagefleet.server.engine.tp_executor import WorkerDiedError

    llm = LLM(tiny_models("qwen3"), tensor_parallel_size=2, max_model_len=512, max_num_seqs=4,
              kv_cache_memory=8 << 20)
    try:
        pid = llm.engine.core.parallel_info()["ranks"][1]["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            llm.generate(random_prompts(3, [20, 30], 512), greedy(200))
    finally:
        llm.shutdown()


def test_a_config_error_on_every_rank_stops_startup_cleanly(tiny_models, caplog):
    """KV sizing fails on every rank alike: the user gets that ConfigError (not a
    worker-died error), and the worker is gone."""
    caplog.set_level(logging.INFO, logger="pagefleet")
    with pytest.raises(ConfigError, match="fewer than one request of --max-model-len 2048"):
        LLM(tiny_models("qwen3"), tensor_parallel_size=2, max_model_len=2048,
            kv_cache_memory=64 << 10)
    text = "\n".join(r.getMessage() for r in caplog.records)
    pid = int(re.search(r"worker rank 1 started \(pid (\d+)\)", text).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "cannot continue" not in text


# -- startup checks and flags -----------------------------------------------------------

def test_startup_checks_speak_vllms_words(tiny_models):
    from pagefleet.server.distributed.checks import check_devices, tp_shape

    with pytest.raises(ConfigError, match=r"Total number of attention heads \(4\) must be "
                                          r"divisible by tensor parallel size \(3\)"):
        LLM(tiny_models("qwen3"), tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"World size \(8\) is larger than the number of "
                                          r"available GPUs \(1\) in this node"):
        check_devices(8, "cuda", 1)
    check_devices(8, "cpu", 0)
    with pytest.raises(ConfigError, match=r"KV heads \(6\) must be divisible"):
        tp_shape(4, 8, 6, 64, 100)
    shape = tp_shape(8, 64, 2, 128, 1001)          # 2 KV heads over 8 ranks: 4 each
    assert (shape.num_heads, shape.num_kv_heads, shape.kv_replicas) == (8, 1, 4)
    assert shape.vocab_per_rank == 126 and shape.vocab_range(7, 1001) == (882, 1001)


def test_parallel_flags():
    from pagefleet.server.cli import build_configs, serve_parser

    eng, _, _ = build_configs(["m", "-tp", "2", "-pp", "1", "--distributed-executor-backend",
                               "mp"])
    assert (eng.tensor_parallel_size, eng.pipeline_parallel_size) == (2, 1)
    eng, _, _ = build_configs(["m", "--tensor-parallel-size=8", "--pipeline-parallel-size", "1"])
    assert eng.tensor_parallel_size == 8
    with pytest.raises(ConfigError, match="--pipeline-parallel-size: pipeline parallelism "
                                          r"\(2 stages\) is not supported; use "
                                          "--tensor-parallel-size"):
        build_configs(["m", "--pipeline-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--distributed-executor-backend: 'ray' is not"):
        build_configs(["m", "--distributed-executor-backend", "ray"])
    with pytest.raises(ConfigError, match="'uni' runs one process"):
        build_configs(["m", "-tp", "2", "--distributed-executor-backend", "uni"])
    with pytest.raises(ConfigError, match="--tensor-parallel-size: must be between 1 and 8"):
        build_configs(["m", "-tp", "16"])
    text = " ".join(serve_parser().format_help().split())
    assert "Short form: -tp N" in text and "Short form: -pp N" in text
