"""The Gluon ping-pong prefill kernel (server/ops/gluon_attention.py) against the shipped
Triton kernel on an H200, over 128-token pages: correctness on ragged batches (the Triton
kernel and the float32 twin as references; every cache slot past a context is NaN, as a
page's stale slots may be), then ms per call (graph-replayed and L2-flushed) and the
TFLOP/s of the long chunks. PP_VARIANTS: a JSON list of PINGPONG_CONFIG overrides.
Run: `. benchmarks/device_setup.sh; pf_env .whl-core; OUT=$OUT python3 benchmarks/gluon_pingpong_ab.py`."""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402

from gpu_bench import flushed_ms, graph_ms  # noqa: E402
from pagefleet.server.ops import attention as twin  # noqa: E402
from pagefleet.server.ops import gluon_attention as ga  # noqa: E402
from pagefleet.server.ops import triton_attention as ta  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
HQ, HK, D, BS = 28, 4, 128, 128
VARIANTS = json.loads(os.environ.get("PP_VARIANTS", "null")) or [
    {"pingpong": True}, {"pingpong": False}]
BASE = dict(ga.PINGPONG_CONFIG)


def tag(v: dict) -> str:
    return ",".join(f"{k}={v[k]}" for k in sorted(v)) or "default"


def make(seqs, dtype=torch.bfloat16, seed=0):
    """q (strided like the qkv projection's output), K/V caches over shuffled 128-token
    pages with NaN in every slot past each sequence's context, cu_seqlens, context
    lengths, block tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = sum(-(-c // BS) for _, c in seqs) + 4
    kc = torch.full((nb, BS, HK, D), float("nan"), device="cuda", dtype=dtype)
    vc = torch.full((nb, BS, HK, D), float("nan"), device="cuda", dtype=dtype)
    perm = torch.randperm(nb, device="cuda", generator=g).int()
    width = max(-(-c // BS) for _, c in seqs)
    bt = torch.zeros(len(seqs), width, dtype=torch.int32, device="cuda")
    o = 0
    for i, (_, c) in enumerate(seqs):
        n = -(-c // BS)
        bt[i, :n] = perm[o:o + n]
        o += n
        for j in range(n):
            k = min(BS, c - j * BS)
            kc[bt[i, j], :k] = torch.randn(k, HK, D, device="cuda", dtype=dtype, generator=g)
            vc[bt[i, j], :k] = torch.randn(k, HK, D, device="cuda", dtype=dtype, generator=g)
    lens = torch.tensor([q for q, _ in seqs])
    cu = torch.tensor([0] + lens.cumsum(0).tolist(), device="cuda", dtype=torch.int64)
    ctx = torch.tensor([c for _, c in seqs], device="cuda", dtype=torch.int64)
    total = int(lens.sum())
    q = torch.randn(total, HQ + 2 * HK, D, device="cuda", dtype=dtype, generator=g)[:, :HQ]
    return q, kc, vc, cu, ctx, bt


def run(kind: str, args, v: dict | None = None):
    q, kc, vc, cu, ctx, bt = args
    out = torch.empty(q.shape, device="cuda", dtype=q.dtype)
    if kind == "triton":
        return ta.paged_prefill_attention(q, kc, vc, cu, ctx, bt, D ** -0.5, out=out)
    ga.PINGPONG_CONFIG.clear()
    ga.PINGPONG_CONFIG.update({**BASE, **v})
    return ga.paged_prefill_attention(q, kc, vc, cu, ctx, bt, D ** -0.5, out, ta.PREFILL_SEQ_BLOCK)


def main() -> None:
    res = {"triton": __import__("triton").__version__, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "base": BASE, "checks": [], "times": []}
    cases = {
        "ragged": [(1, 1), (7, 7), (130, 130), (1000, 3000), (64, 64), (128, 200), (513, 1537),
                   (1, 900), (16, 4096), (300, 301), (129, 129), (255, 2000)],
        "one_long": [(4096, 6000)],
        "exact_tiles": [(128, 128), (256, 512), (64, 192)],
        "chunk_over_prefix": [(8192, 16384)],
    }
    for name, seqs in cases.items():
        args = make(seqs, seed=len(seqs))
        ref = twin.paged_prefill_attention(args[0].float(), args[1].float(), args[2].float(),
                                           *args[3:], D ** -0.5) if name != "chunk_over_prefix" else None
        tri = run("triton", args).float()
        row = {"case": name, "triton_finite": bool(torch.isfinite(tri).all())}
        if ref is not None:
            row["triton_vs_f32"] = (tri - ref).abs().max().item()
        for v in VARIANTS:
            try:
                o = run("gluon", args, v).float()
                torch.cuda.synchronize()
                r = {"vs_triton": (o - tri).abs().max().item(), "same_as_triton": bool(torch.equal(o, tri)),
                     "finite": bool(torch.isfinite(o).all())}
                if ref is not None:
                    r["vs_f32"] = (o - ref).abs().max().item()
                row[tag(v)] = r
            except Exception as e:   # noqa: BLE001 - recorded, the next variant runs
                row[tag(v)] = {"error": repr(e)[:600]}
                traceback.print_exc()
        print("check", json.dumps(row), flush=True)
        res["checks"].append(row)

    for q_len, ctx_len, nseq in ((512, 512, 16), (8192, 8192, 1), (8192, 16384, 1), (2048, 16384, 1)):
        args = make([(q_len, ctx_len)] * nseq, seed=q_len + ctx_len)
        start = ctx_len - q_len
        flops = 4 * nseq * HQ * D * q_len * (start + (q_len + 1) / 2)
        row = {"q_len": q_len, "ctx": ctx_len, "nseq": nseq}
        for name, kind, v in [("triton", "triton", None)] + [(tag(v), "gluon", v) for v in VARIANTS]:
            try:
                fn = lambda: run(kind, args, v)   # noqa: E731
                g, f = graph_ms(fn, reps=3, n=8), flushed_ms(fn)
                row[name] = {"graph_ms": round(g, 4), "flushed_ms": round(f, 4),
                             "tflops_graph": round(flops / (g / 1e3) / 1e12, 1)}
            except Exception as e:   # noqa: BLE001
                row[name] = {"error": repr(e)[:600]}
        print("time", json.dumps(row), flush=True)
        res["times"].append(row)
    (OUT / "pingpong_ab.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
