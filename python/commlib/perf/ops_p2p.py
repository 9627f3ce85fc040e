"""commlib-perf operation ``send_recv``: one ring-exchange step of point-to-point messages.

Every rank sends its buffer (the size in bytes) to rank + 1 and receives the same size from
rank - 1 in one ``batch_isend_irecv`` (the step of ring attention and pipeline parallelism), then
waits for it. What each backend runs, on the same buffers:

* ``ddacomm``: ``Communicator.batch_isend_irecv`` — on CUDA, copy-engine transfers into the
  peer's channel slots with stream-ordered flags (Note [cuda p2p]); on CPU, shared memory.
* ``nccl`` / ``gloo`` / ``dist-ddacomm``: ``torch.distributed.batch_isend_irecv`` on that group.

nccl-tests' sendrecv definitions: count = bytes / element size, busbw = algbw (factor 1). The
output is always a separate buffer (the in-place columns show n/a). Needs two ranks or more.

Check: every element of the received buffer equals rank - 1's input (regenerated from its seed);
a poisoned (unwritten) element counts as wrong.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import registry
from .registry import Buffers, Case, Collective, Unsupported

NAME = "send_recv"


def _setup(case: Case) -> Buffers:
    count = case.nbytes // case.esize
    inp = registry.rank_input(case.rank, count, case.dtype, case.salt, case.device)
    out = registry.poison(torch.empty_like(inp))
    return Buffers(inp=inp, out=out, extra={"count": count})


def _run(backend, b: Buffers, case: Case) -> None:
    n = case.world_size
    if n < 2:
        raise Unsupported(f"{NAME}: needs two ranks or more (a rank does not send to itself)")
    if case.in_place:
        raise Unsupported(f"{NAME}: has no in-place form")
    nxt, prv = (case.rank + 1) % n, (case.rank - 1) % n
    comm = getattr(backend, "comm", None)
    if comm is not None:  # commlib's direct API
        comm.batch_isend_irecv([("send", b.inp, nxt), ("recv", b.out, prv)]).wait()
        return
    group = getattr(backend, "group", None)
    if group is None or backend.name == "symm":
        raise Unsupported(f"{backend.name}: {NAME} not available")
    ops = [dist.P2POp(dist.isend, b.inp, dist.get_global_rank(group, nxt), group),
           dist.P2POp(dist.irecv, b.out, dist.get_global_rank(group, prv), group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _check(b: Buffers, case: Case) -> int:
    prv = (case.rank - 1) % case.world_size
    expected = registry.rank_input(prv, b.extra["count"], case.dtype, case.salt, torch.device("cpu"))
    registry.plant(b.out, case)
    return registry.count_unequal(b.out, expected)


registry.register(Collective(
    name=NAME, count=lambda nbytes, esize, n: nbytes // esize, bus_factor=lambda n: 1.0,
    setup=_setup, run=_run, check=_check))
