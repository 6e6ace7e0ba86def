#!/usr/bin/env bash
# vLLM 0.26.0 and pagefleet under the same online workloads in ONE device call (the
# cheapest side-by-side run: one machine, minutes apart). Needs vLLM's first part in
# /tmp/vl from a call before on the same warm machine (`mkdir -p /tmp/vl && cp .vla/* /tmp/vl/`,
# carry .vla), then carry .vlb .whl .whl-x: .whl-x holds the wheels pagefleet needs beyond
# vLLM's (jsonschema-rs, xgrammar, apache-tvm-ffi from .whl-pf; benchmarks/README.md).
# PAIR_TIMEOUTS="vllm pagefleet" bounds each server's run (s); results land as they come.
# ONLINE_ARGS (e.g. "--workloads longdoc") goes to both servers' runs, PF_ARGS (e.g.
# "--extra --block-size 128") to pagefleet's only.
set -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# vLLM took 131-142 s to start on these machines (2026-12-02); 275 s cut its 256-user phase once.
read -r T_VLLM T_PF <<< "${PAIR_TIMEOUTS:-340 205}"
M=/dev/shm/qwen2.5-7b-random
ONLINE_TIMEOUT=$T_VLLM VLLM_PHASES=online bash benchmarks/device_vllm.sh > "$OUT/vllm.log" 2>&1
# pagefleet's imports from vLLM's wheel folder (same versions as the Dockerfile's where
# both pin them) plus .whl-x; a target of its own, not vLLM's /tmp/site.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-pf \
    .whl/fastapi-*.whl .whl/starlette-*.whl .whl/uvicorn-*.whl .whl/pydantic-*.whl \
    .whl/pydantic_core-*.whl .whl/annotated_types-*.whl .whl/typing_inspection-*.whl \
    .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl-x/*.whl > "$OUT/pip.log" 2>&1 || exit 1
mkdir -p /tmp/pf/pagefleet && ln -sfn "$PWD/server" /tmp/pf/pagefleet/server
PYTHONPATH=/tmp/site-pf:/tmp/pf PYTHONUNBUFFERED=1 timeout "$T_PF" python3 benchmarks/online_bench.py \
    --server pagefleet --model "$M" --out "$OUT/online_pagefleet.json" \
    --server-log "$OUT/pagefleet_server.log" ${ONLINE_ARGS:-} ${PF_ARGS:-} > "$OUT/pf.log" 2>&1
tail -11 "$OUT/vllm.log" | cut -c1-250
tail -11 "$OUT/pf.log" | cut -c1-250
echo "compiles while serving: $(grep -c 'while serving' "$OUT/pagefleet_server.log" 2>/dev/null)"
