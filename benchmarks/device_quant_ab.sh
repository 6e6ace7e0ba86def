#!/usr/bin/env bash
# One device call (carry .whl-core), ~6 minutes:
#  1. benchmarks/gemv_step_ab.py: a B=1 step's 112 quantized GEMVs (28 distinct layers, no
#     L2 reuse) graph-replayed per variant: split-K summed by each tile's last program
#     (shipped, `fused_reduce`) against the second kernel, the fp8 load placements, the
#     programs per SM (which changes the splits);
#  2. the engine's B=1 decode step (quant_bench.py, graphs, kernel profile) for bf16, fp8
#     and AWQ with the shipped configs, then fp8 and AWQ with `fused_reduce` off.
# Results: $OUT/gemv_step_ab.{json,log}, $OUT/quant_{on,off}.{json,log}, a summary last.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-pf .whl-core/*.whl || exit 1
mkdir -p /tmp/pf/pagefleet && ln -sfn "$PWD/server" /tmp/pf/pagefleet/server
PYTHONPATH=/tmp/site-pf:/tmp/pf PYTHONUNBUFFERED=1 timeout 200 \
    python3 benchmarks/gemv_step_ab.py fp8,w4 > "$OUT/gemv_step_ab.log" 2>&1
OUT=/tmp/qab-on timeout 200 bash benchmarks/run_quant.sh \
    --phases build,quantize,engine_bf16,engine_fp8,engine_awq --num-requests 64 \
    --decode-batches 1 --tuned '{}' > "$OUT/quant_on.log" 2>&1
cp /tmp/qab-on/quant_result.json "$OUT/quant_on.json" 2>/dev/null
OUT=/tmp/qab-off timeout 140 bash benchmarks/run_quant.sh --phases engine_fp8,engine_awq \
    --num-requests 64 --decode-batches 1 \
    --tuned '{"FP8_CONFIG": {"fused_reduce": false}, "W4_CONFIG": {"fused_reduce": false}}' \
    > "$OUT/quant_off.log" 2>&1
cp /tmp/qab-off/quant_result.json "$OUT/quant_off.json" 2>/dev/null
grep -E "^(fp8|w4) " "$OUT/gemv_step_ab.log"
for f in on off; do
  echo "fused_reduce $f: $(grep -h 'B=1 step' "$OUT/quant_$f.log" | cut -c1-110 | tr '\n' ' ')"
done
