"""Ring transports: what the ring needs from one (``RingTransport``), and the two that move
messages through a collective library: ``DistTransport`` (torch.distributed point-to-point) and
``CommTransport`` (a ``commlib.Communicator``'s all_to_all_v). The copy-engine ring is
``SymmetricTransport`` (symmetric.py)."""
from __future__ import annotations

import inspect
import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist


class RingTransport:
    """What the ring needs from a transport.

    ``allocate(specs, device)`` declares the receive slots, ``{name: (shape, dtype)}`` (collective:
    same specs on every rank; a symmetric-memory transport allocates them there). ``slot(name)`` is
    this rank's slot tensor. ``start(sends, recvs)`` posts, in one step, ``sends`` ``[(peer, name,
    src)]`` (copy ``src`` into ``peer``'s slot ``name``) and ``recvs`` ``[(peer, name)]`` (this rank's
    slot ``name`` is filled by ``peer``); messages between the same two ranks are matched in list
    order. Every rank calls ``start`` the same number of times. ``wait(token)`` returns when the
    step's received slots hold their data and its sends no longer read ``src``. ``release(names)``
    says this rank is done reading those slots (a peer may refill them).
    """

    def allocate(self, specs: dict, device) -> None:
        raise NotImplementedError

    def slot(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def start(self, sends, recvs):
        raise NotImplementedError

    def wait(self, token) -> None:
        raise NotImplementedError

    def release(self, names) -> None:
        pass


class _LocalSlots(RingTransport):
    def __init__(self):
        self._slots: dict = {}
        self._specs: dict = {}

    def allocate(self, specs: dict, device) -> None:
        device = torch.device(device)
        for name, (shape, dtype) in specs.items():
            cur = self._slots.get(name)
            if cur is None or tuple(cur.shape) != tuple(shape) or cur.dtype != dtype or cur.device != device:
                self._slots[name] = torch.empty(shape, dtype=dtype, device=device)

    def slot(self, name: str) -> torch.Tensor:
        return self._slots[name]


class DistTransport(_LocalSlots):
    """The ring over torch.distributed point-to-point (``batch_isend_irecv``): gloo, NCCL, and
    commlib's own path on the "ddacomm" backend."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not dist.group.WORLD else peer

    def start(self, sends, recvs):
        ops = [dist.P2POp(dist.isend, src.contiguous(), self._global(peer), self.group, _tag(name))
               for peer, name, src in sends]
        ops += [dist.P2POp(dist.irecv, self.slot(name), self._global(peer), self.group, _tag(name))
                for peer, name in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    def wait(self, token) -> None:
        for work in token:
            work.wait()


def _tag(name: str) -> int:
    """A point-to-point tag per slot family, so messages of different families never pair up."""
    family = "kv" if name.startswith("kv") else name[0]
    return {"kv": 1, "q": 2, "p": 3}[family] * 1024 + int(name.lstrip("kvqp"))


def _all_to_all_v(comm, output, input, output_split_sizes, input_split_sizes):
    """``comm.all_to_all_v`` by keyword, for either argument naming of the direct API."""
    params = _a2a_params(type(comm))
    if "output_split_sizes" in params:
        return comm.all_to_all_v(output, input, output_split_sizes=output_split_sizes,
                                 input_split_sizes=input_split_sizes)
    return comm.all_to_all_v(output, input, input_splits=input_split_sizes, output_splits=output_split_sizes)


_a2a_param_cache: dict = {}


def _a2a_params(cls) -> frozenset:
    if cls not in _a2a_param_cache:
        _a2a_param_cache[cls] = frozenset(inspect.signature(cls.all_to_all_v).parameters)
    return _a2a_param_cache[cls]


_staging: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Communicator -> its CUDA staging


class CommTransport(_LocalSlots):
    """The ring over a ``commlib.Communicator``: each step is one ``all_to_all_v`` of bytes whose
    only non-zero splits are the step's peers (a correct ring step on CPU and CUDA; it completes
    inside ``start``). When the direct API gains send / recv, ``start`` becomes those calls.

    On CUDA a step receives into a symmetric-memory buffer large enough for every slot at once,
    allocated in ``allocate`` (collective: the specs are the same on every rank), so the
    all_to_all_v writes straight into it at any size; through the communicator's workspace a step
    was limited to half of it (32 MiB by default: a pass-Q step at 8K tokens is more)."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self._staging: Optional[torch.Tensor] = None  # CUDA: what each step receives into

    def allocate(self, specs: dict, device) -> None:
        super().allocate(specs, device)
        device = torch.device(device)
        if device.type != "cuda":
            return
        need = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs.values())
        # The buffer belongs to the communicator, not to this transport: a transport made for one
        # call is dropped while that call's last step may still be writing into the peers' buffers
        # (freeing one unmaps the peers' memory under the running kernel). It only grows, on every
        # rank alike (the specs are the same everywhere), after this device finished with the old.
        cur = _staging.get(self.comm)
        if cur is None or cur.numel() < need or cur.device != device:
            if cur is not None:
                torch.cuda.synchronize(cur.device)
            cur = _staging[self.comm] = self.comm.symmetric_empty((max(need, 1),), torch.uint8, device)
        self._staging = cur

    def start(self, sends, recvs):
        n = self.world_size
        in_splits, out_splits = [0] * n, [0] * n
        by_peer_send = [[] for _ in range(n)]
        by_peer_recv = [[] for _ in range(n)]
        for peer, _, src in sends:
            by_peer_send[peer].append(src.contiguous().view(-1).view(torch.uint8))
            in_splits[peer] += src.numel() * src.element_size()
        for peer, name in recvs:
            dst = self.slot(name)
            by_peer_recv[peer].append(dst)
            out_splits[peer] += dst.numel() * dst.element_size()
        if not sends and not recvs:
            return None
        device = self.slot(recvs[0][1]).device if recvs else sends[0][2].device
        parts = [t for peer in range(n) for t in by_peer_send[peer]]
        inp = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        total = sum(out_splits)
        staged = self._staging is not None and device.type == "cuda" and total <= self._staging.numel()
        out = self._staging[:total] if staged else torch.empty(total, dtype=torch.uint8, device=device)
        # A zero-row input or output still takes part in the collective. When the direct API has
        # send / recv, this step becomes one send per entry of `sends` and one recv per `recvs`.
        _all_to_all_v(self.comm, out, inp, out_splits, in_splits)
        offset = 0
        for peer in range(n):
            for dst in by_peer_recv[peer]:
                nbytes = dst.numel() * dst.element_size()
                dst.view(-1).view(torch.uint8).copy_(out[offset:offset + nbytes])
                offset += nbytes
        return None

    def wait(self, token) -> None:
        return None
