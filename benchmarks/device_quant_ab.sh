#!/usr/bin/env bash
# One device call (carry .whl-core), ~6 minutes:
#  1. benchmarks/gemv_step_ab.py: a B=1 step's 112 quantized GEMVs (28 distinct layers, no
#     L2 reuse) graph-replayed per variant (split-K summed in the kernel or by a second
#     one, the fp8 GEMV's chunked accumulator, tile sizes, programs per SM);
#  2. the engine's B=1 decode step (quant_bench.py, graphs, kernel profile) for bf16, fp8
#     and AWQ with the shipped configs, then fp8 and AWQ with step 1's fastest variants.
# Results: $OUT/gemv_step_ab.{json,log}, $OUT/quant_{shipped,best}.{json,log}, a summary.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
timeout 240 \
    python3 benchmarks/gemv_step_ab.py fp8,w4 > "$OUT/gemv_step_ab.log" 2>&1
BEST=$(python3 -c 'import json, os, sys
p = os.path.join(os.environ["OUT"], "gemv_step_ab.json")
print(json.dumps(json.load(open(p)).get("best", {})) if os.path.exists(p) else "{}")')
OUT=/tmp/qab-shipped timeout 150 bash benchmarks/run_quant.sh \
    --phases build,quantize,engine_bf16,engine_fp8,engine_awq --num-requests 64 \
    --decode-batches 1 --tuned '{}' > "$OUT/quant_shipped.log" 2>&1
cp /tmp/qab-shipped/quant_result.json "$OUT/quant_shipped.json" 2>/dev/null
OUT=/tmp/qab-best timeout 120 bash benchmarks/run_quant.sh --phases engine_fp8,engine_awq \
    --num-requests 64 --decode-batches 1 --tuned "$BEST" > "$OUT/quant_best.log" 2>&1
cp /tmp/qab-best/quant_result.json "$OUT/quant_best.json" 2>/dev/null
grep -E "^(fp8|w4|best)" "$OUT/gemv_step_ab.log"
for f in shipped best; do
  echo "$f: $(grep -h 'B=1 step' "$OUT/quant_$f.log" | cut -c1-110 | tr '\n' ' ')"
done
