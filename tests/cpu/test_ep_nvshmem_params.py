"""The NVSHMEM EP transport's host-side logic at every world size up to nvshmem_ep::kMaxRanks (64),
without a GPU or NVSHMEM: tests/cpp/ep_nvshmem_params_check.cc, built with the host compiler against
csrc/kernels/ep_nvshmem_params.hpp, checks the 64-bit rank sets the kernels use (every world 1..64,
every rank, against sets built bit by bit), the launchers' parameter check (every valid world
accepted, each bad field refused with a message naming the operation, the value and the valid
range) and the buffer layout (aligned, disjoint regions, each as large as its contents)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ep_nvshmem_params_at_every_world_size(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "ep_nvshmem_params_check"
    build = subprocess.run([cxx, "-std=c++20", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'include'}",
                            f"-I{ROOT / 'csrc'}", str(ROOT / "tests" / "cpp" / "ep_nvshmem_params_check.cc"),
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "OK\n"
