"""Expert-parallel dispatch / combine from registered buffers (issue #8).

Layout (Note [EP layout] in include/commlib/ep.hpp): experts are split contiguously, rank r owns
experts ``[r * L, (r + 1) * L)`` with ``L = num_experts // world_size``. In ``expert_x[e]`` the rows
of local expert e hold the tokens routed to it ordered by (source rank, token index, k); the first
``expert_counts[e]`` rows are valid. ``topk_idx`` entries of -1 mean "no expert".
``combine`` returns, for each token, ``sum_k w[t, k] * y(t, k)`` over its kept routes: each owner
rank sums its routes of the token in fp32 with k ascending (each product and sum rounded to fp32,
no fused multiply-add) and rounds that partial to the dtype; the token's rank adds the partials in
fp32 in ascending owner rank and rounds once. A token whose experts all live on one rank gets
``round(sum_k w * y)`` exactly. Tokens travel once per owner rank, not once per route.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Optional

import torch

from . import _C

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_TRANSPORTS = ("auto", "peer", "nvshmem")
_buffer_ids = itertools.count()


def _num_hosts(comm) -> int:
    """Hosts the ranks of ``comm`` run on (Note [communicator hosts])."""
    native = comm.native if hasattr(comm, "native") else comm
    return getattr(native, "num_hosts", 1)


def _resolve_transport(comm, transport: str, device: torch.device) -> str:
    if transport not in _TRANSPORTS:
        raise ValueError(f"EPBuffer: transport '{transport}' not supported; supported: {', '.join(_TRANSPORTS)}")
    hosts = _num_hosts(comm)
    if device.type != "cuda":
        if transport == "nvshmem":
            raise ValueError(f"EPBuffer: transport 'nvshmem' not supported on {device}; supported: auto, peer")
        if hosts > 1:
            raise ValueError(f"EPBuffer: device {device} needs every rank on one host (shared memory); the "
                             f"communicator's ranks span {hosts} hosts: use CUDA tensors (transport 'auto' or "
                             "'nvshmem')")
        return "peer"
    if transport == "auto":
        transport = "nvshmem" if hosts > 1 else "peer"
    if transport == "peer" and hosts > 1:
        raise ValueError(f"EPBuffer: transport 'peer' needs every rank on one host (CUDA peer memory); the "
                         f"communicator's ranks span {hosts} hosts; supported here: auto, nvshmem")
    if transport == "nvshmem":
        from . import _nvshmem
        _nvshmem.attach(comm, device.index)
    return transport


class EPHandle(NamedTuple):
    """What combine needs from its dispatch (the rest stays in the buffer). Valid until the next
    dispatch on the same buffer."""
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int


class EPDispatchResult(NamedTuple):
    expert_x: torch.Tensor       # [L, capacity, hidden], a view of the registered buffer
    expert_counts: torch.Tensor  # [L] int32, valid rows per local expert
    handle: EPHandle


class EPBuffer:
    """Registered buffers for expert-parallel dispatch / combine on one communicator.

    ``EPBuffer(comm, max_tokens_per_rank, hidden, num_experts, topk, dtype, device="cpu", capacity=None,
    name=None, transport="auto")`` is collective on CUDA (it allocates symmetric memory once).
    ``capacity`` (rows per local expert) defaults to ``max_tokens_per_rank * world_size``, which no
    routing without repeated experts in a token's top-k can exceed. Rows beyond the capacity are dropped and recorded in an overflow word
    on every rank; ``check()`` raises ``ValueError`` describing it (it syncs with the device on CUDA).

    ``dispatch`` and ``combine`` are collective and alternate (on CUDA a call out of order raises
    ``ValueError``): the tensors a dispatch returns
    (``expert_x``, ``expert_counts``, the handle) are valid until the next dispatch. On CUDA both run on
    the current stream, read no value on the host, and can be captured in a CUDA graph and replayed
    with routing that changes between replays.

    ``name`` names the buffer in ``torch.ops.commlib.ep_dispatch`` / ``ep_combine`` (default:
    ``"<comm name>/ep<k>"``, k counting this process's buffers; docs/ops.md); under
    ``torch.compile`` ``dispatch`` and ``combine`` are those ops.

    ``transport`` (CUDA): ``"peer"`` (CUDA peer memory, one node), ``"nvshmem"`` (NVSHMEM puts, which
    reach peers over NVLink or the network; needs nvshmem4py, ``pip install commlib[nvshmem]``, and
    a build that found the NVSHMEM headers; docs/ep.md), or ``"auto"``: peer memory when every rank is
    on one host, NVSHMEM otherwise. Both give the same bits. On CPU only ``"auto"`` / ``"peer"``.
    """

    def __init__(self, comm, max_tokens_per_rank: int, hidden: int, num_experts: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, device="cpu", capacity: Optional[int] = None,
                 name: Optional[str] = None, transport: str = "auto"):
        if dtype not in _DTYPES:
            raise TypeError(f"EPBuffer: dtype {dtype} not supported; supported: float32, float16, bfloat16")
        for arg, value in (("max_tokens_per_rank", max_tokens_per_rank), ("hidden", hidden),
                           ("num_experts", num_experts), ("topk", topk)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"EPBuffer: {arg} must be an int, got {type(value).__name__}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.comm = comm
        self.world_size = comm.world_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.hidden = hidden
        self.num_experts = num_experts
        self.topk = topk
        self.dtype = dtype
        self.device = device
        native = comm.native if hasattr(comm, "native") else comm
        self.name = str(name) if name is not None else f"{comm.name}/ep{next(_buffer_ids)}"
        self.transport = _resolve_transport(comm, transport, device)
        self._buf = _C.EPBuffer(native, max_tokens_per_rank, hidden, num_experts, topk, int(capacity or 0),
                                _DTYPES[dtype], str(device), self.transport)
        self.capacity = self._buf.capacity
        self.num_local_experts = num_experts // self.world_size
        self._last = None
        _C.register_ep_buffer(self.name, self._buf)

    def __del__(self):
        buf, name = getattr(self, "_buf", None), getattr(self, "name", None)
        if buf is not None and name is not None and _C is not None:  # _C is None late in shutdown
            _C.unregister_ep_buffer(name, buf)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> EPDispatchResult:
        """Sends each token to its top-k experts. ``x`` [num_tokens, hidden] (num_tokens may be 0),
        ``topk_idx`` [num_tokens, topk] int64 or int32 (-1: no expert), ``topk_weights``
        [num_tokens, topk] float (used by combine)."""
        if torch.compiler.is_compiling():
            expert_x, expert_counts = torch.ops.commlib.ep_dispatch(x, topk_idx, topk_weights, self.name)
            return EPDispatchResult(expert_x, expert_counts, EPHandle(topk_idx, topk_weights, x.shape[0]))
        handle = self._send(x, topk_idx, topk_weights, "both")
        expert_x, expert_counts = self._last
        return EPDispatchResult(expert_x, expert_counts, handle)

    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> EPHandle:
        """First half of dispatch: starts sending this rank's tokens and returns at once (on CUDA the
        work is queued on the current stream). Finish with ``dispatch_recv(handle)``; independent
        compute may run in between, but ``x`` must stay unchanged until then (on CUDA the receive
        part copies this rank's own tokens from it)."""
        return self._send(x, topk_idx, topk_weights, "send")

    def dispatch_recv(self, handle: EPHandle) -> EPDispatchResult:
        """Second half of dispatch: waits for the peers' tokens and lays them out expert-major."""
        expert_x, expert_counts = self._buf.dispatch(None, None, None, "recv")
        return EPDispatchResult(expert_x, expert_counts, handle)

    def _send(self, x, topk_idx, topk_weights, phase) -> EPHandle:
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"EPBuffer.dispatch: {name} must be a torch.Tensor, got {type(t).__name__}")
        if topk_idx.dtype == torch.int32:
            topk_idx = topk_idx.long()
        if not topk_weights.is_floating_point():
            raise TypeError(f"EPBuffer.dispatch: topk_weights has dtype {topk_weights.dtype}; supported: floating")
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"EPBuffer.dispatch: topk_weights has shape {tuple(topk_weights.shape)} but topk_idx "
                             f"has {tuple(topk_idx.shape)}; they must match")
        topk_weights = topk_weights.float()
        self._last = self._buf.dispatch(x, topk_idx, topk_weights, phase)
        return EPHandle(topk_idx, topk_weights, int(x.shape[0]))

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Returns [num_tokens, hidden]: each token's expert outputs weighted by topk_weights and summed
        (order and rounding: module docstring). ``expert_out`` has expert_x's shape; rows past
        expert_counts are ignored. ``out`` (contiguous) receives the result when given."""
        if torch.compiler.is_compiling() and out is None:
            return torch.ops.commlib.ep_combine(expert_out, handle.topk_idx, self.name)
        self._check_combine(expert_out, handle)
        return self._buf.combine(expert_out, handle.num_tokens, out, "both")

    def combine_send(self, expert_out: torch.Tensor, handle: EPHandle, out: Optional[torch.Tensor] = None) -> None:
        """First half of combine: sends this rank's expert outputs back. Finish with ``combine_recv()``."""
        self._check_combine(expert_out, handle)
        self._buf.combine(expert_out, handle.num_tokens, out, "send")

    def combine_recv(self) -> torch.Tensor:
        """Second half of combine: waits for the peers and returns the [num_tokens, hidden] output."""
        return self._buf.combine(None, 0, None, "recv")

    @staticmethod
    def _check_combine(expert_out, handle) -> None:
        if not isinstance(expert_out, torch.Tensor):
            raise TypeError(f"EPBuffer.combine: expert_out must be a torch.Tensor, got {type(expert_out).__name__}")
        if not isinstance(handle, EPHandle):
            raise TypeError(f"EPBuffer.combine: handle must be the EPHandle from dispatch, got {type(handle).__name__}")

    def check(self) -> None:
        """Raises ValueError if any dispatch since the last check dropped routes (capacity overflow)."""
        self._buf.check()

    @property
    def kernels(self) -> str:
        """Which kernels run this buffer's calls: "host" (CPU), "flags" or "ll" (CUDA; "ll" for decode-sized
        buffers when ``COMMLIB_EP_LL`` is 1 on every rank: docs/ep.md), "nvshmem" (transport "nvshmem")."""
        return self._buf.kernels

    @property
    def overflow_word(self) -> torch.Tensor:
        """The overflow word: [routes dropped, max(count << 24 | expert), invalid ids, 0] (sticky)."""
        return self._buf.overflow_word

    def __repr__(self) -> str:
        return (f"commlib.EPBuffer(world_size={self.world_size}, max_tokens_per_rank={self.max_tokens_per_rank}, "
                f"hidden={self.hidden}, num_experts={self.num_experts}, topk={self.topk}, capacity={self.capacity}, "
                f"dtype={self.dtype}, device={self.device}, transport={self.transport!r})")


    def without_ranks(self, comm, masked_ranks, *, renormalize: bool = False) -> "MaskedEPBuffer":
        """This buffer's layout over the survivors after ``masked_ranks`` died: a new buffer on
        ``comm`` (``old_comm.shrink(masked_ranks)``, made collectively by the survivors) that takes
        the original expert ids (Note [EP rank mask])."""
        return MaskedEPBuffer(comm, self.world_size, masked_ranks, self.max_tokens_per_rank, self.hidden,
                              self.num_experts, self.topk, self.dtype, self.device, renormalize=renormalize)


class MaskedEPBuffer:
    """Expert parallelism carrying on without some ranks (Note [EP rank mask]).

    Note [EP rank mask]
    When an EP rank dies the survivors get ``PeerError``; the group and its buffers are unusable.
    They shrink the communicator (``Communicator.shrink``) and make this buffer over it: it keeps the
    original expert ids (``num_experts`` over ``original_world_size`` ranks, Note [EP layout]).
    ``dispatch`` maps each route to its expert on the owner's new rank; a route to an expert of a
    masked rank is dropped (its ``topk_idx`` entry becomes -1) and counted in ``dropped`` (a tensor
    on the buffer's device: the routes this rank dropped in the last dispatch; nothing is read on the
    host, so capture still works). ``combine`` then sums the kept routes only, with their weights as
    given or, with ``renormalize=True``, divided by the sum of the token's kept weights (a token
    whose routes were all dropped combines to zeros). The remap is one gather through a
    [num_experts + 1] table on the device.
    """

    def __init__(self, comm, original_world_size: int, masked_ranks, max_tokens_per_rank: int, hidden: int,
                 num_experts: int, topk: int, dtype: torch.dtype = torch.bfloat16, device="cpu", *,
                 renormalize: bool = False, capacity: Optional[int] = None, transport: str = "auto"):
        masked = sorted({int(r) for r in masked_ranks})
        if num_experts % original_world_size != 0:
            raise ValueError(f"MaskedEPBuffer: num_experts {num_experts} is not a multiple of original_world_size "
                             f"{original_world_size}")
        survivors = [r for r in range(original_world_size) if r not in masked]
        if not masked or any(not 0 <= r < original_world_size for r in masked) or not survivors:
            raise ValueError(f"MaskedEPBuffer: masked_ranks {list(masked_ranks)} not supported; valid: a non-empty "
                             f"subset of 0..{original_world_size - 1} that leaves at least one rank")
        if comm.world_size != len(survivors):
            raise ValueError(f"MaskedEPBuffer: the communicator has {comm.world_size} ranks but "
                             f"{len(survivors)} survive; pass the communicator comm.shrink({masked}) returned")
        local = num_experts // original_world_size
        self.masked_ranks = masked
        self.renormalize = renormalize
        self.num_experts = num_experts
        self.buffer = EPBuffer(comm, max_tokens_per_rank, hidden, local * len(survivors), topk, dtype, device,
                               capacity=capacity, transport=transport)
        table = torch.full((num_experts + 1,), -1, dtype=torch.long)  # the last entry serves idx -1
        for new_rank, rank in enumerate(survivors):
            table[rank * local:(rank + 1) * local] = torch.arange(new_rank * local, (new_rank + 1) * local)
        self._table = table.to(self.buffer.device)
        self.dropped = torch.zeros((), dtype=torch.long, device=self.buffer.device)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> EPDispatchResult:
        """``EPBuffer.dispatch`` with the original expert ids (routes to masked ranks dropped)."""
        if not isinstance(topk_idx, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
            raise TypeError("MaskedEPBuffer.dispatch: topk_idx and topk_weights must be torch.Tensors")
        idx = topk_idx.long()
        if idx.numel() and (bool((idx < -1).any()) if not idx.is_cuda else False):
            raise ValueError("MaskedEPBuffer.dispatch: topk_idx has entries below -1; valid: -1 or 0.."
                             f"{self.num_experts - 1}")
        mapped = self._table[torch.where(idx < 0, self.num_experts, idx).clamp(max=self.num_experts)]
        # Ids past num_experts stay invalid (the buffer reports them as it does without a mask).
        mapped = torch.where(idx >= self.num_experts, idx, mapped)
        dropped = (mapped < 0) & (idx >= 0)
        self.dropped = dropped.sum()
        weights = topk_weights.float().masked_fill(dropped, 0.0)
        if self.renormalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = torch.where(total > 0, weights / torch.where(total > 0, total, 1.0), weights)
        return self.buffer.dispatch(x, mapped, weights)

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.buffer.combine(expert_out, handle, out)

    def check(self) -> None:
        self.buffer.check()


__all__ = ["EPBuffer", "EPDispatchResult", "EPHandle", "MaskedEPBuffer"]
