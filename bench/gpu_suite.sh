#!/usr/bin/env bash
# One GPU-machine session in one command: build, then the named steps, each under its own time
# limit, logging to $OUT (default ./gpu-run). A step that fails or times out is reported and the
# next one still runs. Steps:
#   test:NAME[:SECONDS]     pytest tests/gpu/NAME.py
#   bench:NAME[:SECONDS]    a benchmark below, its markdown table written to $OUT/NAME.md
#                           (allreduce, fused, ep, ep-ll = ep at decode sizes with COMMLIB_EP_LL 0
#                           then 1, backend, profile = per-kernel times)
#   perf[:SECONDS]          commlib-perf all_reduce sample (ddacomm vs nccl vs symm, graph) + plot
#   ab:NAME[:SECONDS]       A/B of bench/experiments/NAME.patch against the tree (bench/variant_ab.sh):
#                           the benchmark the experiments README names for it, twice per build, then
#                           the patch's GPU test file on the variant
# Example:  bash bench/gpu_suite.sh test:test_all_reduce:240 bench:allreduce:120 ab:perf-ep-weights
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-run}
mkdir -p "$OUT"
# Every NVLink multicast kill switch, whatever the machine's environment holds (the 1-GPU kind
# was seen with none of them set): adding one is always safe (DESIGN.md, Safety).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COMMLIB_DISABLE_MULTICAST=1
export COMMLIB_TIMEOUT_MS=${COMMLIB_TIMEOUT_MS:-30000} COMMLIB_TEST_TIMEOUT_S=${COMMLIB_TEST_TIMEOUT_S:-240}
start=$(date +%s)
if ! MAX_JOBS=${MAX_JOBS:-16} make build >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
PY=$(cat .build/python)
echo "== built in $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2

# The A/B command of each patch in bench/experiments/ (see its README): benchmark, then tests.
ab_command() {
  case $1 in
    perf-fused-ll-early-loads)
      echo 'for i in 1 2; do $PY bench/bench_fused_rmsnorm.py --replays 10 --max-tokens 128 --sweep-tokens --ab-tokens --out $OUT/ab-$VARIANT-$i.md; done; [ $VARIANT = base ] || $PY -m pytest tests/gpu/test_fused_rmsnorm_gpu.py -q -x -rs' ;;
    perf-ep-weights)
      echo 'for i in 1 2; do COMMLIB_EP_LL=1 $PY bench/bench_ep.py --tokens 1,8,32,128 --out $OUT/ab-$VARIANT-$i.md; done; [ $VARIANT = base ] || COMMLIB_EP_LL=1 $PY -m pytest tests/gpu/test_ep_cuda.py -q -x -rs' ;;
    *) return 1 ;;
  esac
}

run_step() {  # name seconds command...
  local name=$1 secs=$2
  shift 2
  local t0=$(date +%s)
  timeout --signal=KILL "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
  tail -${TAIL:-6} "$OUT/$name.log"
}

for step in "$@"; do
  IFS=: read -r kind name secs <<<"$step"
  case $kind in
    test)
      run_step "$name" "${secs:-300}" "$PY" -m pytest "tests/gpu/$name.py" -q -x -rs --durations=8 ;;
    bench)
      case $name in
        allreduce) run_step bench-allreduce "${secs:-180}" "$PY" bench/gpu_all_reduce.py --out "$OUT/allreduce.md" ;;
        fused) run_step bench-fused "${secs:-180}" "$PY" bench/bench_fused_rmsnorm.py --replays 10 --sweep-tokens 1024 --out "$OUT/fused.md" ;;
        ep) run_step bench-ep "${secs:-180}" "$PY" bench/bench_ep.py --tokens 1,8,32,128,512,4096 --out "$OUT/ep.md" ;;
        ep-ll)
          for ll in 0 1; do
            COMMLIB_EP_LL=$ll run_step "bench-ep-ll$ll" "${secs:-120}" "$PY" bench/bench_ep.py --tokens 1,8,32,128 \
              --out "$OUT/ep-ll$ll.md"
          done ;;
        profile) run_step bench-profile "${secs:-180}" "$PY" bench/profile_kernels.py --out "$OUT/profile.md" ;;
        backend) run_step bench-backend "${secs:-120}" "$PY" -m torch.distributed.run --nproc_per_node 2 bench/bench_backend.py --out "$OUT/backend.md" ;;
        *) echo "unknown bench $name" ;;
      esac ;;
    perf)
      run_step perf "${name:-240}" "$PY" -m commlib.perf all_reduce -b 1K -e 256M -f 4 -n 20 -w 5 -G 10 -d bfloat16 \
        --backend ddacomm nccl symm --json "$OUT/perf.json" --plot "$OUT/perf.png" ;;
    ab)
      if cmd=$(ab_command "$name") && bash bench/variant_ab.sh patch "$name" "bench/experiments/$name.patch"; then
        OUT=$OUT TAIL=${TAIL:-14} run_step "ab-$name" "${secs:-400}" bash bench/variant_ab.sh run "$cmd" base "$name"
      else
        echo "== ab-$name: no A/B command or the patch does not apply"
      fi ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "== total $(( $(date +%s) - start )) s"
