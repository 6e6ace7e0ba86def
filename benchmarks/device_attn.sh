#!/usr/bin/env bash
# One device call (carry .whl-core) for what landed untimed on 2026-12-02 (evening):
#  1. greedy parity against HF with the shipped defaults (PAGEFLEET_PDL=early, page ids
#     one tile ahead in both attention kernels): gpu_check.py parity;
#  2. the attention kernels with page_ahead on and off (profile_serving.py attn, dattn);
#  3. the 16-document long-context run at the engine level, page_ahead on and off
#     (profile_serving.py longdoc, longdoc_no_ahead; not profiled).
# About 7 minutes. Everything lands in $OUT/results.tgz (the device returns 8 files at
# most); a summary is printed last.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=/tmp/attn-results; mkdir -p "$R"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
M=/dev/shm/qwen2.5-7b-random
[ -f "$M/config.json" ] || python3 benchmarks/build_model.py "$M" > "$R/build.log" 2>&1
OUT=$R timeout 200 python3 benchmarks/gpu_check.py parity > "$R/check.log" 2>&1
OUT=$R PROFILE_LONGDOC=0 timeout 560 python3 benchmarks/profile_serving.py \
    "${ATTN_PHASES:-attn,dattn,longdoc,longdoc_no_ahead}" > "$R/profile.log" 2>&1
tar czf "$OUT/results.tgz" -C "$R" .
grep -h "parity \|equal_hf" "$R/check.log" | cut -c1-160 | tail -6
grep -h "attn {\|dattn {\|longdoc (" "$R/profile.log" | cut -c1-400
