"""Paged attention: torch reference twins (the CPU path and the kernels' oracle).

Layout (DESIGN.md, "KV cache"): per layer, `k_cache` and `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`. A sequence's token at position p
lives in block `block_table[p // block_size]`, row `p % block_size`.

Every attention call reads K/V from the cache only: the runner writes the new tokens'
K/V through the slot mapping first, so prefix hits, chunked prefill and decode are all
the same computation with different numbers of cached tokens.
"""

from __future__ import annotations

import torch


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write K/V `[num_tokens, num_kv_heads, head_dim]` into the flat slots of the cache.

    A slot of -1 (padding) is skipped. For an fp8 cache the values are divided by the
    per-tensor scale before the cast.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    k, v = key[valid], value[valid]
    if k_cache.dtype != key.dtype:
        k = (k.float() / k_scale).to(k_cache.dtype)
        v = (v.float() / v_scale).to(v_cache.dtype)
    kc[slots] = k
    vc[slots] = v



def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int,
                    scale: float, dtype: torch.dtype) -> torch.Tensor:
    block_size = cache.shape[1]
    n_blocks = (ctx_len + block_size - 1) // block_size
    blocks = cache[block_table[:n_blocks].long()]
    flat = blocks.reshape(-1, *cache.shape[2:])[:ctx_len]
    if flat.dtype != dtype:
        flat = flat.to(torch.float32) * scale
    return flat.to(dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention for a packed batch of new tokens over their cached context.

    q: `[total_new_tokens, num_heads, head_dim]`, sequence b owning rows
    `cu_seqlens_q[b]:cu_seqlens_q[b+1]`. `context_lens[b]` counts all of b's tokens in
    the cache, the new ones included; the new tokens are the last of them, so query i
    of b sits at position `context_lens[b] - q_len + i` and sees positions up to it.
    Works for decode too (q_len 1). Softmax in float32. `out`, if given, receives the
    result (a mixed step writes its prefill rows into a slice of one output).
    """
    out = torch.empty_like(q) if out is None else out
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    for b in range(len(ctx)):
        s, e = cu[b], cu[b + 1]
        q_len, c_len = e - s, ctx[b]
        if q_len == 0:
            continue
        k = _gather_context(k_cache, block_tables[b], c_len, k_scale, q.dtype)
        v = _gather_context(v_cache, block_tables[b], c_len, v_scale, q.dtype)
        qb = q[s:e].float().view(q_len, num_kv_heads, group, -1)
        # scores: [kv_heads, group, q_len, c_len]
        scores = torch.einsum("qhgd,khd->hgqk", qb, k.float()) * scale
        q_pos = torch.arange(c_len - q_len, c_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(c_len, device=q.device).unsqueeze(0)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v.float())
        out[s:e] = o.reshape(q_len, num_heads, -1).to(q.dtype)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: q `[batch, num_heads, head_dim]` over its context.

    Batched over sequences by padding every context to the longest and masking, which
    is what makes it cheaper than the per-sequence prefill loop on the CPU.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max().item()) if batch else 0
    n_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :n_blocks].long()
    k = k_cache[table].reshape(batch, n_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[table].reshape(batch, n_blocks * block_size, num_kv_heads, head_dim)
    k = k.float() * (k_scale if k_cache.dtype != q.dtype else 1.0)
    v = v.float() * (v_scale if v_cache.dtype != q.dtype else 1.0)
    qf = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bkhd->bhgk", qf, k) * scale
    pos = torch.arange(n_blocks * block_size, device=q.device)
    mask = pos.unsqueeze(0) >= context_lens.unsqueeze(1)  # [batch, keys]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhgk,bkhd->bhgd", probs, v).reshape(batch, num_heads, head_dim)
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out
