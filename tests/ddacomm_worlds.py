"""A "ddacomm" process group inside a test rank, and its CUDA call counters (shared by the GPU
backend tests); ``as_host``, which makes a rank act as a host of its own."""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch


@contextlib.contextmanager
def as_host(host):
    """This rank acts as host ``host`` (COMMLIB_TEST_HOST_ID) while communicators and groups are
    created (Note [communicator hosts])."""
    os.environ["COMMLIB_TEST_HOST_ID"] = f"host-{host}"
    try:
        yield
    finally:
        os.environ.pop("COMMLIB_TEST_HOST_ID", None)


@contextlib.contextmanager
def ddacomm_world(ctx, device_id: bool = False, with_nccl: bool = True):
    """A fresh "ddacomm" default group of the rank pool (any earlier one destroyed), and an NCCL
    group of the same ranks when with_nccl; yields (world, nccl or None)."""
    import commlib  # noqa: F401  (registers "ddacomm")
    import torch.distributed as dist
    ctx.drop_default_group()
    n = ctx.scratch["ddacomm-worlds"] = ctx.scratch.get("ddacomm-worlds", 0) + 1
    store = dist.PrefixStore(f"ddacomm-gpu-test/{n}", ctx.store)
    kwargs = {"device_id": torch.device("cuda", ctx.device)} if device_id else {}
    dist.init_process_group("ddacomm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=120), **kwargs)
    try:
        yield dist.group.WORLD, (dist.new_group(backend="nccl") if with_nccl else None)
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group()


def fast_path_counts(group):
    """(commlib calls, inner-backend calls) of the group's DdaBackend for CUDA tensors so far."""
    backend = group._get_backend(torch.device("cuda"))
    assert type(backend).__name__ == "DdaBackend" and backend.has_fast_path, type(backend).__name__
    return backend.num_fast_calls, backend.num_fallback_calls
