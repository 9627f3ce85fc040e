"""Builds tests/cpp/commlib_example (CMake target commlib_example) in the extension's CMake build
directory, which the extension build (setup.py, `make build`) left: only the example's own file
is compiled and linked against the layers already built."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_dir() -> Path | None:
    """The extension's CMake build directory: COMMLIB_BUILD_DIR, else build/cmake (or build/cmake-nocuda)."""
    candidates = [os.environ.get("COMMLIB_BUILD_DIR"), ROOT / "build" / "cmake", ROOT / "build" / "cmake-nocuda"]
    for c in candidates:
        if c and (Path(c) / "CMakeCache.txt").exists():
            return Path(c)
    return None


def build_example() -> Path:
    d = build_dir()
    if d is None:
        raise FileNotFoundError("no CMake build directory of the extension (run `make build` or setup.py first)")
    jobs = os.environ.get("MAX_JOBS", "2")
    result = subprocess.run(["cmake", "--build", str(d), "--target", "commlib_example", "-j", jobs],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building commlib_example failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return d / "commlib_example"
