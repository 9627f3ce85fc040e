"""abort() ends a pending device wait; a killed rank during a device wait; GPU calls in the flight
recorder (Note [abort], Note [flight recorder]). Ranks may share one GPU (COMMLIB_TEST_SHARE_GPUS=1)."""
from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu


def _device_wait_aborted(ctx, count):
    import commlib
    torch.cuda.set_device(ctx.device)
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm("gpu-abort", timeout=timedelta(seconds=60))
    x = torch.randn(count, dtype=torch.bfloat16, device=dev)
    comm.all_reduce_(x)  # GPU state set up on every rank
    torch.cuda.synchronize()
    comm.barrier()
    if ctx.rank == 1:  # never joins the next all-reduce
        ctx.store.wait([f"gpu-abort-done-{count}"], timedelta(seconds=120))
        comm.close()
        return None
    comm.all_reduce_(x)  # enqueued: its kernel waits on the device for rank 1
    aborted_at = {}

    def abort():
        time.sleep(0.5)
        aborted_at["t"] = time.monotonic()
        comm.abort()
    thread = threading.Thread(target=abort)
    thread.start()
    torch.cuda.synchronize()  # returns once the kernel has seen the poisoned state
    freed = time.monotonic()
    thread.join()
    state = comm.error()
    with pytest.raises(commlib.PeerError, match="aborted"):
        comm.all_reduce_(x)
    comm.close()
    ctx.store.set(f"gpu-abort-done-{count}", "1")
    return state, freed - aborted_at["t"]


# 128 KiB: the LL kernel's line waits (ll_wait_all); 4 MiB: a flag barrier (wait_flag).
@pytest.mark.parametrize("count", [1 << 16, 1 << 21])
@pytest.mark.parametrize("world_size", [2])
def test_abort_ends_a_device_wait(ranks, world_size, count):
    state, latency = ranks(world_size).run(_device_wait_aborted, count, timeout=180)[0]
    # The device wait ended because of the abort, long before the 60 s timeout.
    assert state == "aborted" and latency < 30, (state, latency)


def _killed_during_device_wait(ctx, victim):
    import commlib
    torch.cuda.set_device(ctx.device)
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm("gpu-kill", timeout=timedelta(seconds=10))
    x = torch.randn(4096, device=dev)
    comm.all_reduce_(x.clone())
    torch.cuda.synchronize()
    comm.barrier()
    if ctx.rank == victim:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(commlib.CommError):
        for _ in range(100_000):
            comm.all_reduce_(x.clone())
            torch.cuda.synchronize()
    state = comm.error()
    comm.close()
    ctx.store.set(f"gpu-kill-{ctx.rank}", state)


@pytest.mark.parametrize("world_size", [2])
def test_killed_rank_during_a_device_wait(ranks, world_size):
    from conftest import RankFailure
    pool = ranks(world_size)
    with pytest.raises(RankFailure) as info:
        pool.run(_killed_during_device_wait, 1, timeout=180)
    assert sorted(info.value.errors) == [1]
    assert pool.store.get("gpu-kill-0") in (b"timeout", b"remote")


def _gpu_calls_recorded(ctx):
    import torch.distributed as dist

    import commlib  # noqa: F401  (registers "ddacomm")
    torch.cuda.set_device(ctx.device)
    dev = torch.device("cuda", ctx.device)
    before = len(pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"])
    ctx.drop_default_group()
    dist.init_process_group("ddacomm", store=dist.PrefixStore("gpu-fr", ctx.store), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=120))
    try:
        x = torch.randn(4096, dtype=torch.bfloat16, device=dev)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        dist.all_reduce(x)  # polls the first call's event
        torch.cuda.synchronize()
        entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"][before:]
    finally:
        dist.destroy_process_group()
    mine = [e for e in entries if " ddacomm." in e["profiling_name"]]
    return [(e["profiling_name"].split(" ")[0], e["state"]) for e in mine]


@pytest.mark.parametrize("world_size", [2])
def test_gpu_calls_in_the_flight_recorder(ranks, world_size):
    got = ranks(world_size, env={"TORCH_FR_BUFFER_SIZE": "100"}).run(_gpu_calls_recorded)
    assert got[0] == got[1]
    assert got[0][0] == ("nccl:all_reduce", "completed") and got[0][1][0] == "nccl:all_reduce"
