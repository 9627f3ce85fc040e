#!/usr/bin/env bash
# Build; the more-ranks tests (all_reduce, fused, EP at world 3/4/8) with every rank on the one GPU.
set -u
export COMMLIB_TIMEOUT_MS=30000 COMMLIB_TEST_TIMEOUT_S=150 COMMLIB_TEST_SHARE_GPUS=1
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
timeout -s KILL ${W_S:-200} $PY -m pytest -v -rs -p no:cacheprovider --durations=10 \
  "tests/gpu/test_all_reduce.py::test_more_ranks[3]" "tests/gpu/test_fused_rmsnorm_gpu.py::test_fused_gpu_more_ranks[3]" \
  "tests/gpu/test_all_reduce.py::test_more_ranks[4]" "tests/gpu/test_fused_rmsnorm_gpu.py::test_fused_gpu_more_ranks[4]" \
  "tests/gpu/test_ep_cuda.py::test_more_ranks[4]" "tests/gpu/test_all_reduce.py::test_more_ranks[8]" \
  "tests/gpu/test_fused_rmsnorm_gpu.py::test_fused_gpu_more_ranks[8]" "tests/gpu/test_ep_cuda.py::test_more_ranks[8]" \
  > "$OUT/more.log" 2>&1
echo "rc=$? passed=$(grep -c PASSED "$OUT/more.log")"; grep -E "PASSED|FAILED|ERROR" "$OUT/more.log" | head -12; tail -25 "$OUT/more.log" | cut -c1-300
echo "total $(( $(date +%s) - t0 )) s"
