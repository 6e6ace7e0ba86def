#!/usr/bin/env bash
# Entry point on the device machine (run from the repository root; $OUT is the result
# folder). pagefleet is not installed there: a symlink tree maps the import package
# `pagefleet.server` onto server/. Arguments go to benchmarks/gpu_bench.py.
set -o pipefail
mkdir -p /tmp/pf/pagefleet && ln -sfn "$PWD/server" /tmp/pf/pagefleet/server
export PYTHONPATH=/tmp/pf PYTHONUNBUFFERED=1   # not the repo root: operator/ would shadow the stdlib
export OUT=${OUT:-/tmp/pagefleet-bench}
mkdir -p "$OUT"
# The 15 GB checkpoint goes to RAM (/dev/shm) when it has room, else to /tmp.
if [ -z "${PAGEFLEET_BENCH_MODEL:-}" ]; then
  shm_free=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
  if [ "${shm_free:-0}" -ge 20 ]; then export PAGEFLEET_BENCH_MODEL=/dev/shm/qwen2.5-7b-random
  else export PAGEFLEET_BENCH_MODEL=/tmp/qwen2.5-7b-random; fi
fi
echo "model dir: $PAGEFLEET_BENCH_MODEL"; df -h /dev/shm /tmp | cat
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 benchmarks/gpu_bench.py "$@" 2>&1 | tee "$OUT/log.txt"
