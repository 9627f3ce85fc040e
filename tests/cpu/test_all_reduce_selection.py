"""GPU all-reduce algorithm selection and GPU-independent argument checks (run without a GPU).

Reference: the built-in table documented in csrc/core/algorithm_selector.cc / docs/gpu-allreduce.md,
and the override order documented in csrc/core/algorithm_selector.hpp.
"""
import re
from pathlib import Path

import pytest
import torch

import commlib
from commlib import _C

KiB, MiB = 1 << 10, 1 << 20
ENV = ("COMMLIB_ALLREDUCE_ALGO", "COMMLIB_FLAT_MAX_BYTES", "COMMLIB_TREE_MAX_BYTES", "COMMLIB_TUNE_FILE")
BUILTIN = {2: (512 * KiB, 256 * MiB), 3: (256 * KiB, 8 * MiB), 4: (256 * KiB, 8 * MiB), 8: (128 * KiB, 8 * MiB),
           16: (64 * KiB, 4 * MiB)}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache/commlib/tune.txt from the machine


def select(nbytes, world=2, dtype=torch.bfloat16):
    return _C.select_all_reduce_algorithm(nbytes, world, dtype)


@pytest.mark.parametrize("world", sorted(BUILTIN))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_builtin_table(world, dtype):
    flat_max, tree_max = BUILTIN[world]
    assert _C.all_reduce_limits(world, dtype) == (flat_max, tree_max)
    assert select(0, world, dtype) == "flat"
    assert select(1 * KiB, world, dtype) == "flat"
    assert select(flat_max, world, dtype) == "flat"
    assert select(flat_max + 1, world, dtype) == "tree"
    assert select(tree_max, world, dtype) == "tree"
    assert select(tree_max + 1, world, dtype) == "nccl"
    assert select(1 << 40, world, dtype) == "nccl"


def test_threshold_overrides(monkeypatch):
    monkeypatch.setenv("COMMLIB_FLAT_MAX_BYTES", "4096")
    assert select(4096) == "flat" and select(4097) == "tree"
    assert select(8 * MiB) == "tree"  # tree limit untouched
    monkeypatch.setenv("COMMLIB_TREE_MAX_BYTES", str(1 * MiB))
    assert select(MiB) == "tree" and select(MiB + 1) == "nccl"
    assert _C.all_reduce_limits(2, torch.float32) == (4096, MiB)


@pytest.mark.parametrize("algo", ["flat", "tree", "nccl"])
def test_forced_algorithm(monkeypatch, algo):
    monkeypatch.setenv("COMMLIB_ALLREDUCE_ALGO", algo)
    assert {select(b) for b in (0, KiB, MiB, 1 << 30)} == {algo}


def test_bad_values_name_knob_value_and_valid_set(monkeypatch):
    monkeypatch.setenv("COMMLIB_ALLREDUCE_ALGO", "fastest")
    with pytest.raises(ValueError, match=r"COMMLIB_ALLREDUCE_ALGO.*'fastest'.*auto, flat, tree, nccl"):
        select(KiB)
    monkeypatch.delenv("COMMLIB_ALLREDUCE_ALGO")
    monkeypatch.setenv("COMMLIB_FLAT_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match=r"COMMLIB_FLAT_MAX_BYTES='lots'.*not an integer"):
        select(KiB)
    monkeypatch.setenv("COMMLIB_FLAT_MAX_BYTES", "-5")
    with pytest.raises(ValueError, match=r"COMMLIB_FLAT_MAX_BYTES=-5 must be >= 0"):
        select(KiB)


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"select_all_reduce_algorithm: dtype int8 not supported; supported: "
                                        r"float32, float16, bfloat16"):
        select(KiB, 2, torch.int8)
    with pytest.raises(ValueError, match=r"world_size 0 must be >= 1"):
        select(KiB, 0)
    with pytest.raises(ValueError, match=r"bytes -1 must be >= 0"):
        select(-1)


def write_tune(path: Path, entries) -> str:
    """A tune file (Note [tune file format]) with one all_reduce line per entry, among lines the
    reader skips: a comment, a blank line, a section it does not know."""
    lines = ["# written by the test", "", "all_to_all ignored=1"]
    lines += ["all_reduce " + " ".join(f"{k}={v}" for k, v in e.items()) for e in entries]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_tune_file(monkeypatch, tmp_path):
    tune = write_tune(tmp_path / "tune.txt", [
        {"world_size": 2, "flat_max_bytes": 8192, "tree_max_bytes": 2 * MiB},
        {"world_size": 2, "dtype": "float32", "flat_max_bytes": 1024, "tree_max_bytes": 4 * MiB},
        {"world_size": 4, "flat_max_bytes": 0, "tree_max_bytes": 0},
    ])
    monkeypatch.setenv("COMMLIB_TUNE_FILE", tune)
    assert _C.all_reduce_limits(2, torch.bfloat16) == (8192, 2 * MiB)
    assert _C.all_reduce_limits(2, torch.float16) == (8192, 2 * MiB)
    assert _C.all_reduce_limits(2, torch.float32) == (1024, 4 * MiB)  # dtype-specific entry wins
    assert select(1, 4) == "nccl" and select(0, 4) == "flat"
    assert _C.all_reduce_limits(8, torch.bfloat16) == BUILTIN[8]  # no entry: built-in
    # Environment thresholds beat the file.
    monkeypatch.setenv("COMMLIB_TREE_MAX_BYTES", str(MiB))
    assert _C.all_reduce_limits(2, torch.bfloat16) == (8192, MiB)


def test_tune_file_default_location(monkeypatch, tmp_path):
    cache = tmp_path / ".cache" / "commlib"
    cache.mkdir(parents=True)
    write_tune(cache / "tune.txt", [{"world_size": 2, "flat_max_bytes": 777, "tree_max_bytes": 999}])
    assert _C.all_reduce_limits(2, torch.bfloat16) == (777, 999)


def test_tune_file_every_section_comments_and_unknown_keys(monkeypatch, tmp_path):
    """Each section the C++ reader knows, with comments (whole-line, indented), blank lines, runs
    of spaces and tabs, unknown keys and the Python-only sections around them. Reference: the
    values written; the world sizes without a line keep the built-in values."""
    path = tmp_path / "tune.txt"
    path.write_text("\n".join([
        "# commlib tune file",
        "   # an indented comment",
        "",
        "all_reduce world_size=3 flat_max_bytes=11 tree_max_bytes=22 measured_by=someone",
        "all_reduce\tworld_size=3   dtype=float16 flat_max_bytes=33 tree_max_bytes=44",
        "   ",
        "fused_num_sms world_size=3 num_sms=24 note=x",
        "fused_num_sms world_size=3 num_sms=28",  # the last one wins
        "host_all_reduce world_size=3 flat_max_bytes=4096 future_key=1",
        "collectives world_size=3 op=broadcast max_bytes=555 other=x",
        "collectives world_size=3 op=some_future_op max_bytes=7",
        "hierarchical op=all_gather num_hosts=2 local_size=8 min_bytes=65536",
        "entry key.device=NVIDIA%20H200 key.world_size=3 all_reduce.flat_max_bytes=1",
        "tokenweave device=X wave_steps.8192x1024=256",
        "some_future_section a=b c=d",
    ]) + "\n")
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(path))
    monkeypatch.delenv("COMMLIB_HOST_TREE_THRESHOLD", raising=False)
    assert _C.all_reduce_limits(3, torch.bfloat16) == (11, 22)
    assert _C.all_reduce_limits(3, torch.float16) == (33, 44)
    assert _C.all_reduce_limits(2, torch.bfloat16) == BUILTIN[2]
    assert _C.tuned_fused_num_sms(3) == 28 and _C.tuned_fused_num_sms(2) == 0
    assert _C.select_host_all_reduce_algorithm(4096, 3) == "flat"
    assert _C.select_host_all_reduce_algorithm(4097, 3) == "tree"
    assert _C.collective_max_bytes("broadcast", 3) == 555
    assert _C.collective_max_bytes("broadcast", 2) == 16 * MiB  # built-in


@pytest.mark.parametrize("line, why", [
    ("all_reduce world_size=2 flat_max_bytes=1k tree_max_bytes=5", "flat_max_bytes=1k is not an integer >= 0"),
    ("all_reduce world_size=2 flat_max_bytes=-1 tree_max_bytes=5", "flat_max_bytes=-1 is not an integer >= 0"),
    ("all_reduce world_size=2 flat_max_bytes=1.5 tree_max_bytes=5", "flat_max_bytes=1.5 is not an integer >= 0"),
    ("all_reduce world_size=2 flat_max_bytes=1", "no tree_max_bytes=<value>"),
    ("all_reduce world_size=2 flat_max_bytes 1 tree_max_bytes=5", "'flat_max_bytes' is not key=value"),
    ("fused_num_sms world_size=2 num_sms=", "num_sms= is not an integer >= 0"),
    ("fused_num_sms world_size=2 num_sms=0", "num_sms=0 is not in 1..2^31-1"),
    ("host_all_reduce world_size=two flat_max_bytes=1", "world_size=two is not an integer >= 0"),
    ("collectives world_size=2 max_bytes=5", "no op=<value>"),
    ("hierarchical op=all_gather num_hosts=2 local_size=8", "no min_bytes=<value>"),
    ("some_future_section =oops", "'=oops' is not key=value"),
])
def test_tune_file_malformed_line(monkeypatch, tmp_path, line, why):
    """A malformed line names the path, the line number (comments and blank lines count) and the line."""
    path = tmp_path / "bad.txt"
    path.write_text(f"# header\n\nall_reduce world_size=8 flat_max_bytes=1 tree_max_bytes=2\n{line}\n")
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(path))
    with pytest.raises(ValueError, match=re.escape(f"COMMLIB_TUNE_FILE: '{path}' line 4: {why}: '{line}'")):
        select(KiB)


def test_old_json_tune_file_says_rerun_commlib_tune(monkeypatch, tmp_path):
    old = tmp_path / "tune.json"
    old.write_text('\n  {"version": 1, "all_reduce": [{"world_size": 2, "flat_max_bytes": 1, "tree_max_bytes": 2}]}')
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(old))
    with pytest.raises(ValueError, match=re.escape(f"COMMLIB_TUNE_FILE: '{old}' is a JSON tune file of an older "
                                                   "commlib") + r".*re-run commlib-tune"):
        select(KiB)


def test_tune_file_errors(monkeypatch, tmp_path):
    missing = tmp_path / "nope.txt"
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(missing))
    with pytest.raises(ValueError, match=r"COMMLIB_TUNE_FILE: cannot read '.*nope.txt'"):
        select(KiB)


def test_knobs_declared():
    names = {k[0] for k in commlib.knobs()}
    assert {"COMMLIB_GPU_WORKSPACE_BYTES", "COMMLIB_TUNE_FILE", *ENV} <= names


def _bad_gpu_independent_inputs(ctx):
    comm = ctx.comm
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"all_reduce: algo 'fast' not supported; supported: auto, flat, tree, nccl"):
        comm.all_reduce_(x, algo="fast")
    with pytest.raises(ValueError, match=r"all_reduce: op 'median' not supported"):
        comm.all_reduce_(x, op="median")
    with pytest.raises(TypeError, match=r"all_reduce: dtype int32 not supported; supported: float32, float16, "
                                        r"bfloat16"):
        comm.all_reduce_(torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"symmetric_empty: device cpu not supported; supported: cuda"):
        comm.symmetric_empty((4,), torch.float32, device="cpu")
    with pytest.raises(TypeError, match=r"symmetric_empty: dtype must be a torch.dtype"):
        comm.symmetric_empty((4,), "float32", device="cuda:0")
    # Still usable afterwards: a real collective on every rank gives the exact sum.
    y = torch.full((5,), float(ctx.rank + 1))
    comm.all_reduce_(y)
    assert torch.equal(y, torch.full((5,), float(sum(range(1, ctx.world_size + 1)))))
    return True


def test_bad_inputs_raise_synchronously_and_comm_survives(ranks):
    assert ranks(2).run(_bad_gpu_independent_inputs) == [True, True]
