"""One decoder for Llama, Mistral, Qwen2 and Qwen3: they differ only in q/k/v bias and
per-head q/k RMSNorm (ModelConfig.qkv_bias / qk_norm).

Projections are fused (qkv, gate|up) for fewer, larger matmuls; the loader copies HF's
separate weights into their shards. Each projection is a `models/linear.py` layer whose
method (unquantized, fp8, AWQ, GPTQ) the checkpoint's quantization config picks.
Attention reads and writes the paged KV cache through the batch's `AttentionMetadata`,
so one forward serves any mix of prefills and decodes.

Tensor parallelism (`tp`, a `distributed.comm.TPGroup`; None on one device, and then
nothing below adds an op): Megatron-style. q|k|v and gate|up are column-parallel (each
rank its heads, KV heads replicated when there are fewer than ranks, and its slice of
the intermediate size); o_proj and down_proj are row-parallel and followed by an
all-reduce; the embedding and lm_head hold a range of the vocabulary each: the
embedding's partial lookups are all-reduced, the logits gathered on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagefleet.server.models.config import ModelConfig
from pagefleet.server.models.linear import (LinearBase, MergedColumnParallelLinear,
                                            QKVParallelLinear, RowParallelLinear,
                                            WeightLoadError)
from pagefleet.server.ops import activation, attention, layernorm, quant, rotary
from pagefleet.server.ops import logits as logits_op
from pagefleet.server.ops.deferred import DeferredSlot, DeferredSum, one_row, qkv_heads, value


@dataclass
class AttentionMetadata:
    """Where each token of a packed batch reads and writes the KV cache.

    Rows are sequences; the first `num_decodes` rows are one-token decodes (run
    through the decode kernel), the rest are prefill chunks (the varlen prefill
    kernel), so a mixed step never sends decode rows through the prefill kernel.
    `num_decodes` and `max_query_len` are host ints: no kernel choice reads a device
    value.
    """

    positions: torch.Tensor        # [T] absolute positions of the new tokens
    slot_mapping: torch.Tensor     # [T] flat cache slot for each new token's K/V (-1: skip)
    cu_seqlens_q: torch.Tensor     # [P+1] offsets of the prefill rows' tokens, from token D
    context_lens: torch.Tensor     # [B] cached + new tokens per sequence (decodes first)
    block_tables: torch.Tensor     # [B, max_blocks] int32
    max_query_len: int             # longest prefill chunk (1 if there is none)
    num_decodes: int = 0           # D: decode rows, one token each, first in the batch
    k_scale: float = 1.0
    v_scale: float = 1.0


class Ops:
    """The op implementations a model calls: torch twins by default, Triton on CUDA."""

    store_kvcache = staticmethod(attention.store_kvcache)
    prefill_attention = staticmethod(attention.paged_prefill_attention)
    decode_attention = staticmethod(attention.paged_decode_attention)
    rms_norm = staticmethod(layernorm.rms_norm)
    rotary_embedding = staticmethod(rotary.rotary_embedding)
    silu_and_mul = staticmethod(activation.silu_and_mul)
    w4a16_linear = staticmethod(quant.w4a16_linear)
    fp8_linear = staticmethod(quant.fp8_linear)
    logits = staticmethod(logits_op.logits)

    @classmethod
    def fp8_silu_linear(cls, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        block: tuple[int, int], input_scale: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None,
                        deferred: DeferredSlot | None = None) -> "torch.Tensor | DeferredSum":
        """The fp8 down projection of silu(gate) * up: the two ops in a row here (whichever
        a subclass picked); TritonOps does the SiLU in the decode GEMV's activation load."""
        return cls.fp8_linear(cls.silu_and_mul(x), weight, weight_scale, block, input_scale,
                              bias, **one_row(x, deferred))

    @classmethod
    def w4a16_silu_linear(cls, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor | None, group_size: int,
                          bias: torch.Tensor | None = None,
                          deferred: DeferredSlot | None = None) -> "torch.Tensor | DeferredSum":
        """The 4-bit down projection of silu(gate) * up: the two ops in a row here;
        TritonOps computes the SiLU as the one-row GEMV stages its input."""
        return cls.w4a16_linear(cls.silu_and_mul(x), qweight, scales, zeros, group_size, bias,
                                **one_row(x, deferred))

    @staticmethod
    def fused_add_rms_norm(x: "torch.Tensor | DeferredSum", residual: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); x may be a deferred GEMV row (made a
        tensor first here; TritonOps' kernel reads it as it is)."""
        return layernorm.fused_add_rms_norm(value(x), residual, weight, eps)

    @classmethod
    def rotary_and_store_deferred(cls, positions: torch.Tensor, qkv: DeferredSum,
                                  heads: int, kv_heads: int, head_dim: int,
                                  cos_sin: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                  k_scale: float, v_scale: float) -> torch.Tensor:
        """`rotary_and_store` of a deferred q/k/v row: made a tensor and split here;
        TritonOps' kernel reads the row as it is."""
        q, k, v = qkv_heads(qkv, heads, kv_heads, head_dim)
        return cls.rotary_and_store(positions, q, k, v, cos_sin, k_cache, v_cache,
                                    slot_mapping, k_scale, v_scale)

    @classmethod
    def rotary_and_store(cls, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float,
                         v_scale: float) -> torch.Tensor:
        """Rotated q; rotated k and v written to the cache. The two ops in a row here
        (whichever a subclass picked); TritonOps fuses them into one kernel."""
        q, k = cls.rotary_embedding(positions, q, k, cos_sin)
        cls.store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return q


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(size)
        self.eps = eps


def _method(quant, prefixes: list[str]):
    return quant.linear_method(prefixes) if quant is not None else None


def _linear(layer: LinearBase, ops: type[Ops]) -> LinearBase:
    layer.ops = ops
    return layer


def _tp_kw(tp) -> dict:
    return {"tp_rank": tp.rank, "tp_size": tp.world_size} if tp is not None else {}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: type[Ops], quant=None, prefix: str = "",
                 tp=None) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        hf = [f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = _linear(QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=cfg.qkv_bias,
            method=_method(quant, hf), prefix=f"{prefix}.qkv_proj", **_tp_kw(tp)), ops)
        # This rank's heads (all of them on one device).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.o_proj = _linear(RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False,
            method=_method(quant, [f"{prefix}.o_proj"]), prefix=f"{prefix}.o_proj",
            **_tp_kw(tp)), ops)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # One-row split sums finished by the reader (ops/deferred.py): q/k/v's by the
        # rotary + KV write (not where q/k norms come between), o's by the next norm
        # (not where an all-reduce comes between)
        if self.q_norm is None:
            self.qkv_proj.deferred = DeferredSlot()
        if not self.o_proj.reduce_results:
            self.o_proj.deferred = DeferredSlot()
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.finish(self.attend(self.project(x, meta, cos_sin), meta))

    def project(self, x: torch.Tensor, meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        """q `[T, heads, head_dim]`, rotated; K/V rotated and written to the cache. Reads
        only `meta.positions` and `meta.slot_mapping` (a CUDA graph piece may hold it)."""
        n = x.shape[0]
        qkv = self.qkv_proj.forward_deferred(x)
        if isinstance(qkv, DeferredSum):
            return self.ops.rotary_and_store_deferred(
                meta.positions, qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                cos_sin, self.k_cache, self.v_cache, meta.slot_mapping, meta.k_scale,
                meta.v_scale)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = self.ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        return self.ops.rotary_and_store(meta.positions, q, k, v, cos_sin, self.k_cache,
                                         self.v_cache, meta.slot_mapping, meta.k_scale,
                                         meta.v_scale)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, num_tokens: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the first `num_tokens` rows of q (all by default; a padded batch
        has more): decode rows through the decode kernel, prefill rows through the varlen
        prefill kernel. Rows past `num_tokens` of `out` are left as they are."""
        n = q.shape[0] if num_tokens is None else num_tokens
        d = meta.num_decodes
        if d == n and out is None:
            return self.ops.decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                             meta.context_lens, self.scale, meta.k_scale,
                                             meta.v_scale)
        if d == 0 and out is None:
            return self.ops.prefill_attention(q, self.k_cache, self.v_cache, meta.cu_seqlens_q,
                                              meta.context_lens, meta.block_tables, self.scale,
                                              meta.k_scale, meta.v_scale)
        o = torch.empty_like(q) if out is None else out
        if d:
            self.ops.decode_attention(q[:d], self.k_cache, self.v_cache, meta.block_tables[:d],
                                      meta.context_lens[:d], self.scale, meta.k_scale,
                                      meta.v_scale, out=o[:d])
        if n > d:
            self.ops.prefill_attention(q[d:n], self.k_cache, self.v_cache, meta.cu_seqlens_q,
                                       meta.context_lens[d:], meta.block_tables[d:], self.scale,
                                       meta.k_scale, meta.v_scale, out=o[d:n])
        return o

    def finish(self, o: torch.Tensor) -> "torch.Tensor | DeferredSum":
        """The output projection (and the tensor-parallel all-reduce) of the attention's
        output (at one row, possibly deferred: the next norm reads it)."""
        out = self.o_proj.forward_deferred(o.reshape(o.shape[0], self.q_size))
        return self.tp.all_reduce(out) if self.o_proj.reduce_results else out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: type[Ops], quant=None, prefix: str = "",
                 tp=None) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        hf = [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        self.gate_up_proj = _linear(MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False, method=_method(quant, hf),
            prefix=f"{prefix}.gate_up_proj", **_tp_kw(tp)), ops)
        self.down_proj = _linear(RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=False,
            method=_method(quant, [f"{prefix}.down_proj"]), prefix=f"{prefix}.down_proj",
            **_tp_kw(tp)), ops)
        if not self.down_proj.reduce_results:   # read by the next layer's (or the final) norm
            self.down_proj.deferred = DeferredSlot()

    def forward(self, x: torch.Tensor) -> "torch.Tensor | DeferredSum":
        out = self.down_proj.forward_silu_mul_deferred(self.gate_up_proj(x))
        return self.tp.all_reduce(out) if self.down_proj.reduce_results else out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: type[Ops], quant=None, prefix: str = "",
                 tp=None) -> None:
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops, quant, f"{prefix}.self_attn", tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ops, quant, f"{prefix}.mlp", tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, residual = self.attn_in(x, residual, meta, cos_sin)
        return self.attn_out(self.self_attn.attend(q, meta), residual)

    # The layer around its attention kernels, in two halves: a piecewise CUDA graph
    # (engine/piecewise.py) captures everything between two layers' attention calls.
    def attn_in(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, residual): the input norm, q/k/v, rotary and the K/V write."""
        ln = self.input_layernorm
        if residual is None:
            residual, h = x, self.ops.rms_norm(x, ln.weight, ln.eps)
        else:
            h, residual = self.ops.fused_add_rms_norm(x, residual, ln.weight, ln.eps)
        return self.self_attn.project(h, meta, cos_sin), residual

    def attn_out(self, o, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual): the output projection, the second norm and the MLP."""
        h = self.self_attn.finish(o)
        ln = self.post_attention_layernorm
        h, residual = self.ops.fused_add_rms_norm(h, residual, ln.weight, ln.eps)
        return self.mlp(h), residual


def _vocab_param(rows: int, hidden: int, start: int, vocab_size: int) -> nn.Parameter:
    """An embedding-shaped parameter holding vocabulary rows [start, start + rows); rows
    past the vocabulary (the last rank's padding) stay zero. Its `vocab_loader` copies
    just those rows from a checkpoint tensor (a `LazyTensor` reads only them)."""
    p = _param(rows, hidden)
    n = max(0, min(rows, vocab_size - start))

    def load(loaded, name: str) -> None:
        if tuple(loaded.shape) != (vocab_size, hidden):
            raise WeightLoadError(f"{name}: shape {tuple(loaded.shape)} does not match the "
                                  f"config's {(vocab_size, hidden)}")
        p.data[n:].zero_()
        p.data[:n].copy_(loaded.narrow(0, start, n).to(dtype=p.dtype))

    p.vocab_loader = load
    return p


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: type[Ops] = Ops, max_positions: int | None = None,
                 quant=None, tp=None) -> None:
        """`quant`: the checkpoint's `QuantConfig` (models/quantization/), None when the
        linear layers are unquantized; embeddings, norms and lm_head never are. `tp`:
        the tensor-parallel group this rank belongs to (None: one device)."""
        super().__init__()
        self.cfg, self.ops, self.tp = cfg, ops, tp
        size = tp.world_size if tp is not None else 1
        self.vocab_per_rank = -(-cfg.vocab_size // size)
        self.vocab_start = self.vocab_per_rank * (tp.rank if tp is not None else 0)
        rows, h = self.vocab_per_rank, cfg.hidden_size
        if tp is None:
            self.embed_tokens = _param(cfg.vocab_size, h)
        else:
            self.embed_tokens = _vocab_param(rows, h, self.vocab_start, cfg.vocab_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, quant, f"model.layers.{i}", tp)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        elif tp is None:
            self.lm_head = _param(cfg.vocab_size, h)
        else:
            self.lm_head = _vocab_param(rows, h, self.vocab_start, cfg.vocab_size)
        n_pos = max(max_positions or 0, cfg.max_position_embeddings)
        self.register_buffer("cos_sin", rotary.cos_sin_cache(
            cfg.head_dim, n_pos, cfg.rope_theta, cfg.rope_scaling), persistent=False)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm."""
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, meta, self.cos_sin)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return nn.functional.embedding(input_ids, self.embed_tokens)
        # This rank's rows; the others' are zeros here, so the sum is exact.
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_per_rank)
        x = nn.functional.embedding(torch.where(mine, local, 0), self.embed_tokens)
        return self.tp.all_reduce(x.masked_fill(~mine.unsqueeze(1), 0.0))

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x, _ = self.ops.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    @property
    def head_weight(self) -> torch.Tensor:
        """The logits weight: lm_head, or the embedding when the model ties them."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits `[rows, vocab]` (float32 on one device, the ops' `logits`); with tensor
        parallelism rank 0 gathers every rank's vocabulary range and the other ranks get
        None."""
        if self.tp is None:
            return self.ops.logits(hidden, self.head_weight)
        logits = nn.functional.linear(hidden, self.head_weight)
        full = self.tp.gather_cat(logits, dim=-1)
        return full[:, :self.cfg.vocab_size] if full is not None else None
