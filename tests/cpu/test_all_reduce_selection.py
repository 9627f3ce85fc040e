"""GPU all-reduce algorithm selection and GPU-independent argument checks (run without a GPU).

Reference: the built-in table documented in csrc/core/algorithm_selector.cc / docs/gpu-allreduce.md,
and the override order documented in csrc/core/algorithm_selector.hpp.
"""
import json
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
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache/commlib/tune.json from the machine


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
    path.write_text(json.dumps({"version": 1, "all_reduce": entries, "all_to_all": [{"ignored": True}]}))
    return str(path)


def test_tune_file(monkeypatch, tmp_path):
    tune = write_tune(tmp_path / "tune.json", [
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
    write_tune(cache / "tune.json", [{"world_size": 2, "flat_max_bytes": 777, "tree_max_bytes": 999}])
    assert _C.all_reduce_limits(2, torch.bfloat16) == (777, 999)


def test_tune_file_errors(monkeypatch, tmp_path):
    missing = tmp_path / "nope.json"
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(missing))
    with pytest.raises(ValueError, match=r"COMMLIB_TUNE_FILE: cannot read '.*nope.json'"):
        select(KiB)
    bad = tmp_path / "bad.json"
    bad.write_text('{"all_reduce": [ {"world_size": 2, ')
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(bad))
    with pytest.raises(ValueError, match=r"cannot parse '.*bad.json'"):
        select(KiB)
    incomplete = tmp_path / "incomplete.json"
    incomplete.write_text('{"all_reduce": [{"world_size": 2, "flat_max_bytes": 1}]}')
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(incomplete))
    with pytest.raises(ValueError, match=r"lacks a non-negative \"tree_max_bytes\""):
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
