"""Quantized GEMMs in Triton (twins: `quant.py`, same signatures and layouts).

w4a16 (AWQ and GPTQ, one K-major layout, see `quant.py`):
- Nibbles become floats without an int-to-float conversion (a quarter-rate instruction
  on Hopper): OR-ing a nibble that sits in the low 16 bits into the bit pattern of 2^23
  gives the float 2^23 + q * 16^j exactly, and one subtraction leaves q * 16^j
  (`_nibble_times_16j`; each half word is ORed into 2^23's bits once, so each nibble
  is then one AND with one immediate); the 16^j is folded into the activation (a power
  of two: exact). On the H200 this moved the B=1 linear layers only from 2.82 to 2.77 ms, and
  tiles spanning four groups (4x the words in flight per thread) only to 2.66 ms: the
  GEMV (1.3 TB/s) issues ~4 instructions per nibble, which the loads do not hide.
- `_w4_gemv_kernel`, small batches (decode): each program takes `BLOCK_N` output
  columns and one K split of one row; it reads `[BLOCK_K / 8, BLOCK_N]` int32 words
  (contiguous along N; a tile spans several quantization groups, one scale row each),
  takes their 8 nibbles as above and multiplies them by the matching 8 activations,
  accumulating float32 partial sums; the zero point comes out of the loop
  (`sum x (q - z) = sum x q - z sum x`) and each group's scale is applied once per
  tile. The loop is kept lean, since at B=1 it issues about as many instructions as the
  SMs retire while its bytes arrive: the group size is compiled in (a shift, not an
  integer division per tile), pointers advance a tile a step, and where the tiles divide
  N and K (every Qwen/Llama layer) the loads carry no masks. Split-K fills the GPU when
  N alone cannot (B = 1: 28 K splits of a 3584-column o_proj); splits go to a float32
  buffer that the tile's last program sums in split order (`_store_split`, arrival
  counters in `triton_common`), or a second kernel after (`fused_reduce` off).
- `_w4_gemm_kernel`, medium batches: tiles dequantized in registers to the activation
  dtype (`q - z` in one subtraction of 2^23 + z) and fed to `tl.dot` (float32 accumulation).
  `_w4_gemm_planes_kernel` (`gemm_planes`, on since the H200 timed it) loads each word
  once instead of once per K row, splits it into 8 nibble planes and joins them back
  into K order.
- From `W4_CONFIG['dequant_min_m']` rows (prefill), `_w4_dequant_kernel` writes the
  whole `[K, N]` weight in the activation dtype once and cuBLAS multiplies: the
  dequantization is paid once per call instead of once per row tile.
fp8 (e4m3 weights with per-row or block scales):
- `_fp8_gemv_kernel` / `_fp8_gemm_kernel`: weight-only (w8a16) for small and medium
  batches, scales applied per tile or at the end (per-row scales);
- large batches quantize the activations per token (`_fp8_act_quant_kernel`) and run
  fp8 x fp8 on the tensor cores: `torch._scaled_mm` (row-wise scales, Hopper) for
  per-row weight scales and bf16 outputs, else `_fp8_w8a8_kernel` (block scales too).

Launch parameters live in W4_CONFIG / FP8_CONFIG (benchmarks/quant_bench.py sweeps them
on the GPU; tests shrink them). No kernel reads a device value back: CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagefleet.server.ops import gluon_w4, gluon_w4_tma
from pagefleet.server.ops import quant as twin
from pagefleet.server.ops import triton_activation
from pagefleet.server.ops.deferred import DeferredSlot, DeferredSum
from pagefleet.server.ops.triton_common import launch_opts, pdl_wait
from pagefleet.server.ops.triton_common import INTERPRET as _INTERPRET
from pagefleet.server.ops.triton_common import dot as _dot
from pagefleet.server.ops.triton_common import arrival_counters, last_arrival, sm_count

# Launch configs and crossovers as the H200 sweep of 2026-12-01 picked them
# (`benchmarks/quant_bench.py --phases kernels`, BENCHMARKS.md); other GPUs run them too.
W4_CONFIG = {
    "gemv_max_m": 2,        # rows up to which the GEMV kernel runs (one program row each)
    # 16 x 256 (two 128-row groups a tile) and 12 programs an SM (8 since: below) for the
    # split-K target:
    # 47 registers a thread (sm_90 ptxas) against 124 for the 32 x 512 tiles at 4 an SM
    # shipped before; a B=1 step's GEMVs 2.53 against 2.75 ms (H200, 2026-12-02 night,
    # benchmarks/gemv_step_ab.py: 28 distinct layers per graph)
    "gemv_block_n": 16, "gemv_block_k": 256, "gemv_warps": 4, "gemv_stages": 2,
    # One vector load per word row's 8 activations instead of 8 scalar loads: 5.95
    # against 7.34 SASS instructions per nibble in the loop (benchmarks/sass_loop.py);
    # the H200 sweep of 2026-12-02 (evening) still picked the scalar loads, so off.
    "gemv_xvec": False,
    # The GEMV's split-K target (the tl.dot kernel's: below), which only the base class
    # (qkv, o at Qwen2.5-7B's shape) keeps. 8, not the 12 that benchmarks/gemv_step_ab.py
    # picked: that benchmark runs a step's 112 GEMVs back to back, where the engine puts
    # norms, rotary and attention between them, and the two disagree. H200, 2026-12-03
    # (fourth session), the engine's AWQ decode graph (`run_quant.sh --phases
    # engine_awq --tuned ...`, one machine, in turn): B=1 2.214 / 2.233 against 2.277-2.283
    # ms for 12 (eager profile: the step's GEMVs 1.850 against 1.923-1.936 ms), B=2 3.590
    # / 3.591 against 3.604-3.650; the back-to-back step had 8 slower (1.99 against 1.95).
    "gemv_programs_per_sm": 8,
    # Per-shape overrides of the keys above, first match wins ({} switches one off).
    # "wide": the output tiles alone (x rows) fill the split-K target, so nothing is split
    # and a program is one tile's whole K: 2 warps a program (Qwen2.5-7B's gate_up at
    # 256-row tiles, twice the programs resident: 33.1 against 37.6 us; the 512-row tiles
    # shipped since: below). "deep": K at least gemv_deep_ratio x N (down): 32-column
    # tiles and a 16-an-SM split target (19.2 against 25.7 us). H200,
    # 2026-12-03 (second session), gemv_step_ab.py GEMV_SHAPES=1 (each shape's 28 GEMVs
    # in a graph of their own): a B=1 step's GEMVs 1.95-1.96 against 2.19-2.20 ms, the
    # engine's AWQ B=1 step 2.58 against 2.75 ms (GPU; two machines). The small layers
    # (qkv, o) ran faster alone at 8 programs an SM (7.7 / 6.9 against 10.0 / 8.1 us) but
    # not in a whole step (1.99-2.00 against 1.95-1.96 ms); the engine, which runs them
    # alone, is faster at 8 (gemv_programs_per_sm, above). Wide
    # layers at 512-row tiles (four groups a tile; nothing is split, so no split target):
    # 1.864-1.884 against 1.904-1.917 ms a step (gate_up 31.1-31.7 against 32.3-32.8
    # us; 121 registers, 8 programs an SM), 2026-12-03 (third session), two calls on one
    # machine, with gemv_prefetch 2; 1,024-row tiles (41.8 us), 1 warp (40.8) and the
    # deep layers at 512 rows (20.3-22.9 against 18.6-18.9) ran slower.
    "gemv_wide": {"gemv_warps": 2, "gemv_block_k": 512},
    "gemv_deep": {"gemv_block_n": 32, "gemv_programs_per_sm": 16},
    "gemv_deep_ratio": 4,
    # The next K tile's words loaded before this one's are multiplied, so a load stays
    # in flight while the thread computes: same bits, 40 registers (compile_sm90's
    # ptxas check). H200,
    # 2026-12-03 (one machine): a step's GEMVs 2.22 against 2.62 ms (gemv_step_ab.py, in
    # either order), the engine's AWQ B=1 step 2.97 against 3.13 ms. (Several column
    # tiles a program sharing each K tile's activations cut SASS to 4.9 a nibble but ran
    # slower, 2.71 ms at 4 tiles: the loop waits on its loads, not on issue; removed.)
    # 2: the scales and zero points a tile ahead too (in the tile's own step sm_90 SASS
    # used them ~30 instructions after their load: a memory latency every step). H200,
    # 2026-12-03 (third session), gemv_step_ab.py GEMV_SHAPES=1, each variant twice in
    # turn: a step's GEMVs 1.927-1.929 against 1.948-1.950 ms (qkv 9.0 against 10.0 us,
    # the other shapes equal), same bits, 40 registers (64 at the deep config; sm_90 ptxas).
    # The words two tiles ahead as well ran slower (2.05 ms; gate_up 35.5 against 32.3
    # us, 68 registers at 2 warps); removed. So did the first tile's weights requested
    # before the PDL wait, to overlap the kernel before (1.918-1.920 against 1.912-1.915
    # ms, next call); removed.
    # (Triton's own pipelining of the K loop, `tl.range(..., num_stages=3..6)` with
    # prefetch 0, does move the weights through shared memory by cp.async (LDGSTS in the
    # sm_90 SASS; the kernel's num_stages alone does not), same bits, but ran slower:
    # 2.12-2.26 against 1.87 ms a step, the engine's B=1 step 3.00 against 2.62 ms at 4
    # stages; not added. Nor the words stored tiled, a 16-column strip of K rows
    # contiguous: 1.838-1.840 against 1.904-1.912 ms back to back, but the engine's
    # forward unchanged, 2.210-2.226 against 2.216-2.220 ms. H200, 2026-12-03, fourth
    # session, BENCHMARKS.md.)
    "gemv_prefetch": 2,
    # 2026-12-03, later, not a switch: the group size compiled in, pointers advanced a
    # tile a step and unmasked loads where the tiles divide the shape took the shipped
    # loop from 242 to 188 SASS instructions a 32-nibble step and 40 to 32 registers,
    # same bits. Timed on the H200 the next session (gemv_step_ab.py "module", one config
    # for every shape): 2.19-2.20 against 2.15 ms for the code before, no faster. Fewer
    # instructions did not help: the loop waits on its loads.
    # The low half word ORed into 2^23's bits by one byte permute (inline PTX) instead of
    # AND + OR, which ptxas folds into each nibble's AND with 2^23 reloaded every time:
    # 181 against 188 SASS instructions a 32-nibble step, 40 registers against 32
    # (sass_loop.py). H200, same session: the same bits; 2.12-2.14 against 2.19-2.20 ms
    # with one config for every shape, 2.005-2.006 against 1.994-2.004 with the
    # per-shape configs above: off.
    "gemv_prmt": False,
    # (A program serving two input rows from each word it loads, so a B=2 step reads the
    # weights once: H200, 2026-12-03 (third session), gemv_step_ab.py GEMV_M=2, a B=2
    # step's GEMVs 3.41-3.42 against 3.27 ms for a program row per input row, 3.25-3.27
    # with the words two tiles ahead; the engine's B=3/4 steps 6.1 against 4.9-5.0 ms
    # through it instead of the tl.dot kernel. Reading the words once saved little (the
    # second program row's reads are likely L2 hits; not profiled). Removed.)
    # The tensor-core GEMV (`_w4_gemv_tc_kernel`) for gemv_tc_min_m to gemv_tc_max_m rows
    # (max 0: off), ahead of the kernels above and below where it applies (16-bit
    # activations, 128-row K tiles inside a group).
    # H200, 2026-12-03 (fifth session), the engine's AWQ decode forward
    # (benchmarks/engine_gemv_ab.py, variants in turn, one machine): B=2 2.83-2.84 against
    # 3.52 ms, B=4 2.96 against 4.38, B=6 3.17 against 4.54, B=8 3.20 against 4.55
    # (run_quant.sh engine_awq, another machine: B=2 2.94 against 3.61, B=8 3.29 against
    # 4.63); B=12 / 16 5.27 / 5.28 against 4.65 / 4.69 for the tl.dot kernel below, so
    # the range ends at 8. At B=1 it loses: the step's GEMVs back to back 2.37 against
    # 1.87 ms (gate_up 37.9 against 31.1 us: one row cannot fill the MMA, the CUDA-core
    # GEMV keeps more loads in flight), and on the small layers (qkv, o) alone 2.28-2.30
    # against 2.20 ms in the engine. 64-column tiles, 16 programs an SM, 3 stages: at B=2 back to back
    # 2.38 against 3.21 ms; 128 x 4 an SM (2 stages) 3.65, 2 stages at 64 columns 3.40
    # in the engine; 32 columns, 4 stages and 8 warps x 256 columns slower (BENCHMARKS.md).
    "gemv_tc_min_m": 2, "gemv_tc_max_m": 8, "gemv_tc_block_n": 64, "gemv_tc_warps": 4,
    "gemv_tc_stages": 3, "gemv_tc_programs_per_sm": 16,
    # The Gluon tensor-core GEMV (`gluon_w4`: each thread loads the words its MMA
    # fragments hold, nothing staged through shared memory; 3.1 SASS instructions a
    # nibble) for 1 to gemv_mma_max_m rows (0: off), ahead of the kernels above where it
    # applies (sm_90, a tested Triton; elsewhere they serve). H200, 2026-12-04, the
    # engine's AWQ (fp16) decode forward (engine_gemv_ab.py, variants in turn, one
    # machine), ms, the kernels above / this one at 8 / 6 programs an SM: B=1 2.176 /
    # 2.075 / 2.034, B=2 2.825 / 2.179 / 2.126, B=4 2.940 / 2.385 / 2.327, B=8 3.145 /
    # 2.859 / 2.786, the same greedy tokens. The split-K target (programs an SM) at 4 and
    # 16 ran slower in the engine (B=1 2.138 and 2.218) though 16 ran fastest back to back
    # (gemv_step_ab.py: 1.818 against 1.896 ms for the CUDA-core GEMV); 5 and 7 about
    # equal (B=1 2.076 / 2.024 against 2.030); 128-column tiles, 32 with 2 warps, and a
    # three-deep prefetch (127 registers) slower (BENCHMARKS.md).
    "gemv_mma_max_m": 8, "gemv_mma_block_n": 64, "gemv_mma_warps": 4,
    "gemv_mma_programs_per_sm": 6,
    # The first tile's weights requested before the PDL wait (they do not depend on the
    # kernel before; its tail hides their latency). Same machine, next call: B=1 1.999
    # against 2.030 ms, B=2 2.084 / 2.128, B=8 2.694 / 2.791, the same greedy tokens.
    "gemv_mma_preload": True,
    # The Gluon GEMV's operands staged through a cp.async ring of gemv_mma_stages K tiles
    # a program (`gluon_w4._w4_gemv_ring_kernel`, 3 tiles in flight in shared memory
    # instead of 1 in registers) from gemv_mma_ring_min_m rows (0: never). H200,
    # 2026-12-04 (twelfth session), the engine's AWQ decode forward (engine_gemv_ab.py,
    # variants in turn; four machines), ms, register kernel / ring of 4: B=8 2.72 / 2.62,
    # 2.787 / 2.695, 2.800 / 2.717, 2.846 / 2.770 (gate_up 980 -> 870-880 us a step, o 229
    # -> 202); B=4 2.403 / 2.517, B=2 2.101 / 2.321, B=1 1.994 / 2.265 (3 and 5 stages the
    # same or slower). The decode graphs pad 5-8 rows to 8, so the ring serves B=5..8.
    "gemv_mma_stages": 4, "gemv_mma_ring_min_m": 8,
    # At one input row (the B=1 decode step), per layer class (`mma_plan`): "unsplit"
    # (the output tiles alone fill the split-K target: gate_up), "deep" (K at least
    # gemv_deep_ratio x N: down), "other". "xsmem": the program's K split of the row
    # staged in shared memory once (up to gemv_mma_xsmem_max_tiles K tiles), so no tile
    # waits on an L2 read of its activations; "depth": K tiles of weights in flight a
    # thread (1-3); "programs_per_sm": the split-K target. H200, 2026-12-04 (thirteenth
    # session). The engine's AWQ decode forward (engine_gemv_ab.py, variants in turn):
    # B=1 1.913-1.918 against 1.983 ms (gate_up 755-766 against 798 us a step, down
    # 438-440 against 463); gate_up alone 1.944; depth 3 without xsmem 1.977; "other"
    # (qkv, o) staged at 4 an SM 1.924, 2 deep 1.985. Back to back (gemv_step_ab.py
    # GEMV_SHAPES=1): a step's GEMVs 1.879 -> 1.525 ms, gate_up 38.9 -> 26.7 us a GEMV
    # (read 18.1), down 17.4 -> 15.3 (read 10.2); in a probe depth 2 gave gate_up 30.4-30.6
    # and the staged row alone 36.4, down 2 or 3 deep was slower.
    # Then (fourteenth session, calls 4 and 5): down 3 tiles deep at 5 programs an SM
    # (616 programs of 14 tiles: one wave at 96 registers, against 952 of 9 tiles one
    # deep) 1.9145 / 1.9105 against 1.9252 / 1.9218 ms, down 427 / 425 against 449 / 443
    # us; 2 deep at 6 an SM 2.067 (down 585). qkv / o deeper at fewer programs (3 deep at
    # 4-5 an SM, 2 deep at 5; one wave) slower: 1.949-1.966 (qkv 192-199 against 171 us).
    # At 2-4 rows down deeper at 5 an SM is slower (call 6: B=2 2.094-2.111 against
    # 2.038, B=4 2.442-2.458 against 2.371; down 523-549 against 463-475 us).
    # "tma" (fifteenth session): the TMA kernel instead (`gluon_w4_tma`: a producer warp
    # streams the split's weight tiles into a ring of "stages" shared-memory slots, the
    # four math warps wait per tile on its mbarrier; the K split "split_tiles" tiles, or
    # unsplit; "maxnreg": its launch's register cap, which sets the programs an SM).
    # Where it cannot serve (a tensor not 16-byte aligned) the keys beside it do. H200,
    # 2026-12-04 (fifteenth session). Each shape's 28 GEMVs back to back (.ab probe, us
    # a GEMV, the register kernel / TMA): gate_up 26.7-27.2 / 21.1-21.2 (unsplit, 6-8
    # stages), down 15.6-15.8 / 13.1 (14-tile splits, 4 stages, 48), qkv 6.5 / 5.95,
    # o 5.5-5.7 / 5.3 (7-tile splits, 7 stages). The engine's AWQ decode forward
    # (engine_gemv_ab.py, variants in turn, B=1): 1.899 ms with the register kernel,
    # 1.707 with TMA in every class (gate_up 781 -> 650 us a step, down 425 -> 347, but
    # qkv 172 -> 191 and o 134 -> 148 at 40 registers, 129 at 48), 1.693 with gate_up at
    # 6 stages / 48 (639 us). So "other" (qkv, o) keeps the register kernel.
    "gemv_mma_one_row": {"unsplit": {"xsmem": True, "depth": 3,
                                     "tma": {"stages": 6, "maxnreg": 48}},
                         "deep": {"xsmem": True, "programs_per_sm": 5, "depth": 3,
                                  "tma": {"split_tiles": 14, "stages": 4, "maxnreg": 48}}},
    "gemv_mma_xsmem_max_tiles": 64,
    # The same per-class overrides (no "xsmem") for 2 rows up to the ring's. The
    # engine's AWQ decode forward (engine_gemv_ab.py, same session, one machine): gate_up
    # 3 tiles deep B=2 2.096 against 2.119 ms, B=4 2.260 against 2.303 (depth 2 slower:
    # 2.193 / 2.372; depth 2 for the other classes 2.361 / 2.551).
    "gemv_mma_rows": {"unsplit": {"depth": 3}},
    # Where the plan stages the one input row (above: down), the down projection's GEMV
    # computes silu(gate) * up as it stages the row (`w4a16_silu_linear`): the same bits,
    # one launch a layer fewer.
    "silu_stage": True,
    # (The o projection merging the decode attention's splits as it stages its one row,
    # `merge_stage`, nineteenth session: measured in the twenty-second on an H200, the
    # AWQ B=1 forward 1.82-1.98 against 1.58 ms, each of o's 784 programs rereading its
    # heads' splits; removed in the twenty-third, its code kept as
    # benchmarks/results/2026-12-05d-merge_stage.patch.)
    "gemm_block_n": 64, "gemm_block_k": 128, "gemm_warps": 4, "gemm_stages": 4,
    # The tl.dot kernel (3 to dequant_min_m - 1 rows) with each word loaded once and
    # unpacked into nibble planes, N on the MMA's wide side (`_w4_gemm_planes_kernel`):
    # sm_90 SASS at 16 rows 10.3 instructions a weight against 15.6, 69 registers against
    # 109. H200, 2026-12-03 (second session), quant_bench.py's sweep at 16 rows (one
    # Qwen2.5-7B layer's four shapes): 0.138 ms at 64 x 128 (4 stages) against 0.242 for
    # the best tile of the other kernel (64 x 64); equal from 64 rows (the dequantize
    # path). The engine's AWQ decode step at B=16 / 32: 5.07 / 5.33 against 7.90 / 8.54 ms.
    "gemm_planes": True,
    "gemm_block_m": None,   # None: 16/32/64/128 by the number of rows
    "target_programs": None,  # None: programs_per_sm x multiprocessors (split-K below that)
    "programs_per_sm": 4,
    "max_split": 32,
    "fused_reduce": True,   # split-K partials summed by the tile's last program (below)
    # At one row, a layer whose consumer reads a deferred sum (the decoder's
    # DeferredSlot: q/k/v, o, down) gets its splits added in fixed point into the layer's
    # accumulator, the consumer finishing the sum (ops/deferred.py): no arrival counter
    # and no last program's sum on the GEMV's critical path. Timing probe (float atomics,
    # H100, 2026-12-05): the AWQ B=1 decode forward 1.804 -> 1.696 ms.
    "deferred_sum": True,
    "dequant_min_m": 64,    # rows from which the weight is dequantized whole for cuBLAS
    "dequant_block_r": 16, "dequant_block_n": 128,
}
FP8_CONFIG = {
    "gemv_max_m": 1,        # rows up to which the weight-only GEMV runs
    "silu_gemv": True,      # the down projection's GEMV takes SiLU-and-mul in its load
    "w8a16_max_m": 32,      # then the weight-only tl.dot kernel; above: w8a8
    "scaled_mm": True,      # w8a8 through torch._scaled_mm where it applies
    # H200, 2026-12-02 (night, benchmarks/gemv_step_ab.py, a B=1 step's 112 GEMVs over 28
    # distinct layers): 32 x 256 tiles with the chunked accumulator (64 registers) and
    # 8 programs an SM: 1.87 ms, 3.49 TB/s, against 2.21 ms (2.95 TB/s) for the 16 x 512
    # tiles with the [16, 512] accumulator (126 registers) shipped before; the engine's
    # B=1 step 2.56 against 2.88 ms (bf16 4.43).
    "gemv_block_n": 32, "gemv_block_k": 256, "gemv_warps": 4, "gemv_stages": 2,
    "gemv_programs_per_sm": 8,   # the GEMV's split-K target (the tl.dot kernels': below)
    # Load placements, same arithmetic: gemv_prefetch loads the next tile's weights while
    # this one is multiplied; gemv_xb loads the activations straight into the weights'
    # layout (no shared-memory shuffle; not with the SiLU form). Both slower on the H200
    # (2026-12-02 night, 16 x 512 tiles: 3.61 and 2.23 against 2.21 ms a step): off.
    "gemv_prefetch": False, "gemv_xb": False,
    # gemv_kchunk > 1: the accumulator is [BLOCK_N, BLOCK_K / kchunk], each thread summing
    # its kchunk contiguous products every step, instead of [BLOCK_N, BLOCK_K] summed at
    # the end (1): 126 registers a thread at 16 x 512 (sm_90 ptxas) left 4 programs an
    # SM, so few weight bytes in flight; 64 with it.
    "gemv_kchunk": 16,
    "gemm_block_n": 64, "gemm_block_k": 128, "gemm_warps": 4, "gemm_stages": 3,
    "w8a8_block_m": 128, "w8a8_block_n": 128, "w8a8_block_k": 128, "w8a8_warps": 8,
    "w8a8_stages": 3,
    "gemm_block_m": None,
    "target_programs": None,
    "programs_per_sm": 4,
    "max_split": 32,
    "fused_reduce": True,   # split-K partials summed by the tile's last program (below)
    # W4_CONFIG["deferred_sum"] for the one-row fp8 GEMV (ops/deferred.py): off until an
    # engine A/B on a GPU measures it (engine_gemv_ab.py --quantization fp8)
    "deferred_sum": False,
    "act_block": 1024,
}

_SCALED_MM_REFUSED: set[tuple[bool, str]] = set()   # why scaled_mm was switched off
FP8 = torch.float8_e4m3fn


def _target(device: torch.device, cfg: dict, gemv: bool = False) -> int:
    if cfg["target_programs"] is not None:
        return cfg["target_programs"]
    if device.type != "cuda":
        return 8
    return cfg.get("gemv_programs_per_sm" if gemv else "programs_per_sm",
                   cfg["programs_per_sm"]) * sm_count(device)


def _splits(tiles: int, k: int, block_k: int, device: torch.device, cfg: dict,
            gemv: bool = False) -> tuple[int, int]:
    """(number of K splits, K columns per split, a multiple of block_k)."""
    k_tiles = triton.cdiv(k, block_k)
    want = max(1, min(_target(device, cfg, gemv) // max(tiles, 1), cfg["max_split"], k_tiles))
    per = triton.cdiv(k_tiles, want) * block_k
    return triton.cdiv(k, per), per


def _gemv_shape_config(cfg: dict, m: int, n: int, k: int, device: torch.device) -> dict:
    """`cfg` with the overrides of the GEMV shape class an (N, K) layer falls in at
    `m` input rows (W4_CONFIG's gemv_wide / gemv_deep): one launch config
    cannot serve a 37,888-wide projection, whose tiles alone fill the GPU, and an
    18,944-deep one, which needs split-K, equally well. Decided from what the split
    count already depends on (the shape and the rows), nothing measured at run time."""
    wide, deep = cfg.get("gemv_wide"), cfg.get("gemv_deep")
    programs = triton.cdiv(n, cfg["gemv_block_n"]) * m   # program rows: one per input row
    if wide and programs >= _target(device, cfg, gemv=True):
        return {**cfg, **wide}
    if deep and k >= cfg["gemv_deep_ratio"] * n:
        return {**cfg, **deep}
    return cfg


def _block_m(m: int, cfg: dict) -> int:
    if cfg["gemm_block_m"]:
        return cfg["gemm_block_m"]
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def _group_block(block_k: int, group: int, k: int) -> int:
    """The largest tile <= block_k that never straddles a group boundary."""
    if group >= k:
        return block_k
    while block_k > 8 and group % block_k:
        block_k //= 2
    return block_k if group % block_k == 0 else 0


def _gemv_tile(block_k: int, group: int, k: int) -> tuple[int, int]:
    """(K rows per GEMV tile, groups per tile): a tile spans whole groups when the
    configured size holds several (power-of-two groups, as every format writes), else
    it stays inside one group."""
    if group < k and block_k > group and block_k % group == 0 and group >= 8 \
            and group & (group - 1) == 0:
        return block_k, block_k // group
    return _group_block(block_k, group, k), 1


@dataclass
class _Outputs:
    """Where a split-K launch writes. `part`: what the kernel's per-split stores go to
    (the result itself for one split); `res`: the result; `cnt`: arrival counters when
    the last program of each tile sums the splits (`fused`), else the splits are summed
    by `_splitk_reduce_kernel` after; `kernel_bias`: the kernel adds the bias."""

    part: torch.Tensor
    res: torch.Tensor
    cnt: torch.Tensor
    fused: bool
    kernel_bias: bool
    splits_pad: int = 1   # the fused sum's unrolled loads (a power of two: few variants)

    def result(self, splits: int, bias, dtype) -> torch.Tensor:
        if splits == 1:
            return self.part[0]
        return self.res if self.fused else _finish(self.part, splits, bias, dtype)


def _outputs(splits: int, m: int, n: int, tiles: int, x: torch.Tensor, dtype: torch.dtype,
             bias, cfg: dict) -> _Outputs:
    """One split: the output itself (the kernel adds the bias and rounds once); several:
    float32 partial sums, reduced in the kernel by each tile's last program
    (cfg['fused_reduce'], where the counters fit) or by `_finish`."""
    if splits == 1:
        out = torch.empty(1, m, n, device=x.device, dtype=dtype)
        return _Outputs(out, out, out, False, bias is not None)
    part = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    cnt = arrival_counters(x.device, tiles) if cfg["fused_reduce"] else None
    if cnt is None:
        return _Outputs(part, part, part, False, False)
    res = torch.empty(m, n, device=x.device, dtype=dtype)
    return _Outputs(part, res, cnt, True, bias is not None, triton.next_power_of_2(splits))


def _deferred_outputs(acc: torch.Tensor) -> _Outputs:
    """A deferred one-row launch's outputs (ops/deferred.py): every split adds into the
    layer's int64 row `acc` (FUSED 2); the reader adds the bias."""
    return _Outputs(acc.view(1, 1, acc.shape[1]), acc, acc, 2, False)


def _finish(out: torch.Tensor, splits: int, bias, dtype) -> torch.Tensor:
    """The K splits summed with the bias added and rounded once, in one kernel (the
    two-kernel form of `_store_split`'s FUSED sum)."""
    _, m, n = out.shape
    res = torch.empty(m, n, device=out.device, dtype=dtype)
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        out, bias if bias is not None else out, res, m * n, n, SPLITS=splits,
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **launch_opts())
    return res


@triton.jit(do_not_specialize=["MN"])   # tokens x N: changes every step
def _splitk_reduce_kernel(part_ptr, b_ptr, out_ptr, MN, N, SPLITS: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sp in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + sp * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_split(val, part_ptr, res_ptr, cnt_ptr, b_ptr, tile, splits, pid_s, MN, offs, n_offs,
                 mask, HAS_BIAS: tl.constexpr, SPLITS_PAD: tl.constexpr, FUSED: tl.constexpr):
    """A program's float32 result `val` for the flat output offsets `offs` (`n_offs`: their
    columns). Not FUSED: stored as it is (plus the bias, HAS_BIAS) to split `pid_s` of
    `part_ptr`, in part_ptr's dtype. FUSED: stored to its split, and the tile's last
    program sums every split in order, adds the bias and rounds once into `res_ptr`: the
    additions `_splitk_reduce_kernel` makes, so the same bits. FUSED 2: added in fixed
    point to the int64 row at `part_ptr`, which the reader finishes (ops/deferred.py)."""
    if FUSED == 2:   # a deferred one-row sum: fixed point into the layer's row (deferred.py)
        tl.atomic_add(part_ptr + offs, (val * 1073741824.0).to(tl.int64), mask=mask,
                      sem="relaxed", scope="gpu")
    elif FUSED:
        tl.store(part_ptr + pid_s.to(tl.int64) * MN + offs, val, mask=mask)
        if last_arrival(cnt_ptr + tile, splits):
            acc = tl.zeros_like(val)
            for sp in tl.static_range(SPLITS_PAD):   # unrolled: every load in flight at once
                live = (offs * 0 + sp) < splits          # (a tensor: the interpreter's masks)
                p = tl.load(part_ptr + sp * MN + offs, mask=mask & live, other=0.0,
                            cache_modifier=".cg")
                acc = tl.where(live, acc + p, acc)
            if HAS_BIAS:
                acc += tl.load(b_ptr + n_offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(res_ptr + offs, acc.to(res_ptr.dtype.element_ty), mask=mask)
    else:
        if HAS_BIAS:
            val += tl.load(b_ptr + n_offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(part_ptr + pid_s.to(tl.int64) * MN + offs,
                 val.to(part_ptr.dtype.element_ty), mask=mask)


# -- w4a16 ----------------------------------------------------------------------------------

MAGIC = tl.constexpr(0x4B000000)   # the bits of the float 2^23: its mantissa's unit is 1.0
MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def _nibble_times_16j(half, j: tl.constexpr):
    """Nibble j (0..3) of `half` (a half word ORed into the bits of 2^23: `_with_magic`) as
    the float q * 16^j: exact, with one AND (a single immediate operand: the mask keeps
    the magic's bits too) and a float subtraction instead of a quarter-rate int-to-float
    conversion."""
    bits = half & (MAGIC | (15 * 16 ** j))
    return bits.to(tl.float32, bitcast=True) - MAGIC_F


@triton.jit
def _with_magic(words, HIGH: tl.constexpr, PRMT: tl.constexpr):
    """The low (or high) 16 bits of each word below the bits of the float 2^23. PRMT: the
    low half by one byte permute (inline PTX; not under the interpreter): written as an
    AND and an OR, ptxas folds it into each nibble's AND and then reloads 2^23 into a
    register before every low nibble (4 extra instructions a word)."""
    if HIGH:
        return (words.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True) | MAGIC
    if PRMT:
        # bytes 0-1 of the word, bytes 2-3 of 0x4b000000
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0x4b000000, 0x7610;", "=r,r",
                                         [words], dtype=tl.int32, is_pure=True, pack=1)
    return (words & 0xFFFF) | MAGIC


@triton.jit
def _q_minus_z(words, z):
    """`q - z` for the low nibble of each word (z: float zero points), in one subtraction."""
    bits = (words & 0xF) | MAGIC
    return bits.to(tl.float32, bitcast=True) - (MAGIC_F + z)


@triton.jit
def _split8(xv, A: tl.constexpr, B: tl.constexpr):
    """`[A, B, 8]` -> its 8 `[A, B]` slices along the last axis, in order (three splits)."""
    a, b = tl.split(tl.reshape(xv, (A, B, 4, 2)))       # x[0::2], x[1::2]
    a0, a1 = tl.split(tl.reshape(a, (A, B, 2, 2)))      # [x0, x4], [x2, x6]
    b0, b1 = tl.split(tl.reshape(b, (A, B, 2, 2)))      # [x1, x5], [x3, x7]
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _w4_words_dot(qw, x0, x1, x2, x3, x4, x5, x6, x7, PRMT: tl.constexpr):
    """`sum_i x_i q_i` over the 8 nibbles of each `[GPT, R, BLOCK_N]` word, with x_i the
    `[GPT, R]` activations of the word's row (x1..x3 and x5..x7 already divided by 16^j:
    `_nibble_times_16j` gives q * 16^j), summed in nibble order."""
    lo = _with_magic(qw, False, PRMT)
    hi = _with_magic(qw, True, PRMT)      # nibbles 4..7
    part = tl.zeros(qw.shape, dtype=tl.float32)
    part += x0[:, :, None] * _nibble_times_16j(lo, 0)
    part += x1[:, :, None] * _nibble_times_16j(lo, 1)
    part += x2[:, :, None] * _nibble_times_16j(lo, 2)
    part += x3[:, :, None] * _nibble_times_16j(lo, 3)
    part += x4[:, :, None] * _nibble_times_16j(hi, 0)
    part += x5[:, :, None] * _nibble_times_16j(hi, 1)
    part += x6[:, :, None] * _nibble_times_16j(hi, 2)
    part += x7[:, :, None] * _nibble_times_16j(hi, 3)
    return part


@triton.jit
def _ld(ptrs, mask, other, EVEN: tl.constexpr):
    """`tl.load`, without the mask where the tiles divide the shape (EVEN)."""
    if EVEN:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask, other=other)
    return v


@triton.jit
def _w4_row_term(qw, x_tile, r_mask, s, z, EVEN: tl.constexpr, XVEC: tl.constexpr,
                 PRMT: tl.constexpr, HAS_ZERO: tl.constexpr, GPT: tl.constexpr,
                 R: tl.constexpr):
    """One input row's `[GPT, R, BLOCK_N]` addend for one K tile of words `qw`: its
    activations (at `x_tile`) times the nibbles, the zero point taken out of the loop
    (`sum x (q - z) = sum x q - z sum x`) and the group's scale applied once."""
    if XVEC:
        # The 8 activations of each word row in one 16-byte load, split in registers.
        xv = _ld(x_tile[:, :, None] + tl.arange(0, 8)[None, None, :],
                 r_mask[:, :, None], 0.0, EVEN).to(tl.float32)
        xs = tl.sum(xv, axis=2)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xv, GPT, R)
    else:
        x0 = _ld(x_tile, r_mask, 0.0, EVEN).to(tl.float32)
        x1 = _ld(x_tile + 1, r_mask, 0.0, EVEN).to(tl.float32)
        x2 = _ld(x_tile + 2, r_mask, 0.0, EVEN).to(tl.float32)
        x3 = _ld(x_tile + 3, r_mask, 0.0, EVEN).to(tl.float32)
        x4 = _ld(x_tile + 4, r_mask, 0.0, EVEN).to(tl.float32)
        x5 = _ld(x_tile + 5, r_mask, 0.0, EVEN).to(tl.float32)
        x6 = _ld(x_tile + 6, r_mask, 0.0, EVEN).to(tl.float32)
        x7 = _ld(x_tile + 7, r_mask, 0.0, EVEN).to(tl.float32)
        xs = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
    # Nibble j of a half word comes out as q * 16^j: its activation divided by 16^j
    # (a power of two: exact).
    part = _w4_words_dot(qw, x0, x1 * (1.0 / 16.0), x2 * (1.0 / 256.0),
                         x3 * (1.0 / 4096.0), x4, x5 * (1.0 / 16.0), x6 * (1.0 / 256.0),
                         x7 * (1.0 / 4096.0), PRMT)
    if HAS_ZERO:
        term = (part - xs[:, :, None] * z[:, None, :]) * s[:, None, :]
    else:
        term = (part - 8.0 * xs[:, :, None]) * s[:, None, :]
    return term


@triton.jit
def _w4_group_rows(s_ptr, z_ptr, k0, k_end, offs_g, offs_n, n_mask, N, GROUP: tl.constexpr,
                   R: tl.constexpr, EVEN: tl.constexpr, HAS_ZERO: tl.constexpr):
    """The float32 scales and zero points (`[GPT, BLOCK_N]`, one row per group slice) of
    the K tile starting at row `k0` (zero points: the scales again without HAS_ZERO)."""
    g_k = k0 + offs_g * (R * 8)                                 # first K row per slice
    g_mask = (g_k < k_end)[:, None] & n_mask[None, :]
    g_off = (g_k // GROUP)[:, None] * N + offs_n[None, :]
    s = _ld(s_ptr + g_off, g_mask, 0.0, EVEN).to(tl.float32)
    if HAS_ZERO:
        z = _ld(z_ptr + g_off, g_mask, 0, EVEN).to(tl.float32)
    else:
        z = s   # unused
    return s, z


@triton.jit(do_not_specialize=["splits"])
def _w4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, res_ptr, cnt_ptr, N, K,
                    stride_xm, stride_os, stride_om, k_per_split, splits,
                    GROUP: tl.constexpr, EVEN: tl.constexpr,
                    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GPT: tl.constexpr, XVEC: tl.constexpr,
                    PREFETCH: tl.constexpr, PRMT: tl.constexpr,
                    SPLITS_PAD: tl.constexpr, FUSED: tl.constexpr, PDL: tl.constexpr):
    """One K tile is GPT groups of `BLOCK_K / GPT` rows each, held as `[GPT, R, BLOCK_N]`
    words: a tile may span several quantization groups (one scale row per group slice),
    so a 128-row group no longer caps each load at `[16, BLOCK_N]` words. XVEC: the
    activations of a word row come in one vector load instead of 8 scalar ones.
    PREFETCH 1: the next K tile's words are loaded before this tile's are multiplied, so
    a load stays in flight while the thread computes; 2: its scales and zero points too
    (else their load's latency is paid in every step). GROUP (the quantization group, a
    compile-time constant) makes each tile's scale row a shift instead of a signed
    integer division (~20 SASS instructions a tile); EVEN (N a multiple of BLOCK_N, K of
    BLOCK_K, as every Qwen/Llama layer is) drops the loads' masks."""
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    m = tl.program_id(2)
    R: tl.constexpr = BLOCK_K // 8 // GPT
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_g = tl.arange(0, GPT)
    local = offs_g[:, None] * R + tl.arange(0, R)[None, :]       # [GPT, R] word rows
    acc = tl.zeros((GPT, R, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    # Pointers advanced a tile each step (not recomputed from the row: int64 multiplies)
    w_tile = qw_ptr + (k_start // 8 + local).to(tl.int64)[:, :, None] * N + offs_n[None, None, :]
    w_step = (BLOCK_K // 8) * N
    x_tile = x_ptr + m.to(tl.int64) * stride_xm + k_start + local * 8   # [GPT, R]
    if PREFETCH >= 1:
        rows = k_start // 8 + local
        qw_next = _ld(w_tile, (rows * 8 < k_end)[:, :, None] & n_mask[None, None, :], 0, EVEN)
    if PREFETCH >= 2:
        s_next, z_next = _w4_group_rows(s_ptr, z_ptr, k_start, k_end, offs_g, offs_n, n_mask,
                                        N, GROUP, R, EVEN, HAS_ZERO)
    for k0 in range(k_start, k_end, BLOCK_K):
        rows = k0 // 8 + local
        r_mask = rows * 8 < k_end
        # The last tile reloads itself rather than read past the split (unmasked: EVEN)
        last = k0 + BLOCK_K >= k_end
        if PREFETCH >= 1:
            qw = qw_next
            nxt = (rows * 8 + BLOCK_K < k_end)[:, :, None] & n_mask[None, None, :]
            qw_next = _ld(w_tile + tl.where(last, 0, w_step), nxt, 0, EVEN)
        else:
            qw = _ld(w_tile, r_mask[:, :, None] & n_mask[None, None, :], 0, EVEN)
        w_tile += w_step
        if PREFETCH >= 2:
            s, z = s_next, z_next
            s_next, z_next = _w4_group_rows(s_ptr, z_ptr, tl.where(last, k0, k0 + BLOCK_K),
                                            k_end, offs_g, offs_n, n_mask, N, GROUP, R, EVEN,
                                            HAS_ZERO)
        else:
            s, z = _w4_group_rows(s_ptr, z_ptr, k0, k_end, offs_g, offs_n, n_mask, N, GROUP,
                                  R, EVEN, HAS_ZERO)
        acc += _w4_row_term(qw, x_tile, r_mask, s, z, EVEN, XVEC, PRMT, HAS_ZERO, GPT, R)
        x_tile += BLOCK_K
    out = tl.sum(tl.sum(acc, axis=1), axis=0)
    _store_split(out, out_ptr, res_ptr, cnt_ptr, b_ptr, m * tl.num_programs(0) + pid_n, splits,
                 pid_s, stride_os, m.to(tl.int64) * stride_om + offs_n, offs_n, n_mask,
                 HAS_BIAS, SPLITS_PAD, FUSED)


@triton.jit(do_not_specialize=["M", "splits"])
def _w4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, res_ptr, cnt_ptr, M, N, K,
                    stride_xm, stride_os, stride_om, group_size, k_per_split, splits,
                    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
                    SPLITS_PAD: tl.constexpr, FUSED: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        qw = tl.load(qw_ptr + (k // 8).to(tl.int64)[:, None] * N + offs_n[None, :],
                     mask=k_mask[:, None] & n_mask[None, :], other=0)
        g = k0 // group_size
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)
        w = (_q_minus_z(qw >> ((k % 8) * 4)[:, None], z[None, :]) * s[None, :]).to(a.dtype)
        acc += _dot(a, w, F32)
    _store_split(acc, out_ptr, res_ptr, cnt_ptr, b_ptr, pid_m * tl.num_programs(1) + pid_n,
                 splits, pid_s, stride_os, offs_m.to(tl.int64)[:, None] * stride_om
                 + offs_n[None, :], offs_n[None, :], m_mask[:, None] & n_mask[None, :],
                 HAS_BIAS, SPLITS_PAD, FUSED)


@triton.jit
def _in_k_order(p0, p1, p2, p3, p4, p5, p6, p7, BN: tl.constexpr, R: tl.constexpr):
    """`[BN, R]` nibble planes -> `[BN, 8R]` with column `8r + j` plane j's column r.
    `tl.join` stacks on a new last axis, and flattening `[.., c, d, e]` reads it as
    `4c + 2d + e` while the joins put plane `4e + 2d + c` there: hence the order below."""
    a = tl.join(tl.join(p0, p4), tl.join(p2, p6))
    b = tl.join(tl.join(p1, p5), tl.join(p3, p7))
    return tl.reshape(tl.join(a, b), (BN, 8 * R))


@triton.jit(do_not_specialize=["M", "splits"])
def _w4_gemm_planes_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, res_ptr, cnt_ptr, M, N,
                           K, stride_xm, stride_os, stride_om, k_per_split, splits,
                           GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
                           SPLITS_PAD: tl.constexpr, FUSED: tl.constexpr, PDL: tl.constexpr):
    """`_w4_gemm_kernel` with each word loaded once (not once per K row of the tile and
    shifted per element: 15.6 SASS instructions a weight at 16 rows): a tile's
    `[BLOCK_N, BLOCK_K / 8]` words give 8 nibble planes, dequantized and joined back into
    K order. N sits on the MMA's wide side (`out^T = W^T x^T`), so 16 rows fill its
    narrow one."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    R: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        rows = k0 // 8 + offs_r
        wt = tl.load(qw_ptr + rows.to(tl.int64)[None, :] * N + offs_n[:, None],
                     mask=n_mask[:, None] & (rows * 8 < k_end)[None, :], other=0)
        k = k0 + offs_k
        xt = tl.load(x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + k[:, None],
                     mask=(k < k_end)[:, None] & m_mask[None, :], other=0.0)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_ZERO:
            z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None]
        else:
            z = tl.full((BLOCK_N, 1), 8.0, tl.float32)
        w = _in_k_order((_q_minus_z(wt, z) * s).to(xt.dtype),
                        (_q_minus_z(wt >> 4, z) * s).to(xt.dtype),
                        (_q_minus_z(wt >> 8, z) * s).to(xt.dtype),
                        (_q_minus_z(wt >> 12, z) * s).to(xt.dtype),
                        (_q_minus_z(wt >> 16, z) * s).to(xt.dtype),
                        (_q_minus_z(wt >> 20, z) * s).to(xt.dtype),
                        (_q_minus_z(wt >> 24, z) * s).to(xt.dtype),
                        (_q_minus_z(wt >> 28, z) * s).to(xt.dtype), BLOCK_N, R)
        acc += _dot(w, xt, F32)
    _store_split(acc, out_ptr, res_ptr, cnt_ptr, b_ptr, pid_m * tl.num_programs(1) + pid_n,
                 splits, pid_s, stride_os, offs_m.to(tl.int64)[None, :] * stride_om
                 + offs_n[:, None], offs_n[:, None], n_mask[:, None] & m_mask[None, :],
                 HAS_BIAS, SPLITS_PAD, FUSED)


# The tensor-core GEMV's nibble pairs (`_w4_tc_pair`): nibbles j and j + 4 of a word sit
# in the low nibbles of its two half words once it is shifted right by 4j, and one LOP3
# ORs both into the bits of 128 (bf16) or 1024 (fp16) below them; one packed
# subtraction of (128 or 1024) + z then leaves both `q - z` exactly.
def _tc_pair_asm(j: int, f16: bool) -> tl.constexpr:
    src = f"shr.u32 t, $2, {4 * j}; lop3.b32 t, t," if j else "lop3.b32 t, $2,"
    magic, ty = ("0x64006400", "f16x2") if f16 else ("0x43004300", "bf16x2")
    return tl.constexpr("{ .reg .b32 t; " + src + f" 0x000F000F, {magic}, 0xEA; "
                        f"sub.rn.{ty} t, t, $3; " + "mov.b32 {$0, $1}, t; }")


# indexed J + 4 * F16 (a tuple of compile-time strings)
TC_ASM = tl.constexpr(tuple(_tc_pair_asm(j, f16).value for f16 in (False, True)
                            for j in range(4)))


@triton.jit
def _tc_asm(wt, zz, J: tl.constexpr, F16: tl.constexpr):
    """The tuple is indexed here and its string handed straight to the builtin: Triton
    3.6 passes an indexed constexpr tuple's item on as a bare `str`, which a call to
    another jit function rejects ("'str' object has no attribute 'type'"; 3.9 accepts
    it). The AWQ engine failed to compile under 3.6 that way (H200, 2026-12-03)."""
    if F16:
        lo, hi = tl.inline_asm_elementwise(TC_ASM[J + 4], "=h,=h,r,r", [wt, zz],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(TC_ASM[J], "=h,=h,r,r", [wt, zz],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=1)
    return lo, hi


@triton.jit
def _w4_tc_pair(wt, zz, z, J: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr):
    """Nibbles J and J + 4 of each word minus its zero point, as two tensors of the
    activations' 16-bit type (exact: integers in [-15, 15]). ASM: two instructions a
    word (three from J = 1) by inline PTX (`zz`: the bits of (128 or 1024) + z in both
    half words); else (the interpreter, which runs no PTX) the same values by integer
    arithmetic (`z`: int32 zero points)."""
    if ASM:
        lo, hi = _tc_asm(wt, zz, J, F16)
    else:
        lo = (((wt >> (4 * J)) & 0xF) - z).to(tl.float32)
        hi = (((wt >> (4 * J + 16)) & 0xF) - z).to(tl.float32)
        if F16:
            lo, hi = lo.to(tl.float16), hi.to(tl.float16)
        else:
            lo, hi = lo.to(tl.bfloat16), hi.to(tl.bfloat16)
    return lo, hi


@triton.jit(do_not_specialize=["M", "splits"])
def _w4_gemv_tc_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, res_ptr, cnt_ptr, M, N, K,
                       stride_xm, stride_os, stride_om, k_per_split, splits,
                       GROUP: tl.constexpr, EVEN: tl.constexpr, HAS_ZERO: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       F16: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr,
                       SPLITS_PAD: tl.constexpr, FUSED: tl.constexpr, PDL: tl.constexpr):
    """Decode GEMV (up to BLOCK_M rows) on the tensor cores, `out^T = W^T x^T`: each
    128-row K tile (inside one quantization group) is `[BLOCK_N, 16]` words, turned
    into a `[BLOCK_N, 128]` operand of `q - z` in the activations' type (exact) by one
    shift, one LOP3 and one packed subtraction per two nibbles (`_w4_tc_pair`), and
    multiplied with the tile's activations by one `tl.dot` (float32 accumulation); the
    group's scale is applied to the tile's float32 result. The operand's columns are
    ordered so that the two halves of each pair register are adjacent K positions of
    the MMA operand (no shuffles): column `8r + 4a + 2b + e` holds K row `8r + 2a + b +
    4e`, and the activations are loaded in that order. Up to 8 (16) input rows cost
    one MMA operand, so a B = 2..8 step decodes each word once where `_w4_gemv_kernel`
    runs a program row per input row: the engine's AWQ decode forward 2.83 against 3.52
    ms at B=2, 3.20 against 4.55 at B=8 (H200). sm_90 SASS: 3.7 instructions a nibble
    at the shipped 64-column tiles (2.7 at 128) against ~6 for the CUDA-core GEMV, yet
    at one row that GEMV is faster (benchmarks/sass_loop.py; W4_CONFIG). K splits as in
    the other kernels; K and every split a multiple of 128."""
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    BK: tl.constexpr = 128
    R: tl.constexpr = BK // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    c = tl.arange(0, BK)
    offs_k = (c // 8) * 8 + ((c // 4) % 2) * 2 + (c // 2) % 2 + (c % 2) * 4
    k_start = pid_s * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w_tile = qw_ptr + (k_start // 8 + tl.arange(0, R)).to(tl.int64)[None, :] * N \
        + offs_n[:, None]
    x_tile = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + (k_start + offs_k)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        wt = _ld(w_tile, n_mask[:, None], 0, EVEN)
        g_off = (k0 // GROUP) * N + offs_n
        s = _ld(s_ptr + g_off, n_mask, 0.0, EVEN).to(tl.float32)
        if HAS_ZERO:
            z = _ld(z_ptr + g_off, n_mask, 0, EVEN).to(tl.int32)
        else:
            z = tl.full((BLOCK_N,), 8, tl.int32)
        z = tl.broadcast_to(z[:, None], (BLOCK_N, R))
        zz = ((0x6400 if F16 else 0x4300) + z) * 0x10001
        l0, h0 = _w4_tc_pair(wt, zz, z, 0, F16, ASM)
        l1, h1 = _w4_tc_pair(wt, zz, z, 1, F16, ASM)
        l2, h2 = _w4_tc_pair(wt, zz, z, 2, F16, ASM)
        l3, h3 = _w4_tc_pair(wt, zz, z, 3, F16, ASM)
        lo = tl.join(tl.join(l0, l2), tl.join(l1, l3))     # [.., r, a, b]: nibble 2a + b
        hi = tl.join(tl.join(h0, h2), tl.join(h1, h3))     # nibble 2a + b + 4
        a = tl.reshape(tl.join(lo, hi), (BLOCK_N, BK))
        xt = tl.load(x_tile, mask=m_mask[None, :], other=0.0)
        acc += _dot(a, xt, F32) * s[:, None]
        w_tile += R * N
        x_tile += BK
    _store_split(acc, out_ptr, res_ptr, cnt_ptr, b_ptr, pid_n, splits, pid_s, stride_os,
                 offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None], offs_n[:, None],
                 n_mask[:, None] & m_mask[None, :], HAS_BIAS, SPLITS_PAD, FUSED)


def _tc_gemv_ok(m: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether the tensor-core GEMV takes this call: 16-bit activations, K tiles of 128
    rows that stay inside one quantization group."""
    cfg = W4_CONFIG
    return (max(1, cfg["gemv_tc_min_m"]) <= m <= cfg["gemv_tc_max_m"]
            and dtype in (torch.bfloat16, torch.float16)
            and k % 128 == 0 and (group_size >= k or group_size % 128 == 0))


def ring_serves(m: int, cfg: dict) -> bool:
    """Whether the Gluon GEMV at `m` input rows stages its operands through the cp.async
    ring (`gluon_w4._w4_gemv_ring_kernel`) rather than registers: from
    gemv_mma_ring_min_m rows (0: never), with a ring of at least two tiles."""
    least = cfg["gemv_mma_ring_min_m"]
    return bool(least) and m >= least and cfg["gemv_mma_stages"] >= 2


class MmaPlan(NamedTuple):
    """How the Gluon GEMV runs one call (`mma_plan`)."""
    splits: int      # K splits
    per: int         # K rows a split (a multiple of 128)
    ring: bool       # the cp.async ring kernel (else the register kernel)
    depth: int       # K tiles of weights in flight a thread (register kernel)
    xs_tiles: int    # one input row staged in shared memory: tiles allocated (0: not)
    stages: int = 0  # the TMA kernel's ring slots (0: not the TMA kernel)
    maxnreg: int = 0  # the TMA kernel's register cap
    blocked: bool = False  # the TMA or register kernel reads `gluon_w4_tma.blocked_copy`
    #                        (the layout A/B's only)
    stream: int = 0  # the TMA kernel in stream-K form: its programs (splits: the most
    #                  partial sums a column tile gets; xs_tiles: its longest segment's)


# The keys a layer class's plan may carry (W4_CONFIG "gemv_mma_one_row" / "gemv_mma_rows")
# and its "tma" plan. `mma_plan` reads only these, so a benchmark variant naming another
# (a saved patch's key with the patch not applied) would time the shipped kernel under
# the variant's name; the benchmarks refuse such variants (`plan_key_errors`).
PLAN_CLASSES = frozenset({"unsplit", "deep", "other"})
CLASS_PLAN_KEYS = frozenset({"xsmem", "depth", "programs_per_sm", "tma", "blocked"})
TMA_PLAN_KEYS = frozenset({"stages", "maxnreg", "split_tiles", "blocked", "stream"})


def plan_key_errors(cfg: dict) -> list[str]:
    """The classes and plan keys in `cfg`'s class tables that `mma_plan` would not read,
    one 'where: what' line each (none for the shipped W4_CONFIG)."""
    errors = []
    for table in ("gemv_mma_one_row", "gemv_mma_rows"):
        for cls, over in cfg.get(table, {}).items():
            where = f"{table}.{cls}"
            if cls not in PLAN_CLASSES:
                errors.append(f"{table}: unknown class {cls!r}")
            errors += [f"{where}: unknown key {key!r}"
                       for key in sorted(set(over) - CLASS_PLAN_KEYS)]
            errors += [f"{where}.tma: unknown key {key!r}"
                       for key in sorted(set(over.get("tma", {})) - TMA_PLAN_KEYS)]
    return errors


def mma_plan(m: int, n: int, k: int, sms: int, cfg: dict, tma: bool = True,
             stream: bool = True) -> MmaPlan:
    """The Gluon GEMV's launch for `m` rows of an (N, K) layer on `sms` multiprocessors:
    the split-K target, and at one row the overrides of the layer's class
    (cfg['gemv_mma_one_row'], its "tma" plan where `tma`: the tensors allow TMA). Decided
    from the shape and the tensors' alignment alone: a captured graph replays it."""
    tiles = n // cfg["gemv_mma_block_n"]
    pps = cfg["gemv_mma_programs_per_sm"]
    splits, per = _splits(tiles, k, 128, None, {**cfg, "target_programs": pps * sms})
    if ring_serves(m, cfg):
        return MmaPlan(splits, per, True, 1, 0)
    cls = ("unsplit" if splits == 1 else
           "deep" if k >= cfg["gemv_deep_ratio"] * n else "other")
    over = cfg["gemv_mma_one_row" if m == 1 else "gemv_mma_rows"].get(cls, {})
    if (m == 1 and tma and "tma" in over
            and cfg["gemv_mma_block_n"] == 16 * cfg["gemv_mma_warps"] >= 32):
        plan = _tma_plan(k, over["tma"], cfg)
        if (plan is not None and stream and over["tma"].get("stream") and cfg["fused_reduce"]
                and k % 128 == 0):
            p, parts, longest = gluon_w4_tma.stream_shape(tiles, k // 128,
                                                          over["tma"]["stream"] * sms)
            plan = plan._replace(splits=parts, xs_tiles=triton.next_power_of_2(longest),
                                 stream=p)
        if plan is not None:
            return plan
    if "programs_per_sm" in over:
        target = over["programs_per_sm"] * sms
        splits, per = _splits(tiles, k, 128, None, {**cfg, "target_programs": target})
    tiles_k = per // 128
    xs = (triton.next_power_of_2(tiles_k) if m == 1 and over.get("xsmem")
          and tiles_k <= cfg["gemv_mma_xsmem_max_tiles"] else 0)
    return MmaPlan(splits, per, False, over.get("depth", 1), xs,
                   blocked=bool(over.get("blocked")) and k % 128 == 0)


def defers(m: int, plan: MmaPlan, cfg: dict) -> bool:
    """Whether a Gluon GEMV launch on `plan` leaves its split sum to the reader
    (ops/deferred.py): one row, K split, the split grid (the ring kernel and the stream-K
    form sum their own), cfg['deferred_sum'] on. At Qwen2.5-7B's shapes: q/k/v, o and
    down; gate_up is not split."""
    return (bool(cfg["deferred_sum"]) and m == 1 and plan.splits > 1 and not plan.stream
            and not plan.ring)


def _tma_plan(k: int, t: dict, cfg: dict) -> MmaPlan | None:
    """The TMA kernel's plan for one row of a K-deep layer: K in splits of t['split_tiles']
    tiles (0 or absent: unsplit), balanced; none where a split's row would not fit the
    staging (cfg['gemv_mma_xsmem_max_tiles'])."""
    tiles_k = k // 128
    splits = triton.cdiv(tiles_k, t.get("split_tiles") or tiles_k)
    per = triton.cdiv(tiles_k, splits)
    if per > cfg["gemv_mma_xsmem_max_tiles"]:
        return None
    return MmaPlan(triton.cdiv(tiles_k, per), per * 128, False, 1,
                   triton.next_power_of_2(per), min(t["stages"], per), t["maxnreg"],
                   bool(t.get("blocked")) and k % 128 == 0)


def _w4_gemv_mma(x, qweight, scales, zeros, group_size, bias, act: bool = False,
                 blocked: tuple[int, int] | None = None, deferred: DeferredSlot | None = None):
    """The Gluon GEMV's launch as `mma_plan` decides: the TMA kernel (one row, tensors
    TMA can read: its descriptors stand for the weight pointers), the ring kernel or the
    register kernel (the caller checked `gluon_w4.usable`). `act`:
    x is `[gate | up]` and the input silu(gate) * up (a plan that stages the one row;
    `w4a16_silu_linear` checked). `blocked`: the layer's (K, N), its tensors
    `gluon_w4_tma.block_columns`'s (the TMA and register kernels only). A plan's
    `stream`: the TMA kernel's stream-K form (`gluon_w4_tma._w4_gemv_tma_stream_kernel`),
    whose partial sums need the arrival counters (where they cannot be had, the split
    grid serves). `deferred`: the layer's accumulator, which a split one-row launch adds
    into instead (a `DeferredSum` is returned: `ops/deferred.py`)."""
    m = x.shape[0]
    k, n = blocked or (qweight.shape[0] * 8, qweight.shape[1])
    cfg = W4_CONFIG
    bn, warps = cfg["gemv_mma_block_n"], cfg["gemv_mma_warps"]
    tiles = n // bn
    tma = gluon_w4_tma.aligned(qweight, scales, zeros)
    plan = mma_plan(m, n, k, sm_count(x.device), cfg, tma)
    acc = (deferred.buffer(n, x.device) if deferred is not None and defers(m, plan, cfg)
           else None)   # None inside a capture that first needs the row: the counters serve
    o = (_deferred_outputs(acc) if acc is not None
         else _outputs(plan.splits, m, n, tiles, x, x.dtype, bias, cfg))
    if plan.stream and not o.fused:   # no counters (first needed inside a capture)
        plan = mma_plan(m, n, k, sm_count(x.device), cfg, tma, stream=False)
        o = _outputs(plan.splits, m, n, tiles, x, x.dtype, bias, cfg)
    splits, per = plan.splits, plan.per
    assert not blocked or not plan.ring, "the ring kernel reads the checkpoint's layout"
    if plan.blocked and not blocked:
        qweight, scales, zeros = gluon_w4_tma.blocked_copy(qweight, scales, zeros, bn)
        blocked = (k, n)
    # a blocked tensor's rows a column tile (words, scales and zero points)
    rows = dict(w_rows=k // 8, s_rows=scales.shape[0] * bn // n) if blocked else {}
    args = (x, qweight, scales, zeros if zeros is not None else scales,
            bias if bias is not None else scales, o.part, o.res, o.cnt, m, n, k, x.stride(0),
            o.part.stride(0), o.part.stride(1), per, splits)
    common = dict(GROUP=group_size if group_size < k else 1 << 30,   # one group: one compile
                  HAS_ZERO=zeros is not None, HAS_BIAS=o.kernel_bias, BLOCK_N=bn,
                  WARPS=warps, F16=x.dtype == torch.float16, SPLITS_PAD=o.splits_pad,
                  FUSED=o.fused, num_warps=warps, **launch_opts("gemv", one_row=m == 1))
    if plan.stages:
        ring = {"w_rows": 0, "s_rows": 0, **rows, "STAGES": plan.stages,
                "XS_TILES": plan.xs_tiles, "ACT": act, "maxnreg": plan.maxnreg,
                "BLOCKED": bool(blocked)}
        descs = gluon_w4_tma.descriptors(qweight, scales, zeros, bn)
    if plan.stream:   # the stream-K form: every split summed in the kernel (no FUSED)
        gluon_w4_tma._w4_gemv_tma_stream_kernel[(plan.stream,)](
            x, *descs, *args[4:11], x.stride(0), o.part.stride(0), o.part.stride(1),
            k // 128, tiles * (k // 128), plan.stream, **ring,
            **{key: v for key, v in common.items() if key != "FUSED"})
    elif plan.stages:
        gluon_w4_tma._w4_gemv_tma_kernel[(tiles, splits)](x, *descs, *args[4:], **ring,
                                                          **common)
    elif plan.ring:
        gluon_w4._w4_gemv_ring_kernel[(tiles, splits)](*args, STAGES=cfg["gemv_mma_stages"],
                                                       **common)
    else:
        gluon_w4._w4_gemv_mma_kernel[(tiles, splits)](
            *args, PRELOAD=bool(cfg["gemv_mma_preload"]), DEPTH=plan.depth,
            XS_TILES=plan.xs_tiles, ACT=act, **common, **rows,
            **(dict(BLOCKED=True) if blocked else {}))
    if acc is not None:
        return deferred.hand_out(bias, x.dtype)
    return o.result(splits, bias, x.dtype)


def silu_stages(m: int, n: int, k: int, sms: int, cfg: dict, tma: bool = True) -> bool:
    """Whether the Gluon GEMV takes SiLU-and-mul into its row staging for `m` rows of an
    (N, K) down projection: cfg['silu_stage'] on, and a plan that stages the row (one
    row, not the ring; `tma` as `mma_plan`'s)."""
    if not cfg["silu_stage"] or m != 1:
        return False
    plan = mma_plan(m, n, k, sms, cfg, tma)
    return not plan.ring and plan.xs_tiles > 0


def _w4_gemv_tc(x, qweight, scales, zeros, group_size, bias):
    m, k = x.shape
    n = qweight.shape[1]
    cfg = W4_CONFIG
    bn = cfg["gemv_tc_block_n"]
    tiles = triton.cdiv(n, bn)
    tc = {**cfg, "gemv_programs_per_sm": cfg["gemv_tc_programs_per_sm"]}
    splits, per = _splits(tiles, k, 128, x.device, tc, gemv=True)
    o = _outputs(splits, m, n, tiles, x, x.dtype, bias, cfg)
    _w4_gemv_tc_kernel[(tiles, splits)](
        x, qweight, scales, zeros if zeros is not None else scales,
        bias if bias is not None else scales, o.part, o.res, o.cnt, m, n, k, x.stride(0),
        o.part.stride(0), o.part.stride(1), per, splits, GROUP=min(group_size, k),
        EVEN=n % bn == 0, HAS_ZERO=zeros is not None, HAS_BIAS=o.kernel_bias,
        BLOCK_M=8 if m <= 8 else 16, BLOCK_N=bn, F16=x.dtype == torch.float16,
        ASM=not _INTERPRET, F32=_INTERPRET, SPLITS_PAD=o.splits_pad, FUSED=o.fused,
        num_warps=cfg["gemv_tc_warps"], num_stages=cfg["gemv_tc_stages"], **launch_opts())
    return o.result(splits, bias, x.dtype)


@triton.jit
def _w4_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, R, group_size, HAS_ZERO: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """`[BLOCK_R, BLOCK_N]` words -> rows `8r + i` of the `[K, N]` weight (coalesced on N)."""
    pdl_wait(PDL)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_r < R)[:, None] & (offs_n < N)[None, :]
    qw = tl.load(qw_ptr + offs_r.to(tl.int64)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    g = (offs_r * 8 // group_size).to(tl.int64)[:, None] * N + offs_n[None, :]
    s = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + g, mask=mask, other=0).to(tl.float32)
    else:
        z = tl.full((BLOCK_R, BLOCK_N), 8.0, tl.float32)
    base = out_ptr + (offs_r * 8).to(tl.int64)[:, None] * N + offs_n[None, :]
    for i in tl.static_range(8):
        w = _q_minus_z(qw >> (4 * i), z) * s
        tl.store(base + i * N, w.to(out_ptr.dtype.element_ty), mask=mask)


def w4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Same as `quant.w4_dequantize` (group_size a multiple of 8, as every format's)."""
    r, n = qweight.shape
    out = torch.empty(r * 8, n, device=qweight.device, dtype=dtype)
    br, bn = W4_CONFIG["dequant_block_r"], W4_CONFIG["dequant_block_n"]
    _w4_dequant_kernel[(triton.cdiv(r, br), triton.cdiv(n, bn))](
        qweight, scales, zeros if zeros is not None else scales, out, n, r, group_size,
        HAS_ZERO=zeros is not None, BLOCK_R=br, BLOCK_N=bn, num_warps=4, **launch_opts())
    return out


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group_size: int,
                 bias: torch.Tensor | None = None,
                 deferred: DeferredSlot | None = None) -> "torch.Tensor | DeferredSum":
    """Same as `quant.w4a16_linear`: on sm_90 the Gluon tensor-core GEMV for up to
    W4_CONFIG['gemv_mma_max_m'] rows; else the GEMV kernel for up to
    W4_CONFIG['gemv_max_m'] rows, the tensor-core GEMV (Triton) for its rows, the tl.dot
    kernel below W4_CONFIG['dequant_min_m'] (split-K when the output tiles alone cannot
    fill the GPU), above it the dequantized weight through cuBLAS. `deferred`: the
    layer's accumulator for a one-row split sum its reader finishes (`_w4_gemv_mma`)."""
    m, k = x.shape
    n = qweight.shape[1]
    cfg = W4_CONFIG
    if m >= cfg["dequant_min_m"] and group_size % 8 == 0 and k % 8 == 0:
        w = w4_dequantize(qweight, scales, zeros, group_size, x.dtype)
        return torch.addmm(bias, x, w) if bias is not None else x @ w
    if m <= cfg["gemv_mma_max_m"] and _gluon_ok(x, n, k, group_size, scales):
        return _w4_gemv_mma(x.contiguous(), qweight, scales, zeros, group_size, bias,
                            deferred=deferred)
    if _tc_gemv_ok(m, k, group_size, x.dtype):
        return _w4_gemv_tc(x.contiguous(), qweight, scales, zeros, group_size, bias)
    gemv = m <= cfg["gemv_max_m"]
    if gemv:
        cfg = _gemv_shape_config(cfg, m, n, k, x.device)
        bk, gpt = _gemv_tile(cfg["gemv_block_k"], group_size, k)
    else:
        bk, gpt = _group_block(cfg["gemm_block_k"], group_size, k), 1
    if m == 0 or bk < (8 if gemv else 16) or k % 8:
        return twin.w4a16_linear(x, qweight, scales, zeros, group_size, bias)
    x = x.contiguous()
    zp = zeros if zeros is not None else scales
    bp = bias if bias is not None else scales
    if gemv:
        bn = cfg["gemv_block_n"]
        n_tiles = triton.cdiv(n, bn)
        splits, per = _splits(n_tiles * m, k, bk, x.device, cfg, gemv=True)
        # one arrival counter per output tile and row
        o = _outputs(splits, m, n, n_tiles * m, x, x.dtype, bias, cfg)
        _w4_gemv_kernel[(n_tiles, splits, m)](
            x, qweight, scales, zp, bp, o.part, o.res, o.cnt, n, k, x.stride(0),
            o.part.stride(0), o.part.stride(1), per, splits,
            GROUP=min(group_size, k), EVEN=n % bn == 0 and k % bk == 0,
            HAS_ZERO=zeros is not None, HAS_BIAS=o.kernel_bias, BLOCK_N=bn, BLOCK_K=bk,
            GPT=gpt, XVEC=bool(cfg["gemv_xvec"]), PREFETCH=int(cfg["gemv_prefetch"]),
            PRMT=bool(cfg["gemv_prmt"]) and not _INTERPRET,
            SPLITS_PAD=o.splits_pad, FUSED=o.fused, num_warps=cfg["gemv_warps"],
            num_stages=cfg["gemv_stages"], **launch_opts())
    else:
        bm, bn = _block_m(m, cfg), cfg["gemm_block_n"]
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        splits, per = _splits(tiles, k, bk, x.device, cfg)
        o = _outputs(splits, m, n, tiles, x, x.dtype, bias, cfg)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits)
        common = dict(HAS_ZERO=zeros is not None, HAS_BIAS=o.kernel_bias, BLOCK_M=bm,
                      BLOCK_N=bn, BLOCK_K=bk, F32=_INTERPRET, SPLITS_PAD=o.splits_pad,
                      FUSED=o.fused, num_warps=cfg["gemm_warps"],
                      num_stages=cfg["gemm_stages"])
        if cfg["gemm_planes"]:
            _w4_gemm_planes_kernel[grid](
                x, qweight, scales, zp, bp, o.part, o.res, o.cnt, m, n, k, x.stride(0),
                o.part.stride(0), o.part.stride(1), per, splits, GROUP=min(group_size, k),
                **common, **launch_opts())
        else:
            _w4_gemm_kernel[grid](
                x, qweight, scales, zp, bp, o.part, o.res, o.cnt, m, n, k, x.stride(0),
                o.part.stride(0), o.part.stride(1), group_size, per, splits, **common,
                **launch_opts())
    return o.result(splits, bias, x.dtype)


# -- fp8 ------------------------------------------------------------------------------------

@triton.jit
def _fp8_tile(w_rows, n_mask, k0, offs_k, k_end):
    """The fp8 weights of keys [k0, k0 + BLOCK_K) of the tile's rows (0 past k_end)."""
    k = k0 + offs_k
    return tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < k_end)[None, :], other=0.0)


@triton.jit(do_not_specialize=["splits"])
def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, res_ptr, cnt_ptr, N, K, stride_xm,
                     stride_ws, stride_os, stride_om, k_per_split, splits, BN_S, BK_S,
                     ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ACT: tl.constexpr, PREFETCH: tl.constexpr,
                     XB: tl.constexpr, KCHUNK: tl.constexpr, SPLITS_PAD: tl.constexpr,
                     FUSED: tl.constexpr,
                    PDL: tl.constexpr):
    """ACT: x rows are `[gate | up]` (2K wide) and the GEMV's input is silu(gate) * up,
    rounded by `triton_activation.silu_mul`, as `silu_and_mul` rounds (so the same bits as
    that kernel followed by this one, without the launch and the activations' round trip).
    PREFETCH and XB (FP8_CONFIG's gemv_prefetch / gemv_xb) change where loads sit, not
    what is computed: see FP8_CONFIG."""
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if KCHUNK > 1:   # each thread's KCHUNK contiguous products summed every step
        acc = tl.zeros((BLOCK_N, BLOCK_K // KCHUNK), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    if PREFETCH:
        w_next = _fp8_tile(w_rows, n_mask, k_start, offs_k, k_end)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        if PREFETCH:   # the next tile's weights load while this one is multiplied
            w = w_next.to(tl.float32)
            w_next = _fp8_tile(w_rows, n_mask, k0 + BLOCK_K, offs_k, k_end)
        else:
            w = _fp8_tile(w_rows, n_mask, k0, offs_k, k_end).to(tl.float32)
        if ACT:
            gate = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
            up = tl.load(x_row + K + k, mask=k_mask, other=0.0).to(tl.float32)
            xv = triton_activation.silu_mul(gate, up, x_ptr.dtype.element_ty)[None, :]
        elif XB:       # the activations loaded in the weights' layout (no shuffle)
            xv = tl.load(x_row + k[None, :] + 0 * offs_n[:, None], mask=k_mask[None, :],
                         other=0.0).to(tl.float32)
        else:
            xv = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        if ROW_SCALE:
            prod = w * xv
        else:
            s = tl.load(ws_ptr + (offs_n // BN_S) * stride_ws + k0 // BK_S, mask=n_mask,
                        other=0.0)
            prod = w * xv * s[:, None]
        if KCHUNK > 1:
            acc += tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // KCHUNK, KCHUNK)), axis=2)
        else:
            acc += prod
    out = tl.sum(acc, axis=1)
    if ROW_SCALE:
        out = out * tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)
    _store_split(out, out_ptr, res_ptr, cnt_ptr, b_ptr, m * tl.num_programs(0) + pid_n, splits,
                 pid_s, stride_os, m.to(tl.int64) * stride_om + offs_n, offs_n, n_mask,
                 HAS_BIAS, SPLITS_PAD, FUSED)


@triton.jit(do_not_specialize=["M", "splits"])
def _fp8_gemm_kernel(x_ptr, w_ptr, ws_ptr, as_ptr, b_ptr, out_ptr, res_ptr, cnt_ptr, M, N, K,
                     stride_xm, stride_ws, stride_os, stride_om, k_per_split, splits, BN_S, BK_S,
                     ROW_SCALE: tl.constexpr, W8A8: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     F32: tl.constexpr, SPLITS_PAD: tl.constexpr, FUSED: tl.constexpr,
                    PDL: tl.constexpr):
    """W8A8 False: x in its dtype, fp8 weights upcast (w8a16). W8A8 True: x is e4m3
    with per-row scales `as_ptr`, an fp8 x fp8 dot."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)   # [BLOCK_N, BLOCK_K]
        if W8A8:
            d = _dot(a, tl.trans(w), F32)
        else:
            d = _dot(a, tl.trans(w.to(a.dtype)), F32)
        if ROW_SCALE:
            acc += d
        else:
            s = tl.load(ws_ptr + (offs_n // BN_S) * stride_ws + k0 // BK_S, mask=n_mask,
                        other=0.0)
            acc += d * s[None, :]
    if ROW_SCALE:
        acc = acc * tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)[None, :]
    if W8A8:
        acc = acc * tl.load(as_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    _store_split(acc, out_ptr, res_ptr, cnt_ptr, b_ptr, pid_m * tl.num_programs(1) + pid_n,
                 splits, pid_s, stride_os, offs_m.to(tl.int64)[:, None] * stride_om
                 + offs_n[None, :], offs_n[None, :], m_mask[:, None] & n_mask[None, :],
                 HAS_BIAS, SPLITS_PAD, FUSED)


@triton.jit
def _fp8_act_quant_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, K, stride_xm,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    m = tl.program_id(0)
    row = x_ptr + m.to(tl.int64) * stride_xm
    if STATIC:
        scale = tl.load(in_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(row + k, mask=k < K, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        # IEEE division, as torch's: the default one is approximate and moved a few
        # values across an e4m3 rounding boundary.
        v = tl.div_rn(tl.load(row + k, mask=k < K, other=0.0).to(tl.float32), scale)
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(q_ptr + m.to(tl.int64) * K + k, v.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + m, scale)


def quantize_fp8_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as `quant.quantize_fp8_per_token`."""
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=FP8)
    s = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m:
        block = min(FP8_CONFIG["act_block"], triton.next_power_of_2(k))
        _fp8_act_quant_kernel[(m,)](x, q, s, input_scale if input_scale is not None else s,
                                    k, x.stride(0), STATIC=input_scale is not None, BLOCK=block,
                                    num_warps=4, **launch_opts())
    return q, s


def _scale_layout(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                  bk: int) -> tuple[bool, int, int, int] | None:
    """(per-row scales?, bn, bk of the scales, a tile size that fits) or None."""
    n, k = weight.shape
    bn_s, bk_s = block
    row = bn_s == 1 and (weight_scale.shape[1] == 1)
    if not row:
        while bk > 16 and bk_s < k and bk_s % bk:
            bk //= 2
        if bk_s < k and bk_s % bk:
            return None
    return row, bn_s, bk_s, bk


def _fp8_launch(x, weight, weight_scale, block, a_scale, w8a8: bool, gemv: bool, bias,
                dtype, act: bool = False, deferred: DeferredSlot | None = None
                ) -> "torch.Tensor | DeferredSum | None":
    """The fp8 kernels' common launch; None when the scale layout does not fit a tile.
    act (GEMV only): x is `[gate | up]`, the input silu(gate) * up. `deferred`: the
    layer's accumulator, which a split one-row GEMV adds into where FP8_CONFIG
    ["deferred_sum"] is on (a `DeferredSum` is returned: ops/deferred.py)."""
    m, k = x.shape
    k = k // 2 if act else k
    n = weight.shape[0]
    cfg = FP8_CONFIG
    if gemv:
        bk0, bn = cfg["gemv_block_k"], cfg["gemv_block_n"]
    elif w8a8:
        bk0, bn = cfg["w8a8_block_k"], cfg["w8a8_block_n"]
    else:
        bk0, bn = cfg["gemm_block_k"], cfg["gemm_block_n"]
    lay = _scale_layout(weight, weight_scale, block, bk0)
    if lay is None:
        return None
    row, bn_s, bk_s, bk = lay
    ws = weight_scale.contiguous()
    bp = bias if bias is not None else ws
    if gemv:
        tiles = triton.cdiv(n, bn) * m
        splits, per = _splits(tiles, k, bk, x.device, cfg, gemv=True)
        acc = (deferred.buffer(n, x.device) if deferred is not None and m == 1 and splits > 1
               and cfg["deferred_sum"] else None)
        o = (_deferred_outputs(acc) if acc is not None
             else _outputs(splits, m, n, tiles, x, dtype, bias, cfg))
        _fp8_gemv_kernel[(triton.cdiv(n, bn), splits, m)](
            x, weight, ws, bp, o.part, o.res, o.cnt, n, k, x.stride(0), ws.stride(0),
            o.part.stride(0), o.part.stride(1), per, splits, bn_s, bk_s, ROW_SCALE=row,
            HAS_BIAS=o.kernel_bias, BLOCK_N=bn, BLOCK_K=bk, ACT=act,
            PREFETCH=bool(cfg["gemv_prefetch"]), XB=bool(cfg["gemv_xb"]) and not act,
            KCHUNK=min(int(cfg["gemv_kchunk"]), bk), SPLITS_PAD=o.splits_pad, FUSED=o.fused,
            num_warps=cfg["gemv_warps"], num_stages=cfg["gemv_stages"], **launch_opts())
        if acc is not None:
            return deferred.hand_out(bias, dtype)
    else:
        bm = cfg["w8a8_block_m"] if w8a8 else _block_m(m, cfg)
        bm = min(bm, max(16, triton.next_power_of_2(m)))
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        splits, per = _splits(tiles, k, bk, x.device, cfg)
        o = _outputs(splits, m, n, tiles, x, dtype, bias, cfg)
        warps = cfg["w8a8_warps" if w8a8 else "gemm_warps"]
        stages = cfg["w8a8_stages" if w8a8 else "gemm_stages"]
        _fp8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), splits)](
            x, weight, ws, a_scale if a_scale is not None else ws, bp, o.part, o.res, o.cnt,
            m, n, k, x.stride(0), ws.stride(0), o.part.stride(0), o.part.stride(1), per,
            splits, bn_s, bk_s, ROW_SCALE=row, W8A8=w8a8, HAS_BIAS=o.kernel_bias, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk, F32=_INTERPRET, SPLITS_PAD=o.splits_pad, FUSED=o.fused,
            num_warps=warps, num_stages=stages, **launch_opts())
    return o.result(splits, bias, dtype)


def fp8_w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int], input_scale: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, gemv: bool | None = None,
                     deferred: DeferredSlot | None = None) -> "torch.Tensor | DeferredSum":
    """Same as `quant.fp8_linear` (weight-only): GEMV or tl.dot kernel."""
    m = x.shape[0]
    gemv = m <= FP8_CONFIG["gemv_max_m"] if gemv is None else gemv
    x = x.contiguous()
    r = (_fp8_launch(x, weight, weight_scale, block, None, False, gemv, bias, x.dtype,
                     deferred=deferred) if m else None)
    return twin.fp8_linear(x, weight, weight_scale, block, input_scale, bias) if r is None else r


def w4a16_silu_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None, group_size: int,
                      bias: torch.Tensor | None = None,
                      deferred: DeferredSlot | None = None) -> "torch.Tensor | DeferredSum":
    """`w4a16_linear(silu_and_mul(x))` (the MLP's down projection): where the Gluon GEMV
    stages the one input row (`silu_stages`) it computes the SiLU-and-mul as it stages,
    bit for bit as the two kernels in a row (one launch a layer fewer); else the two."""
    m, n = x.shape[0], qweight.shape[1]
    k = qweight.shape[0] * 8
    if (x.dim() == 2 and x.shape[1] == 2 * k and _gluon_ok(x, n, k, group_size, scales)
            and silu_stages(m, n, k, sm_count(x.device), W4_CONFIG,
                            gluon_w4_tma.aligned(qweight, scales, zeros))):
        return _w4_gemv_mma(x.contiguous(), qweight, scales, zeros, group_size, bias,
                            act=True, deferred=deferred)
    return w4a16_linear(triton_activation.silu_and_mul(x), qweight, scales, zeros,
                        group_size, bias, deferred)


def _gluon_ok(x: torch.Tensor, n: int, k: int, group_size: int, scales: torch.Tensor) -> bool:
    """The Gluon GEMV can run this call (`gluon_w4.usable`) with 16-byte aligned scales
    (the ring kernel copies them 16 bytes at a time)."""
    return (gluon_w4.usable(x, n, k, group_size, W4_CONFIG["gemv_mma_block_n"])
            and scales.data_ptr() % 16 == 0)


def fp8_silu_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    block: tuple[int, int], input_scale: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None,
                    deferred: DeferredSlot | None = None) -> "torch.Tensor | DeferredSum":
    """`fp8_linear(silu_and_mul(x))` (the MLP's down projection): up to the GEMV's batch
    the SiLU-and-mul happens in the GEMV's activation load, bit for bit as the two
    kernels in a row (one launch per layer fewer); above it, the two."""
    m = x.shape[0]
    if FP8_CONFIG["silu_gemv"] and 0 < m <= min(FP8_CONFIG["gemv_max_m"],
                                                FP8_CONFIG["w8a16_max_m"]):
        x = x.contiguous()
        r = _fp8_launch(x, weight, weight_scale, block, None, False, True, bias, x.dtype,
                        act=True, deferred=deferred)
        if r is not None:
            return r
    return fp8_linear(triton_activation.silu_and_mul(x), weight, weight_scale, block,
                      input_scale, bias, deferred)


def _scaled_mm_ok(q: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  block: tuple[int, int], out_dtype: torch.dtype) -> bool:
    n, k = weight.shape
    return (FP8_CONFIG["scaled_mm"] and q.is_cuda and out_dtype == torch.bfloat16
            and block[0] == 1 and weight_scale.shape[1] == 1 and k % 16 == 0 and n % 16 == 0)


def fp8_gemm_a8(q: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                weight_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None,
                out_dtype: torch.dtype, scaled_mm: bool | None = None) -> torch.Tensor:
    """Same as `quant.fp8_gemm_a8`: `torch._scaled_mm` (row-wise scales) where it
    applies, else the Triton fp8 x fp8 kernel."""
    m = q.shape[0]
    use_mm = _scaled_mm_ok(q, weight, weight_scale, block, out_dtype) if scaled_mm is None \
        else scaled_mm
    if m and use_mm:
        try:
            out = torch._scaled_mm(q, weight.t(), scale_a=a_scale,
                                   scale_b=weight_scale.reshape(1, -1).float(),
                                   out_dtype=out_dtype)
            return out if bias is None else out + bias
        except RuntimeError as e:   # a shape this torch build refuses: Triton from now on
            if torch.cuda.is_current_stream_capturing():
                raise
            _SCALED_MM_REFUSED.add((m % 16 == 0, str(e)[:200]))
            FP8_CONFIG["scaled_mm"] = False
    r = _fp8_launch(q, weight, weight_scale, block, a_scale, True, False, bias, out_dtype) \
        if m else None
    return twin.fp8_gemm_a8(q, a_scale, weight, weight_scale, block, bias, out_dtype) \
        if r is None else r


def fp8_w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    block: tuple[int, int], input_scale: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same as `quant.fp8_w8a8_linear`: per-token activation quantization, then the
    fp8 GEMM."""
    x = x.contiguous()
    q, a_scale = quantize_fp8_per_token(x, input_scale)
    return fp8_gemm_a8(q, a_scale, weight, weight_scale, block, bias, x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               block: tuple[int, int], input_scale: torch.Tensor | None = None,
               bias: torch.Tensor | None = None,
               deferred: DeferredSlot | None = None) -> "torch.Tensor | DeferredSum":
    """The GPU's fp8 GEMM: weight-only up to FP8_CONFIG['w8a16_max_m'] rows (twin:
    `quant.fp8_linear`), fp8 activations above (twin: `quant.fp8_w8a8_linear`)."""
    if x.shape[0] <= FP8_CONFIG["w8a16_max_m"]:
        return fp8_w8a16_linear(x, weight, weight_scale, block, input_scale, bias,
                                deferred=deferred)
    return fp8_w8a8_linear(x, weight, weight_scale, block, input_scale, bias)
