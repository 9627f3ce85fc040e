"""``ring_attention``: context-parallel attention over the ranks of a communicator or process
group. It checks and agrees on the arguments (Note [agreed arguments]), picks the transport and
the mode, and runs pass-KV or pass-Q (passes.py) over the call's plan (plan.py)."""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .attention import AttnFn, default_attention
from .layout import _DTYPE_NAMES, _DTYPES, LAYOUTS, _check_layout, _seqlens, _shard
from .merge import _State
from .passes import _pack_kv, _pass_kv, _pass_q
from .plan import _block_attention, _plan
from .select import select_mode
from .symmetric import SymmetricTransport
from .transport import CommTransport, DistTransport, RingTransport

MODES = ("auto", "pass_kv", "pass_q")
PASS_Q_RETURNS = ("stream", "all_to_all")


_symmetric_transports: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _transport_for(comm, device) -> RingTransport:
    """The transport of a commlib.Communicator: the copy-engine ring for CUDA tensors (one per
    communicator, kept for its slots), the all_to_all_v step otherwise."""
    if device.type == "cuda" and comm.world_size > 1:
        from .. import _C
        if hasattr(_C, "cp_symmetric_peer_views"):
            t = _symmetric_transports.get(comm)
            if t is None:
                t = _symmetric_transports[comm] = SymmetricTransport(comm)
            return t
    return CommTransport(comm)


_MODE_CODES = {"pass_kv": 1, "pass_q": 2}
_LAYOUT_CODES = {name: i + 1 for i, name in enumerate(LAYOUTS)}
_RETURN_CODES = {name: i + 1 for i, name in enumerate(PASS_Q_RETURNS)}
_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
_HEADER = ("mode", "layout", "causal", "pass_q_return", "batch size", "new tokens (cu_seqlens_q)",
           "cu_seqlens_q (digest)", "cu_seqlens_kv (digest)", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
           "kv_cache given", "attn_fn given")


def _digest(values: Sequence[int]) -> int:
    h = 1469598103934665603
    for x in values:
        h = ((h ^ (x & 0xFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFF
    return h


class _Group:
    """Small metadata all-gathers over the ring's group (host ints)."""

    def __init__(self, comm):
        self.comm = comm

    def all_gather(self, values: List[int], device) -> List[List[int]]:
        comm = self.comm
        n = dist.get_world_size(comm.group) if isinstance(comm, _ProcessGroupRef) else comm.world_size
        if n == 1:
            return [list(values)]  # one rank: its own values, nothing to exchange
        t = torch.tensor(values, dtype=torch.int64)
        if isinstance(comm, _ProcessGroupRef):
            dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(comm.group) == "nccl" \
                else torch.device("cpu")
            out = torch.empty(n * len(values), dtype=torch.int64, device=dev)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(out, t.to(dev), group=comm.group)
        else:
            out = torch.empty(n * len(values), dtype=torch.int64)
            comm.all_gather(out, t)
        return out.view(n, len(values)).tolist()


@dataclass
class _ProcessGroupRef:
    group: object


def _resolve(comm, transport, device):
    """(rank, world_size, transport, metadata group) for a Communicator or a process group."""
    from ..communicator import Communicator
    if isinstance(comm, Communicator):
        return comm.rank, comm.world_size, transport or _transport_for(comm, device), _Group(comm)
    if comm is None or isinstance(comm, dist.ProcessGroup):
        if not dist.is_initialized():
            raise ValueError("ring_attention: comm is a process group but torch.distributed is not initialised")
        group = comm if comm is not None else dist.group.WORLD
        return (dist.get_rank(group), dist.get_world_size(group), transport or DistTransport(group),
                _Group(_ProcessGroupRef(group)))
    raise TypeError(f"ring_attention: comm must be a commlib.Communicator, a torch.distributed.ProcessGroup or "
                    f"None (the default group), got {type(comm).__name__}")


def _check_qkv(what, q, k, v, kv_cache):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{what}: {name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{what}: {name} has dtype {t.dtype}; supported: {_DTYPE_NAMES}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{what}: {name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}; "
                            "q, k and v must share dtype and device")
    if q.is_cuda and q.dtype == torch.float64:
        raise TypeError(f"{what}: q has dtype torch.float64, which PyTorch's CUDA attention does not support; "
                        "supported on CUDA: float32, float16, bfloat16")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{what}: k has {k.shape[0]} tokens but q has {q.shape[0]}; the new tokens' K/V must be "
                         "sharded like q (cached keys go in kv_cache)")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{what}: q has head_dim {q.shape[2]} but k has {k.shape[2]}; they must match")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        divisors = ", ".join(str(x) for x in range(1, q.shape[1] + 1) if q.shape[1] % x == 0)
        raise ValueError(f"{what}: num_q_heads {q.shape[1]} is not a multiple of num_kv_heads {k.shape[1]} "
                         f"(k's and v's heads); valid num_kv_heads: {divisors}")
    if kv_cache is not None:
        if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 3:
            raise TypeError(f"{what}: kv_cache must be (k_cache, v_cache, cache_seqlens), "
                            f"got {type(kv_cache).__name__}")
        kc, vc, _ = kv_cache
        for name, t in (("k_cache", kc), ("v_cache", vc)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != tuple(k.shape[1:]):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{what}: kv_cache {name} must be [cached tokens, {k.shape[1]}, {k.shape[2]}] "
                                 f"like k; got {shape}")
            if t.dtype != k.dtype or t.device != k.device:
                raise TypeError(f"{what}: kv_cache {name} is {t.dtype} on {t.device}; it must match k "
                                f"({k.dtype} on {k.device})")
        if kc.shape[0] != vc.shape[0]:
            raise ValueError(f"{what}: kv_cache k_cache has {kc.shape[0]} rows but v_cache {vc.shape[0]}")


# Argument names a rank's check can reject (Note [agreed arguments]); the code travels in the header.
_ARGUMENTS = ("q", "k", "v", "mode", "layout", "pass_q_return", "causal", "cu_seqlens_q", "cu_seqlens_kv",
              "kv_cache", "num_q_heads", "arguments")


def _argument_code(error: Optional[Exception]) -> int:
    """0 for no error, else 1 + the index in _ARGUMENTS of the argument the message names first
    (messages read "ring_attention: <argument> ..."), and the TypeError flag in bit 8."""
    if error is None:
        return 0
    text = str(error).split(": ", 1)[-1]
    word = text.split(" ", 1)[0]
    code = 1 + (_ARGUMENTS.index(word) if word in _ARGUMENTS else len(_ARGUMENTS) - 1)
    return code | (256 if isinstance(error, TypeError) else 0)


def _check_args(what, rank, world_size, q, k, v, cu_seqlens_q, cu_seqlens_kv, causal, kv_cache, mode, layout,
                pass_q_return) -> dict:
    """This rank's own argument checks (raise ValueError / TypeError naming the argument, the value
    and the valid set); returns the parsed sequence layouts."""
    if mode not in MODES:
        raise ValueError(f"{what}: mode '{mode}' not supported; supported: {', '.join(MODES)}")
    _check_layout(what, layout)
    if pass_q_return not in PASS_Q_RETURNS:
        raise ValueError(f"{what}: pass_q_return '{pass_q_return}' not supported; supported: "
                         f"{', '.join(PASS_Q_RETURNS)}")
    if not isinstance(causal, bool):
        raise TypeError(f"{what}: causal must be a bool, got {type(causal).__name__}")
    _check_qkv(what, q, k, v, kv_cache)
    lens_q = _seqlens(what, "cu_seqlens_q", cu_seqlens_q)
    nb = len(lens_q)
    own = _shard(lens_q, world_size, rank, layout)
    if q.shape[0] != own.index.numel():
        raise ValueError(f"{what}: q has {q.shape[0]} tokens but rank {rank} of {world_size} holds "
                         f"{own.index.numel()} tokens of cu_seqlens_q in the {layout} layout; pass this rank's shard "
                         "(commlib.cp.shard)")
    cache_local = [0] * nb
    if kv_cache is not None:
        cs = kv_cache[2]
        cache_local = [int(x) for x in (cs.tolist() if isinstance(cs, torch.Tensor) else cs)]
        if len(cache_local) != nb or any(x < 0 for x in cache_local):
            raise ValueError(f"{what}: kv_cache cache_seqlens must hold {nb} counts >= 0 (one per sequence of "
                             f"cu_seqlens_q); got {cache_local[:8]}")
        if sum(cache_local) != kv_cache[0].shape[0]:
            raise ValueError(f"{what}: kv_cache cache_seqlens sum to {sum(cache_local)} but k_cache has "
                             f"{kv_cache[0].shape[0]} rows")
    lens_kv = None if cu_seqlens_kv is None else _seqlens(what, "cu_seqlens_kv", cu_seqlens_kv)
    return {"lens_q": lens_q, "lens_kv": lens_kv, "cache_local": cache_local}


def ring_attention(comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q,
                   cu_seqlens_kv=None, causal: bool = True, kv_cache=None, mode: str = "auto",
                   scale: Optional[float] = None, layout: str = "balanced", pass_q_return: str = "stream",
                   attn_fn: Optional[AttnFn] = None, transport: Optional[RingTransport] = None,
                   return_lse: bool = False):
    """Context-parallel attention over the ranks of ``comm`` for this rank's shard of a batch.

    ``comm``: a ``commlib.Communicator`` or a ``torch.distributed`` process group (None: the default
    group); every rank calls with the same arguments except its own tensors. q ``[local tokens,
    H, D]``, k / v ``[local tokens, Hkv, D]``: this rank's rows of the new tokens, in
    ``shard(cu_seqlens_q, world_size, rank, layout=layout)`` order. ``cu_seqlens_q``: the
    *global* new tokens per sequence. ``kv_cache``: ``(k_cache, v_cache, cache_seqlens)``, this
    rank's cached K/V rows packed per sequence and their per-sequence counts (partial prefill,
    decode); ``cu_seqlens_kv`` (optional) is then checked to equal cached + new per sequence,
    summed over the ranks. ``mode``: ``pass_kv``, ``pass_q`` or ``auto`` (``select_mode``; decode
    uses pass-Q). ``layout``: ``balanced`` (prefill) or ``round_robin`` (decode: sequence b on
    rank b mod N). ``pass_q_return``: ``stream`` (partials return during the ring) or
    ``all_to_all`` (the paper's post-loop exchange). ``attn_fn``: see ``default_attention``.

    Returns the attention output for this rank's tokens in q's layout and dtype (and the fp32 LSE
    ``[H, local tokens]`` with ``return_lse``). A bad argument on any rank, ranks that disagree, or
    a copy-engine ring the watchdog found stuck raise on every rank before anything is sent
    (``ValueError`` / ``TypeError`` naming the argument, or ``commlib.CommTimeoutError``).
    """
    what = "ring_attention"
    rank, world_size, transport, group = _resolve(comm, transport, q.device if isinstance(q, torch.Tensor)
                                                  else torch.device("cpu"))
    # Note [agreed arguments]
    # Every rank checks its own arguments, then all ranks all-gather a small
    # header (the arguments' fingerprint, whether each rank's check passed, whether its ring failed)
    # over the group's host path, so a bad argument on one rank, ranks that disagree, or a failed
    # ring raise on every rank before anything is sent, and the communicator stays usable (_agree).
    # One rank has nobody to agree with: it raises its own error and builds no header (on one H200 a
    # world-1 call spent ~150 us of host time beyond its attention; the header and its exchange took
    # 59 of the 90 us of host time per call on a 2-core CPU with a stand-in attention).
    local_error, args = None, None
    try:
        args = _check_args(what, rank, world_size, q, k, v, cu_seqlens_q, cu_seqlens_kv, causal, kv_cache, mode,
                           layout, pass_q_return)
    except (ValueError, TypeError) as e:
        local_error = e
    if world_size > 1:
        _agree(what, group, q, k, args, local_error, getattr(transport, "failure", None),
               (mode, layout, causal, pass_q_return, kv_cache is not None, attn_fn is not None))
    elif local_error is not None:
        raise local_error  # one rank: nobody to tell, no exchange (Note [agreed arguments])
    lens_q, lens_kv, cache_local = args["lens_q"], args["lens_kv"], args["cache_local"]
    nb = len(lens_q)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    cache = [[0] * nb for _ in range(world_size)]
    if kv_cache is not None:
        cache = group.all_gather(cache_local, q.device)
    if lens_kv is not None:
        if len(lens_kv) != nb:
            raise ValueError(f"{what}: cu_seqlens_kv names {len(lens_kv)} sequences but cu_seqlens_q {nb}")
        expect = [lens_q[b] + sum(cache[r][b] for r in range(world_size)) for b in range(nb)]
        if lens_kv != expect:
            raise ValueError(f"{what}: cu_seqlens_kv gives sequence lengths {lens_kv[:8]} but cached + new tokens "
                             f"over the ranks are {expect[:8]}")

    if mode == "auto":
        if layout == "round_robin":
            mode = "pass_q"
        else:
            total_p = sum(sum(c) for c in cache)
            mode = select_mode(sum(lens_q), total_p, world_size, heads, kv_heads, head_dim, q.dtype,
                               device_type="cuda" if q.is_cuda else "cpu")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    attn = attn_fn or default_attention
    plan = _plan(lens_q, cache, world_size, layout, causal, q.device)
    state = _State(q.shape[0], heads, head_dim, q.device)
    watched = isinstance(transport, SymmetricTransport) and world_size > 1
    if watched:
        transport.begin_call()  # Note [cp ring watchdog]
    try:
        if world_size == 1 and kv_cache is None:
            # One block pair, this rank's own: no K/V block to pack, no ring (either mode).
            _block_attention(plan, rank, rank, q, k, v, attn, scale, state)
        elif mode == "pass_kv":
            kv_local = _pack_kv(plan, rank, k, v, kv_cache, max(plan.kv_rows))
            _pass_kv(plan, transport, rank, q, kv_local, attn, scale, state)
        else:
            kv_local = _pack_kv(plan, rank, k, v, kv_cache, plan.kv_rows[rank])
            _pass_q(plan, transport, rank, q, kv_local[0], kv_local[1], attn, scale, state, heads, head_dim,
                    pass_q_return)
    finally:
        if watched:
            transport.end_call()
    out, lse = state.result(q.dtype)
    return (out, lse) if return_lse else out


def _agree(what: str, group, q, k, args, local_error, ring_failure, flags) -> None:
    """Note [agreed arguments]: all-gathers this rank's header (its arguments' fingerprint, whether
    its own check passed, whether its ring failed) and raises on every rank for a bad argument on
    any rank, a failed ring, or ranks that disagree."""
    mode, layout, causal, pass_q_return, has_cache, has_attn_fn = flags
    if args is not None:
        lens_q, lens_kv = args["lens_q"], args["lens_kv"]
        header = [_MODE_CODES.get(mode, 0), _LAYOUT_CODES[layout], int(causal), _RETURN_CODES[pass_q_return],
                  len(lens_q), sum(lens_q), _digest(lens_q), _digest(lens_kv) if lens_kv is not None else -1,
                  q.shape[1], k.shape[1], q.shape[2], _DTYPE_CODES[q.dtype], int(has_cache), int(has_attn_fn)]
    else:
        header = [0] * len(_HEADER)
    header += [_argument_code(local_error), int(ring_failure is not None)]
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    headers = group.all_gather(header, device)
    n_fields = len(_HEADER)
    bad = [(r, h[n_fields]) for r, h in enumerate(headers) if h[n_fields]]
    if bad:
        if local_error is not None:
            raise local_error
        r, code = bad[0]
        exc = TypeError if code & 256 else ValueError
        raise exc(f"{what}: rank {r} rejected its argument {_ARGUMENTS[(code & 255) - 1]} (rank {r}'s error names "
                  f"the value and the valid set); every rank raises" +
                  "".join(f"; rank {r2} rejected {_ARGUMENTS[(c & 255) - 1]}" for r2, c in bad[1:]))
    failed = [r for r, h in enumerate(headers) if h[n_fields + 1]]
    if failed:
        from ..errors import CommTimeoutError
        if ring_failure is not None:
            raise CommTimeoutError(ring_failure)
        raise CommTimeoutError(f"{what}: rank {failed[0]}'s copy-engine ring timed out in an earlier call (its "
                               "error names the peer and the slot); the ring of this communicator is no longer "
                               "usable (create a new communicator)")
    for f, name in enumerate(_HEADER):
        values = [h[f] for h in headers]
        if len(set(values)) > 1:
            raise ValueError(f"{what}: ranks disagree on {name}: " +
                             ", ".join(f"rank {r}: {_describe(name, x)}" for r, x in enumerate(values)) +
                             "; every rank must pass the same")


def _describe(name: str, value: int) -> str:
    if name == "mode":
        return {v: k for k, v in _MODE_CODES.items()}.get(value, "auto")
    if name == "layout":
        return {v: k for k, v in _LAYOUT_CODES.items()}[value]
    if name == "pass_q_return":
        return {v: k for k, v in _RETURN_CODES.items()}[value]
    if name == "dtype":
        return str({v: k for k, v in _DTYPE_CODES.items()}[value]).replace("torch.", "")
    if name in ("causal", "kv_cache given", "attn_fn given"):
        return str(bool(value))
    if value == -1:
        return "not given"
    return str(value)
