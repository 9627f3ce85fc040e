"""Carrying on after a rank dies: Communicator.shrink over the survivors (Note [abort] for the
error state the survivors see first)."""
import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from test_host_collectives import ordered_reference, rank_input


def _kill_then_shrink(ctx, victim, count):
    import commlib
    comm = ctx.new_comm(f"shrink-{ctx.world_size}-{victim}", timeout=timedelta(seconds=60))
    x = rank_input(ctx.rank, count, torch.float32, salt=5)
    comm.all_reduce_(x.clone())  # everything set up and working before the kill
    comm.barrier()
    if ctx.rank == victim:
        time.sleep(0.2)  # the survivors are inside the next all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    killed_after = time.monotonic()
    with pytest.raises(commlib.PeerError, match=rf"rank {victim} \(pid \d+\) has exited"):
        for _ in range(100_000):  # mid-collective: the victim dies while the survivors wait in one
            comm.all_reduce_(x.clone())
    errored = time.monotonic()
    assert comm.error() == "remote"
    small = comm.shrink([victim])
    comm.close()
    survivors = [r for r in range(ctx.world_size) if r != victim]
    assert (small.rank, small.world_size) == (survivors.index(ctx.rank), len(survivors))
    out = torch.full((count,), float("nan"))
    small.all_reduce(x, out=out)
    recovered = time.monotonic()
    expected = ordered_reference([rank_input(r, count, torch.float32, salt=5) for r in survivors], "sum",
                                 len(survivors))
    assert torch.equal(out, expected)
    for algo in ("flat", "tree"):  # both shapes work over the survivors
        y = rank_input(ctx.rank, 70_001, torch.bfloat16, salt=9)
        small.all_reduce_(y, algo=algo)
        ref = ordered_reference([rank_input(r, 70_001, torch.bfloat16, salt=9) for r in survivors], "sum",
                                len(survivors))
        assert torch.equal(y, ref)
    small.close()
    ctx.store.set(f"shrink-times-{ctx.world_size}-{ctx.rank}", f"{errored - killed_after} {recovered - errored}")


@pytest.mark.parametrize("world_size,victim", [(3, 1), (4, 3)])
def test_survivors_shrink_and_carry_on(ranks, world_size, victim):
    from conftest import RankFailure
    pool = ranks(world_size)
    with pytest.raises(RankFailure) as info:
        pool.run(_kill_then_shrink, victim, 4097, timeout=120)
    assert sorted(info.value.errors) == [victim] and info.value.errors[victim][0] == "EOFError"
    for r in range(world_size):
        if r != victim:  # every survivor finished (the store has its timings, printed for `pytest -s`)
            assert pool.store.check([f"shrink-times-{world_size}-{r}"])
            to_error, to_step = map(float, pool.store.get(f"shrink-times-{world_size}-{r}").split())
            print(f"world {world_size}, rank {r}: kill -> PeerError {to_error * 1e3:.0f} ms, "
                  f"PeerError -> first all-reduce after shrink {to_step * 1e3:.0f} ms")


def _bad_shrink(ctx):
    comm = ctx.new_comm("shrink-bad")
    msgs = []
    for bad in ([], [ctx.world_size], [0, 1], [ctx.rank]):
        with pytest.raises(ValueError) as info:
            comm.shrink(bad)
        msgs.append(str(info.value))
    x = torch.ones(5)
    comm.all_reduce_(x)  # still usable
    comm.close()
    return msgs, x.tolist()


def test_shrink_rejects_bad_ranks(ranks):
    msgs, x = ranks(2).run(_bad_shrink)[0]
    assert x == [2.0] * 5
    assert "exclude_ranks [] not supported" in msgs[0] and "0..1" in msgs[0]
    assert "exclude_ranks [2] not supported" in msgs[1]
    assert "leaves at least one rank" in msgs[2]
    assert "rank 0 is in exclude_ranks [0]" in msgs[3]


def _torch_shrink_group(ctx, victim):
    import torch.distributed as dist
    from test_backend import ddacomm_world
    with ddacomm_world(ctx, timeout_s=60) as (world, _):
        x = rank_input(ctx.rank, 1000, torch.float32, salt=3)
        dist.all_reduce(x.clone())
        if ctx.rank == victim:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        with pytest.raises(dist.DistBackendError, match=rf"rank {victim} \(pid \d+\) has exited"):
            for _ in range(100_000):
                dist.all_reduce(x.clone())
        backend = world._get_backend(torch.device("cpu"))
        assert backend.supports_shrinking
        small = dist.shrink_group([victim])  # the default group: it becomes the new default
        survivors = [r for r in range(ctx.world_size) if r != victim]
        assert (dist.get_rank(small), dist.get_world_size(small)) == (survivors.index(ctx.rank), len(survivors))
        y = x.clone()
        dist.all_reduce(y, group=small)
        expected = ordered_reference([rank_input(r, 1000, torch.float32, salt=3) for r in survivors], "sum",
                                     len(survivors))
        assert torch.equal(y, expected)
        assert small._get_backend(torch.device("cpu")).num_fast_calls >= 1  # commlib served it
    ctx.store.set(f"torch-shrink-{ctx.world_size}-{ctx.rank}", "1")


def test_torch_shrink_group(ranks):
    from conftest import RankFailure
    if not hasattr(torch.distributed, "shrink_group"):
        pytest.skip("this torch has no shrink_group")
    pool = ranks(3)
    with pytest.raises(RankFailure) as info:
        pool.run(_torch_shrink_group, 1, timeout=120)
    assert sorted(info.value.errors) == [1] and info.value.errors[1][0] == "EOFError"
    assert pool.store.check(["torch-shrink-3-0"]) and pool.store.check(["torch-shrink-3-2"])
