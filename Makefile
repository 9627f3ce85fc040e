# The README's two commands. Both set everything up on a fresh machine (tools/setup.sh).
SHELL := /bin/bash
PY = $$(cat .build/python)
PYTEST_ARGS ?=

.PHONY: all build bench test test-gpu clean

all: test

build:
	@bash tools/setup.sh

# The main job: commlib beside the incumbent (gloo on CPU-only machines, NCCL with >= 2 GPUs).
bench: build
	$(PY) -m commlib.perf

# Source rules first (tools/lint.py: seconds, no build needed), then the tests.
test: build
	$(PY) tools/lint.py
	$(PY) -m pytest tests -q -rs $(PYTEST_ARGS)

# Only the GPU tests (on the GPU machine).
test-gpu: build
	$(PY) -m pytest tests -q -rs -m gpu $(PYTEST_ARGS)

clean:
	rm -rf build .build python/commlib/_C*.so python/commlib/libcommlib_nvshmem.so python/commlib/lib
