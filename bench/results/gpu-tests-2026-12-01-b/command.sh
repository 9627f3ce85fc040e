#!/usr/bin/env bash
# Build, then the GPU suite at world 1, then the world-2 tests with both ranks on the one GPU.
set -u
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=240
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -s KILL 150 $PY -m pytest tests/gpu -q -rs -p no:cacheprovider > "$OUT/w1.log" 2>&1; echo "w1 rc=$?"; tail -3 "$OUT/w1.log"
COMMLIB_TEST_SHARE_GPUS=1 timeout -s KILL ${W2_S:-330} $PY -m pytest tests/gpu/test_all_reduce.py tests/gpu/test_fused_rmsnorm_gpu.py tests/gpu/test_backend_gpu.py \
  -q -rs -p no:cacheprovider --durations=10 > "$OUT/w2.log" 2>&1; echo "w2 rc=$?"; tail -16 "$OUT/w2.log"
echo "total $(( $(date +%s) - t0 )) s"
