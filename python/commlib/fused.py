"""Fused all-reduce + residual add + RMSNorm (TokenWeave's reduce-scatter -> norm -> all-gather).

``comm.fused_allreduce_rmsnorm(x, residual, weight, eps)`` computes, collectively::

    residual += all_reduce(x)              # x, residual: [tokens, hidden]
    out = rms_norm(residual) * weight      # weight: [hidden]; out: [tokens, hidden] on every rank

Each rank reduces and normalises only its own token slice (``token_slice``), then the normalised
rows are gathered. The arithmetic is fixed (Note [fused rmsnorm arithmetic] in
include/commlib/fused_rmsnorm.hpp; ``reference_rmsnorm`` below is the same in torch), so the
result is bitwise equal to ``comm.all_reduce(x)`` followed by ``reference_rmsnorm``, on CPU and GPU.

The op is also ``torch.ops.commlib.fused_allreduce_rmsnorm(x, residual, weight, eps,
comm.group_name, residual_mode, num_sms, algo)`` (updates ``residual`` in place and returns ``out``;
``fused_allreduce_rmsnorm_out`` writes a given ``out``): it has a Meta kernel, so it works under
torch.compile and CUDA graph capture (docs/ops.md).
"""
from __future__ import annotations

from typing import Optional, Tuple

import math

import torch
import torch.distributed as dist

from . import _C
from .errors import from_dispatcher

RESIDUAL_MODES = ("replicated", "sharded")
ALGOS = ("auto", "p2p", "multimem")
HIDDEN_ALIGN = 8


def token_slice(num_tokens: int, world_size: int, rank: int) -> Tuple[int, int]:
    """Rows ``[begin, end)`` that ``rank`` owns: ceil-split, c = ceil(num_tokens / world_size),
    rank r owns ``[min(T, r*c), min(T, (r+1)*c))`` (trailing ranks may own fewer or none)."""
    return tuple(_C.token_slice(int(num_tokens), int(world_size), int(rank)))


def reference_rmsnorm(summed: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The documented arithmetic on an already all-reduced ``summed`` (dtype of ``residual``).

    Returns ``(out, new_residual)``; bitwise what the fused op gives. Pure torch; run it on CPU
    tensors for a bitwise reference (elementwise fp32 ops there are IEEE-exact).
    """
    dtype = residual.dtype
    r = (residual.float() + summed.float()).to(dtype)
    rf = r.float()
    tokens, hidden = rf.shape
    sq = (rf * rf).reshape(tokens, hidden // HIDDEN_ALIGN, HIDDEN_ALIGN)
    q = sq[..., 0]
    for i in range(1, HIDDEN_ALIGN):
        q = q + sq[..., i]
    groups = hidden // HIDDEN_ALIGN
    p = 1
    while p < groups:
        p *= 2
    if p > groups:
        q = torch.cat([q, torch.zeros(tokens, p - groups, dtype=torch.float32, device=q.device)], dim=1)
    while p > 1:
        p //= 2
        q = q[:, :p] + q[:, p:2 * p]
    sumsq = q[:, 0:1]
    variance = sumsq / torch.full_like(sumsq, float(hidden))
    shifted = variance + torch.full_like(variance, eps)
    # torch's CPU float32 sqrt is not always correctly rounded (the kernels' is): take Python's
    # double sqrt (correctly rounded) and round it to float32, which gives the float32 sqrt exactly.
    root = torch.tensor([math.sqrt(v) for v in shifted.flatten().tolist()], dtype=torch.float32,
                        device=shifted.device).reshape(tokens, 1)
    rstd = torch.ones_like(root) / root
    out = ((rf * rstd) * weight.float()).to(dtype)
    return out, r


def fused_allreduce_rmsnorm(comm, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float = 1e-6, *, residual_mode: str = "replicated",
                            out: Optional[torch.Tensor] = None, num_sms: Optional[int] = None,
                            algo: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """``residual += all_reduce(x); out = rms_norm(residual) * weight``. Collective.

    ``comm``: a ``commlib.Communicator``, or a "ddacomm" process group (one host: its communicator;
    several hosts: the two-level path of ``commlib.hierarchy``, residual_mode "replicated" only).

    x, residual: [tokens, hidden] (hidden a multiple of 8, at most 16384); weight: [hidden]; one
    dtype (bfloat16, float16; float32 on CPU). ``residual_mode``:

    - ``"replicated"`` (vLLM ``fused_add_rms_norm``): every rank passes the same full residual and
      ends with the full updated residual and the full ``out``.
    - ``"sharded"`` (TokenWeave): only this rank's rows ``token_slice(tokens, world, rank)`` of the
      residual are read and updated; ``residual`` is the full [tokens, hidden] tensor (other rows
      untouched) or just the slice [end - begin, hidden]. ``out`` is still complete on every rank.

    ``out``: optional [tokens, hidden] output (must not alias x or residual); ``num_sms``: CTAs of
    the GPU kernel (None: ``COMMLIB_FUSED_NUM_SMS``, else by size up to commlib-tune's
    ``fused_num_sms`` for this world size when the tune file has one, else up to 132 (the barrier
    kernel; 16 for the LL kernel of small batches); see
    ``tuned_fused_num_sms``); ``algo``: ``auto``/``p2p``, or
    ``multimem`` (NVLink multicast: needs the opt-in ``COMMLIB_ENABLE_MULTICAST`` set to 1 and no kill
    switch, else ``ValueError`` before any CUDA call; the first call creates the communicator's
    multicast workspace collectively, outside graph capture).
    Returns ``(out, residual)``.
    """
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fused_allreduce_rmsnorm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if residual_mode not in RESIDUAL_MODES:
        raise ValueError(f"fused_allreduce_rmsnorm: residual_mode '{residual_mode}' not supported; "
                         f"supported: {', '.join(RESIDUAL_MODES)}")
    if algo not in ALGOS:
        raise ValueError(f"fused_allreduce_rmsnorm: algo '{algo}' not supported; supported: {', '.join(ALGOS)}")
    if num_sms is not None and (not isinstance(num_sms, int) or num_sms < 1):
        raise ValueError(f"fused_allreduce_rmsnorm: num_sms {num_sms!r} must be a positive int or None")
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"fused_allreduce_rmsnorm: out must be a torch.Tensor, got {type(out).__name__}")
    group_name = comm.group_name
    if isinstance(comm, dist.ProcessGroup):  # a "ddacomm" group: its communicator, or its hierarchy
        from .backend_registration import hierarchy_of
        h = hierarchy_of(comm.group_name)
        if h is not None:
            from . import hierarchy
            return hierarchy.fused_allreduce_rmsnorm(h, x, residual, weight, eps, residual_mode, out,
                                                     int(num_sms or 0), algo)
        backend = comm._get_backend(torch.device("cpu"))
        if not getattr(backend, "has_fast_path", False):
            raise ValueError("fused_allreduce_rmsnorm: the group spans hosts with different numbers of ranks "
                             f"(or is not a \"ddacomm\" group: {type(backend).__name__}); supported: a \"ddacomm\" "
                             "group on one host, or on hosts with the same number of ranks each")
        group_name = "ddacomm-" + comm.group_name
    args = (x, residual, weight, float(eps), group_name, residual_mode, int(num_sms or 0), algo)
    if torch.compiler.is_compiling():
        if out is None:
            return torch.ops.commlib.fused_allreduce_rmsnorm(*args), residual
        torch.ops.commlib.fused_allreduce_rmsnorm_out(*args, out=out)
        return out, residual
    try:
        if out is None:
            out = torch.ops.commlib.fused_allreduce_rmsnorm(*args)
        else:
            torch.ops.commlib.fused_allreduce_rmsnorm_out(*args, out=out)
    except dist.DistBackendError as e:
        raise from_dispatcher(e) from None
    return out, residual


def tuned_fused_num_sms(world_size: int) -> int:
    """commlib-tune's CTA count for the GPU kernel at ``world_size`` (the tune file's
    ``fused_num_sms`` lines, ``COMMLIB_TUNE_FILE``; read once per file per process), 0 when none.
    The GPU path reads it once per communicator and caps its by-size count with it."""
    return int(_C.tuned_fused_num_sms(int(world_size)))


def multicast_allowed() -> Tuple[bool, str, str]:
    """(allowed, deciding variable, reason): the NVLink multicast guard, from the environment only."""
    return tuple(_C.multicast_allowed())


__all__ = ["fused_allreduce_rmsnorm", "token_slice", "reference_rmsnorm", "multicast_allowed",
           "tuned_fused_num_sms"]
