"""GPU memory comes back: a communicator's symmetric memory (workspace, barrier pads, LL lines),
symmetric tensors and EPBuffers are released on close() or when dropped, cycle after cycle, so a
program that creates and closes communicators does not leak device memory."""
from __future__ import annotations

import gc
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _store_barrier(ctx, tag: str) -> None:
    # Over the store, not a commlib collective: a barrier that allocates nothing on the GPU.
    key = f"memory-release-{tag}"
    ctx.store.add(key, 1)
    deadline = time.monotonic() + 60
    while ctx.store.add(key, 0) < ctx.world_size:
        assert time.monotonic() < deadline, f"store barrier {tag}: peers did not arrive"
        time.sleep(0.005)


def _free_bytes(ctx, tag: str) -> int:
    """Free device memory once every rank has dropped what it released (ranks may share a GPU)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _store_barrier(ctx, tag + "-released")
    free = torch.cuda.mem_get_info()[0]
    _store_barrier(ctx, tag + "-measured")
    return free


def _use_everything(ctx, cycle: int) -> int:
    """One communicator with every allocating path used once; returns the free bytes while it is open."""
    import commlib
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm(f"memory-release-{cycle}")
    x = torch.randn(1 << 20, device=dev)  # 4 MiB: the copy-in tree through the workspace
    comm.all_reduce_(x, algo="flat")
    comm.all_reduce_(x, algo="tree")
    comm.all_reduce_(torch.randn(1000, device=dev))  # the LL lines
    sym = comm.symmetric_empty((8 * MiB,), torch.bfloat16, dev)  # 16 MiB of symmetric memory
    sym.copy_(torch.randn(8 * MiB, device=dev))
    comm.all_reduce_(sym)
    tokens, hidden = 33, 8192
    residual = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=dev)
    comm.fused_allreduce_rmsnorm(torch.randn_like(residual), residual, torch.ones(hidden, dtype=torch.bfloat16,
                                                                                   device=dev), 1e-6)
    buf = commlib.EPBuffer(comm, 64, 7168, 8 * ctx.world_size, 2, torch.bfloat16, device=dev)
    idx = torch.randint(0, 8 * ctx.world_size, (64, 2), device=dev)
    res = buf.dispatch(torch.randn(64, 7168, dtype=torch.bfloat16, device=dev), idx,
                       torch.rand(64, 2, device=dev))
    buf.combine(res.expert_x, res.handle)
    torch.cuda.synchronize()
    open_free = torch.cuda.mem_get_info()[0]
    comm.barrier()
    if cycle % 2 == 0:
        comm.close()  # explicitly; odd cycles only drop their references
    del comm, x, sym, residual, buf, idx, res
    return open_free


def _cycles(ctx):
    torch.cuda.set_device(ctx.device)
    torch.randn(1, device=f"cuda:{ctx.device}")  # the CUDA context and torch's own state
    _use_everything(ctx, 0)  # loads the kernels' modules (lazy loading keeps them), warms torch
    baseline = _free_bytes(ctx, "baseline")
    for cycle in range(1, 5):
        open_free = _use_everything(ctx, cycle)
        # The measurement sees the allocations: at least this rank's 64 MiB workspace and 16 MiB
        # symmetric tensor were in use.
        assert baseline - open_free >= 80 * MiB, f"cycle {cycle}: only {(baseline - open_free) / MiB:.1f} MiB in use"
        free = _free_bytes(ctx, f"cycle-{cycle}")
        lost = baseline - free
        how = "close()" if cycle % 2 == 0 else "dropping the references"
        assert lost <= 8 * MiB, f"cycle {cycle}: {lost / MiB:.1f} MiB not released after {how}"
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_gpu_memory_released_on_close_and_drop(ranks, world_size):
    assert all(ranks(world_size).run(_cycles, timeout=300))
