#!/usr/bin/env bash
# One device call (carry .whl-core), twenty-seventh session: the deferred one-row split
# sums (ops/deferred.py) checked on the GPU (gemv_mma_check.py's deferred section), then
# the engine's AWQ B=1 decode forward A/B'd: the arrival-counter sum (deferred_sum off,
# the reference for tokens) against the deferred sum (shipped), with the kernel trace.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
GEMV_MMA_ONLY=deferred timeout 150 python3 benchmarks/gemv_mma_check.py > "$OUT/deferred_check.log" 2>&1
echo "deferred check rc $?"; grep -E "FAILED|deferred sums" "$OUT/deferred_check.log" | cut -c1-400 | tail -14
echo '[{"W4_CONFIG": {"deferred_sum": false}}, {}]' > /tmp/deferred_variants.json
AB_S=${AB_S:-300} AB_BATCHES=${AB_BATCHES:-1} AB_VARIANTS_FILE=/tmp/deferred_variants.json \
    bash benchmarks/device_engine_ab.sh
