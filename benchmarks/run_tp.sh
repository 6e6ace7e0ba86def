#!/usr/bin/env bash
# Entry point on the device machine for the tensor-parallel benchmark (run from the
# repository root; $OUT is the result folder). As run_gpu.sh: a symlink tree maps the
# import package `pagefleet.server` onto server/ (the workers inherit PYTHONPATH).
# Arguments go to benchmarks/tp_bench.py.
set -o pipefail
mkdir -p /tmp/pf/pagefleet && ln -sfn "$PWD/server" /tmp/pf/pagefleet/server
if [ -d .whl-core ]; then   # msgspec + pyzmq: the engine's protocol imports them (carry .whl-core)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site-pf .whl-core/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site-pf:/tmp/pf PYTHONUNBUFFERED=1   # not the repo root: operator/ would shadow the stdlib
export OUT=${OUT:-/tmp/pagefleet-bench}
mkdir -p "$OUT"
if [ -z "${PAGEFLEET_BENCH_MODEL:-}" ]; then
  shm_free=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
  if [ "${shm_free:-0}" -ge 20 ]; then export PAGEFLEET_BENCH_MODEL=/dev/shm/qwen2.5-7b-random
  else export PAGEFLEET_BENCH_MODEL=/tmp/qwen2.5-7b-random; fi
fi
echo "model dir: $PAGEFLEET_BENCH_MODEL"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
nvidia-smi topo -m 2>/dev/null | head -12
python3 benchmarks/tp_bench.py "$@" 2>&1 | tee "$OUT/tp_log.txt"
