"""The Python package's layers: product modules (everything in python/commlib outside perf/ and
models/) never import the benchmark (commlib.perf) or the reference models (commlib.models); those
two may import the product. Two references: a static scan of every import statement of every
product module, lazy ones inside functions included, and a fresh interpreter that imports every
product module and then finds neither package in sys.modules."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "commlib"
FORBIDDEN = ("commlib.perf", "commlib.models")
IMPORT_FUNCTIONS = ("import_module", "__import__")


def product_modules():
    """(dotted name, path) of every product module; ``__main__`` modules are left out of the import
    check (importing one runs it) but not out of the scan."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[1:2] in (("perf",), ("models",)):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def imported_names(module: str, path: Path):
    """Every module name ``path`` imports (absolute, relative ones resolved), with its line."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            yield target, node.lineno
            for alias in node.names:  # `from . import perf` imports the submodule commlib.perf
                yield f"{target}.{alias.name}", node.lineno
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in IMPORT_FUNCTIONS and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                name = node.args[0].value
                yield (".".join(package) + name if name.startswith(".") else name), node.lineno


def test_scan_resolves_relative_imports(tmp_path):
    """The scan itself: relative, absolute, from-import of a submodule and import_module all count."""
    pkg = tmp_path / "commlib"
    (pkg / "sub").mkdir(parents=True)
    src = pkg / "sub" / "mod.py"
    src.write_text("import os\nfrom ..perf import harness\ndef f():\n    from .. import models\n"
                   "    import commlib.perf.tune\n    importlib.import_module('commlib.models.llama')\n"
                   "from . import sibling\n")
    names = [n for n, _ in imported_names("commlib.sub.mod", src)]
    assert [n for n in names if _forbidden(n)] == ["commlib.perf", "commlib.perf.harness", "commlib.models",
                                                   "commlib.perf.tune", "commlib.models.llama"]
    assert "commlib.sub.sibling" in names and "os" in names


def test_scan_resolves_a_subpackage_init(tmp_path):
    """A subpackage's ``__init__`` (commlib.cp's): its relative imports start at the subpackage."""
    pkg = tmp_path / "commlib" / "sub"
    pkg.mkdir(parents=True)
    src = pkg / "__init__.py"
    src.write_text("from .ring import f\nfrom . import layout\ndef g():\n    from ..perf.tune import main\n"
                   "    from .. import models\n")
    names = [n for n, _ in imported_names("commlib.sub", src)]
    assert [n for n in names if _forbidden(n)] == ["commlib.perf.tune", "commlib.perf.tune.main", "commlib.models"]
    assert {"commlib.sub.ring", "commlib.sub.layout"} <= set(names)


def test_product_modules_do_not_import_perf_or_models():
    modules = list(product_modules())
    assert len(modules) >= 10 and ("commlib.tuned", PACKAGE / "tuned.py") in modules, modules
    # Subpackages are product modules too: every module of commlib.cp, its __init__ included.
    cp_modules = {name for name, _ in modules if name == "commlib.cp" or name.startswith("commlib.cp.")}
    assert cp_modules == {"commlib.cp"} | {f"commlib.cp.{p.stem}" for p in (PACKAGE / "cp").glob("*.py")
                                           if p.stem != "__init__"}, cp_modules
    assert len(cp_modules) > 1, cp_modules
    problems = [f"{path.relative_to(ROOT)}:{line}: imports {name}"
                for module, path in modules for name, line in imported_names(module, path) if _forbidden(name)]
    assert not problems, "product modules import the benchmark or the models:\n" + "\n".join(problems)


def test_importing_the_product_loads_neither_perf_nor_models():
    names = [m for m, path in product_modules() if path.name != "__main__.py"]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r})))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0 and "No module named 'commlib._C'" in r.stderr:
        pytest.skip("commlib._C is not built; run `make build`")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == "[]", f"importing the product modules loaded {r.stdout.strip()}"
