#!/usr/bin/env bash
# One device call (carry .whl-core), ~7 minutes, after a change of shipped kernel configs:
#  1. greedy parity against HF transformers (gpu_check.py parity, five cases);
#  2. the engine's B=1 decode step for bf16, fp8 and AWQ (quant_bench.py, shipped configs;
#     TUNED='{"W4_CONFIG": {...}}' runs them with those keys over the shipped ones instead,
#     e.g. a variant an A/B picked before it is switched on; the AWQ phase's greedy
#     parity against the torch twins runs with it).
# Results straight into $OUT (kept if the call runs out of time); a summary last.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
timeout "${PARITY_S:-190}" python3 benchmarks/gpu_check.py parity > "$OUT/check.log" 2>&1
grep -h "parity " "$OUT/check.log" | cut -c1-200
if [ -n "${TUNED:-}" ]; then configs=(--tuned "$TUNED"); else configs=(--no-tuned); fi
OUT=/tmp/final-q timeout "${ENGINE_S:-200}" bash benchmarks/run_quant.sh \
    --phases build,quantize,engine_bf16,engine_fp8,engine_awq --num-requests 64 \
    --decode-batches 1 "${configs[@]}" > "$OUT/quant.log" 2>&1
cp /tmp/final-q/quant_part_engine_*.json "$OUT/" 2>/dev/null
grep -E "== phase|decode B=1" "$OUT/quant.log" | sed -E "s/.*(== phase \w+).*/\1/; s/.*'total_ms': ([0-9.]+).*'gpu_step_ms': ([0-9.]+).*'us_by_kind': (\{[^}]*\}).*/  step \1 ms, GPU \2 ms, \3/"
