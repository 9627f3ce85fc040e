"""Registers the torch.distributed backend "ddacomm" (a drop-in for NCCL and gloo).

``register_backend()`` is idempotent; ``import commlib`` calls it. torch's entry points register the
same backend without importing commlib (``_commlib_autoload``, Note [lazy registration]); its
creator imports commlib and calls ``create_backend`` when the first group is made.

For each process group the creator builds, from the group's store:
  * a commlib communicator (CPU shared-memory collectives, GPU fast paths) when every rank of the
    group is on this host (decided collectively through the store), else none; torch.ops.commlib
    ops name it ``"ddacomm-" + group_name`` (docs/ops.md);
  * when the ranks span several hosts with the same number of ranks each: a hierarchy (an intra-host
    "ddacomm" backend over this host's ranks and an inter-host gloo / NCCL group of the ranks with
    this local index) for the two-level collectives (csrc/torch/hierarchy.hpp, Note [hierarchical
    collectives]; docs/multinode.md);
  * an inner gloo backend for the CPU calls commlib does not take;
  * an inner NCCL backend for the CUDA calls it does not take, created on first CUDA use only
    (a CPU-only process never touches NCCL).
See csrc/torch/backend.cpp, Note [ddacomm routing], for which calls take which path.
"""
from __future__ import annotations

import os
from datetime import timedelta

BACKEND_NAME = "ddacomm"
_registered = False


def _host_id() -> str:
    """This process's host id (the communicator's: ``commlib::host_id``, Note [communicator hosts])."""
    from . import _C
    return _C.host_id()


def _host_ids(store, rank: int, world_size: int, timeout: timedelta) -> list:
    """Every rank's host id, in group-rank order (collective over the store).

    Waits at most the group's ``timeout`` (not the store's own) for the other ranks."""
    import torch.distributed as dist
    store.set(f"host/{rank}", _host_id())
    for r in range(world_size):
        try:
            store.wait([f"host/{r}"], timeout)
        except (dist.DistStoreError, RuntimeError) as e:
            raise dist.DistBackendError(
                f"ddacomm group creation: Timed out after {timeout.total_seconds() * 1000:.0f} ms: rank {rank} "
                f"waiting for rank {r} at set-up phase 'host' ({e})") from e
    return [store.get(f"host/{r}").decode() for r in range(world_size)]


class HostLayout:
    """The group's ranks by host: hosts numbered in the order of their lowest rank, a rank's local
    index its order among its host's ranks (Note [hierarchical collectives])."""

    def __init__(self, host_ids, rank: int):
        order = []
        members = {}
        for r, h in enumerate(host_ids):
            if h not in members:
                order.append(h)
                members[h] = []
            members[h].append(r)
        self.hosts = [members[h] for h in order]  # group ranks of each host
        self.sizes = [len(m) for m in self.hosts]
        self.num_hosts = len(self.hosts)
        self.host_index = order.index(host_ids[rank])
        self.local_rank = self.hosts[self.host_index].index(rank)

    @property
    def uniform(self) -> bool:
        return len(set(self.sizes)) == 1

    @property
    def local_size(self) -> int:
        return self.sizes[self.host_index]

    def rank_of(self) -> list:
        """Group rank of local index l on host h at [h * local_size + l] (uniform layouts)."""
        return [r for host in self.hosts for r in host]

    def peers(self) -> list:
        """Group ranks with this rank's local index, in host order (the inter-host group)."""
        return [host[self.local_rank] for host in self.hosts]


def _creation_store(store, world_size: int):
    """The keys of this creation of the group. torch names a group again after
    destroy_process_group (the name counter restarts), so the group's store prefix comes back with
    the keys the last creation left; read as this one's, they pair ranks with stale tokens and
    addresses. Every member adds 1 to a counter once per creation, as its first step, and no member
    finishes a creation before all have started it, so (count - 1) // world_size numbers the creation
    the same on every rank."""
    import torch.distributed as dist
    joined = store.add("ddacomm/joined", 1)
    return dist.PrefixStore(f"ddacomm/{(joined - 1) // world_size}/", store)


def _group_token(store, rank: int, timeout: timedelta) -> str:
    """A random token chosen by rank 0, the same on every rank of the group."""
    import uuid

    import torch.distributed as dist
    key = "token"
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


def create_backend(dist_opts, backend_options=None):
    """The creator torch calls (extended API) for every "ddacomm" process group."""
    import torch.distributed as dist

    from . import _C

    rank, world_size = dist_opts.group_rank, dist_opts.group_size
    store = _creation_store(dist_opts.store, world_size)
    timeout = dist_opts.timeout
    group_name = str(dist_opts.group_id)
    global_ranks = list(dist_opts.global_ranks_in_group) or list(range(world_size))

    _forget_hierarchy(group_name)  # a destroyed group's of the same name
    comm = None
    layout = HostLayout(_host_ids(store, rank, world_size, timeout), rank)
    if layout.num_hosts == 1:
        # A name no other communicator of this process has: the core numbers communicators of one
        # name in creation order, and a rank creates only the subgroups it belongs to, so a name
        # reused per group id ("2") would number differently on different ranks.
        comm = _C.Communicator(dist.PrefixStore("commlib/", store), rank, world_size,
                               f"ddacomm-{group_name}-{_group_token(store, rank, timeout)}", timeout.total_seconds())
        # torch.ops.commlib ops name it 'ddacomm-<group name>' (docs/ops.md).
        _C.register_group(f"ddacomm-{group_name}", comm, replace=True)
    gloo = _make_gloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout, group_name, global_ranks)
    nccl = _nccl_factory(dist.PrefixStore("nccl/", store), rank, world_size, timeout, group_name,
                         global_ranks, backend_options)
    backend = _C.DdaBackend(rank, world_size, comm, gloo, nccl, timeout, group_name, global_ranks)
    if comm is not None:
        backend._set_shrink_factory(_shrinker(store, rank, world_size, timeout, group_name, global_ranks,
                                              backend_options))
    if layout.num_hosts > 1 and layout.uniform:
        _attach_hierarchy(backend, layout, store, rank, timeout, group_name, global_ranks, backend_options)
    return backend


def _shrinker(store, rank: int, world_size: int, timeout: timedelta, group_name: str, global_ranks,
              backend_options):
    """What torch's shrink_group gets from a one-host group: a backend over the survivors (renumbered
    in order) with its own communicator, gloo and NCCL factory under a prefix of the group's store
    that names the excluded ranks, so only survivors that agree on them meet. Nothing in it waits for
    an excluded rank (docs/debugging.md)."""
    def shrink(excluded):
        import torch.distributed as dist

        from . import _C
        excluded = sorted({int(r) for r in excluded})
        survivors = [r for r in range(world_size) if r not in excluded]
        new_rank, size = survivors.index(rank), len(survivors)
        tag = "-".join(map(str, excluded))
        sub = dist.PrefixStore(f"shrink-{tag}/", store)
        name = f"{group_name}-shrink-{tag}"
        ranks = [global_ranks[r] for r in survivors]
        comm = _C.Communicator(dist.PrefixStore("commlib/", sub), new_rank, size, f"ddacomm-{name}",
                               timeout.total_seconds())
        _C.register_group(f"ddacomm-{name}", comm, replace=True)
        gloo = _make_gloo(dist.PrefixStore("gloo/", sub), new_rank, size, timeout, name, ranks)
        nccl = _nccl_factory(dist.PrefixStore("nccl/", sub), new_rank, size, timeout, name, ranks, backend_options)
        backend = _C.DdaBackend(new_rank, size, comm, gloo, nccl, timeout, name, ranks)
        backend._set_shrink_factory(_shrinker(sub, new_rank, size, timeout, name, ranks, backend_options))
        return backend
    return shrink


def _attach_hierarchy(backend, layout: HostLayout, store, rank: int, timeout: timedelta, group_name: str,
                      global_ranks, backend_options) -> None:
    """Gives a multi-host group its intra-host backend and inter-host groups (built from the group's
    store, under per-host and per-local-index prefixes)."""
    import torch.distributed as dist

    from . import _C
    h, l, size = layout.host_index, layout.local_rank, layout.local_size
    host_ranks = [global_ranks[r] for r in layout.hosts[h]]
    intra_store = dist.PrefixStore(f"host{h}/", store)
    token = _group_token(store, rank, timeout)
    intra_comm = _C.Communicator(dist.PrefixStore("commlib/", intra_store), l, size,
                                 f"ddacomm-{group_name}-host{h}-{token}", timeout.total_seconds())
    intra_name = f"{group_name}/host{h}"
    intra = _C.DdaBackend(l, size, intra_comm,
                          _make_gloo(dist.PrefixStore("gloo/", intra_store), l, size, timeout, intra_name, host_ranks),
                          _nccl_factory(dist.PrefixStore("nccl/", intra_store), l, size, timeout, intra_name,
                                        host_ranks, backend_options),
                          timeout, intra_name, host_ranks)
    peer_ranks = [global_ranks[r] for r in layout.peers()]
    inter_store = dist.PrefixStore(f"local{l}/", store)
    inter_name = f"{group_name}/local{l}"
    inter_gloo = _make_gloo(dist.PrefixStore("gloo/", inter_store), h, layout.num_hosts, timeout, inter_name,
                            peer_ranks)
    inter_nccl = _nccl_factory(dist.PrefixStore("nccl/", inter_store), h, layout.num_hosts, timeout, inter_name,
                               peer_ranks, backend_options)
    # Tests whose ranks share one GPU (NCCL refuses them): CUDA tensors cross "hosts" through gloo.
    via_host = os.environ.get("COMMLIB_TEST_HIER_INTER_GLOO", "0") == "1"
    backend._attach_hierarchy(layout.num_hosts, size, h, l, layout.rank_of(), intra, inter_gloo, inter_nccl, timeout,
                              inter_cuda_via_host=via_host)
    _hierarchies[group_name] = Hierarchy(layout, intra, intra_comm, inter_gloo, backend, store, timeout)


class Hierarchy:
    """Python's view of a multi-host group's hierarchy (the fused all-reduce + RMSNorm runs its legs
    here: commlib.hierarchy)."""

    def __init__(self, layout: HostLayout, intra, intra_comm, inter_gloo, backend, store, timeout: timedelta):
        self.layout = layout
        self.intra = intra            # DdaBackend over this host's ranks
        self.intra_comm = intra_comm  # its commlib communicator
        self.inter_gloo = inter_gloo
        self.backend = backend        # the group's DdaBackend (its inter NCCL is created there)
        self.store = store
        self.timeout = timeout
        self.self_comm = None         # a world-1 communicator for the norm of the reduced shard


_hierarchies: dict = {}


def _forget_hierarchy(group_name: str) -> None:
    old = _hierarchies.pop(group_name, None)
    if old is not None and old.self_comm is not None:
        from . import _C
        _C.unregister_group(old.self_comm.name, old.self_comm)
        old.self_comm.close()


def hierarchy_of(group_name: str):
    """The Hierarchy of the "ddacomm" group named ``group_name``, or None (one host, or uneven hosts)."""
    return _hierarchies.get(str(group_name))


def register_backend() -> bool:
    """Registers "ddacomm" with torch.distributed (idempotent). Returns True once registered."""
    global _registered
    if _registered:
        return True
    import torch.distributed as dist
    if not dist.is_available():
        return False
    if BACKEND_NAME.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"])
    _registered = True
    return True


def is_registered() -> bool:
    import torch.distributed as dist
    return BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {})


__all__ = ["BACKEND_NAME", "register_backend", "is_registered"]
