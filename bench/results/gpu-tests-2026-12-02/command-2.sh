#!/usr/bin/env bash
# Call 2 (after f0253e0, the test-only jitter knob in the CPU shared-memory transport): build;
# pytest tests/gpu at world 1; the new CPU sequence test on this 16-core machine.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COMMLIB_DISABLE_MULTICAST=1
export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=150
t0=$(date +%s)
git log --oneline -1 2>/dev/null
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
step() {  # name seconds pytest-args...
  local name=$1 secs=$2; shift 2
  local t=$(date +%s)
  timeout -s KILL "$secs" $PY -m pytest -q -rs -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t )) s"; tail -2 "$OUT/$name.log"
}
step w1 120 tests/gpu
step cpu-sequences 200 tests/cpu/test_host_sequences.py
echo "total $(( $(date +%s) - t0 )) s"
