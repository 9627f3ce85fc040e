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
        if r != victim:  # every survivor finished (the store has its timings)
            assert pool.store.check([f"shrink-times-{world_size}-{r}"])


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
