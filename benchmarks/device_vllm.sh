#!/usr/bin/env bash
# One device call, vLLM 0.26.0's side (run right after device_pagefleet.sh, same machine):
# carry .vl2 and .whl (../shared/tools/vllm-on-device/README.md). Same model, same
# online workloads and flags, then vLLM's offline LLM with its own defaults.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp .vl2/* /tmp/vl/ && cat /tmp/vl/part00 /tmp/vl/part01 | xz -dc | (mkdir -p /tmp/site && tar -x -C /tmp/site) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
M=/dev/shm/qwen2.5-7b-random
[ -f "$M/config.json" ] || { mkdir -p /tmp/pf/pagefleet; PYTHONPATH=/tmp/site python3 benchmarks/build_model.py "$M"; }
timeout "${ONLINE_TIMEOUT:-330}" python3 benchmarks/online_bench.py --server vllm --model "$M" \
    --out "$OUT/online_vllm.json" --server-log "$OUT/vllm_server.log" ${ONLINE_ARGS:-}
timeout "${OFFLINE_TIMEOUT:-220}" python3 benchmarks/vllm_offline.py "$M" --out "$OUT/offline_vllm.json" \
    > "$OUT/vllm_offline.log" 2>&1
tail -3 "$OUT/vllm_offline.log"
