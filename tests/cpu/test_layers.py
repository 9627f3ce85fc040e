"""The build enforces the layers of docs/architecture.md twice: each layer's include root (CMake,
commlib_layer_includes) reaches its own folder and the ones below, so an upward include does not
compile (each case preprocesses one include with the compiler and that root); and each layer's
static library needs no symbol that only a layer above it (or its sibling engine) defines (nm over
the libraries the build left)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "cpp"))
from cpp_example_build import build_dir  # noqa: E402

# (target, a header of a layer below or its own, a header of a layer above)
CASES = [
    ("commlib_common", "common/multicast_guard.hpp", "transport/host_shm.hpp"),
    ("commlib_transport", "transport/host_shm.hpp", "core/algorithm_selector.hpp"),
    ("commlib_transport", "bootstrap/bootstrap.hpp", "host/reduce.hpp"),
    ("commlib_bootstrap", "bootstrap/bootstrap.hpp", "transport/host_shm.hpp"),
    ("commlib_core", "transport/host_shm.hpp", "host/reduce.hpp"),
    ("commlib_core", "core/algorithm_selector.hpp", "torch/fused_ops.hpp"),
    ("commlib_host", "core/algorithm_selector.hpp", "torch/fused_ops.hpp"),
    ("commlib_host", "transport/host_shm.hpp", "cuda/cuda_comm.hpp"),
    ("commlib_cuda", "core/algorithm_selector.hpp", "host/reduce.hpp"),
    ("commlib_core", "core/algorithm_selector.hpp", "cuda/cuda_comm.hpp"),
]

# Each layer and the layers it may use (docs/architecture.md); cuda and host are sibling engines.
BELOW = {
    "common": [],
    "kernels": ["common"],
    "bootstrap": ["common"],
    "transport": ["bootstrap", "common"],
    "core": ["transport", "kernels", "bootstrap", "common"],
    "cuda": ["core", "transport", "kernels", "bootstrap", "common"],
    "host": ["core", "transport", "bootstrap", "common"],
}


def _preprocess(root: Path, header: str) -> subprocess.CompletedProcess:
    compiler = shutil.which("c++") or shutil.which("g++")
    return subprocess.run([compiler, "-std=c++20", "-E", "-x", "c++", "-", f"-I{ROOT / 'include'}", f"-I{root}",
                           "-o", "/dev/null"], input=f'#include "{header}"\n', capture_output=True, text=True)


@pytest.mark.parametrize("target,allowed,forbidden", CASES)
def test_upward_include_does_not_compile(target, allowed, forbidden):
    d = build_dir()
    if d is None or not (d / "layers" / target).exists():
        pytest.skip("no CMake build directory with layer include roots; run `make build`")
    root = d / "layers" / target
    ok = _preprocess(root, allowed)
    assert ok.returncode == 0, ok.stderr
    bad = _preprocess(root, forbidden)
    assert bad.returncode != 0 and "No such file" in bad.stderr, bad.stderr


def _symbols(lib: Path, *flags: str) -> set[str]:
    out = subprocess.run(["nm", "-P", *flags, str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line and not line.endswith(":")}


def test_no_layer_needs_a_symbol_from_above():
    d = build_dir()
    libs = {layer: d / f"libcommlib_{layer}.a" for layer in BELOW} if d else {}
    if not libs or not all(p.exists() for layer, p in libs.items() if layer != "kernels"):
        pytest.skip("no CMake build directory with the layers' libraries; run `make build`")
    if shutil.which("nm") is None:
        pytest.skip("nm not installed")
    libs = {layer: p for layer, p in libs.items() if p.exists()}  # no kernels without CUDA
    defined = {layer: _symbols(p, "--defined-only") for layer, p in libs.items()}
    problems = []
    for layer, lib in libs.items():
        reachable = set().union(defined[layer], *(defined[b] for b in BELOW[layer] if b in defined))
        above = set().union(*(defined[o] for o in libs if o != layer and o not in BELOW[layer]))
        wrong = sorted((_symbols(lib, "--undefined-only") - reachable) & above)
        problems += [f"{layer} needs {sym}" for sym in wrong]
    assert not problems, "\n".join(problems[:20])
