"""The NCCL shim (docs/nccl.md): ``lib/libnccl.so.2`` beside this package exports NCCL's whole C API
and runs commlib underneath, so a program written for NCCL gets commlib without code changes::

    LD_AUDIT=$(python -m commlib.nccl --audit) torchrun ...   # only libnccl.so.2 is redirected
    LD_PRELOAD=$(python -m commlib.nccl --path) torchrun ...  # or VLLM_NCCL_SO_PATH=...
    python -m commlib.nccl --path     # the shim's file
    python -m commlib.nccl --check    # the real NCCL it forwards to, and what commlib serves

This module only finds and describes the library; loading it into a running torch process does
not replace the NCCL torch already loaded (use LD_PRELOAD at start-up).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parent / "lib" / "libnccl.so.2"
# The LD_AUDIT library that sends the loader's search for libnccl.so.2 to LIBRARY (Note [nccl shim audit]).
AUDIT_LIBRARY = LIBRARY.parent / "libcommlib_nccl_audit.so"


class UniqueId(ctypes.Structure):
    """ncclUniqueId (128 bytes, passed by value to ncclCommInitRank), for callers using ctypes."""
    _fields_ = [("internal", ctypes.c_char * 128)]


# nccl.h's ncclDataType_t and ncclRedOp_t codes, for callers using ctypes.
DATA_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6, "float32": 7,
              "float64": 8, "bfloat16": 9}
RED_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def library_path() -> Path:
    """The shim's file (it may not exist: a build without CUDA or without the nvidia-nccl wheel)."""
    return LIBRARY


def _version_text(code: int) -> str:
    if code <= 0:
        return "none"
    major, minor, patch = (code // 1000, code % 1000 // 100, code % 100) if code < 10000 else (
        code // 10000, code % 10000 // 100, code % 100)
    return f"{major}.{minor}.{patch}"


def info() -> dict[str, str]:
    """What the shim reports about itself (commlibNcclShimInfo): real_path, real_version,
    real_error, header_version, gpu_built, served. Loads the shim with ctypes; raises
    FileNotFoundError when it was not built."""
    if not LIBRARY.exists():
        raise FileNotFoundError(f"commlib.nccl: {LIBRARY} not built (it needs CUDA and the nvidia-nccl wheel's nccl.h; "
                                "rebuild commlib)")
    lib = ctypes.CDLL(str(LIBRARY))
    lib.commlibNcclShimInfo.restype = ctypes.c_char_p
    text = lib.commlibNcclShimInfo().decode()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.nccl", description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--path", action="store_true", help="print the shim's path (libnccl.so.2)")
    what.add_argument("--audit", action="store_true",
                      help="print the LD_AUDIT library's path (redirects only libnccl.so.2 to the shim)")
    what.add_argument("--check", action="store_true",
                      help="print the real NCCL the shim forwards to (path, version) and what commlib serves")
    args = parser.parse_args(argv)
    if not LIBRARY.exists():
        print(f"commlib.nccl: {LIBRARY} not built (it needs CUDA and the nvidia-nccl wheel's nccl.h)", file=sys.stderr)
        return 1
    if args.path:
        print(LIBRARY)
        return 0
    if args.audit:
        if not AUDIT_LIBRARY.exists():
            print(f"commlib.nccl: {AUDIT_LIBRARY} not built (rebuild commlib)", file=sys.stderr)
            return 1
        print(AUDIT_LIBRARY)
        return 0
    facts = info()
    real_version = int(facts.get("real_version", "0"))
    print(f"shim: {LIBRARY} (built against nccl.h {_version_text(int(facts.get('header_version', '0')))})")
    if AUDIT_LIBRARY.exists():
        print(f"LD_AUDIT library (redirects only libnccl.so.2 to the shim): {AUDIT_LIBRARY}")
    if facts.get("real_path"):
        print(f"real NCCL: {facts['real_path']} (version {_version_text(real_version)}, code {real_version})")
    else:
        print(f"real NCCL: not loadable ({facts.get('real_error', '')}); set COMMLIB_NCCL_REAL")
    print(f"commlib serves (one-host communicators with peer memory): {facts.get('served', '')}")
    print("everything else goes to the real NCCL" + ("" if facts.get("gpu_built") == "1" else
                                                    " (this build has no GPU paths: everything does)"))
    return 0 if facts.get("real_path") else 2


if __name__ == "__main__":
    sys.exit(main())
