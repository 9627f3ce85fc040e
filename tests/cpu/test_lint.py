"""tools/lint.py: the checked-out tree passes, and each rule catches a violation planted in a copy."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def lint(root):
    return subprocess.run([sys.executable, str(ROOT / "tools/lint.py"), "--root", str(root)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path):
    for folder in ("csrc", "include"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    return tmp_path


def test_tree_passes():
    run = lint(ROOT)
    assert run.returncode == 0, run.stderr


def _append(path, text):
    path.write_text(path.read_text() + text)


@pytest.mark.parametrize("plant, expect", [
    (lambda t: _append(next(t.glob("csrc/kernels/all_reduce*")), "\n// multimem\n"),
     "the all-reduce path mentions multimem"),
    (lambda t: _append(t / "csrc/core/communicator.cc", "\n// cuMulticastCreate(\n"),
     "cuMulticastCreate( must appear only in csrc/transport/cuda_multicast.cc"),
    (lambda t: (t / "csrc/cuda/cuda_comm_stub.cc").write_text(
        (t / "csrc/cuda/cuda_comm_stub.cc").read_text().replace("require_multicast(", "other_call(", 1)),
     "multicast stub Communicator::multicast: must call require_multicast(...) first"),
], ids=["multimem-in-all-reduce", "second-multicast-creator", "unguarded-factory"])
def test_rule_catches_violation(tree, plant, expect):
    plant(tree)
    run = lint(tree)
    assert run.returncode == 1 and expect in run.stderr, run.stderr
