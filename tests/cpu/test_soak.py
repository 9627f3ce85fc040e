"""The soak module (python -m commlib.perf.soak, Note [soak]) runs and checks what it claims, at a
few steps: random op sequences at worlds 2 and 3 (every result compared with its reference; a
mismatch ends the run with rc != 0), create / use / destroy cycles with nothing left behind, and
the same random sequences with the tensors on GPUs (ranks sharing one when
COMMLIB_TEST_SHARE_GPUS is set). The long runs are bench/results/soak.md's, not CI's.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_soak(*args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "commlib.perf.soak", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def table(stdout: str) -> list:
    return [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines() if line.startswith("| ")]


def check_sequences(r, worlds, steps):
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table(r.stdout)
    assert [int(row[0]) for row in rows] == worlds, r.stdout
    for row in rows:
        counts = dict(item.rsplit(" ", 1) for item in row[3].split(", "))
        assert int(row[1]) == steps and sum(map(int, counts.values())) == steps, row
        assert {"all_reduce", "all_gather", "broadcast"} <= set(counts), row  # several kinds of op drawn
        assert row[4].startswith("every result checked"), row


def test_random_sequences_cpu(tmp_path):
    out = tmp_path / "soak.md"
    out.write_text("# Soak\n\n## Kept section\n\nuntouched\n")
    r = run_soak("--sequences", "40", "--world", "2,3", "--seed", "5", "--out", str(out))
    check_sequences(r, [2, 3], 40)
    text = out.read_text()
    assert "## Kept section\n\nuntouched" in text and "## Random op sequences (cpu)" in text
    assert "--sequences 40 --world 2,3 --seed 5" in text
    assert text.count("| 2 | 40 |") == 1 and text.count("| 3 | 40 |") == 1, text  # rewritten per world, not appended


def test_cycles_cpu_leave_nothing():
    r = run_soak("--cycles", "20", "--world", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = table(r.stdout)
    world, cycles, _, shm, fds = row[:5]
    assert (world, cycles) == ("2", "20")
    before, after = shm.split(" → ")
    assert before == after, row
    before, after = fds.split(" → ")
    assert before == after, row
    assert len(row[5].split(" → ")) == 3 and row[7] == "-", row  # RSS at start, half, end; no device on CPU


@pytest.mark.gpu
def test_cycles_cuda_leave_nothing():
    """Communicators with an EPBuffer made, used, dropped and closed on the GPU (the buffer dropped
    right after its combine is enqueued): nothing faults, and shared memory, descriptors, torch's
    GPU bytes and the device's used memory (the soak's rc) come back."""
    r = run_soak("--cycles", "30", "--world", "2", "--device", "cuda", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = table(r.stdout)
    assert row[:2] == ["2", "30"], row
    before, after = row[6].split(" → ")
    assert before == after, row


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_random_sequences_cuda(world_size):
    r = run_soak("--sequences", "60", "--world", str(world_size), "--device", "cuda", "--seed", "3", timeout=600)
    check_sequences(r, [world_size], 60)


def test_results_sections_rewritten_in_place(tmp_path):
    """--out rewrites its own section of the results file and keeps the others, each section set off
    by a blank line (a rewritten first section once ran into the next header)."""
    from commlib.perf.soak import _write_section
    path = str(tmp_path / "soak.md")
    _write_section(path, "A", "## A\n\nfirst\n")
    _write_section(path, "B", "## B\n\nsecond\n")
    _write_section(path, "A", "## A\n\nfirst, again\n")
    text = open(path).read()
    assert text.endswith("## A\n\nfirst, again\n\n## B\n\nsecond\n"), text
    _write_section(path, "B", "## B\n\nsecond, again\n")
    assert open(path).read().endswith("## A\n\nfirst, again\n\n## B\n\nsecond, again\n")
