#!/usr/bin/env bash
# The one device call of 2026-12-02 (only the 1-GPU kind was lent): build main; pytest tests/gpu at
# world 1; then, with both ranks on the one GPU (a protocol check, never a measurement), the EP,
# backend and memory-release files at world 2.
set -u
# Every NVLink multicast kill switch (DESIGN.md, Safety): adding one is always safe.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COMMLIB_DISABLE_MULTICAST=1
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=150
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() {  # name seconds pytest-args...
  local name=$1 secs=$2; shift 2
  local t=$(date +%s)
  timeout -s KILL "$secs" $PY -m pytest -q -rs -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t )) s"; tail -2 "$OUT/$name.log"
}
step w1 120 tests/gpu
export COMMLIB_TEST_SHARE_GPUS=1
step w2-ep 200 tests/gpu/test_ep_cuda.py -x
step w2-backend 120 tests/gpu/test_backend_gpu.py -x
step w2-memory 60 tests/gpu/test_memory_release.py
echo "total $(( $(date +%s) - t0 )) s"
