"""device::FastDiv, the multiply-and-shift division the KV copy and the attention-state merge use
for row indices below 2^31: tests/cpp/fast_div_check.cc, built with the host compiler against
include/commlib/device/fast_div.cuh (the same arithmetic as on the GPU, __umulhi spelled out),
compares it with n / d over every divisor up to 4096, powers of two and their neighbours, large
primes and 2^31, at the numerators around multiples of d, the top of the range and random ones."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_fast_div_matches_division(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "fast_div_check"
    build = subprocess.run([cxx, "-std=c++20", "-O2", "-Wall", "-Wextra", "-Werror", "-x", "c++",
                            f"-I{ROOT / 'include'}", str(ROOT / "tests" / "cpp" / "fast_div_check.cc"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "OK\n", result.stdout[-2000:] + result.stderr[-2000:]
