#!/usr/bin/env bash
# One device call, pagefleet's side of the side-by-side run (BENCHMARKS.md): carry
# .vl1 (copied to /tmp/vl for the vLLM call that follows) and .whl-pf (the server's
# wheels the device lacks: fastapi, uvicorn, pydantic, pyzmq, msgspec).
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .vl1 ]; then mkdir -p /tmp/vl && cp .vl1/* /tmp/vl/; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-pf/*.whl || exit 1
mkdir -p /tmp/pf/pagefleet && ln -sfn "$PWD/server" /tmp/pf/pagefleet/server
export PYTHONPATH=/tmp/site:/tmp/pf PYTHONUNBUFFERED=1 PAGEFLEET_BENCH_MODEL=/dev/shm/qwen2.5-7b-random
M=$PAGEFLEET_BENCH_MODEL
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
[ -f "$M/config.json" ] || python3 benchmarks/build_model.py "$M"
timeout 40 python3 benchmarks/gpu_bench.py --phases ceilings > "$OUT/ceilings.log" 2>&1; cp /tmp/pagefleet-bench/part_ceilings.json "$OUT/" 2>/dev/null
timeout "${ONLINE_TIMEOUT:-290}" python3 benchmarks/online_bench.py --server pagefleet --model "$M" \
    --out "$OUT/online_pagefleet.json" --server-log "$OUT/pagefleet_server.log" ${ONLINE_ARGS:-}
OUT=/tmp/pagefleet-check timeout 330 python3 benchmarks/gpu_check.py ${CHECK_PHASES:-steps} > "$OUT/check.log" 2>&1
cp /tmp/pagefleet-check/check*.json "$OUT/" 2>/dev/null
tail -30 "$OUT/check.log"
