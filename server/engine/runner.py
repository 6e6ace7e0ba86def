"""Model runner: device, weights, KV cache allocation and sizing, step inputs.

Executes what the scheduler decided: packs the scheduled tokens of all requests into
one flat batch (decodes first, then prefill chunks), writes their K/V through a slot
mapping, and returns the logits of the rows that produce a token this step.

Every step's inputs travel the same way: packed on the host into a pinned staging
buffer, one non-blocking copy per dtype, block tables kept on the device per row slot
and updated only where a request gained blocks. Pure-decode steps replay CUDA graphs
at padded batch sizes; mixed steps of up to 1,024 tokens replay piecewise graphs with
their attention launched in between (piecewise.py); longer ones run eagerly, from the
same staged inputs. Nothing on the step path copies pageable memory to the device or
reads a device value back.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagefleet.server.config import ConfigError, EngineConfig
from pagefleet.server.engine.gemm_warmup import warm_gemm_kernels
from pagefleet.server.engine.graph_capture import capture, capture_stream
from pagefleet.server.engine.piecewise import PiecewiseGraphs, input_ids
from pagefleet.server.engine.scheduler import SchedulerOutput
from pagefleet.server.engine.staging import Staging
from pagefleet.server.models.config import ModelConfig
from pagefleet.server.models.decoder import AttentionMetadata, DecoderForCausalLM, Ops
from pagefleet.server.models.loader import load_model

log = logging.getLogger("pagefleet.engine")

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 512 << 20

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cpu_threads() -> int:
    """Torch threads for a CPU engine: PAGEFLEET_CPU_THREADS, else one core less than
    the machine has, at most 4: the API process needs a core too, and small models gain
    nothing from more (oversubscribed OpenMP threads cost 20x here, measured)."""
    env = os.environ.get("PAGEFLEET_CPU_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(4, (os.cpu_count() or 2) - 1))


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
    """Padded decode batch sizes (CUDA graphs): 1, 2, 4, 8, then multiples of 8 to 512,
    of 16 above (a decode step that large is mostly GEMM work: 16 rows of padding cost
    at most 3%, and half the captures), and max_num_seqs itself."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, min(max_num_seqs, 512), 8))
    sizes += list(range(512, max_num_seqs, 16))
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
    """One rank's model, KV cache and step execution.

    `tp` is the tensor-parallel group when the model is sharded (None: one device, and
    nothing here does anything extra). Every rank runs this same class on the same
    staged inputs; only rank 0 stages them and gets the logits (see tp_executor.py).
    """

    def __init__(self, config: EngineConfig, model_dir: Path, model_cfg: ModelConfig,
                 max_model_len: int, ops: type[Ops] | None = None, tp=None) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.max_model_len = max_model_len
        self.tp = tp
        self.device = resolve_device(config.device) if tp is None else tp.device
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads())
        self.dtype = resolve_dtype(config.dtype, model_cfg, self.device)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        self.ops = ops or default_ops(self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._decode_sizes: list[int] = []
        self._widths: list[int] = []
        self._pieces: PiecewiseGraphs | None = None   # mixed steps' graphs (piecewise.py)
        if self.device.type == "cuda":
            self._check_free_memory()
        self.model: DecoderForCausalLM = load_model(model_dir, model_cfg, self.dtype, self.device,
                                                    self.ops, max_positions=max_model_len,
                                                    quantization=config.quantization,
                                                    **({"tp": tp} if tp is not None else {}))
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # KV heads this rank holds (all of them without tensor parallelism).
        self.num_kv_heads = self.model.attention_layers()[0].num_kv_heads
        if self.model.quant_info is not None:   # the quantized size and the KV room it frees
            log.info("%s", self.model.quant_info.log_line(
                self.bytes_per_block() // self.block_size, self._kv_from_free_memory()))
        self._setup_step_buffers()
        self.layout: CacheLayout | None = None

    def init_kv_cache(self) -> None:
        """Size and allocate the KV cache, then capture the decode graphs. Called once
        everything else that stays resident (the sampler's state) is allocated."""
        self.layout = self._size_kv_cache()
        self._allocate_kv_cache()
        if self.device.type == "cuda":
            # Before serving: cuBLAS's first launch of each kernel waits for the device.
            warm_gemm_kernels(self.model, self.config.max_num_batched_tokens,
                              max(self.max_rows, PROMPT_LOGPROB_SLICE))
            self._setup_decode_path()

    # -- sizing ------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        c = self.model_cfg
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * c.num_layers * self.block_size * self.num_kv_heads * c.head_dim * elem

    def _kv_from_free_memory(self) -> bool:
        """Whether the KV cache is sized from the GPU memory left free (so smaller
        weights make it larger), not fixed by a flag or the CPU budget."""
        return (self.config.num_kv_blocks is None and self.config.kv_cache_memory is None
                and self.device.type != "cpu")

    def _size_kv_cache(self) -> CacheLayout:
        per_block = self.bytes_per_block()
        log.info("Model weights: %.3g GiB (%s on %s)", self.weights_bytes / GiB,
                 str(self.dtype).removeprefix("torch."), self.device)
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif not self._kv_from_free_memory():
            budget = self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = budget // per_block
        else:
            num_blocks = self._gpu_blocks(per_block)
        if self.tp is not None:   # every rank must hold the same blocks: the fewest wins
            from pagefleet.server.engine.tp_executor import agree_on_blocks

            num_blocks = agree_on_blocks(self.tp, num_blocks, self.weights_bytes, per_block)
        layout = CacheLayout(num_blocks, self.block_size, per_block)
        if self.tp is None:
            log.info("KV cache: %d blocks = %d tokens (%.2f GiB)", num_blocks, layout.num_tokens,
                     num_blocks * per_block / GiB)
        else:
            n = self.tp.world_size
            log.info("KV cache: %d blocks = %d tokens (%.2f GiB per rank, %.2f GiB over %d "
                     "ranks)", num_blocks, layout.num_tokens, num_blocks * per_block / GiB,
                     n * num_blocks * per_block / GiB, n)
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
        shape = (sum(blocks), bs, self.num_kv_heads, c.head_dim)
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
            max_query_len=max(lens), num_decodes=0)
        with torch.inference_mode():
            hidden = self.model(ids, meta)
            rows = min(n, self.config.max_num_seqs)
            logits = self._logits(hidden[-rows:])
            del hidden
            if logits is not None:   # the rank that samples
                probs = logits.softmax(dim=-1)
                noise = torch.empty_like(probs).exponential_()
                (probs / noise).argmax(dim=-1)
                del probs, noise
            del logits
        self._bind_cache([])
        return sum(k.numel() * k.element_size() * 2 for k, _ in scratch)

    def _allocate_kv_cache(self) -> None:
        c = self.model_cfg
        shape = (self.layout.num_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                          for _ in range(c.num_layers)]
        self._bind_cache(self.kv_caches)

    def _bind_cache(self, caches: list) -> None:
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = caches[i] if caches else (None, None)

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

    # -- step inputs -------------------------------------------------------------------
    def _setup_step_buffers(self) -> None:
        """Persistent per-row state on the device (allocated before KV sizing, so it
        counts as persistent memory): a block table per row slot, updated in place as
        requests get blocks, and the last sampled token of each sampling row (read on
        the device by the next step's pending decodes)."""
        dev = self.device
        self.max_rows = self.config.max_num_seqs
        self.max_blocks = -(-self.max_model_len // self.block_size)
        self.block_table = torch.zeros(self.max_rows, self.max_blocks, dtype=torch.int32,
                                       device=dev)
        self.last_tokens = torch.zeros(self.max_rows, dtype=torch.long, device=dev)
        cap = 4 * (self.config.max_num_batched_tokens + self.max_rows) + 8 * self.max_rows
        self.staging = Staging(dev, capacity_i64=cap + 4096)
        self._bt_src: list[list[int] | None] = [None] * self.max_rows
        self._bt_len = [0] * self.max_rows

    def stage(self, sched: SchedulerOutput, tables: list[list[int]]) -> "StagedStep":
        """Pack the step's inputs into the staging buffer (host work only).

        Rows are the scheduler's: `sched.num_decodes` one-token decodes first, then
        prefill chunks. A decode whose input is the previous step's pending token
        reads it from `last_tokens[r.sample_row]` on the device."""
        rows = sched.scheduled
        n_rows, n_dec = len(rows), sched.num_decodes
        st = self.staging
        bs = self.block_size
        padded = self._padded_size(sched)
        n_tok = sum(s.num_new_tokens for s in rows)
        pieces = self._pieces.size_for(n_tok) if self._pieces is not None and not padded else 0
        width = padded or pieces or n_tok
        tok_h, tok = st.reserve("i64", 4, width)          # ids, positions, slots, pending row
        row_h, row = st.reserve("i64", 2, padded or n_rows)   # context lens, row slot
        ids, pos, slot_map, pend = tok[0], tok[1], tok[2], tok[3]
        ctx, row_slot = row[0], row[1]
        bt_src, bt_len = self._bt_src, self._bt_len
        upd_slot: list[int] = []
        upd_col: list[int] = []
        upd_blk: list[int] = []
        sample_rows: list[int] = []
        # Decode rows: scalars per row.
        d_ids, d_pos, d_slot, d_pend = [], [], [], []
        for i in range(n_dec):
            s = rows[i]
            r = s.request
            p = r.num_computed_tokens
            table = tables[i]
            if s.pending:
                d_ids.append(0)
                d_pend.append(r.sample_row)
            else:
                d_ids.append(r.all_token_ids[p])
                d_pend.append(-1)
            d_pos.append(p)
            d_slot.append(table[p // bs] * bs + p % bs)
        width_blocks = self._graph_width(padded, max(d_pos) + 1) if padded else 0
        if n_dec:
            ids[:n_dec] = d_ids
            pos[:n_dec] = d_pos
            slot_map[:n_dec] = d_slot
            pend[:n_dec] = d_pend
            ctx[:n_dec] = pos[:n_dec] + 1
            sample_rows = list(range(n_dec))
        # Prefill rows: slices of the token lists.
        cu = [0]
        a = n_dec
        max_q = 1
        pl_rows: list[int] = []
        pl_targets: list[int] = []
        pl_segments: list[tuple] = []
        pl_top = 0
        for i in range(n_dec, n_rows):
            s = rows[i]
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            b = a + n
            if r.params.prompt_logprobs is not None:
                # Logprob of prompt token p at row p-1, for the prompt positions here
                # not reported before (a recompute after preemption repeats a prompt;
                # the core moves `prompt_logprobs_next` once the step is staged).
                lo = max(start + 1, r.prompt_logprobs_next)
                last = min(start + n, r.num_prompt_tokens - 1)
                if last >= lo:
                    pl_rows.extend(range(a + lo - 1 - start, a + last - start))
                    pl_targets.extend(r.all_token_ids[lo:last + 1])
                    pl_segments.append((r, lo, last + 1 - lo))
                    pl_top = max(pl_top, r.params.prompt_logprobs)
            ids[a:b] = r.all_token_ids[start:start + n]
            p = np.arange(start, start + n)
            pos[a:b] = p
            table = np.asarray(tables[i], dtype=np.int64)
            slot_map[a:b] = table[p // bs] * bs + p % bs
            pend[a:b] = -1
            ctx[i] = start + n
            cu.append(b - n_dec)
            max_q = max(max_q, n)
            if s.samples:
                sample_rows.append(b - 1)
            a = b
        # Row slots and block-table updates (only the blocks a row gained). The books
        # (`_bt_src`, `_bt_len`) change only once every array is staged: a staging
        # overflow retries the whole step.
        changed: list[tuple[int, list[int], int]] = []
        for i in range(n_rows):
            r = rows[i].request
            slot = r.slot
            row_slot[i] = slot
            table = tables[i]
            size = len(table)
            first = bt_len[slot] if bt_src[slot] is table and bt_len[slot] <= size else 0
            if size > first or bt_src[slot] is not table:
                upd_slot.extend([slot] * (size - first))
                upd_col.extend(range(first, size))
                upd_blk.extend(table[first:size])
                changed.append((slot, table, size))
        if padded:
            ids[n_rows:] = 0
            pos[n_rows:] = 0
            slot_map[n_rows:] = -1
            pend[n_rows:] = -1
            ctx[n_rows:] = 0
            row_slot[n_rows:] = 0
        elif pieces:   # padding tokens: no K/V write, nothing read from a pending row
            ids[n_tok:] = 0
            pos[n_tok:] = 0
            slot_map[n_tok:] = -1
            pend[n_tok:] = -1
        upd_h = st.put("i64", [upd_slot, upd_col, upd_blk], 3, len(upd_slot)) if upd_slot else None
        cu_h = st.put("i64", cu) if n_rows > n_dec else None
        rows_h = st.put("i64", sample_rows)
        pl = None
        if pl_rows:
            pl = PromptLogprobRows(st.put("i64", pl_rows), st.put("i64", pl_targets),
                                   len(pl_rows), pl_top, pl_segments)
        for slot, table, size in changed:
            bt_src[slot], bt_len[slot] = table, size
        return StagedStep(tok_h, row_h, upd_h, cu_h, rows_h, n_tok, n_rows, n_dec, max_q,
                          len(sample_rows), padded, width_blocks, pl, pieces)

    def _padded_size(self, sched: SchedulerOutput) -> int:
        """The captured batch size for a pure-decode step, or 0 (eager, unpadded)."""
        n = len(sched.scheduled)
        if self._decode_sizes and sched.num_decodes == n and n <= self._decode_sizes[-1]:
            return next(b for b in self._decode_sizes if b >= n)
        return 0

    # -- execution ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: "StagedStep") -> torch.Tensor:
        """Queue the step's forward (after `staging.commit()`); returns the logits
        `[num_sampling_rows, vocab]` (float32) of the rows that sample."""
        st = self.staging
        if step.bt_updates is not None:
            upd = st.get(step.bt_updates)
            self.block_table[upd[0], upd[1]] = upd[2].to(torch.int32)
        t0 = time.perf_counter()
        tok, row = st.get(step.tok), st.get(step.row)
        if step.padded:
            self._g_tok[:, :step.padded].copy_(tok)
            self._g_row[:, :step.padded].copy_(row)
            graph = self._graphs.get((step.padded, step.width))
            if graph is not None:
                graph[0].replay()
                hidden = graph[1]
            else:
                hidden = self._decode_forward(step.padded, step.width)
            self.last_prepare_s = time.perf_counter() - t0
            return self._logits(hidden[:step.num_samples])
        meta = AttentionMetadata(
            positions=tok[1], slot_mapping=tok[2],
            cu_seqlens_q=st.get(step.cu) if step.cu is not None else row[0][:0],
            context_lens=row[0], block_tables=self.block_table.index_select(0, row[1]),
            max_query_len=step.max_query_len, num_decodes=step.num_decodes)
        self.last_prepare_s = time.perf_counter() - t0
        if step.pieces:
            hidden = self._pieces.run(step.pieces, tok, meta, step.num_tokens)
            hidden = hidden[:step.num_tokens]
        else:
            hidden = self.model(input_ids(self.last_tokens, tok[0], tok[3]), meta)
        if step.prompt_logprobs is not None:
            step.prompt_logprobs.compute(self.model, hidden, st)
        if step.num_samples == 0:
            return torch.empty(0, self.model_cfg.vocab_size, device=self.device)
        if step.num_samples == step.num_tokens:
            return self._logits(hidden)
        return self._logits(hidden.index_select(0, st.get(step.sample_rows)))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits `[rows, vocab]`; None on tensor-parallel ranks other than 0
        (their vocabulary shards went to rank 0)."""
        logits = self.model.compute_logits(hidden)
        return logits.float() if logits is not None else None

    # -- padded decode batches and CUDA graphs ------------------------------------------
    last_prepare_s = 0.0

    def _setup_decode_path(self, force: bool = False, pieces: bool | None = None) -> None:
        """Pure decode batches run at padded sizes from static input buffers, replayed
        from CUDA graphs unless --enforce-eager (or the ops are not graph-safe). Eager
        runs use the same padded shapes, so outputs with and without graphs are equal.
        `force` sets up the padded path without a GPU (tests run it eagerly on the CPU).
        Mixed steps of up to 1,024 tokens run through piecewise graphs (piecewise.py),
        on one device with --cudagraph-mode FULL_AND_PIECEWISE (the default); `pieces`
        overrides that choice (tests run the pieces eagerly on the CPU).
        """
        self._graphs.clear()
        self._pieces = None
        if not (force or getattr(self.ops, "graph_safe", False)):
            self._decode_sizes = []
            return
        if pieces is None:
            pieces = (self.tp is None and not self._graphs_off()
                      and self.config.cudagraph_mode == "FULL_AND_PIECEWISE")
        if pieces:
            self._pieces = PiecewiseGraphs(self.model, self.last_tokens,
                                           self.config.max_num_batched_tokens, self.device,
                                           self.dtype)
        sizes = decode_batch_sizes(min(self.config.max_num_seqs, MAX_GRAPH_BATCH))
        self._decode_sizes = sizes
        self._widths = context_buckets(self.max_model_len, self.block_size)
        max_bs = sizes[-1]
        dev = self.device
        self._g_tok = torch.zeros(4, max_bs, dtype=torch.long, device=dev)
        self._g_tok[2].fill_(-1)
        self._g_tok[3].fill_(-1)
        self._g_row = torch.zeros(2, max_bs, dtype=torch.long, device=dev)
        if self._graphs_off() or dev.type != "cuda":
            log.info("CUDA graphs off%s; decode batches padded to %s",
                     " (--enforce-eager or --cudagraph-mode NONE)" if self._graphs_off() else "",
                     sizes)
            return
        t0 = time.perf_counter()
        torch.cuda.empty_cache()   # free memory before and after: the graphs' pool alone
        free_before = torch.cuda.mem_get_info(dev)[0]
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(), capture_stream():
            for bs in reversed(sizes):
                for width in self._graph_widths(bs):
                    self._decode_forward(bs, width)   # warm-up: compiles outside capture
                    torch.cuda.synchronize(dev)
                    self._graphs[(bs, width)] = capture(
                        lambda bs=bs, width=width: self._decode_forward(bs, width), pool)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()   # the warm-up runs' blocks, cached for the capture stream
        used = free_before - torch.cuda.mem_get_info(dev)[0]
        log.info("CUDA graphs: captured %d decode graphs (batch 1..%d, context buckets %s "
                 "tokens) in %.1f s, %.2f GiB", len(self._graphs), max_bs,
                 [w * self.block_size for w in self._widths], time.perf_counter() - t0,
                 used / GiB)
        if self._pieces is not None:
            self._pieces.capture(pool)

    def _graphs_off(self) -> bool:
        return self.config.enforce_eager or self.config.cudagraph_mode == "NONE"

    def _graph_widths(self, bs: int) -> list[int]:
        """Block-table widths captured for batch `bs`. The decode kernel splits long
        contexts when the batch alone cannot fill the GPU, and sizes its grid of splits
        from the table's width: small batches get a graph per context bucket (a 1K
        context does not launch the split programs of a 32K one); large batches never
        split, one width."""
        if not self._widths or self._fills_gpu(bs):
            return self._widths[-1:] if self._widths else [self.max_blocks]
        return self._widths

    def _fills_gpu(self, bs: int) -> bool:
        try:
            from pagefleet.server.ops import triton_attention
        except ImportError:   # pragma: no cover - triton-less CPU installs
            return True
        return bs * self.model_cfg.num_kv_heads >= triton_attention._target_programs(self.device)

    def _graph_width(self, bs: int, max_ctx: int) -> int:
        need = -(-max_ctx // self.block_size)
        return next(w for w in self._graph_widths(bs) if w >= need)

    def _decode_forward(self, bs: int, width: int | None = None) -> torch.Tensor:
        """The captured decode step: input ids (pending ones from `last_tokens`), block
        tables gathered by row slot (the first `width` blocks), then the model. Reads
        only static buffers."""
        tok, row = self._g_tok[:, :bs], self._g_row[:, :bs]
        tables = self.block_table.index_select(0, row[1])
        if width is not None and width < self.max_blocks:
            tables = tables[:, :width]
        meta = AttentionMetadata(
            positions=tok[1], slot_mapping=tok[2], cu_seqlens_q=row[0][:0],
            context_lens=row[0], block_tables=tables, max_query_len=1, num_decodes=bs)
        return self.model(input_ids(self.last_tokens, tok[0], tok[3]), meta)


# Larger decode batches run eagerly. vLLM caps its captures at 512, but an eager decode
# step of 513-1,024 rows took 36 ms to launch against ~20 ms on the GPU (H200, fp8
# weights, 2026-12-01), and the default --max-num-seqs on large GPUs is 1,024.
MAX_GRAPH_BATCH = 1024


def context_buckets(max_model_len: int, block_size: int) -> list[int]:
    """Block-table widths (in blocks) of the decode graphs: 2K, 8K, 32K, 128K tokens
    below max_model_len, then max_model_len itself."""
    widths = [t for t in (2048, 8192, 32768, 131072) if t < max_model_len] + [max_model_len]
    return [-(-t // block_size) for t in widths]


class PromptLogprobRows:
    """Prompt logprobs asked for in one step: which hidden rows, which target tokens,
    and (after `compute`) the results on their way to the host. Logits are computed in
    slices of PROMPT_LOGPROB_SLICE rows, so a long prompt never holds a
    [tokens, vocab] tensor."""

    def __init__(self, rows_h: int, targets_h: int, count: int, top: int,
                 segments: list[tuple]) -> None:
        self.rows_h, self.targets_h, self.count, self.top = rows_h, targets_h, count, top
        self.segments = segments        # (request, first prompt position, count)
        self.host: tuple | None = None

    @torch.inference_mode()
    def compute(self, model, hidden: torch.Tensor, staging: Staging) -> None:
        rows, targets = staging.get(self.rows_h), staging.get(self.targets_h)
        k = self.top
        dev = hidden.device
        chosen = torch.empty(self.count, device=dev)
        ranks = torch.empty(self.count, dtype=torch.long, device=dev)
        top_v = torch.empty(self.count, k, device=dev)
        top_i = torch.empty(self.count, k, dtype=torch.long, device=dev)
        for j in range(0, self.count, PROMPT_LOGPROB_SLICE):
            sl = slice(j, min(j + PROMPT_LOGPROB_SLICE, self.count))
            logits = model.compute_logits(hidden.index_select(0, rows[sl]))
            if logits is None:   # a tensor-parallel worker: its vocabulary shard went to rank 0
                continue
            lp = logits.float().log_softmax(-1)
            c = lp.gather(1, targets[sl].unsqueeze(1))
            chosen[sl] = c.squeeze(1)
            ranks[sl] = (lp > c).sum(dim=-1) + 1
            if k:
                v, i = lp.topk(k, dim=-1)
                top_v[sl], top_i[sl] = v, i
        from pagefleet.server.engine.sampler import _to_host
        self.host = tuple(_to_host(t) for t in (chosen, ranks, top_v, top_i, targets))
        if dev.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    _event = None

    def results(self):
        """[(request, first position, Logprobs)] once the step's copies are done."""
        from pagefleet.server.engine.protocol import Logprobs
        if self._event is not None:
            self._event.synchronize()
        chosen, ranks, top_v, top_i, targets = (t.tolist() for t in self.host)
        out, a = [], 0
        for req, first, n in self.segments:
            k = req.params.prompt_logprobs
            ids = [[targets[j]] + top_i[j][:k] for j in range(a, a + n)]
            vals = [[chosen[j]] + top_v[j][:k] for j in range(a, a + n)]
            out.append((req, first, Logprobs(ids, vals, ranks[a:a + n])))
            a += n
        return out


PROMPT_LOGPROB_SLICE = 256


@dataclass(slots=True)
class StagedStep:
    """Handles into the staging buffer for one step, plus the host-side shape facts."""

    tok: int
    row: int
    bt_updates: int | None
    cu: int | None
    sample_rows: int
    num_tokens: int
    num_rows: int
    num_decodes: int
    max_query_len: int
    num_samples: int
    padded: int
    width: int = 0          # block-table width of the decode graph (padded steps)
    prompt_logprobs: PromptLogprobRows | None = None
    pieces: int = 0         # a mixed step's padded token count (piecewise graphs), or 0
