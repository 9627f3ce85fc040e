#!/usr/bin/env bash
# A/B of source variants in one GPU-machine call, where the variants are other branches' versions of
# a few files (kernels without a knob). The device machine gets a copy of the working tree, not
# the git history, so the variants travel as plain files:
#
#   here:    bash bench/variant_ab.sh prepare BRANCH FILE...    # copies BRANCH's FILEs to variants/BRANCH/
#   device:  bash bench/variant_ab.sh run 'COMMAND' base BRANCH...
#
# or, from a committed patch (bench/experiments/NAME.patch, which outlives the branch), on either
# machine: bash bench/variant_ab.sh patch NAME bench/experiments/NAME.patch   # variants/NAME/
#
# `run` builds the tree as it is (base), then, for each BRANCH, lays variants/BRANCH/ over the
# tree, rebuilds (incremental: only the swapped files) and runs COMMAND again; every run's output
# goes to $OUT/variant-<name>.log (OUT defaults to ./gpu-run) and its last lines to stdout. The
# original files are put back at the end, also after a failure. COMMAND sees VARIANT=<name> and
# PY (the built python). Example:
#   bash bench/variant_ab.sh run '$PY bench/bench_ep.py --tokens 1,8,128 --out $OUT/ep-$VARIANT.md' base perf-ep-lead
set -u
cd "$(dirname "$0")/.."
mode=${1:-}
shift || true
case $mode in
  prepare)
    branch=$1
    shift
    for f in "$@"; do
      mkdir -p "variants/$branch/$(dirname "$f")"
      git show "$branch:$f" >"variants/$branch/$f" || exit 1
    done
    echo "variants/$branch: $*" ;;
  patch)
    name=$1 patchfile=$(realpath "$2")
    rm -rf "variants/$name"
    for f in $(sed -n 's#^+++ b/##p' "$patchfile"); do
      mkdir -p "variants/$name/$(dirname "$f")"
      cp "$f" "variants/$name/$f" || exit 1
    done
    # git apply outside any repository (a temporary copy) works like patch(1), which may be missing
    tmp=$(mktemp -d)
    cp -r "variants/$name/." "$tmp"
    (cd "$tmp" && git apply -p1 "$patchfile") || { rm -rf "$tmp"; exit 1; }
    cp -r "$tmp/." "variants/$name"
    rm -rf "$tmp"
    echo "variants/$name: $(sed -n 's#^+++ b/##p' "$patchfile" | tr '\n' ' ')" ;;
  run)
    cmd=$1
    shift
    OUT=${OUT:-$PWD/gpu-run}
    mkdir -p "$OUT" .variant-orig
    export OUT
    restore() { if [ -d .variant-orig ]; then cp -r .variant-orig/. . 2>/dev/null; rm -rf .variant-orig; fi; }
    trap restore EXIT
    for name in "$@"; do
      restore
      mkdir -p .variant-orig
      if [ "$name" != base ]; then
        [ -d "variants/$name" ] || { echo "no variants/$name (run prepare first)"; continue; }
        (cd "variants/$name" && find . -type f) | while read -r f; do
          mkdir -p ".variant-orig/$(dirname "$f")"
          cp "$f" ".variant-orig/$f"
          cp "variants/$name/$f" "$f"
        done
      fi
      if ! MAX_JOBS=${MAX_JOBS:-16} make build >"$OUT/variant-$name-build.log" 2>&1; then
        echo "== $name: build failed"
        tail -20 "$OUT/variant-$name-build.log"
        continue
      fi
      PY=$(cat .build/python) VARIANT=$name bash -c "$cmd" >"$OUT/variant-$name.log" 2>&1
      echo "== $name: rc=$?"
      tail -${TAIL:-12} "$OUT/variant-$name.log"
    done ;;
  *)
    sed -n 2,16p "$0"
    exit 2 ;;
esac
