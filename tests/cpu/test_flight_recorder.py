"""ddacomm and direct-API calls in torch's flight recorder, and torch's analyzer over their dumps
(Note [flight recorder])."""
import os
import pickle
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import pytest
import torch

from test_backend import ddacomm_world

FR_ENV = {"TORCH_FR_BUFFER_SIZE": "200"}


def _entries():
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]


def _backend_calls(ctx):
    import commlib
    import torch.distributed as dist
    assert commlib._C.fr_enabled() and commlib._C.fr_shares_torch_recorder()
    before = len(_entries())
    n = ctx.world_size
    with ddacomm_world(ctx) as (world, _):
        x = torch.randn(1000 + ctx.rank * 0)  # the same shape on every rank
        dist.all_reduce(x)
        dist.broadcast(x, src=1)
        out = torch.empty(n * 7, dtype=torch.float16)
        dist.all_gather_into_tensor(out, torch.randn(7).half())
        rs = torch.empty(5)
        dist.reduce_scatter_tensor(rs, torch.randn(5 * n))
        dist.all_to_all_single(torch.empty(3 * n), torch.randn(3 * n))
        dist.barrier()
        assert world._get_backend(torch.device("cpu")).get_error() == torch._C._distributed_c10d.ErrorType.SUCCESS
    mine = [e for e in _entries()[before:] if " ddacomm." in e["profiling_name"]]
    return [(e["profiling_name"], e["collective_seq_id"], e["state"], e["input_sizes"], e["output_sizes"],
             e["input_dtypes"]) for e in mine]


def test_backend_calls_are_recorded(ranks):
    results = ranks(2, env=FR_ENV).run(_backend_calls)
    assert results[0] == results[1]  # every rank records the same calls with the same sequence ids
    names = [r[0] for r in results[0]]
    assert names == ["gloo:all_reduce ddacomm.host", "gloo:broadcast ddacomm.host",
                     "gloo:_all_gather_base ddacomm.host", "gloo:_reduce_scatter_base ddacomm.host",
                     "gloo:all_to_all_single ddacomm.host", "gloo:barrier ddacomm.host"]
    seqs = [r[1] for r in results[0]]
    assert seqs == list(range(seqs[0], seqs[0] + 6))
    assert all(r[2] == "completed" for r in results[0])
    assert results[0][0][3] == [[1000]] and results[0][2][3:6] == ([[7]], [[14]], ["Half"])
    assert results[0][3][3:5] == ([[10]], [[5]])


def _direct_calls(ctx):
    import commlib
    before = len(_entries())
    comm = ctx.new_comm("fr-direct")
    x = torch.randn(33)
    comm.all_reduce_(x, algo="tree")
    comm.all_reduce(x, "max")
    comm.all_gather(torch.empty(33 * ctx.world_size), x)
    comm.barrier()
    assert isinstance(comm._comm, commlib.flight_recorder.RecordingComm)
    comm.close()
    mine = [e for e in _entries()[before:] if "ddacomm." in e["profiling_name"]]
    return [(e["profiling_name"], e["state"], e["input_sizes"]) for e in mine]


def test_direct_api_calls_are_recorded(ranks):
    results = ranks(2, env=FR_ENV).run(_direct_calls)
    assert results[0] == results[1]
    assert results[0] == [("gloo:all_reduce ddacomm.tree", "completed", [[33]]),
                          ("gloo:all_reduce ddacomm.auto", "completed", [[33]]),
                          ("gloo:_all_gather_base ddacomm.host", "completed", [[33]]),
                          ("gloo:barrier ddacomm.host", "completed", [])]


def _recorder_off(ctx):
    import commlib
    comm = ctx.new_comm("fr-off")
    native = comm._comm is comm.native
    comm.close()
    return commlib._C.fr_enabled(), native


def test_recorder_off_leaves_the_call_path_alone(ranks):
    # No buffer: the communicator calls the native object.
    assert ranks(2, env={"TORCH_FR_BUFFER_SIZE": "0"}).run(_recorder_off) == [(False, True)] * 2


def _skip_one(ctx, dump_dir, skipper):
    """Every rank but `skipper` runs four all-reduces; `skipper` skips the third and then waits for
    the others' dumps. Returns (error class, getError) on the ranks that failed."""
    import torch.distributed as dist
    with ddacomm_world(ctx, timeout_s=3) as (world, _):
        x = torch.ones(64)
        for i in range(4):
            if ctx.rank == skipper and i == 2:
                # Alive but elsewhere: its watcher writes its dump once a peer has asked for dumps.
                deadline = time.monotonic() + 60
                while len(os.listdir(dump_dir)) < ctx.world_size and time.monotonic() < deadline:
                    time.sleep(0.1)
                return ("skipped", None)
            try:
                dist.all_reduce(x)
            except dist.DistBackendError as e:
                error = world._get_backend(torch.device("cpu")).get_error()
                return (type(e).__name__, str(error))
    return ("no error", None)


@pytest.mark.parametrize("world_size,skipper", [(2, 1), (3, 2)])
def test_analyzer_names_the_rank_that_did_not_join(ranks, world_size, skipper):
    with tempfile.TemporaryDirectory() as dump_dir:
        env = dict(FR_ENV, TORCH_FR_DUMP_TEMP_FILE=os.path.join(dump_dir, "rank_"), COMMLIB_FR_TEST=dump_dir)
        pool = ranks(world_size, env=env)
        results = pool.run(_skip_one, dump_dir, skipper, timeout=90)
        pool.close()
        for rank, result in enumerate(results):
            if rank == skipper:
                assert result == ("skipped", None)
            else:
                assert result == ("DistBackendError", "ErrorType.TIMEOUT"), result
        assert sorted(os.listdir(dump_dir)) == [f"rank_{r}" for r in range(world_size)]
        report = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", dump_dir],
                                capture_output=True, text=True, timeout=120)
        text = report.stdout + report.stderr  # the analyzer reports through logging
        assert report.returncode == 0, text
        assert "Not all ranks joining collective, sequence number: 3" in text, text
        assert f"missing ranks: {{{skipper}}}" in text, text
        assert f"waiting for rank {skipper}" in text  # commlib's own note on the entry


def _direct_timeout(ctx, dump_dir):
    import commlib
    comm = ctx.new_comm("fr-timeout", timeout=timedelta(seconds=2))
    comm.barrier()
    if ctx.rank == 1:
        time.sleep(4)
        comm.close()
        return None
    with pytest.raises(commlib.CommTimeoutError):
        comm.all_reduce_(torch.ones(10))
    comm.close()
    with open(os.path.join(dump_dir, "rank_0"), "rb") as f:
        entries = pickle.load(f)["entries"]
    return entries[-1]["profiling_name"], entries[-1]["state"]


def test_direct_api_timeout_dumps(ranks):
    with tempfile.TemporaryDirectory() as dump_dir:
        env = dict(FR_ENV, TORCH_FR_DUMP_TEMP_FILE=os.path.join(dump_dir, "rank_"), COMMLIB_FR_TEST=dump_dir)
        pool = ranks(2, env=env)
        name, state = pool.run(_direct_timeout, dump_dir, timeout=60)[0]
        pool.close()
    assert name.startswith("gloo:all_reduce ddacomm.auto [all_reduce= Timed out after") and "waiting for rank 1" in name
    assert state == "started"
