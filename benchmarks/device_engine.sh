#!/usr/bin/env bash
# Device call 1 of the side-by-side run (BENCHMARKS.md "How to reproduce"): pagefleet's
# engine without HTTP (GPU parity against HF, decode/sampled/mixed step times, offline
# LLM). Carry .vla (the first part of vLLM, left in /tmp/vl for device_vllm.sh) and
# .whl-core (msgspec + pyzmq, which the engine imports and the device lacks).
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .vla ]; then mkdir -p /tmp/vl && cp .vla/* /tmp/vl/; fi
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
OUT=/tmp/pagefleet-check timeout "${CHECK_TIMEOUT:-540}" python3 benchmarks/gpu_check.py \
    "${CHECK_PHASES:-parity,steps,profile}" > "$OUT/check.log" 2>&1
cp /tmp/pagefleet-check/check*.json "$OUT/" 2>/dev/null
grep -v "^\[transformers\]\|Loading weights" "$OUT/check.log" | tail -40
