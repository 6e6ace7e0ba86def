#!/usr/bin/env bash
# One device call (carry .whl-core), ~5 minutes, for the B=1 decode step's kernels:
#  1. the decode attention kernel per DECODE_CONFIG variant (profile_serving.py dattn:
#     28 layers' distinct caches in one graph, batch 1-256, contexts 768-16K);
#  2. the fp8 GEMV variants around the shipped config (gemv_step_ab.py fp8);
#  3. the engine's B=1 step, bf16 and fp8, shipped configs (quant_bench.py).
# Everything lands in $OUT/results.tgz; a summary is printed last.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=/tmp/decode-ab; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-pf .whl-core/*.whl || exit 1
mkdir -p /tmp/pf/pagefleet && ln -sfn "$PWD/server" /tmp/pf/pagefleet/server
export PYTHONPATH=/tmp/site-pf:/tmp/pf PYTHONUNBUFFERED=1
OUT=$R timeout 200 python3 benchmarks/profile_serving.py dattn > "$R/dattn.log" 2>&1
OUT=$R timeout 150 python3 benchmarks/gemv_step_ab.py fp8 > "$R/gemv_step_ab.log" 2>&1
OUT=$R/q timeout 120 bash benchmarks/run_quant.sh --phases build,engine_bf16,engine_fp8 \
    --num-requests 64 --decode-batches 1 --tuned '{}' > "$R/quant.log" 2>&1
tar czf "$OUT/results.tgz" -C "$R" .
python3 - "$R/dattn.log" <<'PY'
import ast, sys
for line in open(sys.argv[1]):
    if "dattn {" in line:
        row = ast.literal_eval(line[line.index("{"):].strip())
        print(row["batch"], row["ctx"], " | ".join(
            f"{v['variant']}: {v.get('us_per_layer', float('nan')):.1f}us d={v.get('max_abs_diff', -1):.2g}"
            for v in row["variants"]))
PY
grep -E "^(fp8|best)" "$R/gemv_step_ab.log"
grep -h "B=1 step" "$R/quant.log" | cut -c1-120
