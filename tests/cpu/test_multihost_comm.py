"""A commlib.Communicator whose ranks span hosts (Note [communicator hosts]), with hosts emulated by
COMMLIB_TEST_HOST_ID: the host numbering, set-up exchanges and the barrier over the store, and the
clear errors (on every rank, leaving the communicator usable) of everything that needs shared
memory. The CUDA side (no peer mapping; EPBuffer over NVSHMEM) is tests/gpu/test_ep_nvshmem.py."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from ddacomm_worlds import as_host

import commlib

# (world size, host of each rank)
LAYOUTS = [(4, (0, 0, 1, 1)), (3, (0, 1, 0)), (6, (0, 1, 2, 0, 1, 2))]


def _comm(ctx, hosts, name, **kwargs):
    with as_host(hosts[ctx.rank]):
        return ctx.new_comm(name, **kwargs)


def _numbering(expected):
    """Hosts numbered in the order of their lowest rank."""
    order = []
    for h in expected:
        if h not in order:
            order.append(h)
    return [order.index(h) for h in expected]


def _layout_and_control(ctx, hosts, tag):
    comm = _comm(ctx, hosts, f"mh-{tag}")
    try:
        assert comm.num_hosts == len(set(hosts))
        assert list(comm.native.host_of) == _numbering(hosts)
        for size in (0, 1, 13, 4096):
            mine = bytes((ctx.rank * 31 + i) % 251 for i in range(size))
            got = comm.native.control_all_gather(mine)
            assert got == [bytes((r * 31 + i) % 251 for i in range(size)) for r in range(ctx.world_size)]
        comm.barrier()
        return True
    finally:
        comm.close()


@pytest.mark.parametrize("world_size,hosts", LAYOUTS)
def test_hosts_and_control_exchanges_over_the_store(ranks, world_size, hosts):
    assert ranks(world_size).run(_layout_and_control, hosts, f"{world_size}-{''.join(map(str, hosts))}") == \
        [True] * world_size


def _one_host(ctx):
    comm = ctx.new_comm("mh-one")
    try:
        assert comm.num_hosts == 1 and list(comm.native.host_of) == [0] * ctx.world_size
        got = comm.native.control_all_gather(bytes([ctx.rank, 7]))  # over shared memory
        assert got == [bytes([r, 7]) for r in range(ctx.world_size)]
        return True
    finally:
        comm.close()


def test_one_host_control_exchange_over_shared_memory(ranks):
    assert ranks(3).run(_one_host) == [True] * 3


def _shared_memory_refused(ctx, hosts):
    comm = _comm(ctx, hosts, "mh-refused")
    try:
        x = torch.randn(37)
        for call in (lambda: comm.all_reduce(x),
                     lambda: comm.all_gather(torch.empty(37 * ctx.world_size), x),
                     lambda: comm.broadcast(x, src=0),
                     lambda: comm.send(x, (ctx.rank + 1) % ctx.world_size)):
            with pytest.raises(ValueError, match=r"needs every rank on one host; its 4 ranks span 2 hosts "
                                                 r"\(rank 0 on 'host-0', rank 2 on 'host-1'\)"):
                call()
        with pytest.raises(ValueError, match="device cpu needs every rank on one host"):
            commlib.EPBuffer(comm, 4, 16, 8, 2, torch.float32, device="cpu")
        comm.barrier()  # still usable
        assert comm.native.control_all_gather(bytes([ctx.rank])) == [bytes([r]) for r in range(ctx.world_size)]
        return True
    finally:
        comm.close()


def test_shared_memory_calls_raise_naming_the_hosts(ranks):
    assert ranks(4).run(_shared_memory_refused, (0, 0, 1, 1)) == [True] * 4


def _dead_peer(ctx):
    comm = _comm(ctx, (0, 1), "mh-dead", timeout=timedelta(seconds=2))
    try:
        if ctx.rank == 0:
            with pytest.raises(commlib.CommTimeoutError, match="Timed out .* rank 0 waiting for rank 1"):
                comm.barrier()
        return True
    finally:
        comm.close()


def test_a_missing_peer_times_out_across_hosts(ranks):
    assert ranks(2).run(_dead_peer) == [True, True]


def _from_multihost_group(ctx, hosts):
    """The documented way to an EPBuffer across hosts: a communicator over a "ddacomm" group that
    spans hosts, numbered as the group numbers its hosts."""
    from test_backend import backend_of, ddacomm_world
    with as_host(hosts[ctx.rank]), ddacomm_world(ctx) as (world, _):
        num_hosts, _, host_index, _ = backend_of(world).host_layout
        comm = commlib.Communicator.from_group(world)
    try:
        assert comm.num_hosts == num_hosts == len(set(hosts))
        assert comm.native.host_of[ctx.rank] == host_index
        comm.barrier()
        with pytest.raises(ValueError, match="device cpu needs every rank on one host"):
            commlib.EPBuffer(comm, 4, 16, 8, 2, torch.float32, device="cpu")
        return True
    finally:
        comm.close()


def test_communicator_from_a_group_spanning_hosts(ranks):
    assert ranks(4).run(_from_multihost_group, (0, 1, 0, 1)) == [True] * 4
