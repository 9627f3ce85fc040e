#!/usr/bin/env bash
# Call 6: the new GPU memory-release test at world 1 and (both ranks on the one GPU) world 2; then the
# same test with a planted leak (every cycle's communicator kept alive, never closed), which must fail.
set -u
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=200
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
COMMLIB_TEST_SHARE_GPUS=1 timeout -s KILL 240 $PY -m pytest tests/gpu/test_memory_release.py -v -rs -p no:cacheprovider > "$OUT/memory.log" 2>&1
echo "memory rc=$?"; grep -E "PASSED|FAILED|SKIPPED|Error|MiB" "$OUT/memory.log" | head -10 | cut -c1-300
sed -e 's/^def _use_everything(ctx, cycle: int) -> int:/KEPT = []\n\n\ndef _use_everything(ctx, cycle: int) -> int:/' \
    -e 's/^    if cycle % 2 == 0:$/    KEPT.append(comm)\n    if False:/' tests/gpu/test_memory_release.py > tests/gpu/test_memory_release_planted_leak.py
grep -n "KEPT\|if False" tests/gpu/test_memory_release_planted_leak.py
timeout -s KILL 120 $PY -m pytest "tests/gpu/test_memory_release_planted_leak.py::test_gpu_memory_released_on_close_and_drop[1]" -q -rs -p no:cacheprovider > "$OUT/leak.log" 2>&1
echo "planted leak rc=$? (1 expected)"; grep -E "MiB not released|passed|failed" "$OUT/leak.log" | head -4 | cut -c1-300
rm -f tests/gpu/test_memory_release_planted_leak.py
echo "total $(( $(date +%s) - t0 )) s"
