"""The C++ API without Python: tests/cpp/commlib_example.cc drives all_reduce, fused all-reduce +
RMSNorm and EP dispatch / combine on CPU through include/commlib only, ranks as threads sharing an
in-memory Store; it checks each result against an fp64 reference itself (poisoned outputs,
rank-dependent non-zero inputs) and exits non-zero with the failing check on any mismatch."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpp"))
from cpp_example_build import build_dir, build_example  # noqa: E402


@pytest.fixture(scope="module")
def example():
    if build_dir() is None:
        pytest.skip("no CMake build directory of the extension (an installed wheel); run `make build`")
    return build_example()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_cpp_example_cpu(example, world_size):
    result = subprocess.run([str(example), "--world", str(world_size)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"OK world {world_size}: all_reduce, fused_allreduce_rmsnorm, ep dispatch/combine")


def test_cpp_example_rejects_bad_usage(example):
    result = subprocess.run([str(example), "--bogus"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage" in result.stderr
