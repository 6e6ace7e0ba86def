"""Attention kernels, the prefill side: paged prefill attention (prefix hits, chunked
prefill, GQA groups, launch orders, page ids ahead or not, TMA key tiles) against its
torch twin under TRITON_INTERPRET=1. Tolerances and shapes:
tests/server/kernel_helpers.py."""

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


@pytest.mark.parametrize("version,ok", [("3.6.0", True), ("3.9.0", True), ("3.9.1+gitabc", True),
                                        ("3.5.1", False), ("3.10.0", False), ("4.0", False),
                                        ("nightly", False)])
def test_gluon_kernel_only_on_the_tritons_it_was_compiled_and_run_with(version, ok):
    """The Gluon ping-pong kernel (ops/gluon_attention.py) serves on the Triton releases
    CI compiles it with (test_kernels_compile.py) and nowhere else: Gluon's API moves
    between releases, and an untested one would fail at warm-up where the Triton kernel
    serves a few percent slower. Off the GPU it never applies (these tests run the Triton
    kernel with `gluon_pingpong` on)."""
    from pagefleet.server.ops import gluon_attention, gluon_common
    assert gluon_common.supported_triton(version) is ok
    q = torch.zeros(4, 8, 64, dtype=torch.bfloat16)
    assert not gluon_attention.usable(q, torch.zeros(2, 128, 2, 64, dtype=torch.bfloat16))
    assert triton_attention.PREFILL_CONFIG["gluon_pingpong"]
