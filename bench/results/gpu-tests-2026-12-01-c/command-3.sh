#!/usr/bin/env bash
# Call 3: the EP world-8 LL "basic" cases alone (the part of test_more_ranks[8] that failed in call 2),
# all 8 ranks on the one GPU, with the test pool's error reporting fixed to show the failing rank.
set -u
export COMMLIB_TIMEOUT_MS=60000 COMMLIB_TEST_SHARE_GPUS=1 COMMLIB_TEST_PROGRESS=1
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
(while sleep 5; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; done) > "$OUT/smi.log" 2>&1 &
cd tests && timeout -s KILL ${LIMIT_S:-240} $PY ../bench/results/gpu-tests-2026-12-01-c/ep_ll_w8.py 8 > "$OUT/ep-ll-w8.log" 2>&1
echo "rc=$? at $(( $(date +%s) - t0 )) s"; grep -v "^\[" "$OUT/ep-ll-w8.log" | head -60 | cut -c1-400; grep "^\[" "$OUT/ep-ll-w8.log" | tail -3
sort -n "$OUT/smi.log" | tail -2
