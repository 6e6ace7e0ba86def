# The twenty-third session's planned device call (carry .whl-core), ~5 minutes:
#   bash benchmarks/results/2026-12-05d-balance_call.sh
# 1. gemv_balance.py: the TMA GEMV's us a GEMV against the grid's balance (gate_up at
#    528-660 programs, down at 528-660; and the stream-K form, every SM the same tiles)
#    and against the layout (the checkpoint's, or each column tile's rows together:
#    "blocked"), 28 distinct layers a graph;
# 2. the engine's B=1 AWQ decode forward with gate_up / down / q-k-v and o / all reading
#    the blocked copy (same bits expected), gate_up / down / both in stream-K form, and
#    everything at once (`results/2026-12-05d-layout_balance_variants.json`, 9 variants);
# 3. ncu on the shipped gate_up and down (per-SM active cycles max / mean: the imbalance).
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 150 python3 benchmarks/gemv_balance.py > "$OUT/balance.log" 2>&1; echo "balance rc $?"
grep -v Warning "$OUT/balance.log" | tail -12
AB_S=250 AB_VARIANTS_FILE=benchmarks/results/2026-12-05d-layout_balance_variants.json \
    bash benchmarks/device_engine_ab.sh 2>&1 | tail -30
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.max,sm__cycles_active.avg,sm__cycles_active.min,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active
timeout 60 ncu --clock-control none --kernel-name regex:w4_gemv --launch-skip 3 --launch-count 5 \
    --metrics $M --csv python3 benchmarks/gemv_ncu.py gate_up,down > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu rc $?"
grep -v "^==" "$OUT/ncu.csv" | cut -d, -f5,12-16 | tail -45
