"""Model runner: device, weights, KV cache allocation and sizing, batch tensors.

Executes what the scheduler decided: packs the scheduled tokens of all requests into
one flat batch (prefill chunks and decodes mixed), writes their K/V through a slot
mapping, and returns the logits of the rows that produce a token this step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.server.config import ConfigError, EngineConfig
from pagefleet.server.engine.scheduler import ScheduledRequest
from pagefleet.server.models.config import ModelConfig
from pagefleet.server.models.decoder import AttentionMetadata, DecoderForCausalLM, Ops
from pagefleet.server.models.loader import load_model

log = logging.getLogger("pagefleet.engine")

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 512 << 20

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto': float32 on the CPU (exact and fast there); on a GPU the checkpoint's
    dtype, with float32 checkpoints served in bfloat16."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    ckpt = _DTYPES.get(str(model_cfg.torch_dtype), torch.bfloat16)
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    return _DTYPES[name]


@dataclass
class CacheLayout:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, model_cfg: ModelConfig,
                 max_model_len: int, ops: type[Ops] = Ops) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.max_model_len = max_model_len
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_cfg, self.device)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        self.model: DecoderForCausalLM = load_model(model_dir, model_cfg, self.dtype, self.device,
                                                    ops, max_positions=max_model_len)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.layout = self._size_kv_cache()
        self._allocate_kv_cache()

    # -- sizing ------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        c = self.model_cfg
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * elem

    def _size_kv_cache(self) -> CacheLayout:
        per_block = self.bytes_per_block()
        log.info("Model weights: %.2f GiB (%s on %s)", self.weights_bytes / GiB,
                 str(self.dtype).removeprefix("torch."), self.device)
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.config.kv_cache_memory is not None or self.device.type == "cpu":
            budget = self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = budget // per_block
        else:
            num_blocks = self._gpu_blocks(per_block)
        layout = CacheLayout(num_blocks, self.block_size, per_block)
        log.info("KV cache: %d blocks = %d tokens (%.2f GiB)", num_blocks, layout.num_tokens,
                 num_blocks * per_block / GiB)
        need = -(-self.max_model_len // self.block_size)
        log.info("Maximum concurrency for %d tokens per request: %.2fx", self.max_model_len,
                 num_blocks / need if need else 0.0)
        if num_blocks < need:
            raise ConfigError(
                f"The KV cache holds {layout.num_tokens} tokens ({num_blocks} blocks), fewer than "
                f"one request of --max-model-len {self.max_model_len} needs ({need} blocks). "
                "Increase --gpu-memory-utilization or --kv-cache-memory, or decrease "
                "--max-model-len.")
        return layout

    def _gpu_blocks(self, per_block: int) -> int:
        """total x utilization - weights - profiled peak activations - non-torch memory."""
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        util = self.config.gpu_memory_utilization
        if free < total * util:
            raise ConfigError(
                f"Free GPU memory at startup ({free / GiB:.2f} GiB) is less than the requested "
                f"--gpu-memory-utilization {util} x {total / GiB:.2f} GiB = "
                f"{util * total / GiB:.2f} GiB. Another process is using the GPU; lower "
                "--gpu-memory-utilization or free the GPU.")
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.profile_run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        used_by_torch = torch.cuda.memory_reserved(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        non_torch = max(total - free_after - used_by_torch, 0)
        budget = total * util - self.weights_bytes - peak - non_torch
        log.info("Memory: total %.2f GiB x %.2f = %.2f GiB; weights %.2f GiB; activation peak "
                 "%.2f GiB; non-torch %.2f GiB; KV cache budget %.2f GiB", total / GiB, util,
                 total * util / GiB, self.weights_bytes / GiB, peak / GiB, non_torch / GiB,
                 budget / GiB)
        return max(int(budget // per_block), 0)

    def profile_run(self) -> None:
        """A forward over a dummy batch of max_num_batched_tokens, to measure peak memory."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        c, dev = self.model_cfg, self.device
        nb = -(-n // self.block_size)
        shape = (nb, self.block_size, c.num_kv_heads, c.head_dim)
        scratch = [(torch.zeros(shape, dtype=self.kv_dtype, device=dev),
                    torch.zeros(shape, dtype=self.kv_dtype, device=dev))
                   for _ in range(c.num_layers)]
        self._bind_cache(scratch)
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            positions=torch.arange(n, device=dev),
            slot_mapping=torch.arange(n, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(nb, dtype=torch.int32, device=dev).unsqueeze(0),
            max_query_len=n)
        with torch.inference_mode():
            hidden = self.model(ids, meta)
            self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        self._bind_cache([])

    def _allocate_kv_cache(self) -> None:
        c = self.model_cfg
        shape = (self.layout.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                          for _ in range(c.num_layers)]
        self._bind_cache(self.kv_caches)

    def _bind_cache(self, caches: list) -> None:
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = caches[i] if caches else (None, None)

    # -- execution ---------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest],
                block_tables: list[list[int]]) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flat batch tensors for the scheduled requests, and the rows to sample from."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        ctx_lens: list[int] = []
        sample_rows: list[int] = []
        for s, table in zip(scheduled, block_tables):
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            input_ids.extend(r.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(cu[-1] + s.num_new_tokens)
            ctx_lens.append(end)
            if s.samples:
                sample_rows.append(cu[-1] - 1)
        width = max(len(t) for t in block_tables)
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(s.num_new_tokens for s in scheduled))
        return torch.tensor(input_ids, dtype=torch.long, device=dev), meta, sample_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest],
                block_tables: list[list[int]]) -> torch.Tensor:
        """Logits `[num_sampling_rows, vocab]` (float32) for the rows that sample."""
        input_ids, meta, rows = self.prepare(scheduled, block_tables)
        hidden = self.model(input_ids, meta)
        if not rows:
            return torch.empty(0, self.model_cfg.vocab_size, device=self.device)
        return self.model.compute_logits(hidden[rows]).float()
