"""The direct API: a communicator over a torch ``Store``."""
from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import _C, flight_recorder

_OPS = ("sum", "avg", "min", "max", "prod")
_OP_SET = frozenset(_OPS)
_TORCH_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min",
              dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "prod"}
_ALGOS = ("auto", "flat", "tree", "nccl")
_PLAN_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "fused_allreduce_rmsnorm")
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def _op_name(what: str, op) -> str:
    """Accepts "sum" ... or a ``torch.distributed.ReduceOp``; returns the lower-case name."""
    if isinstance(op, str) and op in _OP_SET:  # the common case, on the per-call path
        return op
    if isinstance(op, str):
        name = op.lower()
    else:
        name = _TORCH_OPS.get(op)
        if name is None:
            raise ValueError(f"{what}: op {op} not supported; supported: {', '.join(_OPS)}")
    if name not in _OPS:
        raise ValueError(f"{what}: op '{op}' not supported; supported: {', '.join(_OPS)}")
    return name


def _check_tensor(what: str, arg: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {arg} must be a torch.Tensor, got {type(t).__name__}")


def _check_out(what: str, tensor: torch.Tensor, out) -> None:
    """``out`` of an out-of-place collective: a contiguous tensor like ``tensor``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what}: out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != tensor.dtype:
        raise TypeError(f"{what}: out has dtype {out.dtype} but tensor has {tensor.dtype}; "
                        "out must have the same dtype")
    if out.device != tensor.device:
        raise TypeError(f"{what}: out is on {out.device} but tensor is on {tensor.device}; "
                        "out must be on the same device")
    if out.shape != tensor.shape:
        raise ValueError(f"{what}: out has shape {tuple(out.shape)} but tensor has {tuple(tensor.shape)}; "
                         "out must have the same shape")
    if not out.is_contiguous():
        raise ValueError(f"{what}: out must be contiguous (strides {out.stride()}); "
                         "supported: a contiguous tensor")


class Communicator:
    """One rank's membership in a group of processes, usually on one node.

    Created collectively: every rank calls ``Communicator(store, rank, world_size, name)`` with the
    same store, name and world size (keys are prefixed by ``name``). Collective methods must be
    called by every rank in the same order with matching arguments; a mismatch raises
    ``commlib.PeerError`` on every rank. A wait for a peer longer than ``timeout`` raises
    ``commlib.CommTimeoutError``; a peer that exits raises ``commlib.PeerError``.

    ``name`` also names the communicator in ``torch.ops.commlib`` ops (``group_name``; docs/ops.md):
    it must be unique among this process's open communicators.

    CPU tensors go through POSIX shared memory; CUDA tensors through peer GPU memory, on the
    caller's current stream. Both exist only inside one host: on a communicator whose ranks span
    several hosts (``num_hosts > 1``) only ``barrier()`` (over the store) and ``EPBuffer`` with CUDA
    tensors (NVSHMEM) work, and the collectives raise ``ValueError`` naming the hosts; for
    collectives across hosts use a "ddacomm" process group (docs/multinode.md). ``close()`` releases everything; it also runs at interpreter exit and
    when the object is collected.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, name: str = "default",
                 timeout: timedelta = timedelta(seconds=300)):
        if not isinstance(store, dist.Store):
            raise TypeError(f"Communicator: store must be a torch.distributed.Store, got {type(store).__name__}")
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"Communicator: timeout must be a positive timedelta, got {timeout!r}")
        self._native = _C.Communicator(store, int(rank), int(world_size), str(name), timeout.total_seconds())
        # The collectives go through _comm: the native communicator, or while torch's flight recorder
        # is on, a RecordingComm over it (Note [flight recorder]).
        self._comm = self._native
        if flight_recorder.enabled():
            self._comm = flight_recorder.RecordingComm(self._native, str(name), int(rank), int(world_size), timeout)
        self._store = store
        self._timeout = timeout
        self._group_name = str(name)
        try:
            _C.register_group(self._group_name, self._native)
        except ValueError:
            self._native.close()
            raise
        _live.add(self)

    @classmethod
    def from_group(cls, group: Optional[dist.ProcessGroup] = None, name: Optional[str] = None) -> "Communicator":
        """A communicator over the ranks of an initialised process group (default: the world)."""
        if not dist.is_initialized():
            raise ValueError("Communicator.from_group: torch.distributed is not initialised; "
                             "call init_process_group first")
        group = group if group is not None else dist.group.WORLD
        from torch.distributed import distributed_c10d as c10d
        group_name = c10d._get_process_group_name(group) if hasattr(c10d, "_get_process_group_name") else "world"
        store = dist.PrefixStore(f"commlib/group/{group_name}", c10d._get_default_store())
        timeout = c10d._get_default_timeout(dist.get_backend(group)) if hasattr(c10d, "_get_default_timeout") \
            else timedelta(seconds=300)
        return cls(store, dist.get_rank(group), dist.get_world_size(group), name or f"group-{group_name}", timeout)

    # ---- properties ----
    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def name(self) -> str:
        return self._comm.name

    @property
    def num_hosts(self) -> int:
        """Hosts the ranks run on (host name and boot id; Note [communicator hosts])."""
        return self._comm.num_hosts

    @property
    def group_name(self) -> str:
        """The name ``torch.ops.commlib`` ops take for this communicator (its ``name``)."""
        return self._group_name

    @property
    def closed(self) -> bool:
        return self._comm.closed

    @property
    def native(self):
        """The ``commlib._C.Communicator`` (for extensions)."""
        return self._native

    def close(self) -> None:
        """Releases shared and GPU memory. Not collective; idempotent."""
        _C.unregister_group(self._group_name, self._native)
        self._native.close()

    def abort(self) -> None:
        """Ends every pending call of this communicator, from any thread: host waits raise
        ``PeerError`` within ~50 ms, device waits end at their next check; every later call raises
        ``PeerError`` at once. Not collective; ``close()`` still releases (Note [abort])."""
        self._native.abort()

    def error(self) -> str:
        """Why this communicator stopped being usable: ``"none"``, ``"timeout"``, ``"remote"`` (a
        peer failed or exited) or ``"aborted"``."""
        return self._native.error()

    def shrink(self, exclude_ranks: Sequence[int], name: Optional[str] = None) -> "Communicator":
        """A new communicator over this one's ranks but ``exclude_ranks`` (ranks renumbered in
        order), for carrying on after a rank died (NCCL's ``ncclCommShrink``).

        Collective over the survivors only: every rank not in ``exclude_ranks`` calls it with the
        same ranks; the excluded ranks do not take part (they may be dead). Survivors that pass
        different ranks never meet (the set is part of the new communicator's name) and raise
        ``CommTimeoutError`` after the timeout. This communicator is left as it is: after a peer
        died it is unusable; ``close()`` it. The new one has the same store and timeout; its name
        defaults to ``"<name>/shrink-<ranks>"``."""
        excluded = sorted({int(r) for r in exclude_ranks})
        n = self.world_size
        bad = [r for r in excluded if not 0 <= r < n]
        if bad or not excluded or len(excluded) == n:
            raise ValueError(f"shrink: exclude_ranks {list(exclude_ranks)} not supported; valid: a non-empty "
                             f"subset of 0..{n - 1} that leaves at least one rank")
        if self.rank in excluded:
            raise ValueError(f"shrink: rank {self.rank} is in exclude_ranks {excluded}; only the survivors call it")
        survivors = [r for r in range(n) if r not in excluded]
        new_name = name or f"{self.name}/shrink-{'-'.join(map(str, excluded))}"
        return Communicator(self._store, survivors.index(self.rank), len(survivors), new_name, self._timeout)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        comm = getattr(self, "_native", None)
        if comm is not None:
            comm.close()

    def __repr__(self) -> str:
        return f"commlib.Communicator(name={self.name!r}, rank={self.rank}, world_size={self.world_size})"

    # ---- collectives ----
    def all_reduce(self, tensor: torch.Tensor, op="sum", algo: str = "auto", *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Out of place: returns the reduction of ``tensor`` across ranks; ``tensor`` is unchanged.

        ``op``: sum, avg, min, max, prod (CUDA: sum and avg). ``algo``: ``auto`` (by size),
        ``flat`` (one-shot), ``tree`` (reduce-scatter + all-gather), ``nccl`` (CUDA only, where an
        NCCL engine is attached). Every algorithm reduces in fp32 in rank order, so all give the same
        bits on every rank. dtypes: float32, float16, bfloat16.

        ``out``: a contiguous tensor of the same shape, dtype and device as ``tensor`` that receives
        the result and is returned (else a new tensor is). CPU tensors read ``tensor`` and write the
        result directly (no extra copy); CUDA tensors copy ``tensor`` into the result and reduce that
        in place. ``out`` must be ``tensor`` itself (then this is ``all_reduce_``) or share no memory
        with it. Under ``torch.compile`` this is ``torch.ops.commlib.all_reduce`` (``all_reduce_out``).
        """
        _check_tensor("all_reduce", "tensor", tensor)
        if algo not in _ALGOS:
            raise ValueError(f"all_reduce: algo '{algo}' not supported; supported: {', '.join(_ALGOS)}")
        op = _op_name("all_reduce", op)
        if torch.compiler.is_compiling():
            if out is None:
                return torch.ops.commlib.all_reduce(tensor, op, self._group_name, algo)
            if out is tensor:
                torch.ops.commlib.all_reduce_(tensor, op, self._group_name, algo)
            else:
                torch.ops.commlib.all_reduce_out(tensor, op, self._group_name, algo, out=out)
            return out
        if out is tensor:
            self._comm.all_reduce(tensor, op, algo)
            return tensor
        if out is None:
            out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        else:
            _check_out("all_reduce", tensor, out)
        self._comm.all_reduce_out(out, tensor, op, algo)
        return out

    def all_reduce_(self, tensor: torch.Tensor, op="sum", algo: str = "auto") -> torch.Tensor:
        """In place: reduces ``tensor`` across ranks into itself and returns it (arguments as
        ``all_reduce``). On the whole of a ``symmetric_empty`` tensor the CUDA path reads the peers'
        tensors directly (zero-copy). Under ``torch.compile`` this is ``torch.ops.commlib.all_reduce_``."""
        _check_tensor("all_reduce_", "tensor", tensor)
        if algo not in _ALGOS:
            raise ValueError(f"all_reduce: algo '{algo}' not supported; supported: {', '.join(_ALGOS)}")
        op = _op_name("all_reduce", op)
        if torch.compiler.is_compiling():
            torch.ops.commlib.all_reduce_(tensor, op, self._group_name, algo)
            return tensor
        self._comm.all_reduce(tensor, op, algo)
        return tensor

    def symmetric_empty(self, shape, dtype: torch.dtype = torch.bfloat16, device=None) -> torch.Tensor:
        """An uninitialised CUDA tensor in symmetric memory (mapped into every rank's GPU).

        Collective: every rank must call it with the same shape and dtype, in the same order as
        its other symmetric allocations (a mismatch raises ``commlib.PeerError``). ``device``:
        a CUDA device (default: the current one). ``all_reduce_`` on the whole tensor (on every
        rank) reads the peers' tensors directly instead of copying into the workspace first
        (zero-copy; tree algorithm). Freeing it is local.
        """
        if isinstance(shape, int):
            shape = (shape,)
        shape = [int(d) for d in shape]
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"symmetric_empty: dtype must be a torch.dtype, got {type(dtype).__name__}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cuda")
        device = torch.device(device)
        if device.type != "cuda":
            raise TypeError(f"symmetric_empty: device {device} not supported; supported: cuda")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return self._comm.symmetric_empty(shape, dtype, device)

    def check_gpu_error(self) -> None:
        """Raises ``commlib.CommTimeoutError`` if an earlier GPU wait of this communicator expired.

        Reads a host-mapped word (no synchronisation); call it after ``torch.cuda.synchronize()``
        to learn whether all queued collectives completed. Every GPU collective also checks first.
        """
        if hasattr(self._comm, "check_gpu_error"):
            self._comm.check_gpu_error()

    def plan(self, op: str, tensor: torch.Tensor, *, algo: str = "auto", nccl: bool = False, num_sms: int = 0,
             residual_mode: str = "replicated", fused_algo: str = "auto", device: Optional[str] = None) -> "_C.Plan":
        """What ``op`` would run for ``tensor`` on this communicator (Note [plan], docs/architecture.md):
        ``.variant`` (e.g. ``"flat_ll"``, ``"host_tree"``), ``.reason`` (one line, e.g. ``"flat_ll: 64 KiB
        <= flat_ll_max 256 KiB"``) and ``.geometry`` (a dict: grid, block, row_ctas, packs_per_thread,
        chunk_bytes, pdl). ``tensor`` is what the op takes: all_reduce's and broadcast's tensor,
        reduce_scatter's, all_gather's and all_to_all's input, fused_allreduce_rmsnorm's ``x``.
        ``nccl=True`` plans as the "ddacomm" backend does, with an NCCL engine attached; ``device``
        ("cpu" or "cuda") plans as if the tensor lived there (the plan is pure: no GPU needed). Local:
        no peer is involved and nothing runs. Executed plans are counted (``commlib.plan_counters()``) and, with
        COMMLIB_LOG_PLAN=1, logged."""
        if op not in _PLAN_OPS:
            raise ValueError(f"Communicator.plan: op {op!r} not known; known: {', '.join(_PLAN_OPS)}")
        _check_tensor("Communicator.plan", "tensor", tensor)
        return _C.plan(self._native, op, tensor, algo, bool(nccl), int(num_sms), residual_mode, fused_algo, device or "")

    def _host_auto_algo(self, nbytes: int) -> str:
        """The CPU algorithm ("flat" or "tree") that ``algo="auto"`` runs for ``nbytes``: chosen in C++
        from COMMLIB_HOST_TREE_THRESHOLD, the tune file and the built-in threshold, as for the backend."""
        return _C.select_host_all_reduce_algorithm(int(nbytes), self.world_size)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op="sum") -> torch.Tensor:
        """``output`` (n elements) receives this rank's slice of the reduction of ``input`` (world × n).

        Out of place into ``output`` (``input`` unchanged); ``output`` may be this rank's slice of
        ``input``. CUDA: sum or avg of float32 / float16 / bfloat16, reduced as ``all_reduce`` (the
        same bits as its slice), by commlib's push kernel at every size (docs/gpu-collectives.md).
        Under ``torch.compile`` this is ``torch.ops.commlib.reduce_scatter_out``."""
        _check_tensor("reduce_scatter", "output", output)
        _check_tensor("reduce_scatter", "input", input)
        op = _op_name("reduce_scatter", op)
        if torch.compiler.is_compiling():
            torch.ops.commlib.reduce_scatter_out(input, op, self._group_name, out=output)
            return output
        self._comm.reduce_scatter(output, input, op)
        return output

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """``output`` (world × n elements) receives every rank's ``input`` in rank order.

        ``input`` may be this rank's block of ``output`` (in place, FSDP's layout). Any dtype. Under
        ``torch.compile`` this is ``torch.ops.commlib.all_gather_out``."""
        _check_tensor("all_gather", "output", output)
        _check_tensor("all_gather", "input", input)
        if torch.compiler.is_compiling():
            torch.ops.commlib.all_gather_out(input, self._group_name, out=output)
            return output
        self._comm.all_gather(output, input)
        return output

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copies rank ``src``'s ``tensor`` into every rank's ``tensor`` (in place; any dtype). Under
        ``torch.compile`` this is ``torch.ops.commlib.broadcast_``."""
        _check_tensor("broadcast", "tensor", tensor)
        if torch.compiler.is_compiling():
            torch.ops.commlib.broadcast_(tensor, int(src), self._group_name)
            return tensor
        self._comm.broadcast(tensor, int(src))
        return tensor

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """Equal-split all-to-all along dim 0: block r of ``input`` goes to rank r (CUDA: commlib's
        push kernel, docs/gpu-collectives.md)."""
        return self.all_to_all_v(output, input, None, None)

    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor,
                     output_split_sizes: Optional[Sequence[int]] = None,
                     input_split_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        """All-to-all with per-rank row counts along dim 0 (``None``: equal splits); the arguments
        in ``torch.distributed.all_to_all_single``'s order.

        ``input_split_sizes[r]`` rows go to rank r; ``output_split_sizes[q]`` rows arrive from rank
        q. Host sequences (or CPU tensors) for CPU tensors. On CUDA also int64 device tensors of shape
        [world_size]: they are never read on the host (the call can be graph-captured); each rank
        writes its rows straight into the receivers' buffers (the output itself when it comes from
        ``symmetric_empty``, else a workspace) at offsets computed on the GPU. Splits may sum to
        less than the tensors' rows (the rest of ``output`` is left as it was). Bad or mismatched
        device splits are detected on the GPU: nothing is sent between the ranks concerned and
        ``check_all_to_all()`` raises. The first CUDA call is collective set-up: make it outside capture.
        Under ``torch.compile`` (host splits) this is ``torch.ops.commlib.all_to_all_v_out``.
        """
        input_splits, output_splits = input_split_sizes, output_split_sizes
        _check_tensor("all_to_all", "output", output)
        _check_tensor("all_to_all", "input", input)
        if (input_splits is None) != (output_splits is None):
            raise ValueError("all_to_all: pass both output_split_sizes and input_split_sizes, or neither")
        if isinstance(input_splits, torch.Tensor) or isinstance(output_splits, torch.Tensor):
            if not (isinstance(input_splits, torch.Tensor) and isinstance(output_splits, torch.Tensor)):
                raise TypeError("all_to_all: output_split_sizes and input_split_sizes must both be tensors or both sequences")
            if input.is_cuda:
                # Device splits: never read on the host (capturable). Mismatches are found on the
                # device and raised by check_all_to_all().
                self._comm.all_to_all_v_device(output, input, input_splits, output_splits)
                return output
            input_splits, output_splits = input_splits.tolist(), output_splits.tolist()
        ins = [int(x) for x in input_splits] if input_splits is not None else []
        outs = [int(x) for x in output_splits] if output_splits is not None else []
        if torch.compiler.is_compiling():
            torch.ops.commlib.all_to_all_v_out(input, outs, ins, self._group_name, out=output)
            return output
        self._comm.all_to_all_v(output, input, outs, ins)
        return output

    def check_all_to_all(self) -> None:
        """Raises ValueError if a CUDA all_to_all_v with device splits since the last check found
        invalid or mismatched splits (it synchronises the device). No-op without GPU state."""
        if hasattr(self._comm, "check_all_to_all"):
            self._comm.check_all_to_all()

    def barrier(self) -> None:
        """Returns once every rank has entered the barrier."""
        self._comm.barrier()

    # ---- point-to-point (docs/backend.md, "Point-to-point") ----
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        """Posts a send of ``tensor`` to rank ``dst``; returns a ``torch.distributed.Work``.

        Not collective: only ``dst`` takes part. ``tensor`` must not change until the work is done.
        CPU tensors: shared memory; a message that fits the channel's ring (2 MiB) is on its way
        when this returns, a larger one moves while any send or receive is waited for.
        CUDA tensors: GPU peer memory (copy engine, stream-ordered flags) once the communicator has
        GPU state (a collective CUDA call or ``symmetric_empty``; at two ranks the first send/recv
        sets it up), else through host memory. Stream-ordered like NCCL: enqueued after the current
        stream's work; ``Work.wait()`` makes the current stream wait; graph-capturable."""
        from . import _C
        return _C.p2p_isend(self._native, tensor, int(dst), int(tag))

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0):
        """Posts a receive into ``tensor`` from rank ``src`` (``None``: any rank; the work's
        ``_source_rank()`` tells which; CPU tensors only) of a message with ``tag``; returns a
        ``torch.distributed.Work``. The message must have ``tensor``'s dtype and number of elements
        (else ``DistBackendError`` "ranks disagree" at ``wait()``; on CPU the message is dropped)."""
        from . import _C
        return _C.p2p_irecv(self._native, tensor, -1 if src is None else int(src), int(tag))

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Sends ``tensor`` to rank ``dst``: on CPU returns once it has left this rank; on CUDA once
        the current stream is ordered after it."""
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receives into ``tensor``; returns the source rank."""
        work = self.irecv(tensor, src, tag)
        work.wait()
        return work._source_rank() if src is None else int(src)

    def batch_isend_irecv(self, ops):
        """Posts sends and receives together and returns one ``torch.distributed.Work`` for all.

        ``ops``: ``(kind, tensor, peer, tag)`` tuples, kind ``"send"`` or ``"recv"`` (tag optional,
        default 0). The pattern of a ring step, overlapped with compute::

            work = comm.batch_isend_irecv([("send", kv, (rank + 1) % n), ("recv", kv_next, (rank - 1) % n)])
            out = attend(q, kv)          # computes while the messages move
            work.wait()                  # kv_next holds the previous rank's kv
        """
        from . import _C
        normalised = []
        for op in ops:
            kind, tensor, peer, *rest = op
            normalised.append((str(kind), tensor, int(peer), int(rest[0]) if rest else 0))
        return _C.p2p_batch(self._native, normalised)

    # ---- fused operations (python/commlib/fused.py) ----
    def fused_allreduce_rmsnorm(self, x, residual, weight, eps=1e-6, *, residual_mode="replicated", out=None,
                                num_sms=None, algo="auto"):
        """``residual += all_reduce(x); out = rms_norm(residual) * weight``; see ``commlib.fused``."""
        from .fused import fused_allreduce_rmsnorm
        return fused_allreduce_rmsnorm(self, x, residual, weight, eps, residual_mode=residual_mode, out=out,
                                       num_sms=num_sms, algo=algo)

    def token_slice(self, num_tokens: int):
        """This rank's rows ``(begin, end)`` of ``num_tokens`` in the fused ops (ceil-split)."""
        from .fused import token_slice
        return token_slice(num_tokens, self.world_size, self.rank)


@atexit.register
def _close_all() -> None:
    for comm in list(_live):
        comm.close()
