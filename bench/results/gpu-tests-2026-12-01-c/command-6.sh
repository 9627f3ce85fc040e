#!/usr/bin/env bash
# Call 7: the fused op at world 1 (one H200: phase B only, no peers), an SM sweep at 1024 and 4096
# tokens, to see how much of the world-2 time with few SMs is local work.
set -u
t0=$(date +%s)
MAX_JOBS=16 make build > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
PY=$(cat .build/python)
echo "built in $(( $(date +%s) - t0 )) s"
timeout -s KILL 400 $PY bench/bench_fused_rmsnorm.py --world-size 1 --replays 10 --max-tokens 4096 \
  --sweep-tokens 1024 4096 --sweep-sms 4 8 16 32 64 132 --sweep-modes replicated --ab-tokens \
  --out "$OUT/fused-w1-sweep.md" > "$OUT/fused-w1.log" 2>&1
echo "rc=$?"; tail -40 "$OUT/fused-w1.log"
echo "total $(( $(date +%s) - t0 )) s"
