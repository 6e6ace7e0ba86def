"""One short GPU call that checks the serving path on CUDA and times its steps.

Phases (each in its own process, results in $OUT/check.json, a table printed last):
  parity   small float32 model: pagefleet (Triton, CUDA graphs, chunked/mixed steps,
           prefix hits, preemption, async on/off) against HF transformers' greedy loop
  server   `pagefleet serve` with the core in its own process on the GPU: concurrent
           streams, chat + logprobs, then SIGKILL the core: /health 503, streams 5xx
  steps    Qwen2.5-7B shape, bf16: decode step at B = 1/64/256 (1K context), a mixed
           step (64 decodes + a 2,048-token prefill chunk), sampled vs greedy decode
           at B = 64, and offline 1,024 x 512/256 with the engine's defaults
  prefill  prefill-attention launch configs at 512 and 16K context
  nosync   small model, every sampling feature at once (penalties, top-k/top-p, min-p's
           sort path, seeds, min_tokens, logit_bias, logprobs, prompt logprobs) in
           chunked mixed steps, under torch.cuda.set_sync_debug_mode("warn"): the Python
           stack of every synchronizing call a step makes (the goal is none)

    bash benchmarks/run_gpu.sh ... is not needed: python3 benchmarks/gpu_check.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
OUT = Path(os.environ.get("OUT", "/tmp/pagefleet-check"))
SMALL = Path("/dev/shm/pf-small")
BIG = Path(os.environ.get("PAGEFLEET_BENCH_MODEL", "/dev/shm/qwen2.5-7b-random"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def part(name: str, data: dict) -> None:
    (OUT / f"check_{name}.json").write_text(json.dumps(data, indent=1, default=str))


def rand_prompts(seed: int, lens: list[int], hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, hi) for _ in range(n)] for n in lens]


def build_small() -> None:
    from build_model import build
    if not (SMALL / "config.json").exists():
        build(SMALL, hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1024,
              vocab=32000, max_pos=4096, std=0.3)


# -- parity ---------------------------------------------------------------------------------

def hf_greedy(model_dir, prompts, n):
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = []
            for _ in range(n):   # plain loop without a cache: exact, small model
                tok = int(m(input_ids=ids).logits[0, -1].argmax())
                gen.append(tok)
                ids = torch.cat([ids, torch.tensor([[tok]], device="cuda")], 1)
            outs.append(gen)
    del m
    torch.cuda.empty_cache()
    return outs


def phase_parity() -> dict:
    from pagefleet.server import LLM, SamplingParams
    build_small()
    shared = rand_prompts(3, [300], 32000)[0]
    prompts = rand_prompts(1, [1, 17, 100, 513, 37, 250], 32000)
    prompts += [shared + t for t in rand_prompts(2, [5, 60, 17], 32000)]
    n = 32
    ref = hf_greedy(SMALL, prompts, n)
    res = {"distinct": [len(set(r)) for r in ref]}
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    cases = {
        "graphs": dict(max_num_seqs=8, max_num_batched_tokens=2048),
        "chunked_mixed": dict(max_num_seqs=8, max_num_batched_tokens=96),
        "eager": dict(max_num_seqs=8, max_num_batched_tokens=256, enforce_eager=True),
        "sync": dict(max_num_seqs=8, max_num_batched_tokens=256, async_scheduling=False),
        # 48 blocks of 16 hold 768 tokens: the first six prompts need 1,110 (80 blocks
        # held 1,280 and never preempted on 2026-12-01: the case was fixed after that run).
        # max-model-len 768: the engine refuses a pool smaller than one longest request.
        "preempt": dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=48,
                        max_model_len=768, block_size=16),
        # The cases above take the device's default block size (128 on Hopper: one page a
        # key tile); 16-token pages, a page id per key, here.
        "block_16": dict(max_num_seqs=8, max_num_batched_tokens=256, block_size=16),
    }
    for name, kw in cases.items():
        t0 = time.time()
        llm = LLM(str(SMALL), dtype="float32", **{"max_model_len": 2048, **kw},
                  gpu_memory_utilization=0.3)
        first = llm.generate(prompts[:6], greedy)
        rest = llm.generate(prompts[6:], greedy)
        got = [o.outputs[0].token_ids for o in first + rest]
        st = llm.stats()
        llm.engine.core.check_whole()
        res[name] = {"equal_hf": got == ref, "seq_equal": sum(a == b for a, b in zip(got, ref)),
                     "prefix_hits": st["prefix_cache_hits"], "preemptions": st["num_preemptions"],
                     "overlapped": llm.engine.num_overlapped_steps, "s": time.time() - t0,
                     # mixed steps through the piecewise CUDA graphs (engine/piecewise.py)
                     "piece_steps": getattr(llm.engine.runner._pieces, "num_steps", 0)}
        log(f"parity {name}: {res[name]}")
        del llm
    # bf16 with 128-token pages, where prefill key tiles come by TMA: the same tokens as
    # with 16-token pages' per-key loads (the kernels' tiles and sums are the same).
    bf16 = {}
    for bs in (16, 128):
        llm = LLM(str(SMALL), dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.3,
                  max_num_seqs=8, max_num_batched_tokens=256, block_size=bs)
        bf16[bs] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        llm.engine.core.check_whole()
        del llm
    res["bf16_block_128_tma_equals_16"] = bf16[16] == bf16[128]
    res["bf16_seq_equal_hf"] = sum(a == b for a, b in zip(bf16[16], ref))
    log(f"parity bf16 block 128 (TMA) == 16: {res['bf16_block_128_tma_equals_16']}")
    # Seeded sampling: alone vs in a crowd (on a GPU the logits themselves may differ in
    # the last bits with the batch shape; reported, not required).
    llm = LLM(str(SMALL), dtype="float32", max_model_len=2048, gpu_memory_utilization=0.3,
              max_num_seqs=8)
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=24,
                        ignore_eos=True, repetition_penalty=1.1)
    alone = llm.generate([prompts[2]], sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)] * 4
    crowd = llm.generate([prompts[0], prompts[1], prompts[2], prompts[3], prompts[4]],
                         others[:2] + [sp] + others[2:])[2].outputs[0].token_ids
    res["seeded_alone_equals_crowd"] = alone == crowd
    res["seeded_distinct"] = len(set(alone))
    return res


# -- nosync ---------------------------------------------------------------------------------

def phase_nosync() -> dict:
    """Steps must never wait for the device (module docstring of engine/runner.py): a
    synchronizing call in `_launch` or `_sample` costs the whole async overlap."""
    import traceback as tb
    import warnings

    import torch
    from pagefleet.server import LLM, SamplingParams
    build_small()
    llm = LLM(str(SMALL), dtype="float32", max_model_len=2048, gpu_memory_utilization=0.3,
              max_num_seqs=8, max_num_batched_tokens=96)
    prompts = rand_prompts(21, [5, 140, 33, 300, 9, 70, 18, 64], 32000)
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                       max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, min_p=0.05, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, min_tokens=12, max_tokens=24),
        SamplingParams(temperature=0.8, logit_bias={11: 5.0, 12: -100.0}, max_tokens=24,
                       ignore_eos=True),
        SamplingParams(temperature=0.8, logprobs=3, frequency_penalty=0.5,
                       presence_penalty=0.2, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=24, ignore_eos=True),
    ]
    llm.generate(prompts, params)            # warm-up: buffers grown, kernels compiled
    stacks: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message) and "set_sync_debug_mode" not in "".join(tb.format_stack(limit=4)):
            key = "".join(tb.format_stack(limit=12)[:-1])
            stacks[key] = stacks.get(key, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            outs = llm.generate(rand_prompts(22, [5, 140, 33, 300, 9, 70, 18, 64], 32000),
                                params)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    llm.engine.core.check_whole()
    res = {"syncs": sum(stacks.values()), "distinct_stacks": len(stacks),
           "stacks": [{"count": c, "stack": k[-3000:]} for k, c in
                      sorted(stacks.items(), key=lambda kv: -kv[1])[:8]],
           "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    log(f"nosync: {res['syncs']} synchronizing calls from {res['distinct_stacks']} places")
    return res


# -- server ---------------------------------------------------------------------------------

def phase_server() -> dict:
    import asyncio

    import httpx
    build_small()
    port = 8123
    logf = open(OUT / "server_small.log", "w")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pagefleet.server.cli", "serve", str(SMALL),
                             "--served-model-name", "small", "--max-model-len", "2048",
                             "--gpu-memory-utilization", "0.3", "--port", str(port),
                             "--host", "127.0.0.1"], stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    res: dict = {}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        res["startup_s"] = time.time() - t0
        prompts = rand_prompts(5, [50] * 16, 32000)

        async def streams():
            async with httpx.AsyncClient(timeout=120) as c:
                async def one(p, n):
                    body = {"model": "small", "prompt": p, "max_tokens": n, "ignore_eos": True,
                            "stream": True, "temperature": 0.7, "top_k": 20}
                    async with c.stream("POST", url + "/v1/completions", json=body) as r:
                        return r.status_code, (await r.aread()).decode()
                rs = await asyncio.gather(*[one(p, 64) for p in prompts])
                chat = await c.post(url + "/v1/completions", json={
                    "model": "small", "prompt": [5, 6, 7], "max_tokens": 8, "logprobs": 2,
                    "echo": True})   # token ids: its tokenizer has no words for text
                return rs, chat
        rs, chat = asyncio.run(streams())
        res["streams_ok"] = sum(s == 200 and b.rstrip().endswith("[DONE]") for s, b in rs)
        res["chat_status"] = chat.status_code
        res["completion_has_logprobs"] = bool((chat.json().get("choices") or [{}])[0].get("logprobs"))

        async def kill_mid_stream():
            async with httpx.AsyncClient(timeout=120) as c:
                async def one():
                    body = {"model": "small", "prompt": prompts[0], "max_tokens": 1900,
                            "ignore_eos": True, "stream": True}
                    async with c.stream("POST", url + "/v1/completions", json=body) as r:
                        return r.status_code, (await r.aread()).decode()
                tasks = [asyncio.create_task(one()) for _ in range(4)]
                await asyncio.sleep(1.0)
                core = [int(x) for x in subprocess.run(["pgrep", "-P", str(proc.pid)],
                                                        capture_output=True, text=True).stdout.split()]
                for pid in core:
                    os.kill(pid, signal.SIGKILL)
                t = time.monotonic()
                while (await c.get(url + "/health")).status_code != 503:
                    await asyncio.sleep(0.02)
                dt = time.monotonic() - t
                return dt, await asyncio.gather(*tasks), core
        dt, killed, core = asyncio.run(kill_mid_stream())
        res["core_pids"] = core
        res["health_503_after_s"] = dt
        res["killed_streams_5xx"] = sum('"code":500' in b for _, b in killed)
        proc.wait(30)
        res["server_exit_code"] = proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return res


# -- steps ----------------------------------------------------------------------------------

def step_times(llm, reqs, params, n_steps=30) -> float:
    import torch
    eng = llm.engine
    for i, p in enumerate(reqs):
        eng.add_request(f"s{time.monotonic_ns()}-{i}", p, params)
    while eng.core.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in eng.core.scheduler.running.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(n_steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    for rid in list(eng.processor.states):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return 1e3 * statistics.median(times)


def phase_steps() -> dict:
    import torch
    from build_model import build
    from pagefleet.server import LLM, SamplingParams
    if not (BIG / "config.json").exists():
        t0 = time.time()
        build(BIG)
        log(f"built 7B in {time.time() - t0:.0f} s")
    res: dict = {}
    t0 = time.time()
    llm = LLM(str(BIG), max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=8192,
              gpu_memory_utilization=0.9)
    res["load_s"] = time.time() - t0
    greedy = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True, output_kind="final")
    sampled = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                             max_tokens=2000, ignore_eos=True, output_kind="final")
    for b in (1, 16, 64, 256):
        res[f"decode_B{b}_ms"] = step_times(llm, rand_prompts(b, [1024] * b, 151000), greedy)
        log(f"decode B={b}: {res[f'decode_B{b}_ms']:.2f} ms")
    res["sampled_B64_ms"] = step_times(llm, rand_prompts(7, [1024] * 64, 151000), sampled)
    log(f"sampled B=64: {res['sampled_B64_ms']:.2f} ms")
    # Mixed: 64 decodes plus a 2048-token prefill chunk each step.
    eng = llm.engine
    for i, p in enumerate(rand_prompts(11, [1024] * 64, 151000)):
        eng.add_request(f"mix{i}", p, greedy)
    while eng.core.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in eng.core.scheduler.running.values()):
        eng.step()
    long_p = rand_prompts(12, [2048 * 6], 151000)[0][:8000]
    eng.add_request("mix-long", long_p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.engine.core.scheduler.long_prefill_token_threshold = 2048
    torch.cuda.synchronize()
    times = []
    for _ in range(4):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    res["mixed_64dec_2048pre_ms"] = [1e3 * x for x in times]
    log(f"mixed steps: {res['mixed_64dec_2048pre_ms']}")
    for rid in list(eng.processor.states):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    del llm, eng
    torch.cuda.empty_cache()
    # Offline: with the engine's own defaults (by use and device), then 8192 / 256.
    prompts = rand_prompts(21, [512] * 1024, 151000)
    p = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for name, kw in (("defaults", {}), ("8192x256", dict(max_num_batched_tokens=8192,
                                                          max_num_seqs=256))):
        t0 = time.time()
        llm = LLM(str(BIG), **kw)
        res[f"offline_{name}_load_s"] = time.time() - t0
        res[f"offline_{name}_config"] = {"max_num_seqs": llm.config.max_num_seqs,
                                         "max_num_batched_tokens": llm.config.max_num_batched_tokens}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, p)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res[f"offline_{name}_tok_s"] = n / dt
        res[f"offline_{name}_s"] = dt
        log(f"offline {name} {res[f'offline_{name}_config']}: {n / dt:.0f} tok/s")
        del llm
        torch.cuda.empty_cache()
    return res


# -- prefill kernel configs --------------------------------------------------------------------

def phase_prefill() -> dict:
    import torch
    from gpu_bench import graph_ms
    from pagefleet.server.ops import triton_attention as ta
    hq, hk, d, bs = 28, 4, 128, 16
    res = []
    base = dict(ta.PREFILL_CONFIG)
    for q_len, ctx_len in ((512, 512), (8192, 16384), (2048, 8192)):
        nseq = max(1, 8192 // q_len) if q_len == 512 else 1
        nb = nseq * (-(-ctx_len // bs)) + 4
        kc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
        bt = torch.randperm(nb - 4, device="cuda").view(nseq, -1).int()
        cu = torch.arange(nseq + 1, device="cuda", dtype=torch.int32) * q_len
        ctx = torch.full((nseq,), ctx_len, device="cuda", dtype=torch.int32)
        q = torch.randn(nseq * q_len, hq, d, device="cuda", dtype=torch.bfloat16)
        start = ctx_len - q_len
        flops = 4 * nseq * hq * d * q_len * (start + (q_len + 1) / 2)
        ref = None
        for var in [dict(block_m=64, block_n=64, num_warps=4, num_stages=2),
                    dict(block_m=64, block_n=32, num_warps=4, num_stages=3),
                    dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
                    dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
                    dict(block_m=128, block_n=32, num_warps=8, num_stages=3),
                    dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
                    dict(block_m=128, block_n=128, num_warps=8, num_stages=2)]:
            ta.PREFILL_CONFIG.update(var)
            try:
                out = ta.paged_prefill_attention(q, kc, vc, cu, ctx, bt, d ** -0.5)
                if ref is None:
                    ref = out.float()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ms = graph_ms(lambda: ta.paged_prefill_attention(q, kc, vc, cu, ctx, bt, d ** -0.5),
                              reps=3, n=8)
            except Exception as e:  # noqa: BLE001
                ms, err = float("nan"), repr(e)[:200]
            res.append({"q_len": q_len, "ctx": ctx_len, "nseq": nseq, **var, "ms": ms,
                        "tflops": flops / (ms / 1e3) / 1e12 if ms == ms else None, "err": err})
            log(f"prefill {res[-1]}")
        ta.PREFILL_CONFIG.update(base)
    return {"variants": res}


# -- offline: the side-by-side figure, warmed up as vllm_offline.py warms vLLM ------------------

def phase_offline() -> dict:
    import torch

    from pagefleet.server import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(str(BIG))
    res = {"load_s": time.time() - t0,
           "config": {"max_num_seqs": llm.config.max_num_seqs,
                      "max_num_batched_tokens": llm.config.max_num_batched_tokens}}
    p = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(rand_prompts(22, [512] * 8, 151000), p)            # warm-up, as for vLLM
    prompts = rand_prompts(21, [512] * 1024, 151000)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, p)
    dt = time.perf_counter() - t0
    res["tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
    res["s"] = dt
    log(f"offline (warmed) {res}")
    return res


# -- profile: where the offline run's time goes ------------------------------------------------

def phase_profile() -> dict:
    """The offline workload at half size under the CUDA profiler (kernels only, so the
    host is not slowed): GPU busy time against wall time says whether the host or the
    device bounds the run, and the kernel table says which kernels the device spends on."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagefleet.server import LLM, SamplingParams
    llm = LLM(str(BIG))
    prompts = rand_prompts(31, [512] * 512, 151000)
    p = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(rand_prompts(32, [512] * 16, 151000), p)       # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, p)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    kernels: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total / 1e3
    busy_ms = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    st = llm.stats()
    return {"wall_s": wall, "tok_s": n / wall, "gpu_busy_s": busy_ms / 1e3,
            "gpu_busy_frac": busy_ms / 1e3 / wall, "steps": st.get("num_steps"),
            "top_kernels_ms": [(k[:90], round(v, 1)) for k, v in top],
            "config": {"max_num_seqs": llm.config.max_num_seqs,
                       "max_num_batched_tokens": llm.config.max_num_batched_tokens}}


PHASES = {"parity": phase_parity, "server": phase_server, "steps": phase_steps,
          "prefill": phase_prefill, "profile": phase_profile, "offline": phase_offline,
          "nosync": phase_nosync}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        name = sys.argv[2]
        try:
            data = PHASES[name]()
        except Exception:  # noqa: BLE001 - the error is the result
            traceback.print_exc()
            data = {"error": traceback.format_exc()[-3000:]}
        part(name, data)
        return
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(PHASES)
    limits = {"parity": 200, "server": 100, "steps": 300, "prefill": 80, "profile": 120, "offline": 100,
              "nosync": 100}
    result = {}
    for name in names:
        t0 = time.time()
        log(f"== {name}")
        try:
            subprocess.run([sys.executable, __file__, "--phase", name], timeout=limits[name])
        except subprocess.TimeoutExpired:
            log(f"{name} timed out")
        f = OUT / f"check_{name}.json"
        result[name] = json.loads(f.read_text()) if f.exists() else {"error": "no result"}
        result[name]["phase_s"] = time.time() - t0
        (OUT / "check.json").write_text(json.dumps(result, indent=1, default=str))
    print("\n==== gpu_check ====")
    for name, r in result.items():
        short = {k: v for k, v in r.items() if k != "variants"}
        print(name, json.dumps(short, default=str)[:1500])
    for v in result.get("prefill", {}).get("variants", []):
        print("prefill", {k: v[k] for k in ("q_len", "ctx", "block_m", "block_n", "num_warps",
                                           "num_stages", "ms", "tflops")})


if __name__ == "__main__":
    main()
