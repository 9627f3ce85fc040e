"""Builds a C++ check program of tests/cpp with the host compiler (no GPU, no CUDA toolkit: the
headers it tests are host-compilable) and runs it; the program prints OK or the first problem."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_host_check(name: str, tmp_path: Path, includes=("include",)) -> None:
    """Compiles tests/cpp/<name>.cc (-Werror, the repository's `includes`) and asserts it prints OK."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / name
    build = subprocess.run([cxx, "-std=c++20", "-O2", "-Wall", "-Wextra", "-Werror", "-x", "c++",
                            *(f"-I{ROOT / d}" for d in includes), str(ROOT / "tests" / "cpp" / f"{name}.cc"),
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "OK\n", result.stdout[-2000:] + result.stderr[-2000:]
