"""commlib-perf on 2 GPUs: ddacomm vs NCCL (and torch symmetric memory), eager and CUDA graph.

Reference: the CLI's own check (fp64 reference on fresh random data, #wrong must be 0). Timing is
not asserted. Runs the CLI as a subprocess (it starts its own processes).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def run_cli(*args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "commlib.perf", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("graph", [[], ["-G", "5"]], ids=["eager", "graph"])
def test_all_reduce_ddacomm_vs_nccl(tmp_path, graph):
    js = tmp_path / "r.json"
    r = run_cli("all_reduce", "-b", "1K", "-e", "4M", "-f", "16", "-n", "5", "-w", "2", "-np", "2",
                "-d", "bfloat16,float", "--device", "cuda", "--backend", "ddacomm", "nccl", "--json", str(js), *graph)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(js.read_text())
    assert data["wrong"] == 0 and data["meta"]["device"] == "cuda"
    nccl = [row for row in data["results"] if row["backend"] == "nccl"]
    assert nccl and all(row["ip"]["time_us"] > 0 and row["ip"]["wrong"] == 0 for row in nccl)
    dda = [row for row in data["results"] if row["backend"] == "ddacomm"]
    assert all(row["ip"].get("wrong", 0) == 0 for row in dda)


def test_all_collectives_with_symm(tmp_path):
    r = run_cli("all", "-b", "64K", "-e", "1M", "-f", "16", "-n", "3", "-w", "1", "-np", "2", "-d", "bfloat16",
                "--device", "cuda", "--backend", "ddacomm", "nccl", "symm")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# Out of bounds values : 0 OK" in r.stdout


def test_planted_wrong_result_on_gpu():
    r = run_cli("all_reduce", "-b", "4K", "-e", "4K", "-n", "2", "-w", "0", "-np", "2", "--device", "cuda",
                "--backend", "nccl", "--corrupt-rank", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED" in r.stdout
