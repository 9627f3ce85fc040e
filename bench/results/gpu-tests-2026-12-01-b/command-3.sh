#!/usr/bin/env bash
# Build; the world-2 tests neither earlier call reached (ids-3.txt), both ranks on the one GPU; then
# the world-1 A/B of perf-ll-early-loads (bench/probes/barrier_w1.py, base then the variant, which
# also runs five LL tests at shared-GPU world 2).
set -u
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=120 COMMLIB_TEST_SHARE_GPUS=1
D=bench/results/gpu-tests-2026-12-01-b
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
timeout -s KILL ${W2_S:-260} $PY -m pytest $(cat $D/ids-3.txt) -v -rs -p no:cacheprovider --durations=12 > "$OUT/w2.log" 2>&1
echo "w2 rc=$? passed=$(grep -c PASSED "$OUT/w2.log")"; grep -E "FAILED|ERROR|SKIPPED" "$OUT/w2.log" | head -12; tail -3 "$OUT/w2.log"
echo "at $(( $(date +%s) - t0 )) s"
LL_TESTS="tests/gpu/test_all_reduce.py::test_ll_matches_ordered_reference_and_tree[bfloat16-sum] tests/gpu/test_all_reduce.py::test_ll_random_sizes tests/gpu/test_all_reduce.py::test_ll_cuda_graph_1000_replays[flat] tests/gpu/test_all_reduce.py::test_cuda_graph_replays_with_pdl[ll] tests/gpu/test_all_reduce.py::test_ll_wait_times_out_with_a_clear_error"
export LL_TESTS
bash bench/variant_ab.sh run 'for i in 1 2; do $PY bench/probes/barrier_w1.py; done; if [ $VARIANT != base ]; then timeout -s KILL 150 $PY -m pytest $LL_TESTS -q -rs -p no:cacheprovider; fi' base perf-ll-early-loads
echo "total $(( $(date +%s) - t0 )) s"
