#!/usr/bin/env bash
# Entry point on the device machine for benchmarks/quant_bench.py (run from the
# repository root; $OUT is the result folder). Same setup as run_gpu.sh: pagefleet is
# not installed there, a symlink tree maps `pagefleet.server` onto server/. The bf16
# checkpoint (15 GB) and the AWQ one (5.5 GB) go to /dev/shm when it has room.
set -o pipefail
mkdir -p /tmp/pf/pagefleet && ln -sfn "$PWD/server" /tmp/pf/pagefleet/server
export PYTHONPATH=/tmp/pf PYTHONUNBUFFERED=1   # not the repo root: operator/ would shadow the stdlib
export OUT=${OUT:-/tmp/pagefleet-bench}
mkdir -p "$OUT"
shm_free=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
if [ -z "${PAGEFLEET_BENCH_MODEL:-}" ]; then
  if [ "${shm_free:-0}" -ge 28 ]; then export PAGEFLEET_BENCH_MODEL=/dev/shm/qwen2.5-7b-random
  else export PAGEFLEET_BENCH_MODEL=/tmp/qwen2.5-7b-random; fi
fi
if [ -z "${PAGEFLEET_BENCH_AWQ:-}" ]; then
  if [ "${shm_free:-0}" -ge 28 ]; then export PAGEFLEET_BENCH_AWQ=/dev/shm/qwen2.5-7b-random-awq
  else export PAGEFLEET_BENCH_AWQ=/tmp/qwen2.5-7b-random-awq; fi
fi
echo "model dir: $PAGEFLEET_BENCH_MODEL  awq dir: $PAGEFLEET_BENCH_AWQ"; df -h /dev/shm /tmp | cat
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 benchmarks/quant_bench.py "$@" 2>&1 | tee "$OUT/quant_log.txt"
