#!/usr/bin/env bash
# The Gluon ping-pong prefill kernel (server/ops/gluon_attention.py) on the H200: the
# kernel against the shipped Triton one (benchmarks/gluon_pingpong_ab.py: ragged
# correctness with NaN in every slot past a context, then ms per call), and, where it was
# correct everywhere, the 16-document engine run with each (profile_serving.py
# longdoc_triton,longdoc_pingpong; ENGINE=0 skips it). Carry .whl-core.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=/dev/shm/qwen2.5-7b-random
if [ "${ENGINE:-1}" = 1 ] && [ ! -f "$M/config.json" ]; then   # built while the A/B runs
  python3 benchmarks/build_model.py "$M" > "$OUT/build.log" 2>&1 &
fi
OUT=$OUT timeout ${AB_S:-240} python3 benchmarks/gluon_pingpong_ab.py > "$OUT/ab.log" 2>&1
echo "ab rc=$?"
grep -h "^check\|^time\|Error\|error" "$OUT/ab.log" | cut -c1-1400 | head -30
wait
[ "${ENGINE:-1}" = 1 ] || exit 0
python3 - "$OUT/pingpong_ab.json" <<'PY' || { echo "not correct everywhere: no engine run"; exit 0; }
import json, sys
r = json.load(open(sys.argv[1]))
tag = "pingpong=True"
bad = [c["case"] for c in r["checks"] if not (isinstance(c.get(tag), dict) and c[tag].get("finite")
       and c[tag].get("vs_triton", 9) < 0.06)]
print("pingpong correct:", not bad, bad)
sys.exit(1 if bad else 0)
PY
OUT=$OUT PROFILE_LONGDOC=0 timeout ${LONGDOC_S:-330} python3 benchmarks/profile_serving.py \
    "${PHASES:-longdoc_triton,longdoc_pingpong}" > "$OUT/longdoc.log" 2>&1
grep -h "longdoc (\|Error\|timed out" "$OUT/longdoc.log" | cut -c1-300
