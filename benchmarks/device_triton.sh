#!/usr/bin/env bash
# One device call: the same engine under the device image's Triton and under the Triton
# the server image ships (the Dockerfile's torch 2.13.0 brings Triton 3.9.0; the device
# image has 3.6.0, which every earlier measurement used).
#
# Carry .whl-core and .t39, made here with (about 5 minutes on 2 cores):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d /tmp/tw triton==3.9.0
#   unzip the wheel into /tmp/t39x; strip --strip-unneeded triton/_C/libtriton.so;
#   drop triton/backends/amd, the cupti libraries, ptxas (CUDA 12.9, used below sm_90), cuobjdump, nvdisasm,
#   libproton.so and instrumentation/*.so (none is used on sm_90 without profiling);
#   move ptxas-blackwell (CUDA 13.4: Triton 3.9 uses it for sm_90 too) out and xz it alone:
#   tar cf - triton *.dist-info | xz -9e > .t39/t39.tar.xz; xz -9e ptxas-blackwell -> .t39/
# (61 MB with the tree: under the 64 MiB a call carries.)
#
# Each Triton in TRITONS ("image 3.9" by default) runs profile_serving.py's PHASES
# (default longdoc_bs128_tma,attn: the 16-document engine run and the prefill kernel over
# 16- and 128-token pages); then, unless PARITY=0, gpu_check.py parity under 3.9 (greedy
# equal to HF). About 5 minutes. Results: $OUT/results.tgz; a summary last.
# 2026-12-03 (eighth session, BENCHMARKS.md): both equal in these; the quantized decode
# steps (run_quant.sh engine phases with PYTHONPATH=/tmp/t39:... TRITON_BACKENDS_IN_TREE=1)
# slower under 3.9.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=/tmp/triton-results; rm -rf "$R"; mkdir -p "$R"
. benchmarks/device_setup.sh
pf_env .whl-core || exit 1
BASE_PATH=$PYTHONPATH
BIN=/tmp/t39/triton/backends/nvidia/bin
[ -f /tmp/t39/triton/__init__.py ] || { mkdir -p /tmp/t39 && tar xJf .t39/t39.tar.xz -C /tmp/t39; } || exit 1
[ -x $BIN/ptxas-blackwell ] || { xz -dc .t39/ptxas-blackwell.xz > $BIN/ptxas-blackwell && chmod +x $BIN/ptxas-blackwell; } || exit 1
M=/dev/shm/qwen2.5-7b-random
[ -f "$M/config.json" ] || python3 benchmarks/build_model.py "$M" > "$R/build.log" 2>&1
use() {   # use image|3.9: PYTHONPATH for that Triton
  # The carried tree has only the nvidia backend: find backends by directory, not by
  # the entry points (the image's Triton dist-info names amd too).
  if [ "$1" = image ]; then export PYTHONPATH=$BASE_PATH; unset TRITON_BACKENDS_IN_TREE
  else export PYTHONPATH=/tmp/t39:$BASE_PATH TRITON_BACKENDS_IN_TREE=1; fi
  python3 -c 'import triton, torch; print("triton", triton.__version__, triton.__file__, "torch", torch.__version__)'
}
export PAGEFLEET_ATTN_VARIANTS=${PAGEFLEET_ATTN_VARIANTS:-'[[128,128,8,3,true,true,false,false,16],[128,128,8,3,true,true,false,true,128]]'}
for t in ${TRITONS:-image 3.9}; do
  use "$t" > "$R/version-$t.log" 2>&1 || { cat "$R/version-$t.log"; continue; }
  OUT=$R/$t PROFILE_LONGDOC=0 timeout ${LONGDOC_S:-300} python3 benchmarks/profile_serving.py \
      "${PHASES:-longdoc_bs128_tma,attn}" > "$R/profile-$t.log" 2>&1
done
if [ "${PARITY:-1}" != 0 ]; then
  use 3.9 >> "$R/version-parity.log" 2>&1
  OUT=$R/parity timeout ${PARITY_S:-200} python3 benchmarks/gpu_check.py parity > "$R/parity.log" 2>&1
fi
tar czf "$OUT/results.tgz" -C "$R" .
for t in ${TRITONS:-image 3.9}; do
  echo "== $(tail -1 "$R/version-$t.log")"
  grep -h "longdoc (\|Error\|error" "$R/profile-$t.log" | cut -c1-300 | head -8
  grep -h "attn {" "$R/profile-$t.log" | python3 -c '
import ast, sys
for line in sys.stdin:
    r = ast.literal_eval(line[line.index("{"):])
    print(r["q_len"], r["ctx"], "bs", r["bs"], "tma", r["tma"], "ms", round(r.get("now_ms", -1), 3),
          "flushed", round(r.get("flushed_ms", -1), 3), "same", r.get("same_as_first"), r.get("now_error", "")[:80])'
done
grep -h "parity \|equal_hf\|Error" "$R/parity.log" 2>/dev/null | cut -c1-160 | tail -8
