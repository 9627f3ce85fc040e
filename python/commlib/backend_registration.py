"""Registers the torch.distributed backend "ddacomm" (a drop-in for NCCL and gloo).

``register_backend()`` is idempotent; ``import commlib`` calls it, and so does the
``torch.backends`` entry point (``commlib._autoload``) after a plain ``import torch``.

For each process group the creator builds, from the group's store:
  * a commlib communicator (CPU shared-memory collectives, GPU fast paths) when every rank of the
    group is on this host (decided collectively through the store), else none; torch.ops.commlib
    ops name it ``"ddacomm-" + group_name`` (docs/ops.md);
  * an inner gloo backend for the CPU calls commlib does not take;
  * an inner NCCL backend for the CUDA calls it does not take, created on first CUDA use only
    (a CPU-only process never touches NCCL).
See csrc/torch/backend.cpp, Note [ddacomm routing], for which calls take which path.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

BACKEND_NAME = "ddacomm"
_registered = False


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _single_host(store, rank: int, world_size: int, timeout: timedelta) -> bool:
    """True when every rank of the group runs on this host (collective over the store).

    Waits at most the group's ``timeout`` (not the store's own) for the other ranks."""
    import torch.distributed as dist
    store.set(f"host/{rank}", _host_id())
    mine = _host_id()
    for r in range(world_size):
        try:
            store.wait([f"host/{r}"], timeout)
        except (dist.DistStoreError, RuntimeError) as e:
            raise dist.DistBackendError(
                f"ddacomm group creation: Timed out after {timeout.total_seconds() * 1000:.0f} ms: rank {rank} "
                f"waiting for rank {r} at set-up phase 'host' ({e})") from e
    return all(store.get(f"host/{r}").decode() == mine for r in range(world_size))


def _group_token(store, rank: int, timeout: timedelta) -> str:
    """A random token chosen by rank 0, the same on every rank of the group."""
    import uuid

    import torch.distributed as dist
    key = "ddacomm/token"
    if rank == 0:
        store.set(key, uuid.uuid4().hex)
    try:
        store.wait([key], timeout)
    except (dist.DistStoreError, RuntimeError) as e:
        raise dist.DistBackendError(f"ddacomm group creation: Timed out after {timeout.total_seconds() * 1000:.0f} ms: "
                                    f"rank {rank} waiting for rank 0 at set-up phase 'token' ({e})") from e
    return store.get(key).decode()


def _make_gloo(store, rank: int, world_size: int, timeout: timedelta, group_name: str, global_ranks):
    from torch.distributed import ProcessGroupGloo
    gloo = ProcessGroupGloo(store, rank, world_size, timeout)
    try:
        gloo.options.global_ranks_in_group = list(global_ranks)
        gloo.options.group_name = group_name
    except (AttributeError, TypeError):  # older torch: options are read-only or absent
        pass
    return gloo


def _nccl_factory(store, rank: int, world_size: int, timeout: timedelta, group_name: str, global_ranks,
                  backend_options):
    """A callable creating the inner NCCL backend, or None without CUDA / NCCL."""
    import torch
    import torch.distributed as dist
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None

    def create():
        from torch.distributed import ProcessGroupNCCL
        opts = backend_options if isinstance(backend_options, ProcessGroupNCCL.Options) else ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.global_ranks_in_group = list(global_ranks)
        opts.group_name = group_name
        return ProcessGroupNCCL(store, rank, world_size, opts)

    return create


def _create_backend(dist_opts, backend_options=None):
    """The creator torch calls (extended API) for every "ddacomm" process group."""
    import torch.distributed as dist

    from . import _C

    store = dist_opts.store
    rank, world_size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout
    group_name = str(dist_opts.group_id)
    global_ranks = list(dist_opts.global_ranks_in_group) or list(range(world_size))

    comm = None
    if _single_host(dist.PrefixStore("ddacomm/", store), rank, world_size, timeout):
        # A name no other communicator of this process has: the core numbers communicators of one
        # name in creation order, and a rank creates only the subgroups it belongs to, so a name
        # reused per group id ("2") would number differently on different ranks.
        comm = _C.Communicator(dist.PrefixStore("ddacomm/commlib/", store), rank, world_size,
                               f"ddacomm-{group_name}-{_group_token(store, rank, timeout)}", timeout.total_seconds())
        # torch.ops.commlib ops name it 'ddacomm-<group name>' (docs/ops.md).
        _C.register_group(f"ddacomm-{group_name}", comm, replace=True)
    gloo = _make_gloo(dist.PrefixStore("ddacomm/gloo/", store), rank, world_size, timeout, group_name, global_ranks)
    nccl = _nccl_factory(dist.PrefixStore("ddacomm/nccl/", store), rank, world_size, timeout, group_name,
                         global_ranks, backend_options)
    return _C.DdaBackend(rank, world_size, comm, gloo, nccl, timeout, group_name, global_ranks)


def register_backend() -> bool:
    """Registers "ddacomm" with torch.distributed (idempotent). Returns True once registered."""
    global _registered
    if _registered:
        return True
    import torch.distributed as dist
    if not dist.is_available():
        return False
    if BACKEND_NAME.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])
    _registered = True
    return True


def is_registered() -> bool:
    import torch.distributed as dist
    return BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {})


__all__ = ["BACKEND_NAME", "register_backend", "is_registered"]
