#!/usr/bin/env bash
# Call 1: build; pytest tests/gpu at world 1; world-1 A/B of bench/experiments/perf-ep-weights.patch
# (bench_ep.py --world 1, twice per build), then the EP test file at world 1 on the variant.
set -u
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=120
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -s KILL 120 $PY -m pytest tests/gpu -q -rs -p no:cacheprovider > "$OUT/w1.log" 2>&1
echo "w1 rc=$?"; tail -3 "$OUT/w1.log"
echo "at $(( $(date +%s) - t0 )) s"
bash bench/variant_ab.sh patch perf-ep-weights bench/experiments/perf-ep-weights.patch
TAIL=14 bash bench/variant_ab.sh run 'for i in 1 2; do $PY bench/bench_ep.py --world 1 --tokens 1,8,32,128 --out $OUT/ep-$VARIANT-$i.md; done; if [ $VARIANT != base ]; then timeout -s KILL 100 $PY -m pytest tests/gpu/test_ep_cuda.py -q -rs -p no:cacheprovider; fi' base perf-ep-weights
echo "total $(( $(date +%s) - t0 )) s"
