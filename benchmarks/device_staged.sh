#!/usr/bin/env bash
# One device call (carry .whl-core) that times what landed untimed on 2026-12-02 (midday):
#  1. the w4 GEMV with vector activation loads (W4_CONFIG["gemv_xvec"]): the kernels
#     phase's sweep holds both forms and engine_awq takes the sweep's pick, so the AWQ
#     B=1 step below is the better of the two (see quant_result.json's "tuned");
#  2. the PDL modes (server/ops/triton_common.py): the B=1 step of bf16 and fp8 with
#     PAGEFLEET_PDL=1, early (shipped since 2026-12-02 evening) and 0, on the same machine;
#  3. the fp8 B=1 step with FP8_CONFIG["silu_gemv"] off (SiLU-and-mul as its own kernel).
# About 8 minutes. Results: $OUT/quant_*.json, $OUT/pdl_*.json, and a table last.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
Q=/tmp/staged-quant
OUT=$Q timeout 330 bash benchmarks/run_quant.sh --phases build,quantize,kernels,engine_awq \
    --num-requests 64 --decode-batches 1 > "$OUT/quant.log" 2>&1
cp "$Q/quant_result.json" "$OUT/quant_result.json" 2>/dev/null
for mode in 1 early 0; do
  PAGEFLEET_PDL=$mode OUT=/tmp/staged-pdl-$mode timeout 120 bash benchmarks/run_quant.sh \
      --phases engine_bf16,engine_fp8 --num-requests 64 --decode-batches 1 \
      > "$OUT/pdl_$mode.log" 2>&1
  cp "/tmp/staged-pdl-$mode/quant_result.json" "$OUT/pdl_$mode.json" 2>/dev/null
done
# 3. the fp8 down projection with SiLU-and-mul in its GEMV (shipped) against the two
# kernels: the kernels phase's tuned configs (left in /tmp) with only that switch off
NOSILU=$(python3 -c 'import json, pathlib
p = pathlib.Path("/tmp/pagefleet-quant-tuned.json")
t = json.loads(p.read_text()) if p.exists() else {}
t.setdefault("FP8_CONFIG", {})["silu_gemv"] = False
print(json.dumps(t))')
OUT=/tmp/staged-nosilu timeout 90 bash benchmarks/run_quant.sh --phases engine_fp8 \
    --num-requests 64 --decode-batches 1 --tuned "$NOSILU" > "$OUT/nosilu.log" 2>&1
grep -h "sweep w4 gemv: best\|engine  awq: B=1" "$OUT/quant.log" | cut -c1-250
echo "fp8 without the SiLU GEMV: $(grep -h 'B=1 step' "$OUT/nosilu.log" | cut -c1-90)"
for mode in 1 early 0; do
  echo "PAGEFLEET_PDL=$mode: $(grep -h 'B=1 step' "$OUT/pdl_$mode.log" | cut -c1-90 | tr '\n' ' ')"
done
