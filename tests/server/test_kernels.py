"""Every Triton kernel against its torch twin, on the CPU under TRITON_INTERPRET=1.

Small random shapes (several sizes, GQA ratios, block sizes, prefix lengths), fresh
inputs for every case, outputs poisoned first; error ‖out − ref‖ / ‖ref‖ within the
tolerance of the dtype (METHOD.md): float32 1e-5, float16 2e-3, bfloat16 1e-2 (the
interpreter rounds bf16 by truncation, the GPU to nearest; both stay inside it), fp8
KV caches 3e-2. The GPU run at real shapes is benchmarks/gpu_bench.py.
"""

from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from pagefleet.server.ops import activation, attention, layernorm, rotary  # noqa: E402
from pagefleet.server.ops import (triton_activation, triton_attention,  # noqa: E402
                                  triton_layernorm, triton_rotary)

if not triton_attention._INTERPRET and not torch.cuda.is_available():
    pytest.skip("triton kernels need TRITON_INTERPRET=1 on a machine without CUDA",
                allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() and not triton_attention._INTERPRET else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FP8 = torch.float8_e4m3fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
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


# -- KV cache write -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float16, torch.float16),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, FP8), (torch.float32, torch.float32)])
@pytest.mark.parametrize("tokens,kv_heads,head_dim,block_size", [(5, 2, 16, 16), (19, 3, 32, 32)])
def test_store_kvcache(dtype, kv_dtype, tokens, kv_heads, head_dim, block_size):
    seed = tokens * 7 + kv_heads
    kc, vc = make_cache(12, block_size, kv_heads, head_dim, kv_dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    # K and V as strided views of one fused projection, as the model passes them.
    qkv = torch.randn(tokens, (2 + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEV)
    k = qkv[:, 2 * head_dim:(2 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (2 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(12 * block_size, generator=g)[:tokens]
    slots[::4] = -1
    slots = slots.to(DEV)
    ks, vs = (0.5, 2.0) if kv_dtype == FP8 else (1.0, 1.0)
    out_k, out_v, ref_k, ref_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    triton_attention.store_kvcache(k, v, out_k, out_v, slots, ks, vs)
    attention.store_kvcache(k, v, ref_k, ref_v, slots, ks, vs)
    untouched = torch.ones(12 * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat = lambda c: c.view(-1, kv_heads, head_dim).float().cpu()  # noqa: E731
    assert torch.equal(flat(out_k)[untouched], flat(kc)[untouched])
    tol = 3e-2 if kv_dtype == FP8 else 0.0
    assert rel_err(flat(out_k), flat(ref_k)) <= tol
    assert rel_err(flat(out_v), flat(ref_v)) <= tol


# -- decode -------------------------------------------------------------------------------

DECODE_CASES = [
    # batch, q heads, kv heads, head_dim, block_size, context lengths
    (1, 4, 4, 16, 16, [1]),
    (3, 8, 2, 32, 16, [5, 40, 97]),
    (4, 8, 1, 16, 32, [33, 64, 1, 130]),
    (2, 14, 2, 32, 32, [70, 17]),        # group of 7, padded
    (6, 4, 2, 16, 16, [3, 16, 17, 31, 32, 48]),
    (3, 8, 2, 32, 8, [5, 40, 97]),        # pages smaller than a key tile
]


@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("dtype,kv_dtype,page_ahead", [
    (torch.float16, torch.float16, True), (torch.bfloat16, torch.bfloat16, True),
    (torch.bfloat16, FP8, True), (torch.float32, torch.float32, True),
    # page ids read in each tile's own step (DECODE_CONFIG["page_ahead"] off)
    (torch.bfloat16, torch.bfloat16, False), (torch.float32, torch.float32, False)])
def test_decode_attention(case, dtype, kv_dtype, page_ahead, monkeypatch):
    monkeypatch.setitem(triton_attention.DECODE_CONFIG, "page_ahead", page_ahead)
    batch, hq, hk, d, bs, ctx = case
    rng = random.Random(hash((case[0], hq, d, bs)))
    nb = sum(-(-c // bs) for c in ctx) + 3
    kc, vc = make_cache(nb, bs, hk, d, kv_dtype, rng.randrange(1 << 30))
    tables = block_tables_for(ctx, bs, nb, rng)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    q = torch.randn(batch, hq, d, generator=g).to(dtype).to(DEV)
    ks, vs = (0.7, 1.3) if kv_dtype == FP8 else (1.0, 1.0)
    out = triton_attention.paged_decode_attention(q, kc, vc, tables, ctx_t, d ** -0.5, ks, vs)
    ref = attention.paged_decode_attention(q, kc, vc, tables, ctx_t, d ** -0.5, ks, vs)
    assert rel_err(out, ref) <= TOL[dtype]


def test_decode_split_and_direct_paths_agree(monkeypatch):
    """The same batch through one split (direct) and many splits (reduction pass)."""
    rng = random.Random(5)
    ctx = [100, 7, 64]
    kc, vc = make_cache(30, 16, 2, 32, torch.float16, 11)
    tables = block_tables_for(ctx, 16, 30, rng)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(3, 4, 32).half().to(DEV)
    ref = attention.paged_decode_attention(q, kc, vc, tables, ctx_t, 0.2)
    outs = []
    for target in (1, 1000):
        monkeypatch.setitem(triton_attention.DECODE_CONFIG, "target_programs", target)
        outs.append(triton_attention.paged_decode_attention(q, kc, vc, tables, ctx_t, 0.2))
    assert triton_attention.decode_plan(3, 2, tables.shape[1] * 16, q.device).splits > 1
    for out in outs:
        assert rel_err(out, ref) <= TOL[torch.float16]


@pytest.mark.parametrize("want_programs", [1, 24, 4096])
def test_decode_rows_pick_their_own_splits(monkeypatch, want_programs):
    """One launch, rows of 1 to 700 tokens: each row's split count comes from its own
    context (`_row_partition`) between the min and max tokens per split, capped by the
    grid; the reduction pass must agree with the kernel on every row's splits."""
    rng = random.Random(want_programs)
    ctx = [700, 1, 33, 0, 64, 65, 300, 129]
    bs, hk, hq, d = 16, 2, 4, 32
    nb = sum(-(-c // bs) for c in ctx) + 3
    kc, vc = make_cache(nb, bs, hk, d, torch.float32, 7)
    tables = block_tables_for(ctx, bs, nb, rng)
    ctx_t = torch.tensor(ctx, dtype=torch.int64, device=DEV)   # int64, as the runner stages it
    q = torch.randn(len(ctx), hq, d, generator=torch.Generator().manual_seed(3)).to(DEV)
    for key, value in (("target_programs", 1 << 20), ("split_programs", want_programs),
                       ("min_partition", 64), ("max_partition", 192), ("block_n", 32)):
        monkeypatch.setitem(triton_attention.DECODE_CONFIG, key, value)
    plan = triton_attention.decode_plan(len(ctx), hk, tables.shape[1] * bs, q.device)
    assert plan.splits > 1 and plan.min_part == 64 and plan.max_part == 192
    out = triton_attention.paged_decode_attention(q, kc, vc, tables, ctx_t, 0.2)
    ref = attention.paged_decode_attention(q, kc, vc, tables, ctx_t, 0.2)
    rows = [i for i, c in enumerate(ctx) if c]   # the twin's empty row is NaN (0 / 0)
    assert rel_err(out[rows], ref[rows]) <= TOL[torch.float32]
    assert torch.equal(out[3].cpu(), torch.zeros(hq, d))   # the empty row


def test_decode_plan(monkeypatch):
    """No split once batch x kv heads fills the GPU; below, what the batch asks for,
    bounded by the tokens per split over the table's width."""
    for key, value in (("block_n", 64), ("min_partition", 128), ("max_partition", 1024),
                       ("target_programs", None), ("split_programs", None)):
        monkeypatch.setitem(triton_attention.DECODE_CONFIG, key, value)
    plan = triton_attention.decode_plan
    cpu = torch.device("cpu")   # target 8 programs, 16 for split batches
    assert plan(4, 2, 4096, cpu).splits == 1
    p = plan(1, 2, 4096, cpu)   # 2 programs want 8 splits; 4,096 tokens need 4 of 1,024
    assert (p.splits, p.want, p.min_part, p.max_part) == (8, 8, 128, 1024)
    assert plan(1, 2, 300, cpu).splits == 3        # 300 tokens: at most 3 splits of 128
    assert plan(1, 1, 100_000, cpu).splits == 98   # longer than want x 1,024: more splits


def test_decode_padded_rows_are_zero(monkeypatch):
    """CUDA-graph padding rows have context 0: finite zeros, nothing read."""
    kc, vc = make_cache(4, 16, 1, 16, torch.float16, 3)
    tables = torch.zeros(2, 4, dtype=torch.int32, device=DEV)
    ctx_t = torch.tensor([20, 0], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 2, 16).half().to(DEV)
    for target in (1, 1000):
        monkeypatch.setitem(triton_attention.DECODE_CONFIG, "target_programs", target)
        out = triton_attention.paged_decode_attention(q, kc, vc, tables, ctx_t, 0.25)
        assert torch.equal(out[1].float().cpu(), torch.zeros(2, 16))
        ref = attention.paged_decode_attention(q[:1], kc, vc, tables[:1], ctx_t[:1], 0.25)
        assert rel_err(out[:1], ref) <= TOL[torch.float16]


@pytest.mark.parametrize("max_splits", [32, 2])
def test_decode_merge_by_the_last_program_is_the_merge_pass(monkeypatch, max_splits):
    """`fused_merge`: each row's last split to finish merges its KV head's query heads
    (arrival counters) instead of `_decode_reduce_kernel`, with the same merge code: the
    same bits here in the interpreter (on a GPU within rounding, splitk_graph_check.py),
    rows of one to many splits, an empty (padding) row zeros, fp8 caches too, and every
    counter back at zero. Over `fused_merge_max_splits` the launch keeps the merge pass."""
    from pagefleet.server.ops import triton_common
    rng = random.Random(17)
    ctx = [700, 1, 33, 0, 64, 65, 300, 129]
    bs, hk, hq, d = 16, 2, 14, 32
    nb = sum(-(-c // bs) for c in ctx) + 3
    tables = block_tables_for(ctx, bs, nb, rng)
    ctx_t = torch.tensor(ctx, dtype=torch.int64, device=DEV)
    q = torch.randn(len(ctx), hq, d, generator=torch.Generator().manual_seed(5)).to(DEV)
    for key, value in (("target_programs", 1 << 20), ("split_programs", 64),
                       ("min_partition", 32), ("max_partition", 192), ("block_n", 32),
                       ("fused_merge_max_splits", max_splits)):
        monkeypatch.setitem(triton_attention.DECODE_CONFIG, key, value)
    for kv_dtype in (torch.float32, FP8):
        kc, vc = make_cache(nb, bs, hk, d, kv_dtype, 9)
        got = []
        for fused in (False, True):
            monkeypatch.setitem(triton_attention.DECODE_CONFIG, "fused_merge", fused)
            got.append(triton_attention.paged_decode_attention(q, kc, vc, tables, ctx_t, 0.2,
                                                               0.5, 1.5))
        assert torch.equal(got[0], got[1])
        assert torch.equal(got[1][3].cpu(), torch.zeros(hq, d))
        counters = triton_common.arrival_counters(q.device, 1)
        assert counters is not None and not counters.any()
    plan = triton_attention.decode_plan(len(ctx), hk, tables.shape[1] * bs, q.device)
    assert plan.splits > 2   # several splits: above max_splits 2 the merge pass ran
    ref = attention.paged_decode_attention(q, kc, vc, tables, ctx_t, 0.2, 0.5, 1.5)
    rows = [i for i, c in enumerate(ctx) if c]
    assert rel_err(got[1][rows], ref[rows]) <= TOL[torch.float32] * 10


# -- prefill ------------------------------------------------------------------------------

PREFILL_CASES = [
    # q heads, kv heads, head_dim, block_size, [(cached prefix, new tokens), ...]
    (4, 4, 16, 16, [(0, 23)]),
    (8, 2, 32, 16, [(0, 5), (16, 20), (37, 1), (0, 40)]),      # prefix hits, a decode row
    (6, 1, 16, 32, [(32, 33), (3, 2), (64, 16)]),              # chunked prefill
    (14, 2, 32, 32, [(0, 17), (50, 9)]),                        # group of 7
    (4, 2, 16, 16, [(203, 37), (0, 64), (48, 16)]),   # unmasked key tiles, then the diagonal
    (4, 2, 16, 8, [(203, 37), (0, 64), (48, 16)]),    # pages smaller than a key tile
]


# Launch orders (PREFILL_CONFIG["longest_first"]): heads fastest with each sequence's last
# tiles first (shipped), and tiles fastest in order; page ids one tile ahead (shipped) or
# read in each tile's own step: each must equal the twin.
# Key tiles by TMA descriptors where a page holds whole tiles (shipped; the per-key
# loads where it does not: block size 8, float32), or by per-key loads everywhere.
PREFILL_VARIANTS = [dict(longest_first=True), dict(longest_first=False),
                    dict(page_ahead=False), dict(tma=False)]
PREFILL_DTYPES = [(torch.float16, torch.float16, 0), (torch.bfloat16, torch.bfloat16, 0),
                  (torch.bfloat16, FP8, 0), (torch.float32, torch.float32, 0),
                  (torch.bfloat16, FP8, 1), (torch.float32, torch.float32, 1),
                  (torch.bfloat16, torch.bfloat16, 2), (torch.float32, torch.float32, 2),
                  (torch.bfloat16, torch.bfloat16, 3), (torch.bfloat16, FP8, 3),
                  (torch.float32, torch.float32, 3)]


@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("dtype,kv_dtype,variant", PREFILL_DTYPES)
def test_prefill_attention(case, dtype, kv_dtype, variant, monkeypatch):
    for key, value in PREFILL_VARIANTS[variant].items():
        monkeypatch.setitem(triton_attention.PREFILL_CONFIG, key, value)
    hq, hk, d, bs, seqs = case
    rng = random.Random(hash((hq, hk, d, bs, len(seqs))))
    ctx = [p + n for p, n in seqs]
    nb = sum(-(-c // bs) for c in ctx) + 2
    kc, vc = make_cache(nb, bs, hk, d, kv_dtype, rng.randrange(1 << 30))
    tables = block_tables_for(ctx, bs, nb, rng)
    cu = [0]
    for _, n in seqs:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    q = torch.randn(cu[-1], hq, d, generator=g).to(dtype).to(DEV)
    args = (torch.tensor(cu, dtype=torch.int32, device=DEV),
            torch.tensor(ctx, dtype=torch.int32, device=DEV), tables, d ** -0.5)
    ks, vs = (0.7, 1.3) if kv_dtype == FP8 else (1.0, 1.0)
    out = triton_attention.paged_prefill_attention(q, kc, vc, *args, ks, vs)
    ref = attention.paged_prefill_attention(q, kc, vc, *args, ks, vs)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("tma", [False, True])
def test_prefill_attention_ignores_slots_past_the_context(tma, monkeypatch):
    """A cache page's slots past its sequence's context hold whatever was there (a freed
    block's old values, or NaN bits in fresh memory): they must not reach the output,
    whether a key tile comes by per-key loads or as one TMA box of a whole page."""
    monkeypatch.setitem(triton_attention.PREFILL_CONFIG, "tma", tma)
    hq, hk, d, bs = 4, 2, 16, 32
    seqs = [(10, 7), (0, 45), (33, 2)]
    ctx = [p + n for p, n in seqs]
    rng = random.Random(5)
    nb = sum(-(-c // bs) for c in ctx) + 2
    kc, vc = make_cache(nb, bs, hk, d, torch.bfloat16, 11)
    tables = block_tables_for(ctx, bs, nb, rng)
    live = torch.zeros(nb * bs, dtype=torch.bool)
    for row, c in zip(tables.tolist(), ctx):
        for t in range(c):
            live[row[t // bs] * bs + t % bs] = True
    for cache in (kc, vc):
        cache.view(nb * bs, hk, d)[~live] = float("nan")
    cu = [0]
    for _, n in seqs:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    args = (torch.tensor(cu, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32), tables,
            d ** -0.5)
    out = triton_attention.paged_prefill_attention(q, kc, vc, *args)
    ref = attention.paged_prefill_attention(q, kc, vc, *args)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[torch.bfloat16]


# -- norms, rotary, activation ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (3, 200)])
def test_rms_norms(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    r = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    assert rel_err(triton_layernorm.rms_norm(x, w, 1e-6), layernorm.rms_norm(x, w, 1e-6)) <= TOL[dtype]
    out, res = triton_layernorm.fused_add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_res = layernorm.fused_add_rms_norm(x, r, w, 1e-5)
    assert rel_err(res, ref_res) <= TOL[dtype]
    assert rel_err(out, ref_out) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_per_head_on_strided_view(dtype):
    """Qwen3's q/k norm: a [tokens, heads, head_dim] view into the fused projection."""
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(5, 6 * 32, generator=g).to(dtype).to(DEV)
    q = qkv[:, :4 * 32].view(5, 4, 32)
    w = (1 + 0.3 * torch.randn(32, generator=g)).to(dtype).to(DEV)
    assert rel_err(triton_layernorm.rms_norm(q, w, 1e-6), layernorm.rms_norm(q, w, 1e-6)) <= TOL[dtype]


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
@pytest.mark.parametrize("tokens,hq,hk,d", [(6, 4, 2, 32), (11, 7, 1, 16)])
def test_rotary(dtype, scaling, tokens, hq, hk, d):
    cs = rotary.cos_sin_cache(d, 512, 10000.0, scaling).to(DEV)
    g = torch.Generator().manual_seed(tokens + hq)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEV)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    pos = torch.randint(0, 512, (tokens,), generator=g).to(DEV)
    q1, k1 = triton_rotary.rotary_embedding(pos, q, k, cs)
    q2, k2 = rotary.rotary_embedding(pos, q, k, cs)
    assert rel_err(q1, q2) <= TOL[dtype] and rel_err(k1, k2) <= TOL[dtype]


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.float32),
                                            (torch.bfloat16, FP8)])
@pytest.mark.parametrize("tokens,hq,hk,d,block_size", [(6, 4, 2, 32, 16), (13, 7, 1, 16, 32),
                                                      (5, 4, 2, 48, 16)])   # 48: the fallback
def test_rotary_and_store(dtype, kv_dtype, tokens, hq, hk, d, block_size):
    """The fused kernel writes the bits rotary-then-store writes (q returned, k and v in
    the cache, slot -1 untouched), and the model's default op composes the two twins."""
    from pagefleet.server.models.decoder import Ops
    cs = rotary.cos_sin_cache(d, 512, 10000.0, LLAMA3).to(DEV)
    g = torch.Generator().manual_seed(tokens * hq + d)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEV)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    v = qkv[:, (hq + hk) * d:].view(tokens, hk, d)
    pos = torch.randint(0, 512, (tokens,), generator=g).to(DEV)
    slots = torch.randperm(10 * block_size, generator=g)[:tokens]
    slots[1::4] = -1
    slots = slots.to(DEV)
    kc, vc = make_cache(10, block_size, hk, d, kv_dtype, tokens)
    ks, vs = (0.5, 2.0) if kv_dtype == FP8 else (1.0, 1.0)
    out_k, out_v, ref_k, ref_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q1 = triton_rotary.rotary_and_store(pos, q, k, v, cs, out_k, out_v, slots, ks, vs)
    q2 = Ops.rotary_and_store(pos, q, k, v, cs, ref_k, ref_v, slots, ks, vs)
    q3, k3 = triton_rotary.rotary_embedding(pos, q, k, cs)   # the two Triton ops in a row
    tri_k, tri_v = kc.clone(), vc.clone()
    triton_attention.store_kvcache(k3, v, tri_k, tri_v, slots, ks, vs)
    assert torch.equal(q1, q3) and rel_err(q1, q2) <= TOL[dtype]
    flat = lambda c: c.view(-1, hk, d).float().cpu()  # noqa: E731
    assert torch.equal(flat(out_k), flat(tri_k)) and torch.equal(flat(out_v), flat(tri_v))
    untouched = torch.ones(10 * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert torch.equal(flat(out_k)[untouched], flat(kc)[untouched])
    tol = 3e-2 if kv_dtype == FP8 else TOL[dtype]
    assert rel_err(flat(out_k), flat(ref_k)) <= tol and rel_err(flat(out_v), flat(ref_v)) <= tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (2, 3, 2 * 1100)])
def test_silu_and_mul(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (2 * torch.randn(*shape, generator=g)).to(dtype).to(DEV)
    assert rel_err(triton_activation.silu_and_mul(x), activation.silu_and_mul(x)) <= TOL[dtype]


# -- the whole model on Triton ops ------------------------------------------------------------

@pytest.mark.parametrize("penalties", [True, False])
def test_penalize_and_scale_matches_twin(penalties):
    """The fused sampling prologue equals the sampler's twin (penalties, then the
    division by the temperature), rows gathered by slot, vocab not a block multiple."""
    from pagefleet.server.engine.sampler import apply_penalties
    from pagefleet.server.ops.triton_sampling import penalize_and_scale

    g = torch.Generator().manual_seed(3)
    slots_total, vocab, rows = 6, 2500, 4
    logits = torch.randn(rows, vocab, generator=g) * 4
    mask = torch.rand(slots_total, vocab, generator=g) < 0.1
    counts = (torch.rand(slots_total, vocab, generator=g) < 0.05).int() * torch.randint(
        1, 4, (slots_total, vocab), generator=g, dtype=torch.int32)
    params = torch.zeros(slots_total, 8)
    params[:, 0] = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0, 1.0])         # temperature
    params[:, 4] = torch.tensor([1.05, 1.0, 1.5, 0.9, 1.2, 2.0])        # repetition
    params[:, 5] = torch.tensor([0.0, 0.5, 0.2, 0.0, 1.0, 0.0])         # frequency
    params[:, 6] = torch.tensor([0.3, 0.0, 0.1, 0.0, 0.0, 1.5])         # presence
    slots = torch.tensor([4, 0, 5, 2])
    p = params[slots]
    ref = logits.clone()
    if penalties:
        ref = apply_penalties(ref, mask[slots], counts[slots], p[:, 4], p[:, 5], p[:, 6])
    ref = ref / p[:, 0:1]
    out = penalize_and_scale(logits.clone().to(DEV), mask.to(DEV), counts.to(DEV),
                             slots.to(DEV), params.to(DEV), (0, 4, 5, 6), penalties)
    assert rel_err(out.cpu(), ref) < 1e-6


def test_triton_ops_model_greedy_matches_torch_ops(tiny_models):
    """A tiny qwen3 (q/k norm, GQA) run end to end on TritonOps (interpreted, float32)
    gives the torch path's greedy tokens, with prefix hits and chunked prefill."""
    from pagefleet.server import LLM, SamplingParams
    from pagefleet.server.models.decoder import Ops
    from pagefleet.server.ops.triton_ops import TritonOps
    from tests.server.helpers import random_prompts

    # hidden 64 over 4 heads: head_dim 32 (qwen3 doubles it), which the rotary kernels
    # take (half a power of two), so the fused rotary + KV write runs, not its fallback.
    model_dir = tiny_models("qwen3-kernels", arch="qwen3", num_layers=2, hidden_size=64)
    shared = random_prompts(3, [40], 512)[0]
    prompts = [shared + t for t in random_prompts(4, [3, 21], 512)] + random_prompts(5, [50, 20], 512)
    # Different lengths: requests finish at different steps, so decode rows shift and
    # block tables grow across block boundaries (the padded path's host mirrors).
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (6, 3, 9, 5)]
    outs = {}
    # Triton through the CUDA decode path (static buffers, padded batch; eager here),
    # prefill and mixed steps through the flat path, then through the pieces of the
    # forward (engine/piecewise.py: attention on slices of static buffers, padding).
    for name, ops, padded, pieces in (("torch", Ops, False, False),
                                      ("triton-padded", TritonOps, True, False),
                                      ("triton-pieces", TritonOps, True, True)):
        llm = LLM(model_dir, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=32,
                  block_size=16, enforce_eager=True)
        runner = llm.engine.runner
        runner.set_ops(ops)
        if padded:   # the CUDA decode path (static buffers, padded batch), run eagerly
            runner._setup_decode_path(pieces=pieces)
            assert runner._decode_sizes == [1, 2, 3]
        first = llm.generate(prompts[:1], params[:1])
        rest = llm.generate(prompts[1:], params[1:])
        outs[name] = [o.outputs[0].token_ids for o in first + rest]
        assert llm.stats()["prefix_cache_hits"] > 0
        llm.engine.kv.check_whole()
        if pieces:
            assert runner._pieces.num_steps > 0
    assert outs["triton-padded"] == outs["torch"]
    assert outs["triton-pieces"] == outs["torch"]
    assert sum(len(set(s)) for s in outs["torch"]) >= 3 * len(prompts)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_warm_up_reaches_every_kernel_variant_a_workload_does(tiny_models, quantization):
    """Triton compiles a kernel once per variant (constexprs, int/pointer
    specializations); one met first while serving stalls every stream for the compile.
    After the engine's warm-up, a varied workload (1 to 6 prompts per wave, greedy and
    sampled, prefix hits, mixed decode + prefill steps, different lengths) must reach
    no variant the warm-up did not; with fp8 weights too (the GEMVs, the SiLU one at
    one decode row, the weight-only and fp8-activation GEMMs)."""
    import random

    from pagefleet.server import LLM, SamplingParams
    from pagefleet.server.engine import gemm_warmup, warmup
    from pagefleet.server.engine.runner import PROMPT_LOGPROB_SLICE
    from pagefleet.server.ops import jit_variants
    from pagefleet.server.ops.triton_ops import TritonOps

    model_dir = tiny_models("qwen3-variants", arch="qwen3", num_layers=1, hidden_size=64)
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              block_size=16, enforce_eager=True, quantization=quantization)
    runner = llm.engine.runner
    runner.set_ops(TritonOps)
    runner._setup_decode_path(force=True)   # the CUDA decode path, eagerly
    with jit_variants.record() as warm:
        # what a CUDA engine does before serving: the GEMM sweep (quantized linears run
        # Triton kernels there), then the warm-up requests
        gemm_warmup.warm_gemm_kernels(runner.model, 64, max(runner.max_rows, PROMPT_LOGPROB_SLICE))
        warmup.warm_up(llm.engine.core)
    assert {"triton_attention._prefill_kernel", "triton_attention._decode_kernel",
            "triton_rotary._rotary_store_kernel"} <= set(warm)
    if quantization:
        assert "triton_quant._fp8_gemv_kernel" in warm
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    with jit_variants.record() as served:
        for n, sampled in ((1, False), (3, True), (6, False)):
            prompts = [(shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(3, 50))]
                       for i in range(n)]
            params = [SamplingParams(temperature=0.7 if sampled else 0.0, top_p=0.8, top_k=20,
                                     repetition_penalty=1.05 if sampled else 1.0,
                                     max_tokens=rng.randint(2, 7), ignore_eos=True) for _ in prompts]
            llm.generate(prompts, params)
    assert llm.stats()["prefix_cache_hits"] > 0
    assert jit_variants.new_variants(warm, served) == {}
    llm.engine.kv.check_whole()
