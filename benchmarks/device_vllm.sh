#!/usr/bin/env bash
# Device call 2 of the side-by-side run, right after device_engine.sh on the same machine
# (which left vLLM's first part in /tmp/vl): carry .vlb and .whl. vLLM 0.26.0's parts
# are prepare.sh's .vl1 + .vl2 re-split at 48 MB (benchmarks/README.md, "the carry folders") so
# that each call stays under the 64 MiB carry with the repository. Same model, same
# online workloads and flags as pagefleet's, then vLLM's offline LLM with its defaults.
# VLLM_PHASES picks "online", "offline" or both; once /tmp/site holds vLLM (a previous
# call on the same machine), nothing needs carrying.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PHASES=${VLLM_PHASES:-online,offline}
if [ ! -d /tmp/site/vllm ]; then
  cp .vlb/* /tmp/vl/ && cat /tmp/vl/part00 /tmp/vl/part01 | xz -dc | (mkdir -p /tmp/site && tar -x -C /tmp/site) || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
M=/dev/shm/qwen2.5-7b-random
[ -f "$M/config.json" ] || { mkdir -p /tmp/pf/pagefleet; PYTHONPATH=/tmp/site python3 benchmarks/build_model.py "$M"; }
[[ $PHASES == *online* ]] && timeout "${ONLINE_TIMEOUT:-420}" python3 benchmarks/online_bench.py --server vllm --model "$M" \
    --out "$OUT/online_vllm.json" --server-log "$OUT/vllm_server.log" ${ONLINE_ARGS:-}
[[ $PHASES == *offline* ]] && timeout "${OFFLINE_TIMEOUT:-220}" python3 benchmarks/vllm_offline.py "$M" --out "$OUT/offline_vllm.json" \
    > "$OUT/vllm_offline.log" 2>&1
tail -3 "$OUT/vllm_offline.log"
