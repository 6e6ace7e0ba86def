"""Model runner: device, weights, KV cache allocation and sizing, batch tensors.

Executes what the scheduler decided: packs the scheduled tokens of all requests into
one flat batch (prefill chunks and decodes mixed), writes their K/V through a slot
mapping, and returns the logits of the rows that produce a token this step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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


def default_ops(device: torch.device) -> type[Ops]:
    """Triton kernels on CUDA (when triton imports), the torch twins elsewhere."""
    if device.type == "cuda":
        try:
            from pagefleet.server.ops.triton_ops import TritonOps
        except ImportError as e:   # pragma: no cover - GPU hosts carry triton
            log.warning("triton is not importable (%s): using the torch ops on CUDA", e)
            return Ops
        return TritonOps
    return Ops


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes (CUDA graphs): 1, 2, 4, 8, then multiples of 8, and
    max_num_seqs itself."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


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
                 max_model_len: int, ops: type[Ops] | None = None) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.max_model_len = max_model_len
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_cfg, self.device)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        self.ops = ops or default_ops(self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._decode_sizes: list[int] = []
        if self.device.type == "cuda":
            self._check_free_memory()
        self.model: DecoderForCausalLM = load_model(model_dir, model_cfg, self.dtype, self.device,
                                                    self.ops, max_positions=max_model_len,
                                                    quantization=config.quantization)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if self.model.quant_info is not None:   # the quantized size and the KV room it frees
            log.info("%s", self.model.quant_info.log_line(self.bytes_per_block() // self.block_size))
        self.layout = self._size_kv_cache()
        self._allocate_kv_cache()
        if self.device.type == "cuda":
            self._setup_decode_path()

    # -- sizing ------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        c = self.model_cfg
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * elem

    def _size_kv_cache(self) -> CacheLayout:
        per_block = self.bytes_per_block()
        log.info("Model weights: %.3g GiB (%s on %s)", self.weights_bytes / GiB,
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
                "Increase --gpu-memory-utilization (or --kv-cache-memory), decrease "
                "--max-model-len or --max-num-batched-tokens, or use --kv-cache-dtype fp8.")
        return layout

    def _check_free_memory(self) -> None:
        """At startup, before anything is loaded: the requested share must be free."""
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        torch.cuda.init()
        torch.empty(1, device=self.device)   # create the context, so it counts as in use
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        util = self.config.gpu_memory_utilization
        self._mem_at_start = (free, total, torch.cuda.memory_reserved(self.device))
        if free < total * util:
            raise ConfigError(
                f"Free GPU memory at startup ({free / GiB:.2f} GiB) is less than the requested "
                f"--gpu-memory-utilization {util} x {total / GiB:.2f} GiB = "
                f"{util * total / GiB:.2f} GiB. Another process is using the GPU; lower "
                "--gpu-memory-utilization or free the GPU.")

    def _gpu_blocks(self, per_block: int) -> int:
        """total x utilization - weights - profiled peak activations - non-torch memory.

        Non-torch memory is what appeared outside torch's allocator since startup
        (cuBLAS/Triton workspaces and modules); the CUDA context itself and other
        processes' memory were already accounted for by the startup free-memory check.
        """
        dev = self.device
        free0, total, reserved0 = self._mem_at_start
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        scratch = self.profile_run()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before - scratch
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info(dev)
        non_torch_now = total - free_after - torch.cuda.memory_reserved(dev)
        non_torch = max(non_torch_now - (total - free0 - reserved0), 0)
        util = self.config.gpu_memory_utilization
        persistent = before   # weights + rotary tables + anything else loaded
        budget = total * util - persistent - peak - non_torch
        log.info("Memory: total %.2f GiB x gpu_memory_utilization %.2f = %.2f GiB; weights %.2f "
                 "GiB; activation peak %.2f GiB (dummy batch of %d tokens); non-torch %.2f GiB; "
                 "KV cache budget %.2f GiB", total / GiB, util, total * util / GiB,
                 persistent / GiB, peak / GiB, self.config.max_num_batched_tokens,
                 non_torch / GiB, max(budget, 0) / GiB)
        self.memory_report = {"total": total, "utilization": util, "weights": persistent,
                              "activation_peak": peak, "non_torch": non_torch,
                              "kv_budget": max(budget, 0)}
        return max(int(budget // per_block), 0)

    def profile_run(self) -> int:
        """A forward over a dummy batch of max_num_batched_tokens (in sequences of at most
        max_model_len), then logits and sampling scratch for max_num_seqs rows, to
        measure peak activation memory."""
        n = self.config.max_num_batched_tokens
        c, dev, bs = self.model_cfg, self.device, self.block_size
        lens = [min(self.max_model_len, n - i) for i in range(0, n, self.max_model_len)]
        blocks = [-(-ln // bs) for ln in lens]
        shape = (sum(blocks), bs, c.num_kv_heads, c.head_dim)
        scratch = [(torch.zeros(shape, dtype=self.kv_dtype, device=dev),
                    torch.zeros(shape, dtype=self.kv_dtype, device=dev))
                   for _ in range(c.num_layers)]
        self._bind_cache(scratch)
        width = max(blocks)
        tables, first = [], 0
        for nb in blocks:
            tables.append(list(range(first, first + nb)) + [0] * (width - nb))
            first += nb
        slots = torch.cat([torch.arange(ln) + t[0] * bs for ln, t in zip(lens, tables)])
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            positions=torch.cat([torch.arange(ln) for ln in lens]).to(dev),
            slot_mapping=slots.to(dev),
            cu_seqlens_q=torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device=dev),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(lens))
        with torch.inference_mode():
            hidden = self.model(ids, meta)
            rows = min(n, self.config.max_num_seqs)
            logits = self.model.compute_logits(hidden[-rows:]).float()
            del hidden
            probs = logits.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_()
            (probs / noise).argmax(dim=-1)
            del logits, probs, noise
        self._bind_cache([])
        return sum(k.numel() * k.element_size() * 2 for k, _ in scratch)

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
    def set_ops(self, ops: type[Ops]) -> None:
        """Swap the op implementations (benchmarks compare the torch twins and Triton on
        one loaded model); CUDA graphs are recaptured for graph-safe ops."""
        self.ops = ops
        for m in self.model.modules():
            if hasattr(m, "ops"):
                m.ops = ops
        self._graphs.clear()
        if self.device.type == "cuda":
            self._setup_decode_path()

    def prepare(self, scheduled: list[ScheduledRequest],
                block_tables: list[list[int]]) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flat batch tensors for the scheduled requests, and the rows to sample from."""
        bs = self.block_size
        n_seqs = len(scheduled)
        num_new = [s.num_new_tokens for s in scheduled]
        cu = np.zeros(n_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        ctx_lens = np.empty(n_seqs, dtype=np.int32)
        width = max(len(t) for t in block_tables)
        tables = np.zeros((n_seqs, width), dtype=np.int32)
        sample_rows: list[int] = []
        for i, (s, table) in enumerate(zip(scheduled, block_tables)):
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + num_new[i]
            a, b = cu[i], cu[i + 1]
            if end - start == 1:
                # A pending token (async scheduling) is not on the host yet: 0 stands
                # in, and the device copy replaces it.
                input_ids[a] = r.all_token_ids[start] if start < len(r.all_token_ids) else 0
                positions[a] = start
            else:
                input_ids[a:b] = r.all_token_ids[start:end]
                positions[a:b] = np.arange(start, end)
            ctx_lens[i] = end
            tables[i, :len(table)] = table
            if s.samples:
                sample_rows.append(int(b) - 1)
        seq_of = np.repeat(np.arange(n_seqs), num_new)
        slots = tables[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.from_numpy(positions).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)).to(dev),
            context_lens=torch.from_numpy(ctx_lens).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(num_new))
        return torch.from_numpy(input_ids).to(dev), meta, sample_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], block_tables: list[list[int]],
                prev_tokens: torch.Tensor | None = None,
                prev_rows: list[int] | None = None) -> torch.Tensor:
        """Logits `[num_sampling_rows, vocab]` (float32) for the rows that sample.

        With `prev_tokens` (async scheduling) every row is a decode whose input is
        `prev_tokens[prev_rows[i]]`, the previous step's sample, read on the device.
        """
        if (self._decode_sizes and len(scheduled) <= self._decode_sizes[-1]
                and all(s.num_new_tokens == 1 for s in scheduled)):
            return self._execute_decode(scheduled, block_tables, prev_tokens, prev_rows)
        t0 = time.perf_counter()
        input_ids, meta, rows = self.prepare(scheduled, block_tables)
        if prev_tokens is not None:
            input_ids = self._gather_pending(prev_tokens, prev_rows)
        self.last_prepare_s = time.perf_counter() - t0
        hidden = self.model(input_ids, meta)
        if not rows:
            return torch.empty(0, self.model_cfg.vocab_size, device=self.device)
        return self.model.compute_logits(hidden[rows]).float()

    # -- padded decode batches and CUDA graphs (CUDA only) ---------------------------------
    last_prepare_s = 0.0

    def _setup_decode_path(self) -> None:
        """Pure decode batches run at padded sizes from static input buffers, replayed
        from CUDA graphs unless --enforce-eager (or the ops are not graph-safe). Eager
        runs use the same padded shapes, so outputs with and without graphs are equal."""
        self._graphs.clear()
        if not getattr(self.ops, "graph_safe", False):
            self._decode_sizes = []
            return
        self._decode_sizes = decode_batch_sizes(self.config.max_num_seqs)
        max_bs = self._decode_sizes[-1]
        dev = self.device
        max_blocks = -(-self.max_model_len // self.block_size)
        pin = dev.type == "cuda"
        # Rows: input ids, positions, slots, context lengths (padding rows: slot -1, ctx 0).
        self._static_i64 = torch.zeros(4, max_bs, dtype=torch.long, device=dev)
        self._static_i64[2].fill_(-1)
        self._static_bt = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev)
        # Host mirrors, written in place each step and sent in two copies. A block-table
        # row is rewritten only when its request changed; a request's block list (the
        # KV manager's own list object) only grows, so otherwise just its tail is new.
        self._host_i64 = torch.zeros(4, max_bs, dtype=torch.long, pin_memory=pin)
        self._host_i64[2].fill_(-1)
        self._host_bt = torch.zeros(max_bs, max_blocks, dtype=torch.int32, pin_memory=pin)
        self._host_i64_np, self._host_bt_np = self._host_i64.numpy(), self._host_bt.numpy()
        self._bt_src: list[list[int] | None] = [None] * max_bs
        self._bt_len = [0] * max_bs
        self._copied: torch.cuda.Event | None = None
        if self.config.enforce_eager:
            log.info("CUDA graphs off (--enforce-eager); decode batches padded to %s",
                     self._decode_sizes)
            return
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(dev)[0]
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self._decode_sizes):
                self._decode_forward(bs)   # warm-up: compiles the kernels outside capture
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._decode_forward(bs)
                self._graphs[bs] = (graph, out)
        torch.cuda.synchronize(dev)
        used = free_before - torch.cuda.mem_get_info(dev)[0]
        log.info("CUDA graphs: captured %d decode batch sizes (1..%d) in %.1f s, %.2f GiB",
                 len(self._graphs), max_bs, time.perf_counter() - t0, used / GiB)

    def _static_meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self._static_i64[1, :bs], slot_mapping=self._static_i64[2, :bs],
            cu_seqlens_q=self._static_i64[3, :0], context_lens=self._static_i64[3, :bs],
            block_tables=self._static_bt[:bs], max_query_len=1)

    def _decode_forward(self, bs: int) -> torch.Tensor:
        return self.model(self._static_i64[0, :bs], self._static_meta(bs))

    def _gather_pending(self, prev_tokens: torch.Tensor, prev_rows: list[int]) -> torch.Tensor:
        index = torch.tensor(prev_rows, dtype=torch.long)
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        return prev_tokens.index_select(0, index)

    def _execute_decode(self, scheduled: list[ScheduledRequest], block_tables: list[list[int]],
                        prev_tokens: torch.Tensor | None = None,
                        prev_rows: list[int] | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        n = len(scheduled)
        bs_pad = next(b for b in self._decode_sizes if b >= n)
        blk = self.block_size
        if self._copied is not None:
            self._copied.synchronize()   # the host mirrors are free to overwrite
        h, bt = self._host_i64_np, self._host_bt_np
        src, lens = self._bt_src, self._bt_len
        ids, pos, slots = [], [], []
        for i, (s, table) in enumerate(zip(scheduled, block_tables)):
            r = s.request
            p = r.num_computed_tokens
            ids.append(r.all_token_ids[p] if p < len(r.all_token_ids) else 0)
            pos.append(p)
            slots.append(table[p // blk] * blk + p % blk)
            size = len(table)
            if src[i] is not table or lens[i] > size:
                bt[i, :size] = table
                src[i], lens[i] = table, size
            elif lens[i] < size:
                bt[i, lens[i]:size] = table[lens[i]:]
                lens[i] = size
        h[0, :n] = ids
        h[1, :n] = pos
        h[2, :n] = slots
        h[3, :n] = h[1, :n] + 1
        h[2, n:bs_pad] = -1
        h[3, n:bs_pad] = 0
        self._static_i64.copy_(self._host_i64, non_blocking=True)
        self._static_bt[:n].copy_(self._host_bt[:n], non_blocking=True)
        if prev_tokens is not None:
            self._static_i64[0, :n] = self._gather_pending(prev_tokens, prev_rows)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.last_prepare_s = time.perf_counter() - t0
        if bs_pad in self._graphs:
            graph, out = self._graphs[bs_pad]
            graph.replay()
            hidden = out
        else:
            hidden = self._decode_forward(bs_pad)
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        hidden = hidden[:n] if len(rows) == n else hidden[rows]
        return self.model.compute_logits(hidden).float()
