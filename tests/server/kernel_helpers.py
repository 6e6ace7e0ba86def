"""Shared pieces of the Triton kernel tests (tests/server/test_kernels_*.py and
test_quant_kernels_*.py): every kernel against its torch twin, on the CPU under
TRITON_INTERPRET=1.

Attention, norms, rotary, activation: small random shapes (several sizes, GQA ratios,
block sizes, prefix lengths), fresh inputs for every case, outputs poisoned first;
error ‖out − ref‖ / ‖ref‖ within the tolerance of the dtype (METHOD.md): float32 1e-5,
float16 2e-3, bfloat16 1e-2 (the interpreter rounds bf16 by truncation, the GPU to
nearest; both stay inside it), fp8 KV caches 3e-2. The GPU run at real shapes is
benchmarks/gpu_bench.py.

Quantized GEMMs (issue 15, must-hold 1): small and odd shapes (K not a multiple of
the group, N not a multiple of the tile, rows not a multiple of the block), every
dtype, zero points or symmetric, split-K forced, both the GEMV and the tl.dot paths.
The GPU run at real shapes is benchmarks/quant_bench.py.

Importing this module sets TRITON_INTERPRET=1 (unless set) before triton is imported,
and skips the importing test module where triton or torch is missing, or where the
kernels can run neither interpreted nor on a GPU. The kernel tests are split by
kernel family into several files so that `--dist loadfile` can spread them over the
workers.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from pagefleet.server.ops import triton_attention, triton_quant  # noqa: E402
from pagefleet.server.ops.int4_packing import pack_rows  # noqa: E402

if not triton_attention._INTERPRET and not torch.cuda.is_available():
    pytest.skip("triton kernels need TRITON_INTERPRET=1 on a machine without CUDA",
                allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() and not triton_attention._INTERPRET else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FP8 = torch.float8_e4m3fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# -- attention --------------------------------------------------------------------------

def attention_small_tiles(monkeypatch) -> None:
    """Tiles small enough that the interpreter is quick and every loop runs several
    times; a low program target so the decode split-K path is exercised."""
    monkeypatch.setitem(triton_attention.DECODE_CONFIG, "block_n", 16)
    monkeypatch.setitem(triton_attention.DECODE_CONFIG, "min_partition", 16)
    monkeypatch.setitem(triton_attention.DECODE_CONFIG, "max_partition", 32)
    monkeypatch.setitem(triton_attention.DECODE_CONFIG, "target_programs", 8)
    monkeypatch.setitem(triton_attention.PREFILL_CONFIG, "block_m", 16)
    monkeypatch.setitem(triton_attention.PREFILL_CONFIG, "block_n", 16)


def make_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    return k.to(kv_dtype).to(DEV), v.to(kv_dtype).to(DEV)


def block_tables_for(ctx_lens, block_size, num_blocks, rng):
    need = [-(-c // block_size) for c in ctx_lens]
    width = max(need)
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, used = [], 0
    for n in need:
        row = pool[used:used + n]
        used += n
        tables.append(row + [rng.randrange(num_blocks) for _ in range(width - n)])
    return torch.tensor(tables, dtype=torch.int32, device=DEV)


# -- quantized GEMMs ----------------------------------------------------------------------

def quant_small_tiles(monkeypatch) -> None:
    """Tiles small enough for the interpreter, so loops, masks and splits all run."""
    for cfg, keys in ((triton_quant.W4_CONFIG, {"gemv_block_n": 16, "gemv_block_k": 32,
                                                "gemm_block_n": 16, "gemm_block_k": 32,
                                                "target_programs": 8, "dequant_block_r": 4,
                                                "dequant_block_n": 16, "gemv_wide": {},
                                                "gemv_deep": {}, "gemv_tc_block_n": 32,
                                                # the tensor-core GEMV only where a test
                                                # asks for it (the paths below are others)
                                                "gemv_tc_max_m": 0}),
                      (triton_quant.FP8_CONFIG, {"gemv_block_n": 16, "gemv_block_k": 32,
                                                 "gemm_block_n": 16, "gemm_block_k": 32,
                                                 "w8a8_block_m": 16, "w8a8_block_n": 16,
                                                 "w8a8_block_k": 32, "target_programs": 8,
                                                 "act_block": 64})):
        for k, v in keys.items():
            monkeypatch.setitem(cfg, k, v)


def int4_case(m, k, n, group, zeros, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ng = -(-k // group)
    qw = pack_rows(torch.randint(0, 16, (k, n), generator=g)).to(DEV)
    s = (0.02 + 0.1 * torch.rand(ng, n, generator=g)).half().to(DEV)
    z = torch.randint(0, 16, (ng, n), generator=g).to(torch.uint8).to(DEV) if zeros else None
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    return x, qw, s, z, b


def record_launches(monkeypatch) -> list[int]:
    """The output tiles (x rows) of each split-K launch from here on, in order: shows which
    kernel path and tile width a call took."""
    launches: list[int] = []
    outputs = triton_quant._outputs

    def recorded(splits, m, n, tiles, *args):
        launches.append(tiles)
        return outputs(splits, m, n, tiles, *args)

    monkeypatch.setattr(triton_quant, "_outputs", recorded)
    return launches


def fp8_case(m, k, n, block, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 3).to(FP8).to(DEV)
    ws = (0.5 + torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g)).to(DEV)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    return x, w, ws, b
