"""lm_head GEMV at decode: cuBLAS (fp16, bf16, padded rows) vs a plain Triton GEMV."""
import json, os, sys, statistics
import torch, triton, triton.language as tl
sys.path.insert(0, "benchmarks")
from gpu_bench import graph_ms

@triton.jit
def _gemv(x_ptr, w_ptr, o_ptr, M, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          MP: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, MP)
    nmask = rn < N
    acc = tl.zeros([MP, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=nmask[:, None] & (kk[None, :] < K), other=0.0,
                    eviction_policy="evict_first")
        if MP == 1:
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)[None, :]
        else:
            x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32) if MP >= 16 else tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=(rm[:, None] < M) & nmask[None, :])

def tgemv(x, w, bn, bk, warps, stages):
    M, K = x.shape; N = w.shape[0]
    o = torch.empty(M, N, device=x.device, dtype=x.dtype)
    mp = max(1, triton.next_power_of_2(M))
    _gemv[(triton.cdiv(N, bn),)](x, w, o, M, N, K, BLOCK_N=bn, BLOCK_K=bk, MP=mp, num_warps=warps, num_stages=stages)
    return o

res = {}
N, K = 152064, 3584
for dt in (torch.float16, torch.bfloat16):
    w = torch.randn(N, K, device="cuda", dtype=dt) * 0.02
    for M in (1, 8):
        x = torch.randn(M, K, device="cuda", dtype=dt)
        ref = torch.nn.functional.linear(x, w).float()
        key = f"{str(dt)[6:]}_M{M}"
        r = {"cublas": graph_ms(lambda: torch.nn.functional.linear(x, w)),
             "cublas_float": graph_ms(lambda: torch.nn.functional.linear(x, w).float())}
        if M == 1:
            x8 = torch.zeros(8, K, device="cuda", dtype=dt); x8[:1] = x
            r["cublas_pad8"] = graph_ms(lambda: torch.nn.functional.linear(x8, w))
            r["mv"] = graph_ms(lambda: torch.mv(w, x[0]))
        for bn, bk, warps, stages in [(8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (16, 512, 8, 3),
                                      (32, 256, 4, 3), (32, 256, 8, 4), (8, 1024, 8, 2), (4, 1024, 4, 3),
                                      (16, 256, 4, 4), (64, 128, 8, 4)]:
            name = f"triton_{bn}x{bk}_w{warps}_s{stages}"
            try:
                o = tgemv(x, w, bn, bk, warps, stages).float()
                err = ((o - ref).norm() / ref.norm()).item()
                r[name] = (graph_ms(lambda: tgemv(x, w, bn, bk, warps, stages)), err)
            except Exception as e:
                r[name] = repr(e)[:200]
        res[key] = r
        print(key, json.dumps(r), flush=True)
    del w
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "lmhead.json"), "w"), indent=1)
