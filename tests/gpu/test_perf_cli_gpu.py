"""commlib-perf on GPUs: ddacomm vs NCCL (and torch symmetric memory, the torch backend), eager and
CUDA graph, at world 1 (one GPU) and 2.

Reference: the CLI's own check (fp64 reference on fresh random data, #wrong must be 0). Timing is
not asserted. Runs the CLI as a subprocess (it starts its own processes, one per GPU: marked
``nccl``, so skipped when COMMLIB_TEST_SHARE_GPUS would put two ranks on one GPU).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.nccl]
WORLDS = [1, 2]


def run_cli(*args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "commlib.perf", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("graph", [[], ["-G", "5"]], ids=["eager", "graph"])
def test_all_reduce_ddacomm_vs_nccl(tmp_path, graph, world_size):
    js = tmp_path / "r.json"
    r = run_cli("all_reduce", "-b", "1K", "-e", "4M", "-f", "16", "-n", "5", "-w", "2", "-np", str(world_size),
                "-d", "bfloat16,float", "--device", "cuda", "--backend", "ddacomm", "nccl", "--json", str(js), *graph)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(js.read_text())
    assert data["wrong"] == 0 and data["meta"]["device"] == "cuda"
    nccl = [row for row in data["results"] if row["backend"] == "nccl"]
    assert nccl and all(row["ip"]["time_us"] > 0 and row["ip"]["wrong"] == 0 for row in nccl)
    dda = [row for row in data["results"] if row["backend"] == "ddacomm"]
    assert all(row["ip"].get("wrong", 0) == 0 for row in dda)


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("graph", [[], ["-G", "5"]], ids=["eager", "graph"])
def test_results_file_with_the_torch_backend(tmp_path, graph, world_size):
    """--out on GPU (bench/results/backend.md's command, small): the torch "ddacomm" backend beside
    NCCL and the direct API, eager and graph-replayed; the file names the GPU, NCCL and the command."""
    out = tmp_path / "backend.md"
    args = ["all_reduce", "-b", "64K", "-e", "64K", "-n", "20", "-w", "2", "-np", str(world_size), "-d", "bfloat16",
            "--device", "cuda", "--backend", "dist-ddacomm", "nccl", "ddacomm", "--out", str(out), *graph]
    r = run_cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    text = out.read_text()
    assert f"- command: `commlib-perf {' '.join(args)}`" in text
    assert "NVIDIA" in text and "NCCL " in text and "# Out of bounds values : 0 OK" in text
    rows = [line.split() for line in text.splitlines() if line.startswith(" ") and "bfloat16" in line]
    assert [row[0] for row in rows] == ["dist-ddacomm", "nccl", "ddacomm"]
    assert all(row[9] == "0" and row[13] == "0" for row in rows), text


@pytest.mark.parametrize("world_size", WORLDS)
def test_ep_ag_rs_baseline_in_a_graph(tmp_path, world_size):
    """--ep-baseline ag-rs: the NCCL all_gather + reduce_scatter path is captured (-G) and right."""
    js = tmp_path / "ep.json"
    r = run_cli("ep_dispatch_combine", "--tokens", "1,33,512", "-n", "5", "-w", "2", "-np", str(world_size),
                "-d", "bfloat16", "--device", "cuda", "--backend", "ddacomm", "nccl", "--ep-baseline", "ag-rs",
                "-G", "5", "--json", str(js))
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(js.read_text())
    assert data["wrong"] == 0
    assert all(row["oop"]["time_us"] > 0 and row["oop"]["wrong"] == 0 for row in data["results"])


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


ROW_OPS = ["fused_allreduce_rmsnorm", "ep_dispatch_combine"]


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("graph", [[], ["-G", "5"]], ids=["eager", "graph"])
def test_fused_and_ep_ddacomm_vs_nccl(tmp_path, graph, world_size):
    """fused op vs NCCL all_reduce + add + rms_norm; EPBuffer vs the host-synchronised NCCL path
    (n/a under -G: it cannot be captured). Default GPU shapes (hidden 8192 / DeepSeek-like EP)."""
    js = tmp_path / "rows.json"
    r = run_cli(*ROW_OPS, "--tokens", "1,128,1024", "-n", "5", "-w", "2", "-np", str(world_size), "-d", "bfloat16",
                "--device", "cuda", "--backend", "ddacomm", "nccl", "--json", str(js), *graph)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(js.read_text())
    assert data["wrong"] == 0
    for row in data["results"]:
        expect_time = row["backend"] == "ddacomm" or not (graph and row["op"] == "ep_dispatch_combine")
        assert (row["oop"].get("time_us") is not None) == expect_time, row
        assert row["oop"].get("wrong", 0) == 0
    assert {row["count"] for row in data["results"] if row["op"] == "fused_allreduce_rmsnorm"} == \
        {t * 8192 for t in (1, 128, 1024)}
    assert {row["count"] for row in data["results"] if row["op"] == "ep_dispatch_combine"} == \
        {t * 7168 for t in (1, 128, 1024)}


def test_fused_sharded_and_num_sms_ep_small(tmp_path):
    r = run_cli(*ROW_OPS, "--tokens", "3,64,333", "--hidden", "4096", "--residual-mode", "sharded",
                "--fused-num-sms", "8", "--experts", "16", "--topk", "4", "-n", "3", "-w", "1", "-np", "2",
                "-d", "half", "--device", "cuda", "--backend", "ddacomm", "nccl", "symm", "-G", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# Out of bounds values : 0 OK" in r.stdout


def test_row_ops_planted_wrong_result_on_gpu():
    r = run_cli(*ROW_OPS, "--tokens", "16", "-n", "2", "-w", "0", "-np", "2", "-d", "bfloat16", "--device", "cuda",
                "--backend", "ddacomm", "nccl", "--corrupt-rank", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "# Out of bounds values : 4 FAILED" in r.stdout


def test_tune_measures_fused_num_sms_and_the_fused_op_uses_it(tmp_path):
    """commlib-tune on the GPUs writes fused_num_sms (one of the candidates); the C++ reader returns
    it and the fused op stays right with it as its default."""
    cache = tmp_path / "tune.txt"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "commlib.perf.tune", "--device", "cuda", "-np", "2", "-b", "64K", "-e", "1M",
                        "-n", "5", "--file", str(cache)], capture_output=True, text=True, env=env, timeout=900,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    from commlib import tuned
    data = tuned.read_file(str(cache))
    sms = data["entries"][0]["fused_num_sms"]
    assert sms in (4, 8, 16, 32, 64), data
    assert data["fused_num_sms"] == [{"world_size": 2, "num_sms": sms}]
    assert f"fused_num_sms world_size=2 num_sms={sms}" in cache.read_text().splitlines()
    env["COMMLIB_TUNE_FILE"] = str(cache)
    env.pop("COMMLIB_FUSED_NUM_SMS", None)
    code = "import commlib.fused as f; print(f.tuned_fused_num_sms(2))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == [str(sms)], r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "commlib.perf", "fused_allreduce_rmsnorm", "--tokens", "64,1024,4096",
                        "-n", "3", "-w", "1", "-np", "2", "-d", "bfloat16", "--device", "cuda", "--backend", "ddacomm"],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and "# Out of bounds values : 0 OK" in r.stdout, r.stdout + r.stderr
