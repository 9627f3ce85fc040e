"""commlib-perf and commlib-tune on 2 CPU processes (small sizes, few iterations).

Reference: the CLI checks every result against an fp64 / exact reference itself (#wrong); these
tests check the table is well formed, that a planted wrong element is reported with a non-zero
exit code, that --json/--csv agree with the table, and that the tune cache round-trips.
The CLI starts its own processes (it is the product under test), so these tests run it as a
subprocess rather than through the ranks() launcher.
"""
import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_python(*args, env=None, timeout=300, **popen):
    """This interpreter with ``args``, commlib from this checkout, output captured."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=e, timeout=timeout,
                          cwd=ROOT, **popen)


def run_cli(module, *args, **kwargs):
    return run_python("-m", module, *args, **kwargs)


def table_rows(stdout):
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")
            and not line.startswith("{")]


SMALL = ["-b", "1K", "-e", "64K", "-f", "8", "-n", "3", "-w", "1", "-np", "2"]


def test_all_reduce_table_json_csv(tmp_path):
    js, cs, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "p.png"
    r = run_cli("commlib.perf", "all_reduce", *SMALL, "-d", "float,bfloat16", "-o", "sum,max",
                "--json", str(js), "--csv", str(cs), "--plot", str(png))
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        import matplotlib  # noqa: F401
        assert png.exists() and png.stat().st_size > 0
    except ImportError:
        assert "--plot" in r.stderr and "matplotlib is not installed" in r.stderr and not png.exists()
    rows = table_rows(r.stdout)
    # 2 dtypes x 2 redops x 3 sizes (1K, 8K, 64K) x 2 backends
    assert len(rows) == 24, r.stdout
    for row in rows:
        backend, size, count, typ, redop, root = row[:6]
        assert backend in ("ddacomm", "gloo")
        assert int(size) == int(count) * (4 if typ == "float" else 2)
        assert redop in ("sum", "max") and root == "-1"
        oop_t, _, _, oop_wrong, ip_t, _, _, ip_wrong, ratio_oop, ratio_ip = row[6:]
        assert float(oop_t) > 0 and float(ip_t) > 0
        assert oop_wrong == "0" and ip_wrong == "0"
        if backend == "gloo":
            assert float(ratio_oop) == pytest.approx(1.0) and float(ratio_ip) == pytest.approx(1.0)
    assert "# Out of bounds values : 0 OK" in r.stdout
    assert r.stdout.count("# Avg bus bandwidth") == 2
    data = json.loads(js.read_text())
    assert data["wrong"] == 0 and data["meta"]["world_size"] == 2 and data["backends"] == ["ddacomm", "gloo"]
    assert len(data["results"]) == 24
    assert {res["bytes"] for res in data["results"]} == {1024, 8192, 65536}
    for res in data["results"]:
        for mode in ("oop", "ip"):
            assert res[mode]["wrong"] == 0 and res[mode]["time_us"] > 0
            assert res[mode]["busbw"] == pytest.approx(res[mode]["algbw"])  # 2(n-1)/n = 1 for n = 2
    recs = list(csv.DictReader(io.StringIO(cs.read_text())))
    assert len(recs) == 24 and all(rec["oop_wrong"] == "0" and rec["ip_wrong"] == "0" for rec in recs)


def test_out_writes_the_results_file(tmp_path):
    # --out: machine, commit, date, the exact command and the table as printed; a bare --plot lands
    # beside it, named after it. The file's table is the run's, line for line.
    out = tmp_path / "results" / "all_reduce.md"
    args = ["all_reduce", "-b", "1K", "-e", "8K", "-f", "8", "-n", "3", "-w", "1", "-np", "2",
            "--out", str(out), "--plot"]
    head_commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                                 capture_output=True, text=True)
    r = run_cli("commlib.perf", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    text = out.read_text()
    head = dict(line[2:].split(": ", 1) for line in text.splitlines() if line.startswith("- ") and ": " in line)
    assert head["command"] == "`commlib-perf " + " ".join(args) + "`"
    sys.path.insert(0, str(ROOT / "python"))
    from commlib.perf.report import cpu_model
    assert head["machine"].startswith(f"{cpu_model()} ({os.cpu_count()} cores); torch "), head["machine"]
    assert "torch " in head["machine"] and "Python " in head["machine"]
    if head_commit.returncode == 0:
        assert head["commit"].split()[0] == head_commit.stdout.strip()
    else:
        assert head["commit"].startswith("unknown")
    import datetime
    assert head["date"][:10] in {(datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=d))
                                 .strftime("%Y-%m-%d") for d in (0, 1)}
    assert head["date"].endswith(" UTC")
    assert text.startswith("# all_reduce: ddacomm vs gloo, CPU, world size 2\n")
    body = text.split("```\n", 1)[1].rsplit("```", 1)[0]
    printed = r.stdout[:r.stdout.index("# wrote")]
    assert body == printed
    assert len(table_rows(body)) == 4 and "# Out of bounds values : 0 OK" in body
    png = out.with_suffix(".png")
    try:
        import matplotlib  # noqa: F401
        assert png.exists() and png.stat().st_size > 0 and "![all_reduce](all_reduce.png)" in text
    except ImportError:
        assert not png.exists() and "matplotlib is not installed" in r.stderr
    # Rerunning the command rewrites the file (no appending).
    r = run_cli("commlib.perf", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert out.read_text().count("# commlib-perf ") == 1


def test_cpu_binding(tmp_path):
    # Default: each rank on its own CPU (the machine has >= 2), and rounds taking turns between the
    # backends (4, or one per call when -n is smaller); both reported in the JSON's timing line.
    runs = {"core": [], "none": ["--cpu-bind", "none", "--rounds", "1"]}
    for mode, flag in runs.items():
        js = tmp_path / f"{mode}.json"
        r = run_cli("commlib.perf", "all_reduce", "-b", "4K", "-e", "4K", "-n", "3", "-w", "1", "-np", "2",
                    "--backend", "ddacomm", "gloo", *flag, "--json", str(js))
        assert r.returncode == 0, r.stdout + r.stderr
        data = json.loads(js.read_text())
        timing = data["meta"]["timing"]
        want = "ranks bound: one CPU each" if mode == "core" and len(os.sched_getaffinity(0)) >= 2 else "ranks bound: no"
        assert want in timing, timing
        assert ("3 rounds taking turns" in timing) == (mode == "core"), timing
        assert len(data["results"]) == 2 and all(res[m]["wrong"] == 0 for res in data["results"] for m in ("oop", "ip"))
    # Fewer CPUs than ranks: no binding, and the reason is reported.
    js = tmp_path / "one-cpu.json"
    cpu = min(os.sched_getaffinity(0))
    r = run_cli("commlib.perf", "all_reduce", "-b", "4K", "-e", "4K", "-n", "3", "-w", "1", "-np", "2",
                "--backend", "ddacomm", "--json", str(js), preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ranks bound: no (1 CPUs for 2 ranks)" in json.loads(js.read_text())["meta"]["timing"]


def test_other_collectives():
    ops = ["reduce_scatter", "all_gather", "all_to_all", "broadcast"]
    r = run_cli("commlib.perf", *ops, *SMALL, "-d", "half", "--backend", "ddacomm", "gloo")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table_rows(r.stdout)
    assert len(rows) == 6 * len(ops), r.stdout
    for i, op in enumerate(ops):
        assert f"# {op}" in r.stdout
        for row in rows[6 * i:6 * (i + 1)]:
            assert row[3] == "half"
            assert row[5] == ("0" if op == "broadcast" else "-1")
            assert row[9] == "0", r.stdout  # out-of-place #wrong
            if op == "all_to_all":
                assert row[10] == "n/a"  # no in-place form
            else:
                assert row[13] == "0", r.stdout


def test_planted_wrong_result_is_reported():
    r = run_cli("commlib.perf", "all_reduce", "all_gather", "-b", "4K", "-e", "4K", "-n", "2", "-w", "0",
                "-np", "2", "--backend", "ddacomm", "--corrupt-rank", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = table_rows(r.stdout)
    assert len(rows) == 2
    for row in rows:
        assert row[9] == "1" and row[13] == "1", r.stdout  # one damaged element, both modes
    assert "# Out of bounds values : 4 FAILED" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["-d", "int8"], "-d int8 not supported; supported: float, half, bfloat16"),
    (["--backend", "nccl"], "--backend nccl needs CUDA tensors; valid on CPU: ddacomm, gloo"),
    (["--backend", "mpi"], "--backend mpi not known; valid: ddacomm, nccl, gloo, symm, dist-ddacomm"),
    (["-o", "xor"], "-o xor not supported"),
    (["all_reduce_fancy"], "operation 'all_reduce_fancy' not known"),
    (["-b", "1M", "-e", "1K"], "is larger than -e"),
    (["--rounds", "0"], "-n and --rounds must be >= 1"),
    (["--plot"], "--plot without a file name needs --out"),
    (["--out", "-"], "--out needs a file name"),
    (["fused_allreduce_rmsnorm", "--hidden", "12"], "--hidden 12 not supported by fused_allreduce_rmsnorm; "
                                                    "supported: multiples of 8 up to 16384"),
    (["ep_dispatch_combine", "-np", "2", "--experts", "7"], "--experts 7 is not a multiple of the world size 2"),
])
def test_bad_arguments(args, message):
    r = run_cli("commlib.perf", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_tuner_writes_and_reads_back(tmp_path):
    cache = tmp_path / "sub" / "tune.txt"
    r = run_cli("commlib.perf.tune", "-b", "1K", "-e", "16K", "-n", "3", "--file", str(cache))
    assert r.returncode == 0, r.stdout + r.stderr
    sys.path.insert(0, str(ROOT / "python"))
    from commlib.perf import tune
    data = tune.read_file(str(cache))
    assert data["version"] == 1 and len(data["entries"]) == 1
    entry = data["entries"][0]
    key = tune.make_key("cpu", 2)
    assert entry["key"] == key and key["link"] == "shm" and key["world_size"] == 2
    ar = entry["all_reduce"]
    assert ar["flat_max_bytes"] in (0, 1024, 2048, 4096, 8192, 16384)
    assert ar["tree_max_bytes"] == 16384 and entry["fused_num_sms"] is None
    assert tune.load(key, str(cache)) == entry
    assert tune.load({**key, "world_size": 3}, str(cache)) is None
    # A second entry is added beside it; the same key is replaced, not duplicated.
    other = {"key": {**key, "world_size": 4}, "all_reduce": {"flat_max_bytes": 1, "tree_max_bytes": 2},
             "fused_num_sms": 8}
    tune.save(other, str(cache))
    tune.save({**entry, "all_reduce": {"flat_max_bytes": 5, "tree_max_bytes": 6}}, str(cache))
    data = tune.read_file(str(cache))
    assert len(data["entries"]) == 2
    assert tune.load(key, str(cache))["all_reduce"] == {"flat_max_bytes": 5, "tree_max_bytes": 6}
    assert tune.load(other["key"], str(cache))["fused_num_sms"] == 8


def test_gpu_tune_entry_reaches_the_cpp_selector(tmp_path):
    """A GPU entry saved by commlib-tune is what the C++ selector (GPU path, backend) uses."""
    sys.path.insert(0, str(ROOT / "python"))
    from commlib.perf import tune
    cache = tmp_path / "gpu-tune.txt"
    key = {"device": "NVIDIA H200", "world_size": 2, "link": "nvlink", "version": "0.1.0"}
    tune.save({"key": key, "all_reduce": {"flat_max_bytes": 12288, "tree_max_bytes": 3 << 20},
               "fused_num_sms": None}, str(cache))
    tune.save({"key": {**key, "device": "cpu model", "link": "shm"},
               "all_reduce": {"flat_max_bytes": 1, "tree_max_bytes": 2}, "fused_num_sms": None}, str(cache))
    env = dict(os.environ, COMMLIB_TUNE_FILE=str(cache))
    code = ("import torch, commlib; from commlib import _C; "
            "print(_C.all_reduce_limits(2, torch.bfloat16), _C.select_all_reduce_algorithm(12289, 2, torch.bfloat16))")
    for name in ("COMMLIB_FLAT_MAX_BYTES", "COMMLIB_TREE_MAX_BYTES", "COMMLIB_ALLREDUCE_ALGO"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["(12288,", f"{3 << 20})", "tree"], r.stdout


def test_tune_file_malformed_raises(tmp_path):
    sys.path.insert(0, str(ROOT / "python"))
    from commlib.perf import tune
    bad = tmp_path / "t.txt"
    bad.write_text("entry key.world_size=2 all_reduce.flat_max_bytes=-1 all_reduce.tree_max_bytes=1\n")
    with pytest.raises(ValueError, match="all_reduce.flat_max_bytes must be an integer >= 0"):
        tune.read_file(str(bad))
    bad.write_text("# header\ncp key.world_size=2 attn_flops_per_s 5\n")
    with pytest.raises(ValueError, match=re.escape(f"'{bad}' line 2: 'attn_flops_per_s' is not key=value: "
                                                   "'cp key.world_size=2 attn_flops_per_s 5'")):
        tune.read_file(str(bad))
    bad.write_text(' {"version": 1, "entries": []}')  # an older commlib's JSON file
    with pytest.raises(ValueError, match=re.escape(f"'{bad}' is a JSON tune file of an older commlib") +
                       ".*re-run commlib-tune"):
        tune.read_file(str(bad))
    # commlib-tune itself replaces such a file instead of refusing it
    key = {"device": "cpu model", "world_size": 2, "link": "shm", "version": "0.1.0"}
    entry = {"key": key, "all_reduce": {"flat_max_bytes": 4, "tree_max_bytes": 8}, "fused_num_sms": None}
    tune.save(entry, str(bad))
    assert tune.read_file(str(bad))["entries"] == [entry]


def test_tune_file_round_trip(tmp_path):
    """read_file(write_file(data)) == data for what the savers store: strings with spaces, '=', '#'
    and '%', strings that look like numbers, floats, None, nested dicts; comments, blank lines and
    unknown sections and keys of a hand-edited file are read too (and the comments dropped on save)."""
    sys.path.insert(0, str(ROOT / "python"))
    from commlib import tuned
    from commlib.perf import tune
    path = tmp_path / "t.txt"
    key = {"device": "Intel(R) Xeon(R) = #1 100%", "world_size": 2, "link": "shm", "version": "1.0"}
    data = {"version": 1,
            "entries": [{"key": key, "all_reduce": {"flat_max_bytes": 0, "tree_max_bytes": 1 << 40},
                         "fused_num_sms": None, "collectives": {"all_gather": 5}}],
            "cp": [{"key": {**key, "version": "7"}, "bw_bytes_per_s": None, "attn_flops_per_s": 1.25e12}],
            "tokenweave": [{"device": "NVIDIA H200", "world_size": 2, "wave_steps": {"8192x1024": 128, "a.b": 3},
                            "split_min_tokens": None, "num_sms": 16}],
            "hierarchical": [{"op": "barrier", "num_hosts": 2, "local_size": 8, "min_bytes": 1}]}
    want = json.loads(json.dumps(data))  # write_file adds the C++ lists to data
    tune.write_file(data, str(path))
    text = path.read_text()
    assert all(len(line.split()) >= 2 and all("=" in w for w in line.split()[1:])
               for line in text.splitlines() if not line.startswith("#")), text
    got = tune.read_file(str(path))
    assert {k: got[k] for k in want} == want
    # write_file's C++ lists, one line each (the CPU entry gives host_all_reduce)
    assert "host_all_reduce world_size=2 flat_max_bytes=0" in text.splitlines()
    assert got["host_all_reduce"] == [{"world_size": 2, "flat_max_bytes": 0}]
    path.write_text("# by hand\n\n   \n" + text + "future_section x=1 y=two\n")
    assert tuned.read_file(str(path))["future_section"] == [{"x": 1, "y": "two"}]
    assert tuned.parse_lines("# c\n\nall_reduce world_size=2  flat_max_bytes=1\n", "p") == [
        ("all_reduce", {"world_size": "2", "flat_max_bytes": "1"})]


def test_crossovers():
    from commlib.perf.tune import crossovers
    sizes = [1, 2, 4, 8]
    assert crossovers(sizes, {"flat": [1, 1, 5, 9], "tree": [2, 2, 4, 8]}) == \
        {"flat_max_bytes": 2, "tree_max_bytes": 8}
    assert crossovers(sizes, {"flat": [1, 3, 5, 9], "tree": [2, 2, 4, 8], "nccl": [5, 5, 5, 5]}) == \
        {"flat_max_bytes": 1, "tree_max_bytes": 4}
    # One noisy point (flat wins at 32 alone) does not move the fitted threshold.
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    assert crossovers(sizes, {"flat": [1, 1, 1, 9, 9, 7, 9, 9], "tree": [2, 2, 2, 4, 4, 8, 4, 4]}) == \
        {"flat_max_bytes": 4, "tree_max_bytes": 128}
    assert crossovers(sizes, {"flat": [9] * 8, "tree": [1] * 8})["flat_max_bytes"] == 0


def _auto_follows_tune_file(ctx, flat_max):
    """all_reduce auto on CPU picks flat/tree from the cache: both give the ordered fp32 result,
    and the choice is visible in the selection helper."""
    import torch
    comm = ctx.new_comm()
    try:
        chosen = [comm._host_auto_algo(n) for n in (flat_max, flat_max + 1)]
        g = torch.Generator().manual_seed(ctx.rank)
        x = torch.rand(flat_max // 4 + 5, generator=g) + 0.5
        ref = x.clone()
        ctx.comm.all_reduce_(ref, algo="tree")
        comm.all_reduce_(x)
        assert torch.equal(x, ref)
        return chosen
    finally:
        comm.close()


def _auto_refuses_bad_tune_file(ctx, path):
    import re

    import torch
    comm = ctx.new_comm()
    try:
        for call in (lambda: comm.all_reduce(torch.ones(8)), lambda: comm._host_auto_algo(8)):
            with pytest.raises(ValueError, match=re.escape(f"COMMLIB_TUNE_FILE: cannot read '{path}'")):
                call()
        x = torch.ones(8)
        comm.all_reduce_(x, algo="flat")  # an explicit algorithm needs no tune file; still usable
        assert torch.equal(x, torch.full((8,), float(ctx.world_size)))
        return True
    finally:
        comm.close()


def test_cpu_auto_honours_tune_file(ranks, tmp_path):
    sys.path.insert(0, str(ROOT / "python"))
    from commlib.perf import tune
    cache = tmp_path / "tune.txt"
    key = tune.make_key("cpu", 2)
    tune.save({"key": key, "all_reduce": {"flat_max_bytes": 4096, "tree_max_bytes": 1 << 20},
               "fused_num_sms": None}, str(cache))
    out = ranks(2, env={"COMMLIB_TUNE_FILE": str(cache)}).run(_auto_follows_tune_file, 4096)
    assert out == [["flat", "tree"]] * 2
    # No CPU entry: the built-in threshold (256 KiB) decides, in C++ as for the backend.
    gpu_only = tmp_path / "gpu.txt"
    gpu_only.write_text("all_reduce world_size=2 flat_max_bytes=1 tree_max_bytes=2\n")
    out = ranks(2, env={"COMMLIB_TUNE_FILE": str(gpu_only)}).run(_auto_follows_tune_file, 4096)
    assert out == [["flat", "flat"]] * 2
    # A tune file that cannot be read is the same clear error on CPU as on GPU.
    missing = tmp_path / "missing.txt"
    assert all(ranks(2, env={"COMMLIB_TUNE_FILE": str(missing)}).run(_auto_refuses_bad_tune_file, str(missing)))


# ---- operations over [tokens, hidden] rows: fused_allreduce_rmsnorm, ep_dispatch_combine ----

ROW_OPS = ["fused_allreduce_rmsnorm", "ep_dispatch_combine"]


def test_fused_and_ep_ops_table_json(tmp_path):
    """Both row operations, ddacomm (fused op / EPBuffer) vs gloo (unfused / host-synchronised path):
    sizes are whole rows (tokens x hidden), #wrong 0 against the fp64 reference, in-place n/a."""
    js = tmp_path / "rows.json"
    tokens, hidden = [1, 7, 33], 64
    r = run_cli("commlib.perf", *ROW_OPS, "--tokens", ",".join(map(str, tokens)), "--hidden", str(hidden),
                "-n", "2", "-w", "1", "-np", "2", "-d", "float,bfloat16", "--json", str(js))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table_rows(r.stdout)
    assert len(rows) == 2 * 2 * 3 * 2, r.stdout  # ops x dtypes x token counts x backends
    for row in rows:
        backend, size, count, typ, redop, root = row[:6]
        assert backend in ("ddacomm", "gloo") and redop == "none" and root == "-1"
        assert int(count) // hidden in tokens and int(count) % hidden == 0
        assert int(size) == int(count) * (4 if typ == "float" else 2)
        assert float(row[6]) > 0 and row[9] == "0", r.stdout  # out-of-place time, #wrong
        assert row[10] == "n/a", r.stdout  # no in-place form
    for op in ROW_OPS:
        assert f"# {op}" in r.stdout and f"# n/a: {op} has no in-place form" in r.stdout
    assert "# Out of bounds values : 0 OK" in r.stdout
    data = json.loads(js.read_text())
    assert data["wrong"] == 0 and len(data["results"]) == 24
    assert {res["op"] for res in data["results"]} == set(ROW_OPS)
    assert {res["count"] for res in data["results"]} == {t * hidden for t in tokens}
    for res in data["results"]:
        assert res["oop"]["wrong"] == 0 and res["oop"]["time_us"] > 0 and "time_us" not in res["ip"]
        assert res["oop"]["busbw"] == pytest.approx(res["oop"]["algbw"])  # 2(n-1)/n = 1 for n = 2


def test_ep_ag_rs_baseline_and_dist_ddacomm_backend():
    """--ep-baseline ag-rs (all_gather + reduce_scatter) on gloo and on a torch.distributed "ddacomm"
    group (dist-ddacomm): #wrong 0 against the fp64 reference at odd token counts; and a planted
    wrong element in the baseline's output is counted."""
    args = ["ep_dispatch_combine", "--tokens", "1,7,33", "--hidden", "40", "--experts", "6", "--topk", "3",
            "-n", "2", "-w", "1", "-np", "2", "-d", "float,half", "--ep-baseline", "ag-rs"]
    r = run_cli("commlib.perf", *args, "--backend", "gloo", "dist-ddacomm", "ddacomm")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table_rows(r.stdout)
    assert len(rows) == 2 * 3 * 3 and all(row[9] == "0" for row in rows), r.stdout
    assert {row[0] for row in rows} == {"gloo", "dist-ddacomm", "ddacomm"}
    r = run_cli("commlib.perf", *args, "--backend", "gloo", "--corrupt-rank", "0")
    assert r.returncode == 1 and all(row[9] == "1" for row in table_rows(r.stdout)), r.stdout + r.stderr


def test_ep_identity_experts():
    """--ep-experts identity (the EP kernels alone, beside launch_floor): the EPBuffer combines
    expert_x as dispatched, the baselines run without the expert pass, every result is checked
    against x * sum(w) in fp64, and a planted wrong element is still counted."""
    args = ["ep_dispatch_combine", "--tokens", "1,7,33", "--hidden", "40", "--experts", "6", "--topk", "3",
            "-n", "2", "-w", "1", "-np", "2", "-d", "float,bfloat16", "--ep-experts", "identity"]
    r = run_cli("commlib.perf", *args, "--backend", "ddacomm", "gloo")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = table_rows(r.stdout)
    assert len(rows) == 2 * 3 * 2 and all(row[9] == "0" for row in rows), r.stdout
    assert {row[0] for row in rows} == {"ddacomm", "gloo"}
    r = run_cli("commlib.perf", *args, "--backend", "ddacomm", "--ep-baseline", "ag-rs", "--corrupt-rank", "1")
    assert r.returncode == 1 and all(row[9] == "1" for row in table_rows(r.stdout)), r.stdout + r.stderr


def test_row_ops_planted_wrong_result_is_reported():
    """One damaged output element per rank-1 result of each new operation, fused and baseline, and
    the sharded residual mode on the way."""
    r = run_cli("commlib.perf", *ROW_OPS, "--tokens", "5", "--hidden", "32", "-n", "1", "-w", "0", "-np", "2",
                "-d", "half", "--residual-mode", "sharded", "--corrupt-rank", "1")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = table_rows(r.stdout)
    assert len(rows) == 4 and all(row[9] == "1" for row in rows), r.stdout
    assert "# Out of bounds values : 4 FAILED" in r.stdout


def test_round_sizes():
    sys.path.insert(0, str(ROOT / "python"))
    from commlib.perf.runner import round_sizes
    assert round_sizes(20, 4) == [5, 5, 5, 5]
    assert round_sizes(7, 3) == [3, 2, 2]
    assert round_sizes(2, 4) == [1, 1]  # never a round without a timed call
    assert round_sizes(5, 1) == [5]


# One process (a world-1 gloo group) runs measure_in_rounds on two cells of a fake operation that
# logs every call: the first call and warm-ups of each cell, then rounds that take turns (each an
# untimed call and its share of -n), then one check call per cell.
ROUNDS_SCRIPT = r"""
import argparse, json, sys, torch, torch.distributed as dist
from commlib.perf.registry import Buffers, Case
from commlib.perf.runner import measure_in_rounds
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
log = []
class Desc:
    def setup(self, case):
        return Buffers(inp=torch.zeros(1), out=torch.zeros(1))
    def run(self, backend, bufs, case):
        log.append(backend + ("/check" if case.salt else ""))
    def check(self, bufs, case):
        return 3 if case.in_place else 0
opts = argparse.Namespace(iters=5, rounds=2, warmup=1, check=1, corrupt_rank=-1)
cells = [(name, Case(rank=0, world_size=1, nbytes=4, dtype=torch.float32, redop="sum", root=0,
                     device=torch.device("cpu"), in_place=name == "b")) for name in ("a", "b")]
res = measure_in_rounds(Desc(), cells, opts)
print(json.dumps({"log": log, "wrong": [r["wrong"] for r in res], "timed": [r["time_us"] > 0 for r in res]}))
dist.destroy_process_group()
"""


def test_rounds_take_turns():
    r = run_python("-c", ROUNDS_SCRIPT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # -n 5 in 2 rounds: 3 then 2 timed calls, each round after one untimed call.
    assert got["log"] == (["a", "a", "b", "b"] + ["a"] * 4 + ["b"] * 4 + ["a"] * 3 + ["b"] * 3
                          + ["a/check", "b/check"]), got["log"]
    assert got["wrong"] == [0, 3] and got["timed"] == [True, True]


def test_row_sizes_mapping():
    sys.path.insert(0, str(ROOT / "python"))
    from commlib.perf.rows import row_sizes
    # -b/-e sizes become whole rows (at least one), repeats dropped; --tokens replaces them.
    assert row_sizes([1024, 2048, 4096, 65536], 2, 1024, None) == [2048, 4096, 65536]
    assert row_sizes([1024], 4, 8, [3, 1, 3]) == [96, 32]


def test_pick_fused_num_sms():
    from commlib.perf.tune import pick_fused_num_sms
    assert pick_fused_num_sms({4: 30.0, 8: 20.0, 16: 19.5, 32: 19.0, 64: 19.2}) == 16  # within 5% of 19.0
    assert pick_fused_num_sms({4: 10.0, 8: 12.0}) == 4
    assert pick_fused_num_sms({4: None, 8: 12.0, 16: 11.9}) == 8
    assert pick_fused_num_sms({4: None}) is None


def test_tuner_writes_fused_num_sms_and_the_fused_default_reads_it(tmp_path, monkeypatch):
    """GPU tuning with fake measurements (the sweeps need GPUs): the entry and the top-level list get
    fused_num_sms, and the C++ reader behind the fused op's default returns it for that world size."""
    sys.path.insert(0, str(ROOT / "python"))
    from commlib import fused
    from commlib.perf import tune
    key = {"device": "NVIDIA H200", "world_size": 2, "link": "nvlink", "version": "0.1.0"}
    monkeypatch.setattr(tune, "make_key", lambda device, world_size: {**key, "world_size": world_size})
    monkeypatch.setattr(tune, "measure", lambda *a: ([1024, 2048], {"flat": [1.0, 3.0], "tree": [2.0, 2.0],
                                                                   "nccl": [4.0, 4.0]}))
    swept = []

    def fake_sweep(np_, iters):
        swept.append(np_)
        return {4: 41.0, 8: 30.0, 16: 24.9, 32: 24.0, 64: 24.5}
    monkeypatch.setattr(tune, "measure_fused_num_sms", fake_sweep)
    monkeypatch.setattr(tune, "measure_collectives", lambda *a: {"all_gather": 4096})
    cache = tmp_path / "gpu.txt"
    assert tune.main(["--device", "cuda", "-np", "2", "--file", str(cache)]) == 0
    assert swept == [2]
    data = tune.read_file(str(cache))
    assert data["collectives"] == [{"world_size": 2, "op": "all_gather", "max_bytes": 4096}]
    assert data["entries"][0]["fused_num_sms"] == 16  # the smallest count within 5% of the best (24.0)
    assert data["fused_num_sms"] == [{"world_size": 2, "num_sms": 16}]
    assert tune.main(["--device", "cuda", "-np", "2", "--file", str(cache), "--no-fused"]) == 0
    assert swept == [2] and "fused_num_sms" not in tune.read_file(str(cache))  # no line
    # The reader (C++, csrc/core/algorithm_selector.cc) behind the fused op's default num_sms.
    tune.save({"key": {**key, "world_size": 4}, "all_reduce": {"flat_max_bytes": 1, "tree_max_bytes": 2},
               "fused_num_sms": 24}, str(cache))
    tune.save({"key": {**key, "link": "shm"}, "all_reduce": {"flat_max_bytes": 1, "tree_max_bytes": 2},
               "fused_num_sms": 99}, str(cache))  # CPU entries never reach the C++ list
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(cache))
    assert [fused.tuned_fused_num_sms(n) for n in (2, 4, 8)] == [0, 24, 0]
    other = tmp_path / "other.txt"
    other.write_text("fused_num_sms world_size=2 num_sms=8\n")
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(other))
    assert fused.tuned_fused_num_sms(2) == 8


def test_fused_num_sms_malformed(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "python"))
    from commlib import fused, tuned
    from commlib.perf import tune
    bad = tmp_path / "bad-sms.txt"
    bad.write_text("fused_num_sms world_size=2 num_sms=0\n")
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(bad))
    with pytest.raises(ValueError, match=r"bad-sms.txt' line 1: num_sms=0 is not in 1..2\^31-1"):
        fused.tuned_fused_num_sms(2)
    entry = {"key": {"world_size": 2}, "all_reduce": {"flat_max_bytes": 1, "tree_max_bytes": 2}, "fused_num_sms": 0}
    bad.write_text(tuned.format_file({"version": 1, "entries": [entry]}))
    with pytest.raises(ValueError, match=r"entry 0: fused_num_sms must be None or an integer >= 1, got 0"):
        tune.read_file(str(bad))


def test_operation_modules_are_found_by_name():
    """Every python/commlib/perf/ops_*.py is imported by the CLI without a registry line, and what
    they register is known to it (fused_allreduce_rmsnorm from ops_fused, ep_dispatch_combine from ops_ep)."""
    sys.path.insert(0, str(ROOT / "python"))
    from commlib.perf import registry
    on_disk = {f"commlib.perf.{p.stem}" for p in (ROOT / "python" / "commlib" / "perf").glob("ops_*.py")}
    assert on_disk >= {"commlib.perf.ops_fused", "commlib.perf.ops_ep"}
    assert set(registry.plugin_modules()) >= on_disk
    registry.load_plugins()
    assert {"fused_allreduce_rmsnorm", "ep_dispatch_combine"} <= set(registry.names())
