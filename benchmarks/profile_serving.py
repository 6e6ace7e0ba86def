"""Where the online misses come from, at the engine level on one GPU (issue 9): the
64-user wave, the 16K-token documents and the prefill-attention kernel behind them.

    OUT=$OUT python3 benchmarks/profile_serving.py [attn,waves,longdoc]

Phases (each in its own process with a timeout; $OUT/profile_<phase>.json):
  attn     the prefill kernel (server/ops/triton_attention.py) over launch configs at
           512 / 2,048 / 8,192-token chunks over up to 16K of context, graph-replayed and
           L2-flushed; with PAGEFLEET_ATTN_BEFORE=module:function, the same shapes
           through an earlier kernel (e.g. `git show REV:server/ops/triton_attention.py
           > benchmarks/_attn_before.py`), outputs compared
  waves    64 requests of 512 tokens arriving at once, 256 out (what the online
           64-user run's closed loop turns into: every request finishes in the same step
           and all come back together): per-step wall time and tokens, the engine's own
           time to first token, and the CUDA kernel table of the prefill steps
  sampled  the same wave greedy and with Qwen2.5-Instruct's sampling (temperature 0.7,
           top-p 0.8, top-k 20, repetition penalty 1.05): step times, TTFT, and kernel
           tables of the sampled prefill steps and of 20 decode steps of each
  host     cProfile of the host side of an 8,192-token prefill step and of mixed steps
           (PROFILE_HOST_TORCH=1: the torch profiler's CPU table instead; PROFILE_HOST_IDLE=1:
           the GPU drained before each profiled step); host_eager with
           CUDA_MODULE_LOADING=EAGER, host_no_graphs with --enforce-eager, host_sync
           without async scheduling, host_lt with every GEMM through cuBLASLt (on
           2026-12-02 the host blocked in aten::mm, classic cuBLAS, not in addmm, cuBLASLt)
  longdoc  16 documents of 16,000 tokens, 128 out, max-model-len 32,768 (the online
           long-document workload without HTTP): wall time, time to first token, the
           kernel table of the whole run (PROFILE_LONGDOC=0: not profiled);
           longdoc_pick with attn's pick as PREFILL_CONFIG, longdoc_64x32 with 64 x 32 tiles,
           longdoc_no_ahead with page_ahead off in both attention kernels, longdoc_before
           with the tiles shipped before 2026-12-02 (evening): 128 x 64, 4 warps, no page_ahead;
           longdoc_bs128 with --block-size 128 without TMA tiles, longdoc_bs128_tma with them,
           longdoc_bs16 with 16-token pages
  dattn    the decode kernel per DECODE_CONFIG variant, batch 1-256, contexts 768-16K
The model is the Qwen2.5-7B shape with random weights (benchmarks/build_model.py).
"""

from __future__ import annotations

import importlib
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
OUT = Path(os.environ.get("OUT", "/tmp/pagefleet-profile"))
BIG = Path(os.environ.get("PAGEFLEET_BENCH_MODEL", "/dev/shm/qwen2.5-7b-random"))
FLAGS = dict(max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9)


def rand_prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 151000) for _ in range(length)] for _ in range(n)]


def kernel_table(prof, top: int = 25) -> dict:
    """GPU time per kernel name (ms), the busiest first, and the total."""
    import torch
    kernels: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total / 1e3
    rows = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {"busy_ms": round(sum(kernels.values()), 2),
            "top_ms": [(k[:100], round(v, 2)) for k, v in rows]}


# -- attn -------------------------------------------------------------------------------------

def phase_attn() -> dict:
    import torch
    from gpu_bench import flushed_ms, graph_ms
    from pagefleet.server.ops import triton_attention as ta
    before = None
    if os.environ.get("PAGEFLEET_ATTN_BEFORE"):
        mod, fn = os.environ["PAGEFLEET_ATTN_BEFORE"].split(":")
        before_mod = importlib.import_module(mod)
        before = (before_mod, getattr(before_mod, fn))
    hq, hk, d = 28, 4, 128
    # (block_m, block_n, num_warps, num_stages, longest_first). 2026-12-02: a variant
    # that packed the 7 query heads of a KV head into one tile (K/V loaded once for 7)
    # ran 341 against 437 TFLOP/s at 8K over 16K: the kernel is bound by its math, not
    # its loads, and the variant was dropped (results/2026-12-02d-h200-4-*).
    # page_ahead (page ids one key tile ahead, so the K/V copies stay pipelined) is new
    # on 2026-12-02 (evening): the shipped tiles with and without it, then tiles and
    # stage counts that the deeper pipeline may favour.
    # 2026-12-03: Triton's Hopper warp specialization (load warps feeding math warps)
    # on the unmasked key loop, with the shipped tiles and those it may favour.
    # 2026-12-03 (seventh session): the cache's block size ("bs", the server's
    # --block-size) and TMA tiles ("tma": a key tile is one bulk copy of one page, which
    # needs pages of at least a tile).
    keys = ("block_m", "block_n", "num_warps", "num_stages", "longest_first", "page_ahead",
            "warp_specialize", "tma", "bs")
    variants = [(128, 128, 8, 3, True, True, False, False, 16),
                (128, 128, 8, 3, True, True, False, False, 128),
                (128, 128, 8, 3, True, True, False, True, 128),
                (128, 128, 8, 2, True, True, False, True, 128),
                (128, 128, 8, 3, True, True, True, True, 128),
                (128, 64, 4, 3, True, True, False, True, 128)]
    if os.environ.get("PAGEFLEET_ATTN_VARIANTS"):   # a JSON list of tuples in `keys` order
        variants = json.loads(os.environ["PAGEFLEET_ATTN_VARIANTS"])
    # shorter tuples: the later keys as shipped (tma off, 16-token pages)
    variants = [{"tma": False, "bs": 16, **dict(zip(keys, v))} for v in variants]
    base = dict(ta.PREFILL_CONFIG)
    res = []
    for q_len, ctx_len, nseq in ((512, 512, 16), (8192, 8192, 1), (8192, 16384, 1),
                                 (2048, 16384, 1)):
        # One set of keys and values per shape, paged at each block size, so every
        # variant's output can be compared with the first one's.
        g = torch.Generator(device="cuda").manual_seed(q_len + ctx_len)
        kl = torch.randn(nseq, ctx_len, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        vl = torch.randn(nseq, ctx_len, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        q = torch.randn(nseq * q_len, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.arange(nseq + 1, device="cuda", dtype=torch.int32) * q_len
        ctx = torch.full((nseq,), ctx_len, device="cuda", dtype=torch.int32)
        start = ctx_len - q_len
        flops = 4 * nseq * hq * d * q_len * (start + (q_len + 1) / 2)
        first_out = None
        for bs in sorted({v["bs"] for v in variants}):
            per_seq = -(-ctx_len // bs)
            nb = nseq * per_seq + 4
            kc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            vc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
            bt = torch.randperm(nb - 4, device="cuda", generator=g).view(nseq, -1)
            pad = per_seq * bs - ctx_len
            for i in range(nseq):
                kc[bt[i]] = torch.nn.functional.pad(kl[i], (0, 0, 0, 0, 0, pad)).view(per_seq, bs, hk, d)
                vc[bt[i]] = torch.nn.functional.pad(vl[i], (0, 0, 0, 0, 0, pad)).view(per_seq, bs, hk, d)
            args = (q, kc, vc, cu, ctx, bt.int(), d ** -0.5)
            for var in (v for v in variants if v["bs"] == bs):
                row = {"q_len": q_len, "ctx": ctx_len, "nseq": nseq, **var}
                for label, (mod, fn) in (("now", (ta, ta.paged_prefill_attention)),
                                         ("before", before or (None, None))):
                    if fn is None:
                        continue
                    mod.PREFILL_CONFIG.update({k: v for k, v in var.items() if k != "bs"})
                    try:
                        out = fn(*args)
                        ms = graph_ms(lambda: fn(*args), reps=3, n=8)
                        row[f"{label}_ms"] = ms
                        row[f"{label}_tflops"] = flops / (ms / 1e3) / 1e12
                        if label == "now":
                            row["flushed_ms"] = flushed_ms(lambda: fn(*args))
                            row["flushed_tflops"] = flops / (row["flushed_ms"] / 1e3) / 1e12
                        row[f"{label}_out"] = out
                    except Exception as e:  # noqa: BLE001 - a config that does not compile
                        row[f"{label}_error"] = repr(e)[:300]
                    mod.PREFILL_CONFIG.clear()
                    mod.PREFILL_CONFIG.update(base)
                a, b = row.pop("now_out", None), row.pop("before_out", None)
                if a is not None and b is not None:
                    row["bit_identical"] = bool(torch.equal(a, b))
                    row["max_abs_diff"] = (a.float() - b.float()).abs().max().item()
                if a is not None:   # against the first variant's output, same keys
                    if first_out is None:
                        first_out = a
                    row["same_as_first"] = bool(torch.equal(a, first_out))
                    row["diff_to_first"] = (a.float() - first_out.float()).abs().max().item()
                log(f"attn {row}")
                res.append(row)
    # The pick: the least L2-flushed time over every shape (a candidate, for longdoc_pick).
    tot: dict[tuple, float] = {}
    for r in res:
        if "flushed_ms" in r:
            k = tuple(r[x] for x in keys)
            tot[k] = tot.get(k, 0.0) + r["flushed_ms"]
    pick = dict(zip(keys, min(tot, key=tot.get))) if tot else None
    if pick:
        (OUT / "attn_pick.json").write_text(json.dumps(pick))
    return {"variants": res, "config_shipped": base, "pick_flushed": pick,
            "flushed_totals": {str(k): v for k, v in tot.items()}}


# DECODE_CONFIG variants phase_dattn times (the first: as shipped); "split_programs"
# given per SM (x the GPU's multiprocessors)
DATTN_VARIANTS = [{}, {"fused_merge": True}, {"num_warps": 2, "min_partition": 128},
                  {"min_partition": 32, "block_n": 32},
                  {"split_programs_per_sm": 8}, {"fused_merge": True, "split_programs_per_sm": 8}]


def phase_dattn() -> dict:
    """The decode kernel (with its reduction pass) per DECODE_CONFIG variant, at the
    batches and contexts the online runs meet: one CUDA graph of as many layers as a
    Qwen2.5-7B step has (up to 28), each over its own K/V cache, so L2 holds no layer's
    K/V when its turn comes, as in the engine; outputs compared with the shipped form."""
    import torch
    from gpu_bench import median_ms
    from pagefleet.server.config import default_block_size
    from pagefleet.server.ops import triton_attention as ta
    hq, hk, d = 28, 4, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bs = default_block_size(torch.cuda.get_device_capability())   # the engine's pages
    base = dict(ta.DECODE_CONFIG)
    res = []
    for batch, ctx_len in ((1, 1024), (1, 4096), (1, 16384), (16, 16384), (64, 1024),
                           (256, 768)):
        per = -(-ctx_len // bs)
        nb = batch * per + 4
        kv_bytes = 2 * batch * ctx_len * hk * d * 2
        layers = max(1, min(28, (6 << 30) // kv_bytes))
        g = torch.Generator(device="cuda").manual_seed(batch + ctx_len)
        caches = [(torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16, generator=g),
                   torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16, generator=g))
                  for _ in range(layers)]
        bt = torch.randperm(nb - 4, device="cuda").view(batch, per).int()
        ctx = torch.full((batch,), ctx_len, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        row: dict = {"batch": batch, "ctx": ctx_len, "layers": layers, "variants": []}
        ref = None
        for var in DATTN_VARIANTS:
            cfg = dict(var)
            if "split_programs_per_sm" in cfg:
                cfg["split_programs"] = cfg.pop("split_programs_per_sm") * sms
            ta.DECODE_CONFIG.update(cfg)
            v: dict = {"variant": var or "shipped"}
            try:
                def step():
                    return [ta.paged_decode_attention(q, kc, vc, bt, ctx, d ** -0.5)
                            for kc, vc in caches]
                out = step()[0]
                ref = out if ref is None else ref
                v["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                v["us_per_layer"] = median_ms(graph.replay, n=20) * 1e3 / layers
                v["TBps"] = kv_bytes / (v["us_per_layer"] / 1e6) / 1e12
                v["splits"] = ta.decode_plan(batch, hk, per * bs, q.device).splits
                del graph
            except Exception as e:  # noqa: BLE001
                v["error"] = repr(e)[:300]
            ta.DECODE_CONFIG.clear()
            ta.DECODE_CONFIG.update(base)
            row["variants"].append(v)
        del caches
        torch.cuda.empty_cache()
        log(f"dattn {row}")
        res.append(row)
    return {"rows": res, "config_shipped": base}


# -- waves ------------------------------------------------------------------------------------

def _run_timed(eng, prompts, params, tag: str, profile_steps: int = 0,
               profile_from: int = 0) -> dict:
    """Add every prompt at once, step to the end; per-step wall/tokens, TTFT per request.
    Steps `profile_from` to `profile_from + profile_steps` run under the CUDA profiler
    (kernels only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    steps = []
    prof = None
    n = 0
    core = eng.core
    while eng.has_unfinished_requests():
        if profile_steps and n == profile_from:
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        ts = time.perf_counter()
        computed = core.prompt_tokens_computed
        outs = eng.step()
        te = time.perf_counter()
        n += 1
        steps.append({"ms": round(1e3 * (te - ts), 2), "tokens": core._last_step_tokens,
                      "prompt_tokens": core.prompt_tokens_computed - computed,
                      "running": len(core.scheduler.running)})
        for o in outs:
            if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                first[o.request_id] = te - t0
        if prof is not None and n == profile_from + profile_steps:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            table = kernel_table(prof)
            prof = None
    wall = time.perf_counter() - t0
    ttft = sorted(first.values())
    res = {"wall_s": wall, "steps": len(steps),
           "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2] if ttft else None,
           "ttft_p95_ms": 1e3 * ttft[int(0.95 * (len(ttft) - 1))] if ttft else None,
           "first_steps": steps[:12],
           "decode_step_ms_median": statistics.median(s["ms"] for s in steps[12:]) if len(steps) > 12 else None}
    if profile_steps:
        res["profiled_steps"] = profile_steps
        res["kernels_first_steps"] = table
    return res


def _engine(max_model_len: int, max_tokens: int, **extra):
    """(engine, its load time, greedy ignore-EOS params with delta outputs)."""
    from pagefleet.server import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(str(BIG), max_model_len=max_model_len, **{**FLAGS, **extra})
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind="delta")
    return llm.engine, time.time() - t0, p


def phase_waves() -> dict:
    eng, load_s, p = _engine(8192, 256)
    res: dict = {"load_s": load_s}
    res["warm"] = _run_timed(eng, rand_prompts(1, 64, 512), p, "warm")
    res["wave"] = _run_timed(eng, rand_prompts(2, 64, 512), p, "wave")
    res["wave_profiled"] = _run_timed(eng, rand_prompts(3, 64, 512), p, "prof", profile_steps=5)
    log(f"waves: {json.dumps({k: v for k, v in res['wave'].items() if k != 'first_steps'})}")
    return res


def phase_sampled() -> dict:
    """The 64-user wave with Qwen2.5-Instruct's sampling against the same wave greedy:
    per-step times, and kernel tables of its prefill steps and of 20 decode steps."""
    from pagefleet.server import SamplingParams
    eng, load_s, greedy = _engine(8192, 256)
    sampled = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                             max_tokens=256, ignore_eos=True, output_kind="delta")
    res: dict = {"load_s": load_s}
    res["warm"] = _run_timed(eng, rand_prompts(11, 64, 512), sampled, "warm")
    res["greedy"] = _run_timed(eng, rand_prompts(12, 64, 512), greedy, "greedy")
    res["sampled"] = _run_timed(eng, rand_prompts(13, 64, 512), sampled, "sampled")
    res["sampled_prefill_prof"] = _run_timed(eng, rand_prompts(14, 64, 512), sampled, "sp",
                                             profile_steps=5)
    res["sampled_decode_prof"] = _run_timed(eng, rand_prompts(15, 64, 512), sampled, "sd",
                                            profile_steps=20, profile_from=40)
    res["greedy_decode_prof"] = _run_timed(eng, rand_prompts(16, 64, 512), greedy, "gd",
                                           profile_steps=20, profile_from=40)
    for k in ("greedy", "sampled"):
        log(f"sampled phase, {k}: " + json.dumps({x: v for x, v in res[k].items()
                                                  if x != "first_steps"}))
    return res


def phase_host(eager_modules: bool = False, blas_lt: bool = False, **engine_kw) -> dict:
    """Where a long step's host time goes (it is not overlapped when the core holds for
    arrivals): cProfile of the step that launches an 8,192-token prefill (the wave's
    first, nothing to wait for) and of three mixed steps (64 decodes + 16, 12, then 16
    new 512-token prompts; each one's time includes waiting for the decode step before
    it). `eager_modules`: CUDA_MODULE_LOADING=EAGER (every kernel loaded at start), to
    tell a first-launch module load, which may synchronize the context, from the rest."""
    if eager_modules:
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    if blas_lt:   # no-bias GEMMs (aten::mm, the blocked calls) through cuBLASLt, as addmm's are
        import torch
        torch.backends.cuda.preferred_blas_library("cublaslt")
    import cProfile
    import io
    import pstats
    eng, load_s, p = _engine(8192, 256, **engine_kw)
    _run_timed(eng, rand_prompts(31, 64, 512), p, "warm")
    res: dict = {"load_s": load_s, "engine": engine_kw, "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING")}

    def prof_step(label: str) -> None:
        if os.environ.get("PROFILE_HOST_IDLE") == "1":   # the GPU idle when the step starts
            import torch
            torch.cuda.synchronize()
        if os.environ.get("PROFILE_HOST_TORCH") == "1":   # CUDA runtime calls, by self time
            import torch
            from torch.profiler import ProfilerActivity, profile
            stats0 = torch.cuda.memory_stats()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                         record_shapes=True) as tp:
                eng.step()
            wall = 1e3 * (time.perf_counter() - t0)
            torch.cuda.synchronize()
            stats1 = torch.cuda.memory_stats()
            table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                            max_name_column_width=70)
            # The single slowest CPU ops (one blocked call, or each call a little?), in
            # launch order among the step's aten::mm/addmm calls, with their shapes.
            gemms = [e for e in tp.events() if e.name in ("aten::mm", "aten::addmm")]
            slow = sorted(range(len(gemms)), key=lambda i: -gemms[i].cpu_time_total)[:10]
            slowest = [(i, gemms[i].name, str(gemms[i].input_shapes)[:90],
                        round(gemms[i].cpu_time_total / 1e3, 2)) for i in slow]
            allocs = {k: stats1[k] - stats0[k] for k in ("num_device_alloc", "num_device_free",
                                                         "num_alloc_retries", "num_sync_all_streams")
                      if k in stats1}
            res[label] = {"wall_ms": wall, "torch_table": table, "slowest_gemms": slowest,
                          "allocator": allocs, "gemm_calls": len(gemms)}
            log(f"host {label}: {wall:.1f} ms; allocator {allocs}; slowest GEMM calls "
                f"{slowest[:5]}\n{table}")
            return
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        eng.step()
        pr.disable()
        wall = 1e3 * (time.perf_counter() - t0)
        buf = io.StringIO()
        st = pstats.Stats(pr, stream=buf)
        st.sort_stats("tottime").print_stats(12)
        st.sort_stats("cumulative").print_stats(25)
        res[label] = {"wall_ms": wall, "stats": buf.getvalue()[-9000:]}
        log(f"host {label}: {wall:.1f} ms")

    for i, pr_ in enumerate(rand_prompts(32, 64, 512)):
        eng.add_request(f"h-{i}", pr_, p)
    prof_step("prefill_first_step")
    n = 0
    joins = {30: (16, "mixed_16"), 40: (12, "mixed_12"), 50: (16, "mixed_16_again"),
             60: (5, "mixed_5")}
    while eng.has_unfinished_requests():
        ts = time.perf_counter()
        eng.step()
        n += 1
        if n in (29, 39, 49, 59):
            res[f"decode_step_{n}_ms"] = 1e3 * (time.perf_counter() - ts)
        if n in joins:
            k, label = joins[n]
            for i, pr_ in enumerate(rand_prompts(33 + n, k, 512)):
                eng.add_request(f"m{n}-{i}", pr_, p)
            prof_step(label)
    return res


def phase_longdoc(tiles: str = "shipped", override: dict | None = None,
                  decode_override: dict | None = None, **engine_kw) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagefleet.server.ops import triton_attention as ta
    if tiles == "pick" and (OUT / "attn_pick.json").exists():
        pick = json.loads((OUT / "attn_pick.json").read_text())
        engine_kw["block_size"] = pick.pop("bs", 16)   # the cache's pages, for the engine
        ta.PREFILL_CONFIG.update(pick)
    elif override:
        ta.PREFILL_CONFIG.update(override)
    ta.DECODE_CONFIG.update(decode_override or {})
    eng, load_s, p = _engine(32768, 128, **engine_kw)
    res: dict = {"load_s": load_s, "engine_kw": engine_kw}
    res["warm"] = _run_timed(eng, rand_prompts(5, 2, 16000), p, "warm")
    res["run"] = _run_timed(eng, rand_prompts(6, 16, 16000), p, "docs")
    res["run"]["out_tok_s"] = 16 * 128 / res["run"]["wall_s"]
    res["prefill_config"] = dict(ta.PREFILL_CONFIG)
    log(f"longdoc ({tiles} tiles {res['prefill_config']}): {res['run']['out_tok_s']:.0f} out tok/s")
    if os.environ.get("PROFILE_LONGDOC", "1") == "0":
        return res
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = _run_timed(eng, rand_prompts(7, 16, 16000), p, "prof")
        torch.cuda.synchronize()
    res["profiled"] = {"wall_s": r["wall_s"], "kernels": kernel_table(prof, top=30)}
    log(f"longdoc: {res['run']['out_tok_s']:.0f} out tok/s, TTFT p50 {res['run']['ttft_p50_ms']:.0f} ms")
    return res


PHASES = {"attn": (phase_attn, 150), "waves": (phase_waves, 150), "sampled": (phase_sampled, 200),
          "host": (phase_host, 150), "host_eager": (lambda: phase_host(True), 200),
          "host_no_graphs": (lambda: phase_host(enforce_eager=True), 200),
          "host_sync": (lambda: phase_host(async_scheduling=False), 200),
          "host_lt": (lambda: phase_host(blas_lt=True), 200), "longdoc": (phase_longdoc, 150),
          "longdoc_pick": (lambda: phase_longdoc("pick"), 150),
          "longdoc_64x32": (lambda: phase_longdoc("64x32", dict(block_m=64, block_n=32,
                                                                num_warps=4, num_stages=3)), 150),
          "dattn": (phase_dattn, 150),
          "longdoc_before": (lambda: phase_longdoc("before 2026-12-02 evening", dict(
              block_m=128, block_n=64, num_warps=4, num_stages=3, page_ahead=False)), 150),
          "longdoc_no_ahead": (lambda: phase_longdoc("no page_ahead", dict(page_ahead=False),
                                                     dict(page_ahead=False)), 150),
          # 128-token cache pages (the Hopper default since the seventh session): one page
          # id a key tile, without and with TMA tiles; 16-token pages (the default before)
          "longdoc_bs128": (lambda: phase_longdoc("bs128", dict(tma=False), block_size=128), 150),
          "longdoc_bs128_tma": (lambda: phase_longdoc("bs128 tma", dict(tma=True),
                                                      block_size=128), 150),
          "longdoc_bs16": (lambda: phase_longdoc("bs16", block_size=16), 150),
          # the Gluon ping-pong kernel (ops/gluon_attention.py) on and off, 128-token pages
          "longdoc_pingpong": (lambda: phase_longdoc("gluon ping-pong", dict(
              gluon_pingpong=True), block_size=128), 150),
          "longdoc_triton": (lambda: phase_longdoc("triton", dict(gluon_pingpong=False),
                                                   block_size=128), 150)}


def main() -> None:
    phase_runner.main(__file__, PHASES, OUT, "profile", list(PHASES))


if __name__ == "__main__":
    main()
