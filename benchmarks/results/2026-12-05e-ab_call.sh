# The twenty-fifth session's first device call (carry .whl-core), ~6 minutes: the
# engine A/B of 2026-12-05d-balance_call.sh (9 variants: blocked layout / stream-K) and
# its ncu step, without the standalone probe (three refused starts left too little
# device time for the 9-minute form and its follow-up):
#   bash benchmarks/results/2026-12-05e-ab_call.sh
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
AB_S=250 AB_VARIANTS_FILE=benchmarks/results/2026-12-05d-layout_balance_variants.json \
    bash benchmarks/device_engine_ab.sh 2>&1 | tail -30
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.max,sm__cycles_active.avg,sm__cycles_active.min,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active
timeout 60 ncu --clock-control none --kernel-name regex:w4_gemv --launch-skip 3 --launch-count 5 \
    --metrics $M --csv python3 benchmarks/gemv_ncu.py gate_up,down > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu rc $?"
grep -v "^==" "$OUT/ncu.csv" | cut -d, -f5,12-16 | tail -45
