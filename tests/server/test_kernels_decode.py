"""Attention kernels, the decode side: the KV cache write and paged decode attention
(split-K, per-row splits, the merge pass and its fused form) against their torch twins
under TRITON_INTERPRET=1. Tolerances and shapes: tests/server/kernel_helpers.py."""

from __future__ import annotations

import random

import pytest

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server.kernel_helpers import (DEV, FP8, TOL, attention_small_tiles,
                                         block_tables_for, make_cache, rel_err, torch,
                                         triton_attention)
from pagefleet.server.ops import attention


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    attention_small_tiles(monkeypatch)


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


@pytest.mark.parametrize("max_part", [32, 96])   # one tile a split, or up to three
def test_decode_keys_read_before_the_wait_see_the_new_key(monkeypatch, max_part):
    """`kv_early`: each split's first K/V tile is read before the PDL wait, and the row's
    new key and value (which the rotary kernel before writes) again after it. The
    interpreter runs one program at a time, so the race is staged: as each program asks
    for its early tile the new slots hold stale data (a hook on `_first_tile`), and its
    wait writes the new key and value (a hook on `pdl_wait`), as the kernel before
    finishing would. The output must be kv_early off's with the new keys in place, bit
    for bit: the new key alone in a row, first or last in a tile, in a later tile, a
    padding row, fp8 caches. (Split launches only: a direct one reads after the wait.)"""
    rng = random.Random(23)
    ctx = [20, 1, 64, 65, 0, 130]
    bs, hk, hq, d = 16, 2, 8, 16
    nb = sum(-(-c // bs) for c in ctx) + 3
    tables = block_tables_for(ctx, bs, nb, rng)
    ctx_t = torch.tensor(ctx, dtype=torch.int64, device=DEV)
    q = torch.randn(len(ctx), hq, d, generator=torch.Generator().manual_seed(4)).to(DEV)
    slots = torch.tensor([int(tables[i, (c - 1) // bs]) * bs + (c - 1) % bs
                          for i, c in enumerate(ctx) if c], device=DEV)
    for key, value in (("target_programs", 1000), ("split_programs", 8),
                       ("min_partition", 32), ("max_partition", max_part), ("block_n", 32)):
        monkeypatch.setitem(triton_attention.DECODE_CONFIG, key, value)
    first_tile, wait = triton_attention._first_tile, triton_attention.pdl_wait
    for kv_dtype in (torch.float32, FP8):
        kc, vc = make_cache(nb, bs, hk, d, kv_dtype, 9)
        flat_k, flat_v = kc.view(-1, hk, d), vc.view(-1, hk, d)
        new = flat_k[slots].clone(), flat_v[slots].clone()
        stale = (torch.full_like(new[0], 3.0), torch.full_like(new[1], -2.0))

        def put(kv):
            flat_k[slots], flat_v[slots] = kv

        monkeypatch.setitem(triton_attention.DECODE_CONFIG, "kv_early", False)
        ref = triton_attention.paged_decode_attention(q, kc, vc, tables, ctx_t, 0.2, 0.5, 1.5)
        monkeypatch.setitem(triton_attention.DECODE_CONFIG, "kv_early", True)
        early = []
        monkeypatch.setattr(triton_attention, "_first_tile",
                            lambda *a: (put(stale), early.append(1), first_tile(*a))[2])
        monkeypatch.setattr(triton_attention, "pdl_wait", lambda PDL: put(new))
        got = triton_attention.paged_decode_attention(q, kc, vc, tables, ctx_t, 0.2, 0.5, 1.5)
        monkeypatch.setattr(triton_attention, "_first_tile", first_tile)
        monkeypatch.setattr(triton_attention, "pdl_wait", wait)
        assert early and torch.equal(got, ref)
        assert torch.equal(flat_k[slots], new[0])


@pytest.mark.parametrize("max_splits", [32, 2])
def test_decode_merge_by_the_last_program_is_the_merge_pass(monkeypatch, max_splits):
    """`fused_merge`: each row's last split to finish merges its KV head's query heads
    (arrival counters) instead of `_decode_reduce_kernel`, with the same arithmetic per
    head: the same bits here in the interpreter (and on an H200, splitk_graph_check.py),
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
