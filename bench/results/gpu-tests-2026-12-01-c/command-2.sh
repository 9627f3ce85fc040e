#!/usr/bin/env bash
# Call 2: the world-8 more-ranks tests (all_reduce, fused, EP) with all 8 ranks on the one GPU,
# progress printed by rank 0 (COMMLIB_TEST_PROGRESS), each test under its own limit.
set -u
export COMMLIB_TIMEOUT_MS=60000 COMMLIB_TEST_SHARE_GPUS=1 COMMLIB_TEST_PROGRESS=1
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
for t in ${TESTS:-"tests/gpu/test_all_reduce.py::test_more_ranks[8]" "tests/gpu/test_fused_rmsnorm_gpu.py::test_fused_gpu_more_ranks[8]" "tests/gpu/test_ep_cuda.py::test_more_ranks[8]"}; do
  name=$(echo "$t" | sed 's#.*/##; s#[^A-Za-z0-9_.-]#_#g')
  COMMLIB_TEST_TIMEOUT_S=${EACH_S:-150} timeout -s KILL $(( ${EACH_S:-150} + 20 )) $PY -m pytest -s -v -rs -p no:cacheprovider "$t" > "$OUT/$name.log" 2>&1
  echo "$t rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "PASSED|FAILED|Error|error" "$OUT/$name.log" | head -5 | cut -c1-300; grep "^\[" "$OUT/$name.log" | tail -2
done
echo "total $(( $(date +%s) - t0 )) s"
