# The twenty-fifth session's scheduler A/B (carry .whl-pf), ~5 minutes (half the request counts): pagefleet's
# OpenAI server under online_bench.py's `mixed` (48 users, 10% 6,000-token documents,
# 90% 96-token questions) and `u64` workloads, first with the server tree from before
# the session's engine merge (benchmarks/_before/server: `git archive 6aacd62 server`,
# untracked, made by hand before the call), then with this tree's: the short-prompt
# reserve beside a running long prefill, the n>1 leader and admission-count fixes.
#   mkdir -p benchmarks/_before && git archive 6aacd62 server | tar -x -C benchmarks/_before
#   bash benchmarks/results/2026-12-05f-sched_ab.sh
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/device_setup.sh
pf_env .whl-pf || exit 1
M=/dev/shm/qwen2.5-7b-random
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 python3 benchmarks/build_model.py "$M" > "$OUT/build.log" 2>&1 || { tail -5 "$OUT/build.log"; exit 1; }
for side in before after; do
  if [ $side = before ]; then ln -sfn "$PWD/benchmarks/_before/server" /tmp/pf/pagefleet/server
  else ln -sfn "$PWD/server" /tmp/pf/pagefleet/server; fi
  echo "== $side: $(readlink /tmp/pf/pagefleet/server)"
  timeout 230 python3 benchmarks/online_bench.py --server pagefleet --model "$M" --workloads ${WORKLOADS:-mixed,u64} --scale ${SCALE:-0.5} \
      --out "$OUT/online_$side.json" --server-log "$OUT/server_$side.log" > "$OUT/bench_$side.log" 2>&1
  echo "rc $?"; grep -v "^\[" "$OUT/bench_$side.log" | tail -14
done
