#!/usr/bin/env bash
# One device call (carry .whl-core), ~7 minutes, for the B=1 decode step's kernels:
#  1. the decode attention kernel per DECODE_CONFIG variant (profile_serving.py dattn:
#     28 layers' distinct caches in one graph, batch 1-256, contexts 768-16K);
#  2. the B=1 GEMV variants of ${GEMV_FORMATS:-w4} (gemv_step_ab.py);
#  3. the engine's B=1 step, bf16, fp8 and AWQ (quant_bench.py), with the shipped configs
#     and then with $CANDIDATE ({"DECODE_CONFIG": ...}) plus step 2's fastest GEMVs.
# Everything lands in $OUT/results.tgz; a summary is printed last.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=/tmp/decode-ab; mkdir -p "$R"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
OUT=$R timeout 120 python3 benchmarks/profile_serving.py dattn > "$R/dattn.log" 2>&1
OUT=$R timeout 120 python3 benchmarks/gemv_step_ab.py "${GEMV_FORMATS:-w4}" \
    > "$R/gemv_step_ab.log" 2>&1
CAND=$(R=$R python3 -c 'import json, os
best = json.load(open(os.environ["R"] + "/gemv_step_ab.json")).get("best", {}) \
    if os.path.exists(os.environ["R"] + "/gemv_step_ab.json") else {}
print(json.dumps({**best, **json.loads(os.environ.get("CANDIDATE") or "{}")}))')
echo "candidate: $CAND" | tee "$R/candidate.txt"
OUT=$R/shipped timeout 150 bash benchmarks/run_quant.sh \
    --phases build,quantize,engine_bf16,engine_fp8,engine_awq --num-requests 64 \
    --decode-batches 1 --tuned '{}' > "$R/quant_shipped.log" 2>&1
OUT=$R/cand timeout 130 bash benchmarks/run_quant.sh --phases engine_bf16,engine_fp8,engine_awq \
    --num-requests 64 --decode-batches 1 --tuned "$CAND" > "$R/quant_cand.log" 2>&1
tar czf "$OUT/results.tgz" -C "$R" .
python3 - "$R/dattn.log" <<'PY'
import ast, sys
for line in open(sys.argv[1]):
    if "dattn {" in line:
        row = ast.literal_eval(line[line.index("{"):].strip())
        print(row["batch"], row["ctx"], " | ".join(
            f"{v['variant']}: {v.get('us_per_layer', -1):.1f}us" for v in row["variants"]))
PY
grep -E "^(fp8|w4|best)" "$R/gemv_step_ab.log"
cat "$R/candidate.txt"
for f in shipped cand; do echo "$f:"; grep -h "B=1 step" "$R/quant_$f.log" | cut -c1-100; done
