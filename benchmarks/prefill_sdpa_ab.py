"""Long prefill chunks: pagefleet's paged Triton prefill kernel against torch's fused
attention backends (cuDNN, FlashAttention-2) on the same K/V gathered from the cache.

Why: the 16 x 16K-document workload is the one issue-9 target still missed (~4%), and
its profile puts a quarter of the run in `_prefill_kernel` at 437-456 TFLOP/s, where
FlashAttention-3-class kernels reach ~600 on Hopper. This script answers whether a
backend that torch already ships would pay for a contiguous gather of the prefix's
pages: every variant's time includes the work it needs from the paged cache onward
(the gather, the GQA expansion where the backend wants it, the copy back into the
`[tokens, heads, dim]` output), with L2 emptied between calls as in the engine.

    OUT=$OUT python3 benchmarks/prefill_sdpa_ab.py     # PYTHONPATH as device_setup.sh sets

Writes $OUT/prefill_sdpa.json: per shape, each variant's ms, TFLOP/s and max |diff|
against the Triton kernel's output (or the error a backend raised).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import flushed_ms, log  # noqa: E402

from pagefleet.server.ops import triton_attention as ta  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/pagefleet-bench"))
HQ, HK, D, BS = 28, 4, 128, 16
SHAPES = ((8192, 8192, 1), (8192, 16384, 1), (2048, 16384, 1), (4096, 4096, 1),
          (2048, 2048, 4))


def gather(cache: torch.Tensor, pages: torch.Tensor, ctx: int) -> torch.Tensor:
    """One sequence's `[1, kv_heads, ctx, dim]` (a BSHD-strided view) from its pages."""
    return cache.index_select(0, pages).view(-1, HK, D)[:ctx].unsqueeze(0).transpose(1, 2)


def merge(o1, l1, o2, l2):
    """Two softmax-normalised partial attentions over disjoint keys, by their LSEs."""
    l1, l2 = l1.reshape(o1.shape[:-1]), l2.reshape(o2.shape[:-1])
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]


def sdpa_path(backend: str, expand: bool, split: bool):
    """A function of the Triton kernel's arguments that computes the same attention."""
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def run(q, kc, vc, cu, ctx_host, bt, scale, out):
        for b in range(len(ctx_host)):
            s, e = cu[b], cu[b + 1]
            q_len, ctx = e - s, ctx_host[b]
            pages = bt[b, : -(-ctx // BS)]
            k, v = gather(kc, pages, ctx), gather(vc, pages, ctx)
            if expand:
                k = k.repeat_interleave(HQ // HK, dim=1)
                v = v.repeat_interleave(HQ // HK, dim=1)
            qb = q[s:e].unsqueeze(0).transpose(1, 2)
            kw = {} if expand else {"enable_gqa": True}
            with sdpa_kernel([be]):
                if q_len == ctx:
                    o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, **kw)
                elif split:
                    # Prefix keys (all visible) and the chunk's own keys (causal, square),
                    # merged by their log-sum-exps.
                    p = ctx - q_len
                    op = torch.ops.aten._scaled_dot_product_cudnn_attention(
                        qb, k[:, :, :p], v[:, :, :p], None, True, 0.0, False, False, scale=scale)
                    oc = torch.ops.aten._scaled_dot_product_cudnn_attention(
                        qb, k[:, :, p:], v[:, :, p:], None, True, 0.0, True, False, scale=scale)
                    o = merge(op[0].float(), op[1].float(), oc[0].float(), oc[1].float())
                else:
                    from torch.nn.attention.bias import causal_lower_right
                    o = F.scaled_dot_product_attention(
                        qb, k, v, attn_mask=causal_lower_right(q_len, ctx), scale=scale, **kw)
            out[s:e] = o[0].transpose(0, 1)
        return out
    return run


VARIANTS = {
    "cudnn_gqa": ("cudnn", False, False), "cudnn_expand": ("cudnn", True, False),
    "cudnn_split_expand": ("cudnn", True, True), "cudnn_split_gqa": ("cudnn", False, True),
    "flash_gqa": ("flash", False, False), "flash_expand": ("flash", True, False),
}


def first_calls() -> list[dict]:
    """Wall time of cuDNN's first call at shapes it has not seen (it builds an execution
    plan per shape; a server's chunk lengths change every step), against a repeat."""
    g = torch.Generator(device="cuda").manual_seed(7)
    rows = []
    for q_len, ctx in ((8000, 8000), (8001, 8001), (7808, 16000), (7809, 16001),
                       (8100, 16100)):
        q = torch.randn(1, HQ, q_len, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, HQ, ctx, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                try:
                    torch.ops.aten._scaled_dot_product_cudnn_attention(
                        q, k, v, None, True, 0.0, q_len == ctx, False, scale=D ** -0.5)
                except Exception as e:  # noqa: BLE001
                    rows.append({"q_len": q_len, "ctx": ctx, "error": repr(e)[:300]})
                    break
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        else:
            rows.append({"q_len": q_len, "ctx": ctx, "first_ms": times[0], "repeat_ms": times[1]})
        log(f"first_call {rows[-1]}")
    return rows


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "prefill_config": dict(ta.PREFILL_CONFIG), "shapes": []}
    for q_len, ctx_len, nseq in SHAPES:
        nb = nseq * (-(-ctx_len // BS)) + 4
        g = torch.Generator(device="cuda").manual_seed(q_len + ctx_len)
        kc = torch.randn(nb, BS, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(nb, BS, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)
        bt = torch.randperm(nb - 4, device="cuda").view(nseq, -1).int()
        cu_host = [i * q_len for i in range(nseq + 1)]
        cu = torch.tensor(cu_host, device="cuda", dtype=torch.int32)
        ctx_host = [ctx_len] * nseq
        ctx = torch.tensor(ctx_host, device="cuda", dtype=torch.int32)
        q = torch.randn(nseq * q_len, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        scale = D ** -0.5
        flops = 4 * nseq * HQ * D * q_len * (ctx_len - q_len + (q_len + 1) / 2)
        ref = ta.paged_prefill_attention(q, kc, vc, cu, ctx, bt, scale)
        row = {"q_len": q_len, "ctx": ctx_len, "nseq": nseq, "variants": {}}
        ms = flushed_ms(lambda: ta.paged_prefill_attention(q, kc, vc, cu, ctx, bt, scale))
        row["variants"]["triton"] = {"ms": ms, "tflops": flops / ms / 1e9}
        for name, (backend, expand, split) in VARIANTS.items():
            fn = sdpa_path(backend, expand, split)
            out = torch.empty_like(q)
            v: dict = {}
            try:
                fn(q, kc, vc, cu_host, ctx_host, bt, scale, out)
                v["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
                v["ms"] = flushed_ms(lambda: fn(q, kc, vc, cu_host, ctx_host, bt, scale, out))
                v["tflops"] = flops / v["ms"] / 1e9
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape
                v["error"] = repr(e)[:400]
            row["variants"][name] = v
        log(f"prefill_sdpa {json.dumps(row)}")
        res["shapes"].append(row)
        del kc, vc
        torch.cuda.empty_cache()
    res["first_calls"] = first_calls()
    (OUT / "prefill_sdpa.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
