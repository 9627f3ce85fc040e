"""The documentation stays true to the tree: every repository path a doc or results file names
exists, every Note cited is defined once and listed in docs/notes.md (tools/notes_index.py),
and every results table names the commit that produced it. Reads files only."""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import notes_index  # noqa: E402

DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("bench/**/*.md")])
# A path of the tree: it starts at one of the top-level folders.
PATH = re.compile(r"(?<![\w/.-])((?:csrc|include|python|tests|tools|bench|docs|\.ci)/[\w./{},*<>-]*[\w*}])")
LINK = re.compile(r"\]\(([^)#\s]+)")
PLACEHOLDER = re.compile(r"(?<![a-z])[A-Z]{2,}(?![a-z])")  # bench/results/OP.md, ops_NAME.py


def _expand(path: str) -> list:
    m = re.match(r"(.*)\{([^}]*)\}(.*)", path)
    return [m.group(1) + alt + m.group(3) for alt in m.group(2).split(",")] if m else [path]


def _missing_paths(doc: Path) -> list:
    text = doc.read_text()
    missing = []
    for m in PATH.finditer(text):
        if text[max(0, m.start() - 6):m.start()] == "--out ":  # what a command will write
            continue
        for path in _expand(m.group(1)):
            if PLACEHOLDER.search(Path(path).name) or "<" in path:
                continue
            found = list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
            if not found:
                missing.append(path)
    outside_code = re.sub(r"```.*?```", "", text, flags=re.S)
    missing += [f"link {t}" for t in LINK.findall(outside_code)
                if not t.startswith(("http://", "https://", "mailto:")) and not (doc.parent / t).exists()]
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_named_path_exists(doc):
    assert not _missing_paths(doc), f"{doc.relative_to(ROOT)} names paths that do not exist: {_missing_paths(doc)}"


def test_notes_are_defined_once_and_indexed():
    problems = notes_index.problems()
    definitions, _ = notes_index.scan()
    if (ROOT / "docs" / "notes.md").read_text() != notes_index.render(definitions):
        problems.append("docs/notes.md is stale: run python tools/notes_index.py")
    assert not problems, "\n".join(problems)


COMMIT = re.compile(r"commit[:s]?\s+`?[0-9a-f]{7,40}|merged in [0-9a-f]{7,40}|commits? [0-9a-f]{7,40}")


@pytest.mark.parametrize("results", sorted(ROOT.glob("bench/results/*.md")), ids=lambda p: p.name)
def test_every_results_table_names_its_commit(results):
    """Each section of a results file (the part before the first `## ` heading, and each `## `
    section) that holds a table names the commit that produced it."""
    sections = re.split(r"^## ", results.read_text(), flags=re.M)
    for section in sections:
        has_table = re.search(r"^\|.*\|[ ]*$|^#[ ]{2,}\S", section, flags=re.M)
        if has_table:
            heading = section.splitlines()[0] if section else ""
            assert COMMIT.search(section), f"{results.name}: section '{heading}' has a table but names no commit"
