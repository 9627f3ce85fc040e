#!/usr/bin/env bash
# Call 2 (same machine, built): with both ranks on the one GPU, the fused file's multimem refusal,
# bad-input and dead-peer tests at world 2 (call 1's limit stopped the file before them), then the
# all-reduce tests of set-up (symmetric allocations and their size mismatch, two communicators), errors and the LL kernel.
set -u
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=150 COMMLIB_TEST_SHARE_GPUS=1
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
step() {  # name seconds pytest-args...
  local name=$1 secs=$2; shift 2
  local t=$(date +%s)
  timeout -s KILL "$secs" $PY -m pytest -q -rs -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t )) s"; tail -2 "$OUT/$name.log"
}
step w2-fused-multimem 200 tests/gpu/test_fused_rmsnorm_gpu.py -k "multimem or bad_inputs or dead_peer"
step w2-allreduce-rest 220 tests/gpu/test_all_reduce.py -k "symmetric or two_communicators or non_default or bad_inputs or times_out or ll_ or flat_without"
echo "total $(( $(date +%s) - t0 )) s"
