"""Touch every cuBLAS kernel the eager steps can pick, before serving.

Why: cuBLAS picks a kernel per GEMM shape, and the first launch of each kernel in a
process waits for the device to finish everything queued before it (measured on an
H200, 2026-12-02, classic cuBLAS and cuBLASLt alike, `CUDA_MODULE_LOADING=EAGER` or
not: `benchmarks/host_block.py`). Every later launch of that kernel, at any shape that
picks it, is asynchronous again. Eager steps (prefills and mixed steps) have a new token
count almost every step, and the lm_head GEMM a new count of sampling rows, so a fresh
server met such a kernel in most mixed steps: the host then sat out the step's whole GPU
time (140 ms of a 200 ms step in `profile_serving.py host`) instead of preparing the
next step, which async scheduling exists to overlap.

So at startup each projection of one decoder layer (the layers share their shapes) runs
at every token count a step can have, on a grid fine enough to meet each kernel (cuBLAS
changes kernels at tile and wave boundaries: every count up to 256, then every 8th up
to 2,048, then every 16th), and lm_head at every row count a step can sample (and a
prompt-logprob slice can hold), and the down projection on `[gate | up]` rows up to 32
(the fused SiLU GEMV). Decode graphs need nothing: their kernels are launched
while capturing them. The values computed are discarded; nothing else changes.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("pagefleet.engine")
# Rows the down projection is warmed on as `[gate | up]`: above the largest batch of a
# quantized GEMV that takes SiLU in its load (FP8_CONFIG's gemv_max_m, at most 16 in
# every tuning so far); its fallback (silu_and_mul, then the GEMM) is swept anyway.
SILU_ROWS = 32


def token_grid(max_tokens: int) -> list[int]:
    """Token counts swept for the layer GEMMs: every count to 256, every 8th to 2,048,
    every 16th beyond, and `max_tokens` itself."""
    grid = list(range(1, min(256, max_tokens) + 1))
    grid += range(264, min(2048, max_tokens) + 1, 8)
    grid += range(2064, max_tokens + 1, 16)
    if grid[-1] != max_tokens:
        grid.append(max_tokens)
    return grid


@torch.inference_mode()
def warm_gemm_kernels(model, max_tokens: int, max_rows: int) -> tuple[int, float]:
    """Run layer 0's projections at every count of `token_grid(max_tokens)` and the
    lm_head at 1..`max_rows` rows; returns (GEMM launches, seconds)."""
    t0 = time.perf_counter()
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    head = model.head_weight
    widest = max(p.input_size_per_partition for p in projections)
    x = torch.zeros(max_tokens, widest, dtype=head.dtype, device=head.device)
    launches = 0
    for m in token_grid(max_tokens):
        for proj in projections:
            proj(x[:m, :proj.input_size_per_partition])
            launches += 1
    # The down projection as the MLP calls it (a quantized GEMV may take SiLU-and-mul in
    # its activation load at decode sizes: a kernel variant of its own).
    down = mlp.down_proj
    act = torch.zeros(min(SILU_ROWS, max_tokens), 2 * down.input_size_per_partition,
                      dtype=head.dtype, device=head.device)
    for m in range(1, act.shape[0] + 1):
        down.forward_silu_mul(act[:m])
        launches += 1
    del act
    h = x[:, :head.shape[1]]
    # one device: the ops' logits (a Triton GEMV at the fewest rows, cuBLAS above);
    # tensor parallel: cuBLAS, as compute_logits runs it before the gather
    logits = model.ops.logits if model.tp is None else torch.nn.functional.linear
    for m in range(1, min(max_rows, max_tokens) + 1):
        logits(h[:m], head)
        launches += 1
    del x, h
    if head.device.type == "cuda":
        torch.cuda.synchronize(head.device)
    took = time.perf_counter() - t0
    log.info("GEMM kernels touched: %d launches (token counts up to %d, lm_head up to %d "
             "rows) in %.2f s", launches, max_tokens, min(max_rows, max_tokens), took)
    return launches, took
