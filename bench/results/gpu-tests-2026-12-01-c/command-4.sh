#!/usr/bin/env bash
# Call 4: the EP world-8 more-ranks test again, after the test gives cached GPU memory back
set -u
export COMMLIB_TIMEOUT_MS=60000 COMMLIB_TEST_SHARE_GPUS=1 COMMLIB_TEST_PROGRESS=1
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
(while sleep 5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader; done) > "$OUT/smi.log" 2>&1 &
for t in ${TESTS:-"tests/gpu/test_ep_cuda.py::test_more_ranks[8]"}; do
  name=$(echo "$t" | sed 's#.*/##; s#[^A-Za-z0-9_.-]#_#g')
  COMMLIB_TEST_TIMEOUT_S=${EACH_S:-150} timeout -s KILL $(( ${EACH_S:-150} + 20 )) $PY -m pytest -s -v -rs -p no:cacheprovider "$t" > "$OUT/$name.log" 2>&1
  echo "$t rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "PASSED|FAILED|Error|error" "$OUT/$name.log" | head -5 | cut -c1-300; grep "^\[" "$OUT/$name.log" | tail -2
done
echo "total $(( $(date +%s) - t0 )) s"
sort -n "$OUT/smi.log" | tail -1
