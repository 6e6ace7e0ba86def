"""Split-K GEMVs summed by their last program, replayed from CUDA graphs on the GPU: each
replay's output bit for bit the eager call's, the eager call within rounding of the torch
twin, and every arrival counter back at zero after (what the next launch or replay counts
on). The CPU tests run the same kernels in the interpreter, where programs run one after
another; this is the concurrent case. Then the same for decode attention's splits merged
by their last program (`DECODE_CONFIG["fused_merge"]`).

    OUT=$OUT python3 benchmarks/splitk_graph_check.py     # prints one line per case; exit 1 on a failure
"""

from __future__ import annotations

import sys


def _rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _replays_equal(torch, fn, eager, replays: int = 3) -> bool:
    """`fn` captured in a CUDA graph: each replay (over a NaN-filled output) gives the
    eager call's bits."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    same = True
    for _ in range(replays):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        same &= bool(torch.equal(out, eager))
    return same


def _counters_zero(device) -> bool:
    """Every arrival counter back at zero (what the next launch or replay counts on)."""
    from pagefleet.server.ops import triton_common
    cnt = triton_common.arrival_counters(device, 1)
    return cnt is not None and not bool(cnt.any())


def main() -> int:
    import torch

    from pagefleet.server.ops import quant
    from pagefleet.server.ops import triton_quant as tq
    failed = 0
    torch.manual_seed(0)
    for n, k in ((3584, 3584), (3584, 18944), (4608, 3584)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quant.quantize_fp8_rows(w)
        qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), device="cuda", dtype=torch.int32)
        s = (torch.rand(k // 128, n, device="cuda") * 0.01 + 0.001).half()
        z = torch.randint(0, 16, (k // 128, n), device="cuda", dtype=torch.uint8)
        for m in (1, 2, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xh = x.half()
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            cases = {
                "fp8": (lambda: tq.fp8_linear(x, wq, ws, (1, k), None, b),
                        lambda: quant.fp8_linear(x.float(), wq, ws, (1, k), None, b.float())),
                "w4": (lambda: tq.w4a16_linear(xh, qw, s, z, 128, b.half()),
                       lambda: quant.w4a16_linear(xh.float(), qw, s, z, 128, b.float())),
            }
            for name, (fn, twin) in cases.items():
                eager = fn()
                err = _rel_err(eager, twin())
                same = _replays_equal(torch, fn, eager)
                zero = _counters_zero(x.device)
                ok = same and zero and err < 2e-2
                failed += not ok
                print(f"{'ok' if ok else 'FAILED'} {name} {m}x{k} -> {n}: replays equal eager "
                      f"{same}, counters zero {zero}, rel err vs twin {err:.2e}", flush=True)
    failed += _decode_merge_check(torch)
    return 1 if failed else 0


def _decode_merge_check(torch) -> int:
    """Decode attention with `fused_merge` (each row's last split merges its heads),
    replayed from a CUDA graph: the eager call's bits, the merge pass's output within
    rounding, counters zero after."""
    from pagefleet.server.ops import triton_attention as ta
    failed = 0
    hq, hk, d, bs = 28, 4, 128, 16
    for batch, ctx_len in ((1, 1024), (1, 1500), (8, 4096), (64, 700)):
        per = -(-ctx_len // bs)
        nb = batch * per + 4
        kc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
        bt = torch.randperm(nb - 4, device="cuda").view(batch, per).int()
        ctx = torch.full((batch,), ctx_len, device="cuda", dtype=torch.int32)
        ctx[0] = max(1, ctx_len // 3)                      # rows of different splits
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        base = dict(ta.DECODE_CONFIG)
        two = ta.paged_decode_attention(q, kc, vc, bt, ctx, d ** -0.5)
        ta.DECODE_CONFIG["fused_merge"] = True
        try:
            def fn():
                return ta.paged_decode_attention(q, kc, vc, bt, ctx, d ** -0.5)
            eager = fn()
            same = _replays_equal(torch, fn, eager)
        finally:
            ta.DECODE_CONFIG.clear()
            ta.DECODE_CONFIG.update(base)
        zero = _counters_zero(q.device)
        splits = ta.decode_plan(batch, hk, per * bs, q.device).splits
        # The merge pass's arithmetic per head (`_merge_group`); on the GPU its sums may
        # take another reduction tree (layouts are the compiler's), so within rounding
        # (an H200 gave the same bits, 2026-12-04).
        err = _rel_err(eager, two)
        ok = same and zero and err < 1e-2
        failed += not ok
        print(f"{'ok' if ok else 'FAILED'} decode merge {batch} x {ctx_len} ({splits} splits): "
              f"replays equal eager {same}, counters zero {zero}, rel err vs the merge pass "
              f"{err:.1e} (bits equal: {bool(torch.equal(eager, two))})", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
