#!/usr/bin/env bash
# Device call 3 of the side-by-side run, right after device_vllm.sh on the same machine:
# pagefleet's OpenAI server under the online workloads (benchmarks/online_bench.py, the
# same client and flags as vLLM's), then the small-model server check (streams, logprobs,
# killing the core) and the offline LLM warmed up as vLLM's is. Carry .whl-pf (fastapi, uvicorn,
# pydantic, pyzmq, msgspec, xgrammar, jsonschema-rs).
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/device_setup.sh
pf_env .whl-pf || exit 1
M=${PAGEFLEET_BENCH_MODEL:-/dev/shm/qwen2.5-7b-random}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
[ -f "$M/config.json" ] || python3 benchmarks/build_model.py "$M"
timeout "${ONLINE_TIMEOUT:-420}" python3 benchmarks/online_bench.py --server pagefleet --model "$M" \
    --out "$OUT/online_pagefleet.json" --server-log "$OUT/pagefleet_server.log" ${ONLINE_ARGS:-}
OUT=/tmp/pagefleet-check timeout "${CHECK_TIMEOUT:-200}" python3 benchmarks/gpu_check.py "${CHECK_PHASES:-server,offline}" \
    > "$OUT/check_server.log" 2>&1
cp /tmp/pagefleet-check/check*.json "$OUT/" 2>/dev/null
tail -5 "$OUT/check_server.log"
# Kernel compiles that a user's step paid for (ops/compile_watch.py); 0 is the goal.
echo "compiles while serving: $(grep -c 'while serving' "$OUT/pagefleet_server.log" 2>/dev/null)"
grep 'while serving' "$OUT/pagefleet_server.log" 2>/dev/null | head -20
