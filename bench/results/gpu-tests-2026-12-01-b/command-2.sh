#!/usr/bin/env bash
# Build, then the world-2 tests the first call did not reach (ids-2.txt: fused; ids-3.txt: the rest), both ranks on the one GPU.
set -u
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=240 COMMLIB_TEST_SHARE_GPUS=1
D=bench/results/gpu-tests-2026-12-01-b
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
timeout -s KILL ${W2_S:-480} $PY -m pytest $(cat $D/${IDS:-ids-2.txt}) -v -rs -p no:cacheprovider --durations=12 > "$OUT/w2.log" 2>&1
echo "w2 rc=$?"; grep -c PASSED "$OUT/w2.log"; grep -E "FAILED|ERROR" "$OUT/w2.log" | head; tail -20 "$OUT/w2.log"
echo "total $(( $(date +%s) - t0 )) s"
