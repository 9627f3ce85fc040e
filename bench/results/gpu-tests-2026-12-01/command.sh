MAX_JOBS=16 make build >$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
PY=$(cat .build/python); export COMMLIB_TIMEOUT_MS=20000 COMMLIB_TEST_TIMEOUT_S=200
S=$(date +%s); echo "built $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t() { local n=$1 s=$2; shift 2; local t0=$(date +%s); timeout -s KILL $s "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $(( $(date +%s)-t0 ))s"; tail -5 $OUT/$n.log; }
F=tests/gpu/test_ep_cuda.py
mapfile -t W1 < <($PY -m pytest --collect-only -q $F 2>/dev/null | grep -E '(\[1\]|-1\])$')
mapfile -t W2 < <($PY -m pytest --collect-only -q $F 2>/dev/null | grep -E '(\[2\]|-2\])$|dead_peer')
t w1 170 $PY -m pytest -q -x -rs --durations=5 "${W1[@]}"
COMMLIB_TEST_SHARE_GPUS=1 t w2 250 $PY -m pytest -q -rs --durations=20 $(printf '%s\n' "${W2[@]}" | grep ll_) $(printf '%s\n' "${W2[@]}" | grep back_to_back) $(printf '%s\n' "${W2[@]}" | grep -v -e ll_ -e back_to_back)
for ll in 0 1; do COMMLIB_EP_LL=$ll t bench$ll 45 $PY bench/bench_ep.py --world 1 --tokens 1,32,128 --out $OUT/ep-w1-ll$ll.md; done
echo "end $(date -u +%FT%TZ)"
