"""Backends commlib-perf times side by side: one small adapter per library, same verbs.

* ``ddacomm``: commlib's direct API (``commlib.Communicator``), CPU tensors over shared memory,
  CUDA tensors over peer memory on the current stream; ``--algo`` picks flat / tree / auto. With
  ``auto``, CUDA all-reduces that the selection table gives to NCCL go to an NCCL group, as the
  ``"ddacomm"`` torch backend does.
* ``gloo`` / ``nccl``: ``torch.distributed`` on a process group of that backend.
* ``dist-ddacomm``: ``torch.distributed`` on a process group of commlib's ``"ddacomm"`` backend (the
  drop-in): beside ``ddacomm`` it shows what the c10d layer costs per call (eager) and that a
  graph-replayed ``dist.all_reduce`` runs the same kernels.
* ``dist-ddacomm-hier``: ``dist-ddacomm`` on a group whose ranks act as 2 hosts (the first half and
  the second half of the ranks, through the test override COMMLIB_TEST_HOST_ID): the two-level
  collectives of a multi-node group (docs/multinode.md), run on one machine. It times the legs
  (intra-host commlib, inter-host gloo / NCCL over local links), not a network. Even world sizes.
* ``nccl-shim``: NCCL's C API called through commlib's ``libnccl.so.2`` (docs/nccl.md) with ctypes,
  as vLLM's ``PyNcclCommunicator`` does, on a communicator formed from the shim's own unique id (CUDA
  only). Beside ``ddacomm`` it shows what the shim adds per call; ``COMMLIB_NCCL_SERVE=0`` sends
  every call to the real NCCL behind it.
* ``symm``: torch symmetric memory (CUDA, all_reduce sum only): the input is copied into a
  symmetric buffer, then one-shot (``--algo flat``) or two-shot (``tree``; ``auto`` picks by size).
  Never the multimem (NVLink multicast) variants.

Every verb is blocking on CPU and stream-ordered on CUDA. A verb a backend lacks raises
``Unsupported``. ``all_reduce_out`` (out of place) is ``out.copy_(inp)`` + the in-place
``all_reduce`` unless a backend has a native one (ddacomm: ``all_reduce(inp, out=out)`` on CPU).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .registry import Unsupported

BACKENDS = ("ddacomm", "nccl", "gloo", "symm", "dist-ddacomm", "dist-ddacomm-hier", "nccl-shim")

_DIST_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
             "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}


class Backend:
    name = "?"
    capturable = False  # may run inside CUDA-graph capture

    def __init__(self):
        # Objects operations keep between calls (e.g. registered EP buffers), dropped before close().
        self.resources: dict = {}

    def label(self) -> str:
        return self.name

    def all_reduce(self, t, redop): raise Unsupported(f"{self.name}: all_reduce not available")

    def all_reduce_out(self, out: torch.Tensor, inp: torch.Tensor, redop: str) -> None:
        """Out of place; ``inp`` unchanged. Default: copy, then reduce in place."""
        out.copy_(inp)
        self.all_reduce(out, redop)

    def reduce_scatter(self, out, inp, redop): raise Unsupported(f"{self.name}: reduce_scatter not available")
    def all_gather(self, out, inp): raise Unsupported(f"{self.name}: all_gather not available")
    def all_to_all(self, out, inp): raise Unsupported(f"{self.name}: all_to_all not available")
    def broadcast(self, t, root): raise Unsupported(f"{self.name}: broadcast not available")

    def close(self) -> None:
        pass


class DDAComm(Backend):
    name = "ddacomm"
    capturable = True

    def __init__(self, store, rank: int, world_size: int, algo: str, device: torch.device):
        import commlib
        super().__init__()
        self.algo = algo
        self.world_size = world_size
        self.comm = commlib.Communicator(dist.PrefixStore(f"commlib-perf/ddacomm-{algo}", store), rank, world_size,
                                         name=f"perf-{algo}")
        # The engine for the sizes where NCCL is the faster one (auto only, as in the torch backend).
        self.nccl = dist.new_group(backend="nccl") if device.type == "cuda" and algo == "auto" else None
        # (op, bytes, dtype) -> whether the backend's plan is nccl, asked once: the lookup stays out of timed calls.
        self._to_nccl: dict = {}

    def label(self) -> str:
        return self.name if self.algo == "auto" else f"{self.name}:{self.algo}"

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except TypeError as e:  # e.g. CUDA tensors for an op this build only has on CPU
            raise Unsupported(f"{self.name}: {e}") from e

    def all_reduce(self, t, redop):
        if self._routes_to_nccl(t, redop):
            dist.all_reduce(t, op=_DIST_OPS[redop], group=self.nccl)
            return
        self._call(self.comm.all_reduce_, t, redop, self.algo)

    def _routes_to_nccl(self, t, redop) -> bool:
        return redop in ("sum", "avg") and self._planned_nccl("all_reduce", t)

    def _planned_nccl(self, op: str, t) -> bool:
        """Whether the torch backend's plan (Note [plan]: the same function, with NCCL attached) hands
        this call to NCCL; only with ``auto``, as there, so this column is what "ddacomm" delivers."""
        if self.nccl is None or not t.is_cuda:
            return False
        key = (op, t.numel() * t.element_size(), t.dtype)
        if key not in self._to_nccl:
            self._to_nccl[key] = self.comm.plan(op, t, nccl=True).variant == "nccl"
        return self._to_nccl[key]

    def all_reduce_out(self, out: torch.Tensor, inp: torch.Tensor, redop: str) -> None:
        if self._routes_to_nccl(inp, redop):
            return super().all_reduce_out(out, inp, redop)
        self._call(lambda: self.comm.all_reduce(inp, redop, self.algo, out=out))

    def reduce_scatter(self, out, inp, redop):
        if redop in ("sum", "avg") and self._planned_nccl("reduce_scatter", inp):
            dist.reduce_scatter_tensor(out, inp, op=_DIST_OPS[redop], group=self.nccl)
            return
        self._call(self.comm.reduce_scatter, out, inp, redop)

    def all_gather(self, out, inp):
        if self._planned_nccl("all_gather", inp):
            dist.all_gather_into_tensor(out, inp, group=self.nccl)
            return
        self._call(self.comm.all_gather, out, inp)

    def all_to_all(self, out, inp):
        if self._planned_nccl("all_to_all", inp):
            dist.all_to_all_single(out, inp, group=self.nccl)
            return
        self._call(self.comm.all_to_all, out, inp)

    def broadcast(self, t, root):
        if self._planned_nccl("broadcast", t):
            dist.broadcast(t, src=dist.get_global_rank(self.nccl, root), group=self.nccl)
            return
        self._call(self.comm.broadcast, t, root)

    def close(self) -> None:
        self.resources.clear()  # registered buffers go before the communicator they live on
        self.comm.close()


class TorchDist(Backend):
    """torch.distributed on its own process group of backend ``name`` (gloo, nccl, or commlib's
    ddacomm as ``dist-ddacomm``)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.capturable = name in ("nccl", "dist-ddacomm")
        if name.startswith("dist-ddacomm"):
            import commlib  # noqa: F401  (registers the "ddacomm" backend)
        if name == "dist-ddacomm-hier":
            self.group = _two_host_group()
        else:
            self.group = dist.new_group(backend="ddacomm" if name == "dist-ddacomm" else name)
        self.world_size = dist.get_world_size(self.group)

    def all_reduce(self, t, redop):
        if self.name == "gloo" and redop == "avg":
            raise Unsupported("gloo: all_reduce op avg not supported by gloo")
        dist.all_reduce(t, op=_DIST_OPS[redop], group=self.group)

    def reduce_scatter(self, out, inp, redop):
        if self.name == "gloo" and redop == "avg":
            raise Unsupported("gloo: reduce_scatter op avg not supported by gloo")
        try:
            dist.reduce_scatter_tensor(out, inp, op=_DIST_OPS[redop], group=self.group)
        except (RuntimeError, NotImplementedError) as e:
            if "not supported" not in str(e).lower() and "not implemented" not in str(e).lower():
                raise
            raise Unsupported(f"{self.name}: reduce_scatter_tensor: {str(e).splitlines()[0]}") from e

    def all_gather(self, out, inp):
        dist.all_gather_into_tensor(out, inp, group=self.group)

    def all_to_all(self, out, inp):
        dist.all_to_all_single(out, inp, group=self.group)

    def broadcast(self, t, root):
        dist.broadcast(t, src=dist.get_global_rank(self.group, root), group=self.group)


class NcclShim(Backend):
    name = "nccl-shim"
    capturable = True

    def __init__(self, store, rank: int, world_size: int, device: torch.device):
        import ctypes

        from .. import nccl
        super().__init__()
        if not nccl.LIBRARY.exists():
            raise Unsupported(f"nccl-shim: {nccl.LIBRARY} not built")
        self._ct = ctypes
        self._types, self._ops = nccl.DATA_TYPES, nccl.RED_OPS
        self.lib = ctypes.CDLL(str(nccl.LIBRARY))
        self.lib.ncclGetLastError.restype = ctypes.c_char_p
        self.world_size = world_size
        uid = nccl.UniqueId()
        key = "commlib-perf/nccl-shim-id"
        if rank == 0:
            self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
            store.set(key, ctypes.string_at(ctypes.byref(uid), 128))
        else:
            ctypes.memmove(ctypes.byref(uid), store.get(key), 128)
        self.comm = ctypes.c_void_p()
        self._check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), world_size, uid, rank), "ncclCommInitRank")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"nccl-shim: {what} returned {rc}: {self.lib.ncclGetLastError(None).decode()}")

    def _call(self, name: str, t: torch.Tensor, *args) -> None:
        c = self._ct
        stream = c.c_void_p(torch.cuda.current_stream(t.device).cuda_stream)
        self._check(getattr(self.lib, name)(*args, self.comm, stream), name)

    def _type(self, t):
        name = str(t.dtype).removeprefix("torch.")
        if name not in self._types:
            raise Unsupported(f"nccl-shim: dtype {t.dtype} has no NCCL type")
        return self._types[name]

    def _ptr(self, t):
        return self._ct.c_void_p(t.data_ptr())

    def all_reduce(self, t, redop):
        self._call("ncclAllReduce", t, self._ptr(t), self._ptr(t), self._ct.c_size_t(t.numel()), self._type(t),
                   self._ops[redop])

    def all_reduce_out(self, out, inp, redop):
        self._call("ncclAllReduce", inp, self._ptr(inp), self._ptr(out), self._ct.c_size_t(inp.numel()),
                   self._type(inp), self._ops[redop])

    def reduce_scatter(self, out, inp, redop):
        self._call("ncclReduceScatter", inp, self._ptr(inp), self._ptr(out), self._ct.c_size_t(out.numel()),
                   self._type(inp), self._ops[redop])

    def all_gather(self, out, inp):
        self._call("ncclAllGather", inp, self._ptr(inp), self._ptr(out), self._ct.c_size_t(inp.numel()),
                   self._type(inp))

    def all_to_all(self, out, inp):
        self._call("ncclAlltoAll", inp, self._ptr(inp), self._ptr(out),
                   self._ct.c_size_t(inp.numel() // self.world_size), self._type(inp))

    def broadcast(self, t, root):
        self._call("ncclBroadcast", t, self._ptr(t), self._ptr(t), self._ct.c_size_t(t.numel()), self._type(t), root)

    def close(self) -> None:
        self.resources.clear()
        if self.comm:
            self._check(self.lib.ncclCommDestroy(self.comm), "ncclCommDestroy")
            self.comm = self._ct.c_void_p()


def _two_host_group():
    """A "ddacomm" group of every rank, its first and second halves acting as two hosts."""
    import os
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2 or world % 2:
        raise ValueError(f"commlib-perf: backend dist-ddacomm-hier needs an even world size; got {world}")
    key = "COMMLIB_TEST_HOST_ID"
    before = os.environ.get(key)
    os.environ[key] = f"commlib-perf-host-{rank * 2 // world}"
    try:
        group = dist.new_group(backend="ddacomm")
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
    backend = group._get_backend(torch.device("cpu"))
    assert backend.hierarchical, "commlib-perf: the two-host group did not get its hierarchy"
    return group


class SymmMem(Backend):
    """torch symmetric memory one-shot / two-shot all-reduce (CUDA, sum)."""
    name = "symm"
    capturable = True
    _TWO_SHOT_MIN_BYTES = 256 << 10  # auto: two-shot from here on (the measured crossover, docs/gpu-allreduce.md)

    def __init__(self, algo: str, device: torch.device):
        if device.type != "cuda":
            raise Unsupported("symm: torch symmetric memory needs CUDA tensors")
        import torch.distributed._symmetric_memory as symm_mem
        super().__init__()
        self.symm_mem = symm_mem
        self.algo = algo
        self.group = dist.group.WORLD
        self.group_name = self.group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op later
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.device = device
        self.buf: Optional[torch.Tensor] = None
        self.rendezvous_done = False

    def label(self) -> str:
        return self.name if self.algo == "auto" else f"{self.name}:{self.algo}"

    def reserve(self, nbytes: int) -> None:
        """Collective: allocates the symmetric buffer once for the largest size (before timing)."""
        self.buf = self.symm_mem.empty(max(nbytes, 16), dtype=torch.uint8, device=self.device)
        self.symm_mem.rendezvous(self.buf, self.group_name)

    def all_reduce(self, t, redop):
        if redop != "sum":
            raise Unsupported(f"symm: op {redop} not supported; supported: sum")
        if self.buf is None or t.numel() * t.element_size() > self.buf.numel():
            raise Unsupported("symm: symmetric buffer not reserved for this size")
        staged = self.buf[: t.numel() * t.element_size()].view(t.dtype)
        staged.copy_(t.reshape(-1))
        nbytes = t.numel() * t.element_size()
        algo = self.algo if self.algo != "auto" else ("tree" if nbytes >= self._TWO_SHOT_MIN_BYTES else "flat")
        if algo == "flat":
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, t.view(-1))
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            t.view(-1).copy_(staged)


ALGOS = ("auto", "flat", "tree")


def split_name(spec: str) -> tuple:
    """"ddacomm:flat" -> ("ddacomm", "flat"); "gloo" -> ("gloo", None)."""
    name, _, algo = spec.partition(":")
    return name, (algo or None)


def make(spec: str, *, store, rank: int, world_size: int, algo: str, device: torch.device) -> Backend:
    """A backend from its spec: a name of BACKENDS, optionally ":algo" for ddacomm and symm
    (overrides --algo, so that several algorithms can be timed side by side)."""
    name, own_algo = split_name(spec)
    algo = own_algo or algo
    if name == "ddacomm":
        return DDAComm(store, rank, world_size, algo, device)
    if name in ("gloo", "dist-ddacomm", "dist-ddacomm-hier"):
        return TorchDist(name)
    if name == "nccl":
        if device.type != "cuda":
            raise ValueError("commlib-perf: backend nccl needs CUDA tensors; use --device cuda on a GPU machine "
                             "(valid backends on CPU: ddacomm, gloo)")
        return TorchDist("nccl")
    if name == "nccl-shim":
        if device.type != "cuda":
            raise ValueError("commlib-perf: backend nccl-shim needs CUDA tensors; use --device cuda on a GPU machine "
                             "(valid backends on CPU: ddacomm, gloo)")
        return NcclShim(store, rank, world_size, device)
    if name == "symm":
        if device.type != "cuda":
            raise ValueError("commlib-perf: backend symm (torch symmetric memory) needs CUDA tensors "
                             "(valid backends on CPU: ddacomm, gloo)")
        return SymmMem(algo, device)
    raise ValueError(f"commlib-perf: backend '{name}' not known; valid: {', '.join(BACKENDS)}")
