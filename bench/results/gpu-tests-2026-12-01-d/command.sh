#!/usr/bin/env bash
# Call 1: build; pytest tests/gpu at world 1 (the multimem refusal on a GPU; the multimem run itself
# skips: the machine sets the kill switches); then with both ranks on the one GPU (a protocol check):
# the fused file, the memory-release file and the all-reduce file at world 2 (every allocation's
# descriptor exchange runs through the refactored CudaIpc::send_fd / receive_fds); the CPU
# multicast tests and the SASS check on this machine too.
set -u
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=150
t0=$(date +%s)
env | grep -E "NVLS|MULTICAST" | sort
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() {  # name seconds pytest-args...
  local name=$1 secs=$2; shift 2
  local t=$(date +%s)
  timeout -s KILL "$secs" $PY -m pytest -q -rs -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t )) s"; tail -2 "$OUT/$name.log"
}
step w1 120 tests/gpu
step cpu-multicast 120 tests/cpu/test_fused_rmsnorm.py -k "multicast or multimem"
export COMMLIB_TEST_SHARE_GPUS=1
step w2-fused 170 tests/gpu/test_fused_rmsnorm_gpu.py -x
step w2-memory 60 tests/gpu/test_memory_release.py
step w2-allreduce 120 tests/gpu/test_all_reduce.py -x -k "not more_ranks"
echo "total $(( $(date +%s) - t0 )) s"
