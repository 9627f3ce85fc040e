#!/usr/bin/env python3
"""Source checks of the project's standing rules (docs/architecture.md). `make test` runs this
before pytest; it reads files only (no build, no torch). Exit status 1 with one line per problem.

Each check is a function returning a list of problems; add new rules the same way.
`--root DIR` checks another tree (tests/cpu/test_lint.py plants violations in a copy).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = (".cc", ".cpp", ".cu", ".cuh", ".hpp", ".h")


def read(rel: str) -> str:
    path = ROOT / rel
    if not path.exists():
        raise LintError(f"{rel}: missing (a rule below names it; update tools/lint.py if it moved)")
    return path.read_text()


class LintError(Exception):
    pass


def sources(folder: str):
    return sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in SOURCE_SUFFIXES)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def check_all_reduce_path_is_multicast_free() -> list[str]:
    """docs/architecture.md, Safety: the all-reduce path never resolves or issues NVLink multicast."""
    files = [*ROOT.glob("csrc/core/cuda_*"), *ROOT.glob("csrc/transport/cuda_ipc*"), *ROOT.glob("csrc/transport/cuda_driver*"),
             *ROOT.glob("csrc/kernels/all_reduce*"), *ROOT.glob("include/commlib/device/*"),
             *ROOT.glob("include/commlib/symmetric_buffer.hpp")]
    problems = [] if len(files) >= 8 else [f"all-reduce path: only {len(files)} files found; the globs are stale"]
    for f in sorted(files):
        text = f.read_text()
        problems += [f"{rel(f)}: the all-reduce path mentions {word}" for word in ("cuMulticast", "multimem", "NVLS")
                     if word in text]
    return problems


def _function_body(text: str, signature: str) -> str:
    start = text.index(signature)
    open_brace = text.index("{", start + len(signature))
    depth, i = 0, open_brace
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_brace + 1:i]
        i += 1


def check_multicast_behind_the_guard() -> list[str]:
    """docs/architecture.md, Safety: one file creates multicast objects, and every way into it asks the guard first."""
    problems = []
    files = sources("csrc")
    creators = [rel(p) for p in files if "cuMulticastCreate(" in p.read_text()]
    if creators != ["csrc/transport/cuda_multicast.cc"]:
        problems.append(f"cuMulticastCreate( must appear only in csrc/transport/cuda_multicast.cc; found in {creators}")
    makers = [rel(p) for p in files if "new MulticastWorkspace" in p.read_text()]
    if makers != ["csrc/cuda/fused_cuda.cc"]:
        problems.append(f"multicast workspaces must be made only by csrc/cuda/fused_cuda.cc; found {makers}")
    multicast, stub = read("csrc/transport/cuda_multicast.cc"), read("csrc/cuda/cuda_comm_stub.cc")
    factory = read("csrc/cuda/fused_cuda.cc")
    for where, text, signature in [
            ("constructor", multicast, "MulticastWorkspace::MulticastWorkspace("),
            ("Communicator::multicast", factory, "MulticastWorkspace& Communicator::multicast("),
            ("stub Communicator::multicast", stub, "MulticastWorkspace& Communicator::multicast(")]:
        if signature not in text:
            problems.append(f"multicast {where}: `{signature}` not found (update tools/lint.py if it moved)")
            continue
        statements = [re.sub(r"^(//[^\n]*\n\s*)+", "", s.strip()) for s in _function_body(text, signature).split(";")]
        first = [s for s in statements if s][:2]
        # The first statement, or the second after check_open (no CUDA), is the guard.
        guarded = first and (first[0].startswith("require_multicast(") or (
            len(first) > 1 and first[0].startswith("check_open(") and first[1].startswith("require_multicast(")))
        if not guarded:
            problems.append(f"multicast {where}: must call require_multicast(...) first; starts with {first}")
    # The multicast entry points are resolved only in that file, never with the shared driver table.
    driver = read("csrc/transport/cuda_driver.cc") + read("csrc/transport/cuda_driver.hpp")
    if "Multicast" in driver:
        problems.append("csrc/transport/cuda_driver.{cc,hpp}: the shared driver table must not resolve multicast entry points")
    return problems


def check_design_lives_in_the_repo() -> list[str]:
    """docs/architecture.md is the design: nothing in the tree cites a design file outside it."""
    outside = re.compile(r"\b(?:DESIGN|STYLE|LAYOUT)\.md\b|\.\./shared/")
    files = [p for folder in ("csrc", "include", "python", "tests", "tools", "bench", "docs")
             for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (*SOURCE_SUFFIXES, ".py", ".md", ".sh")]
    files += [ROOT / name for name in ("README.md", "CMakeLists.txt", "Makefile", "setup.py") if (ROOT / name).exists()]
    return [f"{rel(p)}: cites a design file outside the repository ({m.group(0)}); cite docs/architecture.md"
            for p in files if p.name != "lint.py" for m in [outside.search(p.read_text(errors="replace"))] if m]


# Knobs: tests/cpu/test_knobs.py checks docs/knobs.md against csrc/common/env.cc.
CHECKS = [check_all_reduce_path_is_multicast_free, check_multicast_behind_the_guard, check_design_lives_in_the_repo]


def main(argv: list[str]) -> int:
    global ROOT
    if len(argv) == 2 and argv[0] == "--root":  # another tree (the lint's own test)
        ROOT = Path(argv[1]).resolve()
    elif argv:
        print("usage: tools/lint.py [--root DIR]", file=sys.stderr)
        return 2
    problems = []
    for check in CHECKS:
        try:
            problems += [f"{check.__name__}: {p}" for p in check()]
        except LintError as e:
            problems.append(f"{check.__name__}: {e}")
    for p in problems:
        print(f"lint: {p}", file=sys.stderr)
    print(f"lint: {len(CHECKS)} checks, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
