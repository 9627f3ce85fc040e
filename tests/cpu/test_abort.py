"""abort() from another thread ends pending waits; error() / getError() say why a communicator
stopped (Note [abort])."""
import threading
import time
from datetime import timedelta

import pytest
import torch

from test_backend import ddacomm_world


def _abort_later(abort, delay_s=0.3):
    """Calls abort() from another thread after delay_s; returns the thread and when it aborted."""
    when = {}

    def run():
        time.sleep(delay_s)
        when["t"] = time.monotonic()
        abort()
    thread = threading.Thread(target=run)
    thread.start()
    return thread, when


def _direct_abort(ctx, kind):
    import commlib
    comm = ctx.new_comm(f"abort-{kind}", timeout=timedelta(seconds=60))
    comm.barrier()
    if ctx.rank == 1:  # never joins; waits until rank 0 is done
        ctx.store.wait([f"abort-{kind}-done"], timedelta(seconds=60))
        comm.close()
        return None
    assert comm.error() == "none"
    thread, when = _abort_later(comm.abort)
    # A receive waits in its torch Work, which raises DistBackendError (PeerError's base).
    error = commlib.PeerError if kind == "all_reduce" else torch.distributed.DistBackendError
    with pytest.raises(error, match="aborted") as info:
        if kind == "all_reduce":
            comm.all_reduce_(torch.randn(4096))
        else:
            comm.recv(torch.empty(10), src=1)
    ended = time.monotonic()
    thread.join()
    state = comm.error()
    with pytest.raises(commlib.PeerError, match="aborted"):  # every later call raises at once
        comm.all_reduce_(torch.randn(8))
    with pytest.raises(commlib.PeerError, match="aborted"):
        comm.barrier()
    comm.close()
    ctx.store.set(f"abort-{kind}-done", "1")
    return state, ended - when["t"], str(info.value)


@pytest.mark.parametrize("kind", ["all_reduce", "recv"])
def test_direct_api_abort_ends_a_pending_wait(ranks, kind):
    state, latency, text = ranks(2).run(_direct_abort, kind, timeout=120)[0]
    assert state == "aborted"
    # The wait ended because of the abort (its message), far before the 60 s timeout.
    assert "waiting for rank 1" in text and latency < 30, (latency, text)


def _backend_abort(ctx):
    import torch.distributed as dist
    errors = torch._C._distributed_c10d.ErrorType
    with ddacomm_world(ctx, timeout_s=60) as (world, _):
        backend = world._get_backend(torch.device("cpu"))
        x = torch.randn(1000)
        dist.all_reduce(x)
        if ctx.rank == 1:
            ctx.store.wait(["backend-abort-done"], timedelta(seconds=60))
            return None
        assert backend.get_error() == errors.SUCCESS
        thread, when = _abort_later(backend.abort)
        with pytest.raises(dist.DistBackendError, match="aborted"):
            dist.all_reduce(x)
        ended = time.monotonic()
        thread.join()
        with pytest.raises(RuntimeError, match="aborted"):
            dist.all_reduce(x)
        state = backend.get_error()
        ctx.store.set("backend-abort-done", "1")
        return str(state), ended - when["t"]


def test_backend_abort_ends_a_pending_all_reduce(ranks):
    state, latency = ranks(2).run(_backend_abort, timeout=120)[0]
    assert state in ("ErrorType.REMOTE_ERROR", "ErrorType.COMM_ERROR") and latency < 30, (state, latency)


def _peer_exit_error(ctx):
    import os
    import commlib
    comm = ctx.new_comm("exit-error", timeout=timedelta(seconds=60))
    comm.barrier()
    if ctx.rank == 1:
        os._exit(0)
    with pytest.raises(commlib.PeerError, match="exited"):
        comm.all_reduce_(torch.ones(100))
    ctx.store.set("exit-error-state", comm.error())
    comm.close()


def test_error_names_a_peer_that_exited(ranks):
    from conftest import RankFailure
    pool = ranks(2)
    with pytest.raises(RankFailure) as info:
        pool.run(_peer_exit_error, timeout=120)
    assert sorted(info.value.errors) == [1] and info.value.errors[1][0] == "EOFError"
    assert pool.store.get("exit-error-state") == b"remote"
