"""Structured outputs on the GPU, in one call (a lent H200; see the README).

1. kernels: the Triton bitmask kernel against its torch twin at real shapes (vocab
   152,064, batch 256, 1/16/64/256 constrained rows, bf16 and fp32, with and without row
   indices): bit-exact, no host sync (torch's sync debug mode set to "error" around each
   call), and the time of each (CUDA events, median of 50 after warm-up). With xgrammar
   importable, its own Triton kernel is timed beside them.
2. step (needs xgrammar): the per-step path as the sampler runs it, for 1/16/64/256 rows
   of a JSON schema over a 152k-token vocabulary: `BitmaskBuffers.stage` (host fill +
   pinned non_blocking upload) then `apply` on the logits, then sampling and the
   tokens' readback, for 30 steps; reports host fill ms, stage ms, apply ms and the
   number of times the double buffer had to wait (expected 0).

Results: `$OUT/structured_output_gpu.json` and a printed table.

    mkdir -p /tmp/pf/pagefleet && ln -sfn "$PWD/server" /tmp/pf/pagefleet/server
    PYTHONPATH=/tmp/pf python3 benchmarks/structured_output_gpu.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from pagefleet.server.ops import bitmask as twin
from pagefleet.server.ops import triton_bitmask

VOCAB, BATCH, ROWS = 152_064, 256, (1, 16, 64, 256)


def cuda_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def no_sync(fn) -> None:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def random_bitmask(n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    words = (vocab + 31) // 32
    return torch.randint(-(2 ** 31), 2 ** 31 - 1, (n, words), generator=g,
                         dtype=torch.int64).to(torch.int32)


def kernels(out: dict) -> None:
    g = torch.Generator().manual_seed(0)
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    res = out.setdefault("kernels", {})
    for dtype in (torch.bfloat16, torch.float32):
        for n in ROWS:
            for with_rows in (True, False):
                if not with_rows and n != BATCH:
                    continue
                logits = torch.randn(BATCH, VOCAB, generator=g).to(dtype).cuda()
                bm = random_bitmask(n, VOCAB, g).cuda()
                rows = torch.randperm(BATCH, generator=g)[:n].to(torch.int32).cuda() \
                    if with_rows else None
                warm = logits.clone()                    # JIT compile outside the check
                triton_bitmask.apply_token_bitmask(warm, bm, rows)
                twin.apply_token_bitmask(warm, bm, rows)
                ref, got = logits.clone(), logits.clone()
                no_sync(lambda r=ref, m=bm, i=rows: twin.apply_token_bitmask(r, m, i))
                no_sync(lambda r=got, m=bm, i=rows: triton_bitmask.apply_token_bitmask(r, m, i))
                torch.cuda.synchronize()
                assert torch.equal(ref, got), f"triton != twin ({dtype}, {n}, {with_rows})"
                work = logits.clone()
                key = f"{str(dtype).split('.')[-1]} rows={n}{'' if with_rows else ' (all)'}"
                res[key] = {
                    "triton_ms": cuda_ms(lambda w=work, m=bm, i=rows:
                                         triton_bitmask.apply_token_bitmask(w, m, i)),
                    "torch_twin_ms": cuda_ms(lambda w=work, m=bm, i=rows:
                                             twin.apply_token_bitmask(w, m, i)),
                }
                if xgr is not None:
                    full = torch.full((BATCH, bm.shape[1]), -1, dtype=torch.int32,
                                      device="cuda")
                    idx = rows if rows is not None else None
                    if rows is not None:
                        full[rows.long()] = bm
                    res[key]["xgrammar_triton_ms"] = cuda_ms(
                        lambda w=work, f=full, i=idx: xgr.apply_token_bitmask_inplace(
                            w, f, indices=i))
                print(key, {k: round(v, 4) for k, v in res[key].items()}, flush=True)


def step_path(out: dict) -> None:
    try:
        import xgrammar as xgr
    except ImportError:
        out["step"] = "skipped: xgrammar not importable (carry its wheels, see the report)"
        print(out["step"])
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from grammar_gil import big_vocab, schema

    from pagefleet.server.engine import structured_output as so

    vocab = big_vocab(VOCAB)
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=8).compile_grammar(
        so.parse_grammar(so.GrammarSpec.json_schema(schema(8))))
    out["compile_s"] = time.perf_counter() - t0
    res = out.setdefault("step", {})
    for n in ROWS:
        states = [so.StructuredState(compiled, [0]) for _ in range(n)]
        buf = so.BitmaskBuffers(BATCH, VOCAB, "cuda", fill_threads=8)
        g = torch.Generator(device="cuda").manual_seed(n)
        fill_ms, stage_ms, apply_ms = [], [], []
        for _ in range(30):
            live = [(i, st) for i, st in enumerate(states) if not st.is_terminated()]
            if not live:
                break
            logits = torch.randn(BATCH, VOCAB, device="cuda", generator=g)  # the forward
            t0 = time.perf_counter()
            so.fill(live, torch.empty(len(live), buf.words, dtype=torch.int32), threads=8)
            fill_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            staged = buf.stage(live)
            stage_ms.append((time.perf_counter() - t0) * 1e3)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            no_sync(lambda x=logits, st=staged: so.apply(x, *st))
            b.record()
            tokens = torch.argmax(logits, dim=-1).cpu().tolist()       # the readback
            apply_ms.append(a.elapsed_time(b))
            for i, st in live:
                assert st.accept(tokens[i]), "a masked argmax was refused by its grammar"
        res[n] = {"host_fill_ms": statistics.median(fill_ms),
                  "stage_ms": statistics.median(stage_ms),
                  "apply_ms": statistics.median(apply_ms), "double_buffer_waits": buf.waits}
        print(f"step rows={n}", {k: round(v, 3) for k, v in res[n].items()}, flush=True)


def main() -> None:
    assert torch.cuda.is_available()
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "vocab": VOCAB, "batch": BATCH}
    kernels(out)
    step_path(out)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "structured_output_gpu.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
