"""Two-level operations of a "ddacomm" group spanning several hosts (docs/multinode.md).

The collectives (all_reduce, reduce_scatter, all_gather, broadcast, barrier) run in the group's
backend (csrc/torch/hierarchy.hpp, Note [hierarchical collectives]). Here: the fused all-reduce +
RMSNorm of such a group, ``commlib.fused_allreduce_rmsnorm(group, ...)``:

    x padded to local_size * c rows (c = ceil(tokens / local_size))
    -> intra-host reduce-scatter (local index l gets rows [l*c, (l+1)*c))
    -> inter-host all-reduce of those rows among the ranks with local index l
    -> residual add + RMSNorm of the reduced rows (a world-1 commlib communicator's fused op, so the
       arithmetic is Note [fused rmsnorm arithmetic])
    -> intra-host all-gather of the normalised rows and the updated residual rows.

The sum is the hierarchical all-reduce's (Note [hierarchical reduction order]); the result is the
same on every rank.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

from . import _C
from .backend_registration import Hierarchy


def layout_of(group: Optional[dist.ProcessGroup] = None):
    """``(num_hosts, local_size, host_index, local_rank)`` of a "ddacomm" group that runs two-level
    collectives, else None (one host, uneven hosts, or another backend)."""
    group = group if group is not None else dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return None
    return getattr(backend, "host_layout", None)


def _self_comm(h: Hierarchy):
    if h.self_comm is None:
        rank = h.layout.hosts[h.layout.host_index][h.layout.local_rank]
        name = f"{h.intra_comm.name}-self{rank}"
        h.self_comm = _C.Communicator(dist.PrefixStore(f"self{rank}/", h.store), 0, 1, name,
                                      h.timeout.total_seconds())
        _C.register_group(name, h.self_comm, replace=True)
    return h.self_comm


def fused_allreduce_rmsnorm(h: Hierarchy, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float, residual_mode: str, out: Optional[torch.Tensor], num_sms: int,
                            algo: str) -> Tuple[torch.Tensor, torch.Tensor]:
    what = "fused_allreduce_rmsnorm"
    if residual_mode != "replicated":
        raise ValueError(f"{what}: residual_mode '{residual_mode}' not supported on a group spanning "
                         f"{h.layout.num_hosts} hosts; supported there: replicated")
    if x.dim() != 2:
        raise ValueError(f"{what}: x must be 2-D [tokens, hidden]; got {x.dim()}-D shape {tuple(x.shape)}")
    if residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError(f"{what}: residual must be a contiguous [{x.shape[0]}, {x.shape[1]}] tensor (residual_mode "
                         f"'replicated'); got {tuple(residual.shape)}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"{what}: out must have x's shape {tuple(x.shape)}, dtype and device; got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    tokens, hidden = x.shape
    size, local = h.layout.local_size, h.layout.local_rank
    comm = _self_comm(h)
    if tokens == 0:
        torch.ops.commlib.fused_allreduce_rmsnorm_out(x, residual, weight, float(eps), comm.name, "replicated",
                                                      num_sms, algo, out=out)  # checks the arguments
        return out, residual
    rows = -(-tokens // size)
    padded = torch.zeros(size * rows, hidden, dtype=x.dtype, device=x.device)
    padded[:tokens].copy_(x)
    shard = torch.empty(rows, hidden, dtype=x.dtype, device=x.device) if size > 1 else padded
    sum_rs = ReduceScatterOptions()
    sum_rs.reduceOp = dist.ReduceOp.SUM
    if size > 1:
        h.intra._reduce_scatter_base(shard, padded, sum_rs).wait()
    h.backend._inter_host_all_reduce(shard)
    begin, end = min(tokens, local * rows), min(tokens, (local + 1) * rows)
    # Columns [0, hidden): the normalised rows; [hidden, 2 hidden): the updated residual rows.
    packed = torch.zeros(rows, 2 * hidden, dtype=x.dtype, device=x.device)
    if end > begin:
        res_rows = residual[begin:end].clone()
        out_rows = torch.empty(end - begin, hidden, dtype=x.dtype, device=x.device)
        torch.ops.commlib.fused_allreduce_rmsnorm_out(shard[:end - begin], res_rows, weight, float(eps), comm.name,
                                                      "replicated", num_sms, algo, out=out_rows)
        packed[:end - begin, :hidden].copy_(out_rows)
        packed[:end - begin, hidden:].copy_(res_rows)
    if size > 1:
        gathered = torch.empty(size * rows, 2 * hidden, dtype=x.dtype, device=x.device)
        h.intra._allgather_base(gathered, packed, AllgatherOptions()).wait()
    else:
        gathered = packed
    out.copy_(gathered[:tokens, :hidden])
    residual.copy_(gathered[:tokens, hidden:])
    return out, residual


__all__ = ["layout_of", "fused_allreduce_rmsnorm"]
