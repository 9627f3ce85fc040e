#!/usr/bin/env bash
# Device call of 2026-12-02 (session 2), after the commlib-perf runner was split into
# _prepare/_wrong/measure and the CPU rounds (--rounds): build; commlib-perf on the one GPU
# (-np 1, eager and -G, ddacomm vs nccl), which runs the CUDA side of the reworked runner; then
# pytest tests/gpu at world 1.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COMMLIB_DISABLE_MULTICAST=1
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=150
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
run() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  local t=$(date +%s)
  timeout -s KILL "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t )) s"; tail -4 "$OUT/$name.log"
}
run perf-eager 120 $PY -m commlib.perf all_reduce all_gather -b 1K -e 16M -f 16 -n 10 -w 3 -d bfloat16 \
  --device cuda -np 1 --backend ddacomm nccl --json "$OUT/perf-eager.json"
run perf-graph 120 $PY -m commlib.perf all_reduce -b 1K -e 16M -f 16 -n 10 -w 3 -G 5 -d bfloat16 \
  --device cuda -np 1 --backend ddacomm nccl --json "$OUT/perf-graph.json"
run w1 150 $PY -m pytest -q -rs -p no:cacheprovider tests/gpu
echo "total $(( $(date +%s) - t0 )) s"
