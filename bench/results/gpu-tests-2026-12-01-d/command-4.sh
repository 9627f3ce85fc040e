#!/usr/bin/env bash
# Call 4 (a fresh machine): after the review mend 8ed06f8 (one FdMessage layout for sending and
# receiving descriptors; one place filling the fused kernels' shared params): build, pytest
# tests/gpu at world 1, then at world 2 with both ranks on the one GPU the tests that exchange
# descriptors (memory release, symmetric size mismatch, two communicators) and the fused op's GPU
# entry (the multimem refusal test, which then runs the P2P op against the unfused bits).
set -u
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=150
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COMMLIB_DISABLE_MULTICAST=1
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
timeout -s KILL 120 $PY -m pytest -q -rs -p no:cacheprovider tests/gpu > "$OUT/call4-w1.log" 2>&1
echo "w1 rc=$?"; tail -1 "$OUT/call4-w1.log"
f=tests/gpu/test_all_reduce.py
COMMLIB_TEST_SHARE_GPUS=1 timeout -s KILL 240 $PY -m pytest -v -rs -p no:cacheprovider tests/gpu/test_memory_release.py \
  $f::test_symmetric_size_mismatch_is_an_error $f::test_two_communicators_and_two_streams \
  tests/gpu/test_fused_rmsnorm_gpu.py -k "memory or mismatch or two_communicators or multimem_refused" \
  > "$OUT/call4-w2.log" 2>&1
echo "w2 rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/call4-w2.log"
echo "total $(( $(date +%s) - t0 )) s"
