"""The build enforces DESIGN.md's layers: each layer's include root (CMake, commlib_layer_includes)
reaches its own folder and the ones below, so an upward include does not compile. Reference: the
layer table in docs/cpp.md; each case preprocesses one include with the compiler and that root."""
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
    ("commlib_transport", "transport/host_shm.hpp", "core/algorithm_selector.hpp"),
    ("commlib_transport", "bootstrap/bootstrap.hpp", "host/reduce.hpp"),
    ("commlib_bootstrap", "bootstrap/bootstrap.hpp", "transport/host_shm.hpp"),
    ("commlib_core", "transport/host_shm.hpp", "host/reduce.hpp"),
    ("commlib_core", "core/algorithm_selector.hpp", "torch/fused_ops.hpp"),
    ("commlib_host", "core/algorithm_selector.hpp", "torch/fused_ops.hpp"),
]


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
