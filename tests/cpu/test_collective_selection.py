"""The crossovers of the CUDA reduce_scatter / all_gather / broadcast / all_to_all (run without a GPU).

Reference: the built-in table of Note [collective crossovers] (csrc/core/algorithm_selector.cc,
docs/gpu-collectives.md) and the override order documented in csrc/core/algorithm_selector.hpp:
COMMLIB_<OP>_MAX_BYTES, then the tune file's "collectives" lines, then the table. Also: the tune
file commlib-tune writes carries the measured crossovers in those lines.
"""
import pytest

from commlib import _C
from commlib.perf import tune

KiB, MiB = 1 << 10, 1 << 20
OPS = ("reduce_scatter", "all_gather", "broadcast", "all_to_all")
KNOBS = {op: f"COMMLIB_{op.upper()}_MAX_BYTES" for op in OPS}
BUILTIN = {
    1: (16 * MiB, 16 * MiB, 16 * MiB, 16 * MiB),
    2: (16 * MiB, 16 * MiB, 16 * MiB, 16 * MiB),
    3: (8 * MiB, 8 * MiB, 2 * MiB, 8 * MiB),
    4: (8 * MiB, 8 * MiB, 2 * MiB, 8 * MiB),
    8: (4 * MiB, 4 * MiB, 1 * MiB, 4 * MiB),
    16: (1 * MiB, 1 * MiB, 256 * KiB, 1 * MiB),
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in list(KNOBS.values()) + ["COMMLIB_TUNE_FILE"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache/commlib/tune.txt from the machine


@pytest.mark.parametrize("world", sorted(BUILTIN))
def test_builtin_table(world):
    assert tuple(_C.collective_max_bytes(op, world) for op in OPS) == BUILTIN[world]


def test_knob_overrides_and_never(monkeypatch):
    monkeypatch.setenv("COMMLIB_ALL_GATHER_MAX_BYTES", str(3 * MiB + 1))
    monkeypatch.setenv("COMMLIB_BROADCAST_MAX_BYTES", "-1")
    assert _C.collective_max_bytes("all_gather", 2) == 3 * MiB + 1
    assert _C.collective_max_bytes("broadcast", 2) == 0  # -1: every non-empty message goes to NCCL
    assert _C.collective_max_bytes("reduce_scatter", 2) == 16 * MiB  # the others keep theirs


def test_bad_values_name_knob_value_and_valid_set(monkeypatch):
    monkeypatch.setenv("COMMLIB_ALL_TO_ALL_MAX_BYTES", "-5")
    with pytest.raises(ValueError, match=r"COMMLIB_ALL_TO_ALL_MAX_BYTES=-5 invalid; valid: -1 .*0 .*byte count"):
        _C.collective_max_bytes("all_to_all", 2)
    monkeypatch.setenv("COMMLIB_ALL_TO_ALL_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match=r"COMMLIB_ALL_TO_ALL_MAX_BYTES='lots' is not an integer"):
        _C.collective_max_bytes("all_to_all", 2)
    monkeypatch.delenv("COMMLIB_ALL_TO_ALL_MAX_BYTES")
    with pytest.raises(ValueError, match=r"collective_max_bytes: op 'gather' not known; known: reduce_scatter"):
        _C.collective_max_bytes("gather", 2)
    with pytest.raises(ValueError, match=r"world_size 0 must be >= 1"):
        _C.collective_max_bytes("all_gather", 0)


def test_tune_file_entries_and_precedence(monkeypatch, tmp_path):
    path = tmp_path / "tune.txt"
    path.write_text(f"""collectives world_size=2 op=all_gather max_bytes={5 * MiB}
collectives world_size=2 op=all_gather max_bytes={6 * MiB}
collectives world_size=4 op=reduce_scatter max_bytes=123
collectives world_size=2 op=some_future_op max_bytes=7
""")  # the last all_gather line wins
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(path))
    assert _C.collective_max_bytes("all_gather", 2) == 6 * MiB
    assert _C.collective_max_bytes("reduce_scatter", 4) == 123
    assert _C.collective_max_bytes("reduce_scatter", 2) == 16 * MiB  # no entry: built-in
    monkeypatch.setenv("COMMLIB_ALL_GATHER_MAX_BYTES", "4096")  # the knob wins over the file
    assert _C.collective_max_bytes("all_gather", 2) == 4096


def test_tune_file_errors(monkeypatch, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("collectives world_size=2 max_bytes=5\n")
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(path))
    with pytest.raises(ValueError, match=r"bad.txt' line 1: no op=<value>: 'collectives world_size=2 max_bytes=5'"):
        _C.collective_max_bytes("all_gather", 2)


def test_commlib_tune_writes_the_collectives_list(monkeypatch, tmp_path):
    key = {"device": "NVIDIA H200", "world_size": 2, "link": "nvlink", "version": "x"}
    entry = {"key": key, "all_reduce": {"flat_max_bytes": 1, "tree_max_bytes": 2}, "fused_num_sms": None,
             "collectives": {"all_gather": 8 * MiB, "broadcast": 0}}
    path = tmp_path / "t.txt"
    tune.save(entry, str(path))
    lines = path.read_text().splitlines()
    assert sorted(line for line in lines if line.startswith("collectives ")) == [
        f"collectives world_size=2 op=all_gather max_bytes={8 * MiB}",
        "collectives world_size=2 op=broadcast max_bytes=0"]
    assert _C.collective_max_bytes("all_gather", 2) == 16 * MiB  # not COMMLIB_TUNE_FILE: built-in
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(path))
    assert _C.collective_max_bytes("all_gather", 2) == 8 * MiB  # what the C++ reader makes of it


def test_threshold_fit_picks_the_crossover():
    sizes = [1 << k for k in range(10, 27, 2)]
    ours = [5.0 * (1 + s / (8 * MiB)) for s in sizes]     # faster up to ~8 MiB
    nccl = [10.0 * (1 + s / (32 * MiB)) for s in sizes]
    limit = tune._threshold(sizes, ours, nccl)
    assert 4 * MiB <= limit <= 16 * MiB
    assert tune._threshold(sizes, [2 * t for t in nccl], nccl) == 0  # never ours


def test_commlib_tune_refuses_a_bad_collectives_entry(tmp_path):
    key = {"device": "NVIDIA H200", "world_size": 2, "link": "nvlink", "version": "x"}
    entry = {"key": key, "all_reduce": {"flat_max_bytes": 1, "tree_max_bytes": 2}, "collectives": {"gather": 5}}
    with pytest.raises(ValueError, match=r"collectives must map reduce_scatter, all_gather, broadcast, all_to_all"):
        tune.save(entry, str(tmp_path / "t.txt"))
