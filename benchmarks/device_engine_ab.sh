#!/usr/bin/env bash
# One device call (carry .whl-core): the engine's decode forward A/B'd across the
# variants in $AB_VARIANTS_FILE (a JSON list for benchmarks/engine_gemv_ab.py; an
# experiment's patches applied to the tree first), on the AWQ Qwen2.5-7B-shape checkpoint
# it builds; with PARITY=1, greedy parity against HF transformers first
# (gpu_check.py parity); with GEMV_CHECK=1, the Gluon w4 GEMVs against their twins first
# (gemv_mma_check.py, GEMV_MMA_CONFIG passed through; ~3-4 minutes: best a call of its
# own, AB_VARIANTS_FILE unset). ~1 minute to build, ~1-2 s a variant a round and batch
# plus its compiles (AB_S, default 470 s, caps the A/B: with PARITY=1 too a call can pass
# its 10 minutes, so parity goes with GEMV_CHECK when the variants file is long).
# Results: $OUT/engine_gemv_ab.{json,log} (and check.log, gemv_mma_check.{json,log});
# the table printed last.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
if [ "${PARITY:-0}" = 1 ]; then
  timeout "${PARITY_S:-190}" python3 benchmarks/gpu_check.py parity > "$OUT/check.log" 2>&1
  grep -h "parity " "$OUT/check.log" | cut -c1-300
fi
if [ "${GEMV_CHECK:-0}" = 1 ]; then
  timeout "${GEMV_CHECK_S:-300}" python3 benchmarks/gemv_mma_check.py > "$OUT/gemv_mma_check.log" 2>&1
  echo "gemv_mma_check rc $?"
  grep -hE "cases|FAILED|served|replays" "$OUT/gemv_mma_check.log" | cut -c1-300 | tail -30
fi
[ -n "${AB_VARIANTS_FILE:-}" ] || exit 0
OUT=/tmp/ab-q timeout 200 bash benchmarks/run_quant.sh --phases build,quantize \
    > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
ENGINE_AB_VARIANTS=$(cat "${AB_VARIANTS_FILE:?a JSON list of variants}") OUT=/tmp/ab-out \
    timeout "${AB_S:-470}" python3 benchmarks/engine_gemv_ab.py \
    --batches "${AB_BATCHES:-1}" --rounds "${AB_ROUNDS:-3}" --trace > "$OUT/engine_ab.log" 2>&1
cp /tmp/ab-out/engine_gemv_ab.json "$OUT/" 2>/dev/null
grep -v "round\|trace {" "$OUT/engine_ab.log" | tail -80
