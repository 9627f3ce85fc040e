"""commlib-perf operation ``ep_dispatch_combine``: expert-parallel dispatch + experts + combine.

One operation rather than two: an ``EPBuffer``'s dispatch and combine alternate (on CUDA a call
out of order raises), so one timed call is a dispatch, the experts and the combine, as a MoE layer
runs them. On every rank, per call: tokens x [tokens, hidden] (different on every rank), a random
routing (top-k distinct experts of ``--experts`` per token, softmax weights; seeded, so every rank
can regenerate every rank's routing), experts that scale their rows by ``scale[e] = 1 + (e % 8) / 8``
(a stand-in that makes a row delivered to the wrong expert visible), output [tokens, hidden] =
``sum_k w[t, k] * scale[idx[t, k]] * x[t]``.

* ``ddacomm``: ``commlib.EPBuffer`` dispatch -> experts on ``expert_x`` -> combine (no host sync;
  CUDA-graph capturable). The buffer is registered once per (shape, token count) outside timing,
  with a capacity computed from the routing (every rank computes the same one).
* ``nccl`` / ``gloo``: ``host_sync_dispatch_combine``, the usual eager path: all_to_all of the
  per-expert counts, ``.tolist()`` (the host sync), permute, all_to_all_single of the rows with
  those splits, experts, all_to_all_single back, weighted sum with ``index_add_``. It cannot be
  captured in a CUDA graph, so with ``-G`` it shows n/a (compare eager runs).
* with ``--ep-baseline ag-rs``, every backend but ``ddacomm`` runs vLLM's default path instead:
  all_gather of x and of the routing, each rank's experts scale the gathered rows routed to them
  (``x * sum over its routes of w * scale``, one elementwise op), reduce_scatter of the
  [world x tokens, hidden] partials back to their owners. No host sync: capturable (``-G``).

* ``--ep-transport`` (``auto``, ``peer``, ``nvshmem``): how ``ddacomm``'s EPBuffer reaches its
  peers; on one node, a run with ``peer`` and one with ``nvshmem`` measure what going through
  NVSHMEM costs (docs/ep.md).
* ``--ep-experts identity``: every expert returns its rows unchanged (scale 1), and ``ddacomm``
  combines ``expert_x`` as dispatch wrote it, so its timed call is the two EP kernels alone, the
  figure that goes beside ``launch_floor`` (Note [ep launch floor]). The default (``scale``) runs
  the stand-in experts above, an elementwise pass over the whole ``expert_x`` buffer (every local
  expert's capacity rows, whatever the routing filled).

Flags: ``--experts`` and ``--topk`` (defaults: DeepSeek-V3-like 256 / 8 with ``--hidden`` 7168 on
GPU; 4 x world size / 2 with hidden 256 on CPU); ``--tokens`` / ``--hidden`` as in
``commlib.perf.rows`` (size = one rank's x). busbw = algbw x 2(n-1)/n, the convention of two
all-to-alls of x (dispatch and combine); the real traffic depends on the routing. Out-of-place
only (in-place n/a).

Check: an fp64 reference from this rank's x and routing; each element of the output may differ by
(n + 3) roundings of the dtype of ``sum_k |w * scale * x|`` (one rounding of each expert output,
one of each owner rank's partial, one of the sum).
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import registry, rows
from .registry import Buffers, Case, Collective, Unsupported

NAME = "ep_dispatch_combine"
GPU_DEFAULTS = {"hidden": 7168, "experts": 256, "topk": 8}  # DeepSeek-V3-like
CPU_DEFAULTS = {"hidden": 256, "experts_per_rank": 4, "topk": 2}
EP_BASELINES = ("host-sync", "ag-rs")
EP_TRANSPORTS = ("auto", "peer", "nvshmem")
EP_EXPERTS = ("scale", "identity")


def _add(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--experts", type=int, default=None,
                       help=f"{NAME}: number of experts, a multiple of the world size (default 256 on GPU, "
                            "4 x world size on CPU)")
    group.add_argument("--topk", type=int, default=None,
                       help=f"{NAME}: experts per token (default 8 on GPU, 2 on CPU)")


    group.add_argument("--ep-baseline", dest="ep_baseline", choices=EP_BASELINES, default="host-sync",
                       help=f"{NAME}: what the other backends run: the host-synchronised all-to-all "
                            "(host-sync, default; eager only) or all_gather + reduce_scatter (ag-rs, vLLM's "
                            "default; CUDA-graph capturable)")
    group.add_argument("--ep-transport", dest="ep_transport", choices=EP_TRANSPORTS, default="auto",
                       help=f"{NAME}: how ddacomm's EPBuffer reaches the peers: peer memory (one node), NVSHMEM "
                            "(needs nvshmem4py; docs/ep.md), or auto (peer memory on one host, else NVSHMEM); "
                            "run once with each to measure the cost of going through NVSHMEM on one node")
    group.add_argument("--ep-experts", dest="ep_experts", choices=EP_EXPERTS, default="scale",
                       help=f"{NAME}: the stand-in experts: scale each row by its expert's factor (default; an "
                            "elementwise pass over expert_x) or identity (no pass: ddacomm times dispatch + "
                            "combine alone, the figure beside launch_floor)")


def _validate(opts: argparse.Namespace) -> Optional[str]:
    if NAME not in getattr(opts, "ops", []):
        return None
    world = None if "RANK" in os.environ else opts.np  # under torchrun the world size is known later
    try:
        _shape(vars(opts), world or 1, check_world=world is not None)
    except ValueError as e:
        return str(e)
    return None


registry.register_options(NAME, _add, _validate)


def _shape(options: dict, world_size: int, check_world: bool = True):
    """(hidden, experts, topk) for this run; ValueError naming the flag when they do not fit."""
    gpu = options.get("device") == "cuda"
    hidden = rows.hidden_of(options, GPU_DEFAULTS["hidden"] if gpu else CPU_DEFAULTS["hidden"])
    experts = options.get("experts") or (GPU_DEFAULTS["experts"] if gpu
                                         else CPU_DEFAULTS["experts_per_rank"] * world_size)
    topk = options.get("topk") or (GPU_DEFAULTS["topk"] if gpu else CPU_DEFAULTS["topk"])
    if experts < 1 or topk < 1 or topk > experts:
        raise ValueError(f"{NAME}: --topk {topk} / --experts {experts} invalid; valid: 1 <= topk <= experts")
    if check_world and experts % world_size:
        raise ValueError(f"{NAME}: --experts {experts} is not a multiple of the world size {world_size}")
    return hidden, experts, topk


def expert_scales(num_experts: int, device, identity: bool = False) -> torch.Tensor:
    """The stand-in experts: expert e multiplies its rows by 1 + (e % 8) / 8 (exact in every dtype),
    or by 1 with ``identity`` (``--ep-experts identity``)."""
    if identity:
        return torch.ones(num_experts, dtype=torch.float32, device=device)
    return (1 + (torch.arange(num_experts, dtype=torch.float32) % 8) / 8).to(device)


def _identity(case: Case) -> bool:
    return case.options.get("ep_experts") == "identity"


@functools.lru_cache(maxsize=64)
def routing(rank: int, num_tokens: int, num_experts: int, topk: int, salt: int):
    """Rank ``rank``'s routing on the CPU: (topk_idx [T, k] int64, distinct experts per token;
    topk_weights [T, k] float32, softmax of the top scores). Any rank can regenerate any rank's."""
    seed = (1000003 * (rank + 1) + 7919 * num_tokens + 31 * num_experts + topk + 104729 * salt) & 0x7FFFFFFF
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    w, idx = scores.topk(topk, dim=1)
    return idx, torch.softmax(w, dim=1).float()


@functools.lru_cache(maxsize=16)
def _tokens(rank: int, num_tokens: int, hidden: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    return registry._cpu_input(rank, num_tokens * hidden, dtype, salt).view(num_tokens, hidden)


def needed_capacity(world_size: int, num_tokens: int, num_experts: int, topk: int, salt: int) -> int:
    """The most rows any expert receives from every rank's routing (the same on every rank)."""
    counts = torch.zeros(num_experts, dtype=torch.long)
    for r in range(world_size):
        counts += torch.bincount(routing(r, num_tokens, num_experts, topk, salt)[0].reshape(-1),
                                 minlength=num_experts)
    return int(counts.max())


def host_sync_dispatch_combine(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                               num_experts: int, group=None,
                               experts: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
                               ) -> torch.Tensor:
    """The usual eager MoE all-to-all through ``torch.distributed`` (NCCL or gloo) on ``group``.

    Rows go to the rank owning their expert (contiguous split, Note [EP layout]), grouped by
    expert; the per-expert counts are exchanged first and read on the host (``.tolist()``) to size
    the row all-to-alls. ``experts(rows, expert_ids)`` (global ids) runs on the received rows
    (identity when None); the results go back and are summed per token in fp32, weighted by
    ``topk_weights``, rounded once to x's dtype. ``topk_idx`` entries of -1 are skipped. Returns
    [num_tokens, hidden]. Collective over ``group``.
    """
    world = dist.get_world_size(group)
    num_tokens, topk = topk_idx.shape
    num_local = num_experts // world
    flat = topk_idx.reshape(-1)
    valid = flat >= 0
    order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)  # by expert; -1 routes last
    send_counts = torch.bincount(flat[valid], minlength=num_experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sends = send_counts.view(world, num_local).sum(1).tolist()  # the host sync
    recv_per_expert = recv_counts.view(world, num_local)
    recvs = recv_per_expert.sum(1).tolist()
    order = order[: sum(sends)]  # the valid routes
    send = x[order // topk]
    recv = torch.empty(sum(recvs), x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, send, recvs, sends, group=group)
    if experts is not None:
        first = dist.get_rank(group) * num_local
        ids = torch.arange(first, first + num_local, device=x.device).repeat(world)
        recv = experts(recv, torch.repeat_interleave(ids, recv_per_expert.reshape(-1), output_size=sum(recvs)))
    back = torch.empty_like(send)
    dist.all_to_all_single(back, recv, sends, recvs, group=group)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // topk, back.float() * topk_weights.reshape(-1)[order][:, None])
    return out.to(x.dtype)


def _setup(case: Case) -> Buffers:
    hidden, experts, topk = _shape(case.options, case.world_size)
    tokens = rows.tokens_of(case, hidden)
    idx, w = routing(case.rank, tokens, experts, topk, case.salt)
    x = _tokens(case.rank, tokens, hidden, case.dtype, case.salt).to(case.device, copy=True)
    out = registry.poison(torch.empty_like(x))
    scales = expert_scales(experts, case.device, _identity(case)).to(case.dtype)
    num_local = experts // case.world_size
    extra = {"idx": idx.to(case.device), "w": w.to(case.device), "tokens": tokens, "shape": (hidden, experts, topk),
             "scales": scales, "local_scales": scales[case.rank * num_local:(case.rank + 1) * num_local, None, None]}
    return Buffers(inp=x, out=out, extra=extra)


def _buffer(backend, case: Case, tokens: int, hidden: int, experts: int, topk: int):
    """The EPBuffer for this case, registered on the backend's first call of a new shape (collective
    on CUDA: every rank takes the same decision from the same routing); reused while it fits."""
    import commlib
    need = needed_capacity(case.world_size, tokens, experts, topk, case.salt)
    transport = case.options.get("ep_transport") or "auto"
    key = ("ep_buffer", hidden, experts, topk, case.dtype, str(case.device), transport)
    buf = backend.resources.get(key)
    if buf is not None and buf.max_tokens_per_rank >= tokens and buf.capacity >= need:
        return buf
    backend.resources.pop(key, None)
    del buf  # free the old registration before the new one
    # Headroom, so that the check's routing fits too; at most what EPBuffer accepts.
    capacity = min((need * 5 // 4 + 31) // 16 * 16, tokens * case.world_size * topk)
    try:
        buf = commlib.EPBuffer(backend.comm, tokens, hidden, experts, topk, case.dtype, device=case.device,
                               capacity=capacity, transport=transport)
    except TypeError as err:
        raise Unsupported(f"ddacomm: {err}") from err
    except ValueError as err:
        if "transport" not in str(err):
            raise
        raise Unsupported(f"ddacomm: {err}") from err
    backend.resources[key] = buf
    return buf


def _run(backend, b: Buffers, case: Case) -> None:
    if case.in_place:
        raise Unsupported(f"{NAME} has no in-place form")
    e = b.extra
    hidden, experts, topk = e["shape"]
    if backend.name == "ddacomm":
        buf = e.get("buffer")
        if buf is None:  # the first (untimed) call of this case
            buf = e["buffer"] = _buffer(backend, case, e["tokens"], hidden, experts, topk)
        res = buf.dispatch(b.inp, e["idx"], e["w"])
        expert_y = res.expert_x if _identity(case) else res.expert_x * e["local_scales"]
        buf.combine(expert_y, res.handle, out=b.out)
        return
    if case.options.get("ep_baseline") == "ag-rs":
        _all_gather_reduce_scatter(backend, b, case)
        return
    if backend.name not in ("nccl", "gloo"):
        raise Unsupported(f"{backend.name}: {NAME} needs all_to_all_single with splits (nccl, gloo)")
    if case.device.type == "cuda" and case.options.get("graph_launches"):
        raise Unsupported(f"{backend.name}: the host-synchronised EP path (.tolist() of the counts) cannot be "
                          "captured in a CUDA graph (-G); compare without -G")
    scales = e["scales"]
    b.out.copy_(host_sync_dispatch_combine(b.inp, e["idx"], e["w"], experts, backend.group,
                                           None if _identity(case) else lambda r, ids: r * scales[ids][:, None]))


def _all_gather_reduce_scatter(backend, b: Buffers, case: Case) -> None:
    """vLLM's default EP path (``--ep-baseline ag-rs``): every rank sees every token, its experts
    weigh the rows routed to them, a reduce_scatter sums each token's partials on its owner."""
    e, n = b.extra, case.world_size
    tokens, (hidden, experts, topk) = e["tokens"], e["shape"]
    if "gathered_x" not in e:  # the first (untimed) call allocates; the timed calls only run
        e["gathered_x"] = torch.empty(n * tokens, hidden, dtype=case.dtype, device=case.device)
        e["gathered_idx"] = torch.empty(n * tokens, topk, dtype=e["idx"].dtype, device=case.device)
        e["gathered_w"] = torch.empty(n * tokens, topk, dtype=e["w"].dtype, device=case.device)
        e["partials"] = torch.empty(n * tokens, hidden, dtype=case.dtype, device=case.device)
        e["scales_f32"] = expert_scales(experts, case.device, _identity(case))
    backend.all_gather(e["gathered_x"], b.inp)
    backend.all_gather(e["gathered_idx"], e["idx"])
    backend.all_gather(e["gathered_w"], e["w"])
    idx = e["gathered_idx"]
    mine = (idx // (experts // n)) == case.rank
    coef = (e["gathered_w"] * e["scales_f32"][idx] * mine).sum(1, keepdim=True)
    torch.mul(e["gathered_x"], coef.to(case.dtype), out=e["partials"])
    backend.reduce_scatter(b.out, e["partials"], "sum")


def _check(b: Buffers, case: Case) -> int:
    e = b.extra
    hidden, experts, topk = e["shape"]
    idx, w = routing(case.rank, e["tokens"], experts, topk, case.salt)
    x64 = _tokens(case.rank, e["tokens"], hidden, case.dtype, case.salt).double()
    coef = (w.double() * expert_scales(experts, "cpu", _identity(case)).double()[idx]).sum(1, keepdim=True)
    expected = x64 * coef
    tol = (case.world_size + 3) * registry._EPS[case.dtype] * expected.abs() + 1e-30  # all terms are positive
    registry.plant(b.out, case)
    diff = (b.out.detach().double().cpu() - expected).abs()
    return int((~(diff <= tol)).sum())


def _sizes(cli_sizes, esize: int, world_size: int, options: dict):
    hidden, _, _ = _shape(options, world_size, check_world=False)
    return rows.row_sizes(cli_sizes, esize, hidden, options.get("tokens"))


registry.register(Collective(
    name=NAME, count=lambda nbytes, esize, n: nbytes // esize, bus_factor=lambda n: 2.0 * (n - 1) / n,
    setup=_setup, run=_run, check=_check, sizes=_sizes))


# ---- launch_floor: what two kernel launches cost, the floor of a dispatch + combine ----
# Note [ep launch floor]
# A dispatch + combine is two kernels; at 1 token their work is a few hundred bytes, so its time
# is bounded below by two back-to-back launches on the stream. ``commlib-perf launch_floor`` times
# exactly that (two empty kernels: torch.cuda._sleep(0)) with the same harness and flags (-G: in
# one CUDA graph), so bench/results/ep.md can put the world-1 dispatch + combine beside it.

def _floor_setup(case: Case) -> Buffers:
    one = torch.zeros(1, dtype=case.dtype, device=case.device)
    return Buffers(inp=one, out=one.clone())


def _floor_run(backend, b: Buffers, case: Case) -> None:
    if case.device.type != "cuda":
        raise Unsupported("launch_floor: times CUDA kernel launches; needs --device cuda")
    if case.in_place:
        raise Unsupported("launch_floor: has no in-place form")
    torch.cuda._sleep(0)
    torch.cuda._sleep(0)


registry.register(Collective(
    name="launch_floor", count=lambda nbytes, esize, n: 0, bus_factor=lambda n: 1.0,
    setup=_floor_setup, run=_floor_run, check=lambda b, case: 0, sizes=lambda cli, esize, n, opts: [cli[0]]))
