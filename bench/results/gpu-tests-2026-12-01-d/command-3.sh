#!/usr/bin/env bash
# Call 3 (same machine, built): call 2's -k "ll_" also matched "all_reduce", so it re-ran the
# all-reduce file from its start; these are the set-up and error tests it meant, by name, at
# world 2 with both ranks on the one GPU.
set -u
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=150 COMMLIB_TEST_SHARE_GPUS=1
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
f=tests/gpu/test_all_reduce.py
timeout -s KILL 240 $PY -m pytest -v -rs -p no:cacheprovider $f::test_symmetric_size_mismatch_is_an_error \
  $f::test_two_communicators_and_two_streams $f::test_symmetric_empty_zero_copy $f::test_non_default_device_ordering \
  $f::test_bad_inputs_raise_synchronously $f::test_device_wait_times_out_with_a_clear_error \
  $f::test_ll_wait_times_out_with_a_clear_error > "$OUT/w2-allreduce-setup.log" 2>&1
echo "rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/w2-allreduce-setup.log"
