"""The one declaration of COMMLIB_* environment variables (csrc/common/env.cc) against the tree.

Reference: env.cc's table as tools/knobs_table.py parses it. Fails when docs/knobs.md is stale, when
the built extension's table differs from env.cc, when a COMMLIB_ name that the tree uses is neither
declared nor defined as a macro or CMake variable, and when a declared knob is used nowhere.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import knobs_table  # noqa: E402

NAME = re.compile(r"\bCOMMLIB_[A-Z0-9_]*[A-Z0-9]\b")  # a trailing "_" is a prefix in prose, not a name
CODE_SUFFIXES = {".py", ".cc", ".cpp", ".hpp", ".h", ".cu", ".cuh", ".c", ".sh", ".toml", ".cfg", ".ini",
                 ".yml", ".yaml", ".txt", ".cmake"}
CODE_NAMES = {"Makefile", "CMakeLists.txt", "setup.py"}
# How the tree defines names that are not environment variables: C/C++ macros, CMake variables and
# options, compile definitions (CMake, -D flags).
DEFINITIONS = [
    re.compile(r"#\s*define\s+(COMMLIB_[A-Z0-9_]+)"),
    re.compile(r"\b(?:set|option)\(\s*(COMMLIB_[A-Z0-9_]+)"),
    re.compile(r"\bfile\(\s*GLOB\s+(COMMLIB_[A-Z0-9_]+)"),
    re.compile(r"\bfind_library\(\s*(COMMLIB_[A-Z0-9_]+)"),
    re.compile(r"\b(?:add_compile_definitions|target_compile_definitions)\([^)]*?\b(COMMLIB_[A-Z0-9_]+)", re.S),
    re.compile(r"-D(COMMLIB_[A-Z0-9_]+)="),  # a CMake cache variable passed on the command line
]


def tracked_files() -> list[Path]:
    """The checkout's files: git's list, or (outside a git checkout) the tree without build outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        paths = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "build", ".build", ".venv", "__pycache__"}
        paths = [Path(d) / f for d, dirs, files in os.walk(ROOT) for f in files
                 if not (dirs.__setitem__(slice(None), [x for x in dirs if x not in skip]))]
    return [p for p in paths if p.is_file()]


def scanned(path: Path) -> str | None:
    """The text of a file whose COMMLIB_ names count: code, build files and docs/ (bench/results
    holds records of past runs, README.md links docs/knobs.md); None for the rest."""
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith("bench/results/") or rel == "docs/knobs.md":
        return None
    is_doc = rel.startswith("docs/") and path.suffix == ".md"
    if not (is_doc or path.suffix in CODE_SUFFIXES or path.name in CODE_NAMES):
        return None
    try:
        return path.read_text()
    except UnicodeDecodeError:
        return None


@pytest.fixture(scope="module")
def declared():
    return knobs_table.parse_env_cc(knobs_table.ENV_CC.read_text())


@pytest.fixture(scope="module")
def tree():
    texts = {}
    for path in tracked_files():
        text = scanned(path)
        if text is not None:
            texts[path.relative_to(ROOT).as_posix()] = text
    assert "csrc/common/env.cc" in texts and "CMakeLists.txt" in texts, "the scan missed the tree"
    return texts


def test_docs_knobs_md_is_current():
    # docs/knobs.md is exactly what tools/knobs_table.py writes from env.cc.
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "knobs_table.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    page = (ROOT / "docs" / "knobs.md").read_text()
    assert page == knobs_table.render(knobs_table.parse_env_cc(knobs_table.ENV_CC.read_text()))


def test_table_parses_every_entry(declared):
    # Every entry of env.cc parsed, once each, with a category and a meaning.
    text = knobs_table.ENV_CC.read_text()
    assert len(declared) == len(re.findall(r'^\s*\{"COMMLIB_', text, re.M))
    names = [d[0] for d in declared]
    assert len(names) == len(set(names)), "a knob is declared twice"
    for name, default, category, meaning in declared:
        assert NAME.fullmatch(name), name
        assert category in {"runtime", "tuning", "test-only", "build"}, (name, category)
        assert len(meaning) > 20, (name, meaning)


def test_built_extension_matches_env_cc(declared):
    # The table the library itself uses (commlib.knobs()) is env.cc's, in the same order.
    import commlib
    built = [(name, default) for name, default, _ in commlib.knobs()]
    assert built == [(d[0], d[1]) for d in declared], "rebuild the extension: it predates csrc/common/env.cc"


def test_every_name_used_is_declared(declared, tree):
    # A COMMLIB_ name in code, build files or docs/ is a declared knob or is defined by the tree
    # as a macro, CMake variable or compile definition.
    defined = {m.group(1) for text in tree.values() for pattern in DEFINITIONS for m in pattern.finditer(text)}
    names = {d[0] for d in declared}
    undeclared = {}
    for rel, text in tree.items():
        for m in NAME.finditer(text):
            name = m.group(0)
            if name not in names and name not in defined and not name.startswith("COMMLIB_LIB_"):
                undeclared.setdefault(name, rel)
    assert not undeclared, f"COMMLIB_ names used but not declared in csrc/common/env.cc: {undeclared}"


def test_every_declared_knob_is_used(declared, tree):
    # No declared knob is dead: each is read or set somewhere besides its declaration.
    unused = [name for name, *_ in declared
              if not any(re.search(rf"\b{name}\b", text) for rel, text in tree.items()
                         if rel != "csrc/common/env.cc" and not rel.startswith("docs/"))]
    assert not unused, f"declared in csrc/common/env.cc but used nowhere: {unused}"


def test_scan_sees_a_new_undeclared_name(tree, declared):
    # The check above can fail: a made-up name in a Python file is caught, a #define is not.
    names = {d[0] for d in declared}
    made_up, macro = "COMMLIB" + "_NOT_A_KNOB", "COMMLIB" + "_SOME_MACRO"  # spelt apart: this file is scanned too
    probe = {"x.py": f'os.environ.get("{made_up}")', "y.h": f"#define {macro} 1\n{macro}"}
    defined = {m.group(1) for text in probe.values() for pattern in DEFINITIONS for m in pattern.finditer(text)}
    found = {m.group(0) for text in probe.values() for m in NAME.finditer(text)} - names - defined
    assert found == {made_up}
