#!/usr/bin/env bash
# Prepares a Python with torch and builds commlib into it; writes its path to .build/python.
#  - If the machine's python3 already has torch >= 2.11 (the GPU machine: offline, torch
#    preinstalled), use it and fetch nothing.
#  - Otherwise create .venv and install the pinned requirements (requirements.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .build
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
# torch runs commlib's entry point at `import torch`; an install whose entry points are stale must
# not stop its own rebuild (Note [lazy registration]).
export TORCH_DEVICE_BACKEND_AUTOLOAD=0

has_torch() {
  "$1" - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
}

if [ -x .venv/bin/python ] && has_torch .venv/bin/python; then
  PY=$(pwd)/.venv/bin/python
elif has_torch "$(command -v python3)"; then
  PY=$(command -v python3)
else
  echo "== creating .venv and installing requirements.txt (first run only)"
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  PY=$(pwd)/.venv/bin/python
fi
echo "$PY" > .build/python

# pytest, numpy, cmake and ninja: on the GPU machine they come with the image.
if ! "$PY" -c "import pytest, numpy" 2>/dev/null; then
  "$PY" -m pip install -q -r requirements.txt
fi
if ! command -v cmake >/dev/null && [ -x "$(dirname "$PY")/cmake" ]; then export PATH="$(dirname "$PY"):$PATH"; fi
export PATH="$(dirname "$PY"):$PATH"

echo "== building commlib with $PY ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
# --no-build-isolation: build against the torch already installed; --no-index: never fetch.
if ! "$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e . >.build/pip.log 2>&1; then
  # Older setuptools or an offline pip that cannot do an editable install: build in place and put
  # python/ on the path with a .pth file.
  grep -v "^WARNING: Location" .build/pip.log | tail -5 || true
  echo "== editable install failed; building in place"
  "$PY" setup.py -q build_ext --inplace
  site=$("$PY" -c "import site; print(site.getsitepackages()[0])")
  echo "$(pwd)/python" > "$site/commlib-inplace.pth"
fi
"$PY" -c "import commlib; print('== commlib', commlib.__version__, 'cuda build:', commlib._C.built_with_cuda)"
