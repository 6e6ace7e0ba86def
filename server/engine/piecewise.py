"""Piecewise CUDA graphs for mixed steps (decode rows + prefill chunks).

A pure-decode step replays one CUDA graph of the whole forward (runner.py). A mixed
step cannot: its attention depends on how many prefill chunks it has and how long
they are, which the kernels' grids are built from. Run eagerly, a mixed step costs the
host ~15 ms of launches for a 7B model (H200, 2026-12-02: 28 layers x ~12 kernels),
more than the ~6 ms decode step queued ahead of it, so the GPU waited for the host in
every step where a new request joined. As vLLM does, everything *between* two layers'
attention calls is captured instead, once per padded token count T, and only the
attention kernels run eagerly:

    piece 0:  embedding, layer 0's input norm, q/k/v, rotary, K/V write
    piece i:  layer i-1's o_proj, norm and MLP; layer i's input norm ... K/V write
    piece L:  layer L-1's o_proj, norm and MLP; the final norm

The pieces pass data through static buffers (q, the residual, the attention output)
that every T shares (slices `[:T]`), so the graphs' own memory pool holds only what
one piece needs inside itself. The step's tokens are staged padded to T: padding rows
have slot -1 (no K/V write) and are never attended to nor sampled; they are computed
row-wise and thrown away.

Off for tensor parallelism for now (one device only): the pieces would hold the
all-reduces, which is fine in principle, but no multi-GPU machine has run it.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from pagefleet.server.engine.graph_capture import capture, capture_stream
from pagefleet.server.models.decoder import AttentionMetadata, DecoderForCausalLM

log = logging.getLogger("pagefleet.engine")

MAX_PIECEWISE_TOKENS = 1024


def input_ids(last_tokens: torch.Tensor, ids: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """Known ids, with pending decodes' ids read from the previous step's samples
    (`last_tokens[pending row]`) on the device."""
    prev = last_tokens.index_select(0, pending.clamp(min=0))
    return torch.where(pending >= 0, prev, ids)


def piece_sizes(max_tokens: int) -> list[int]:
    """Padded token counts with captured pieces: every 16th to 256, every 32nd to 512,
    every 64th to 1,024 (padding is at most 1/8 of a step's tokens from 128 on, where the
    GEMMs start to cost by the row), capped by `max_tokens` (max_num_batched_tokens),
    which is itself a size when smaller."""
    cap = min(max_tokens, MAX_PIECEWISE_TOKENS)
    sizes = list(range(16, 257, 16)) + list(range(288, 513, 32)) + list(range(576, 1025, 64))
    sizes = [t for t in sizes if t < cap]
    return sizes + [cap] if cap >= 2 else sizes


class PiecewiseGraphs:
    """The pieces of `model`'s forward per padded token count, and how to run a step
    through them. Until `capture` has run (never on a CPU: the tests), `run` calls the
    very same pieces eagerly."""

    def __init__(self, model: DecoderForCausalLM, last_tokens: torch.Tensor, max_tokens: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        # Tensors only, never the runner: a reference back to it would make a cycle that
        # keeps a deleted engine's KV cache on the GPU until the next garbage collection.
        self.model = model
        self.last_tokens = last_tokens      # the runner's: pending decodes read their ids there
        self.sizes = piece_sizes(max_tokens)
        attn = model.attention_layers()[0]
        t = self.sizes[-1] if self.sizes else 0
        self.tok = torch.zeros(4, t, dtype=torch.long, device=device)   # ids, pos, slot, pending
        self.tok[2].fill_(-1)
        self.tok[3].fill_(-1)
        shape = (t, attn.num_heads, attn.head_dim)
        self.q = torch.zeros(shape, dtype=dtype, device=device)
        self.o = torch.zeros(shape, dtype=dtype, device=device)
        self.residual = torch.zeros(t, model.cfg.hidden_size, dtype=dtype, device=device)
        self.hidden: dict[int, torch.Tensor] = {}     # T -> the last piece's output
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.num_steps = 0                             # steps run through the pieces

    def size_for(self, num_tokens: int) -> int:
        """The padded token count for a step of `num_tokens`, or 0 (run it eagerly)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else 0

    def _meta(self, t: int) -> AttentionMetadata:
        """What the pieces read of the metadata: positions and slots (static slices)."""
        tok = self.tok[:, :t]
        return AttentionMetadata(positions=tok[1], slot_mapping=tok[2], cu_seqlens_q=tok[1][:0],
                                 context_lens=tok[1][:0], block_tables=tok[1][:0],
                                 max_query_len=1)

    def _piece(self, i: int, t: int, meta: AttentionMetadata) -> None:
        m = self.model
        if i == 0:
            x, residual = m.embed(input_ids(self.last_tokens, self.tok[0, :t], self.tok[3, :t])), None
        else:
            x, residual = m.layers[i - 1].attn_out(self.o[:t], self.residual[:t])
        if i == len(m.layers):
            self.hidden[t] = m.final_norm(x, residual)
            return
        q, residual = m.layers[i].attn_in(x, residual, meta, m.cos_sin)
        self.q[:t].copy_(q)
        self.residual[:t].copy_(residual)

    def capture(self, pool) -> None:
        """Capture every size's pieces (largest first, one memory pool), after one eager
        run of each size (Triton compiles outside capture)."""
        if not self.sizes:   # --max-num-batched-tokens 1: no mixed step is small enough
            return
        t0 = time.perf_counter()
        self.tok[2].fill_(-1)   # no K/V writes from the eager runs (slots of an earlier step)
        self.tok[3].fill_(-1)
        n = len(self.model.layers) + 1
        with torch.inference_mode(), capture_stream():
            for t in reversed(self.sizes):
                meta = self._meta(t)
                for i in range(n):   # warm-up: Triton compiles outside capture
                    self._piece(i, t, meta)
                torch.cuda.synchronize()
                self.graphs[t] = [capture(lambda i=i: self._piece(i, t, meta), pool)[0]
                                  for i in range(n)]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()   # the eager runs' blocks, cached for the capture stream
        log.info("CUDA graphs: captured %d pieces for mixed steps (%d token counts, 16..%d) in "
                 "%.1f s", n * len(self.sizes), len(self.sizes), self.sizes[-1],
                 time.perf_counter() - t0)

    def run(self, t: int, tok: torch.Tensor, meta: AttentionMetadata,
            num_tokens: int) -> torch.Tensor:
        """The forward of a step staged at padded size `t` (`tok`: its `[4, t]` staged
        ids/positions/slots/pending rows; `meta`: its real attention metadata): hidden
        states `[t, hidden]`, rows past `num_tokens` padding."""
        self.tok[:, :t].copy_(tok)
        graphs = self.graphs.get(t)
        layers = self.model.layers
        piece_meta = None if graphs is not None else self._meta(t)
        for i in range(len(layers) + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(i, t, piece_meta)
            if i < len(layers):
                layers[i].self_attn.attend(self.q[:t], meta, num_tokens, out=self.o[:t])
        self.num_steps += 1
        return self.hidden[t]
