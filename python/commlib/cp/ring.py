"""Context parallelism: ring attention (pass-KV, pass-Q), the load-balanced sharding, the merge of
partial attention states, and the pass-KV / pass-Q selection rule. See docs/cp.md.

Layouts follow FlashAttention's varlen API: q / k / v are ``[tokens, heads, head_dim]`` with the
sequences of a batch packed one after another, described by ``cu_seqlens`` (``[0, L0, L0 + L1,
...]``); the log-sum-exp (LSE) is ``[heads, tokens]`` in float32 (natural log, scaled scores).

Note [balanced layout]
    Every sequence's new tokens are cut into 2N contiguous chunks (N = world size; chunk c holds
    positions [c*L // 2N, (c+1)*L // 2N), so a sequence shorter than 2N has empty chunks); rank r
    holds chunks r and 2N-1-r, in that order. Under causal masking each rank then does the same
    work: chunk r is cheap (early positions), chunk 2N-1-r is dear. A rank's local tokens are, per
    sequence in batch order, its first chunk then its second chunk. With a KV cache (partial
    prefill: P cached + T new tokens) only the T new tokens are sharded; the cached tokens stay
    where they are (every cached token precedes every new one, so where it lives does not matter
    for masking). The "round_robin" layout places whole sequences on ranks (sequence b on rank
    b mod N): decode, where every sequence has one new token.

Note [block pairs]
    Rank j's queries against rank i's keys (balanced layout, causal), per sequence: the cached keys
    are seen by every query; of the new keys,
      i == j: the local tokens are in position order, so one causal call (bottom-right aligned,
              FlashAttention's convention) over [cache_i, new_i] covers the block;
      i <  j: both of j's chunks see i's first chunk fully and none of i's second chunk;
      i >  j: j's second chunk sees all of i's tokens; j's first chunk sees only the cache.
    Nothing masked out is computed. Non-causal attention is one full call per pair. A rank's K/V
    block is stored per sequence as [cache, first chunk, second chunk], so every key range above is
    a prefix of a sequence's rows.

Note [cp copy-engine ring]
    On CUDA with a commlib.Communicator the ring uses no SM. Each message slot (K/V, Q: two each,
    double-buffered; partial (O, LSE) returns: one per step) lives in symmetric memory (cuMem,
    mapped into every peer) and has exactly one sender per receiver, so two 32-bit flags per slot
    suffice: ready[X] in the receiver's memory, free[X] in the sender's. Sender, on a copy stream
    that first waits for the current stream: wait free[X] == 1, write free[X] = 0, copy the block
    into the receiver's slot (cudaMemcpyAsync between peer-mapped addresses: a copy-engine
    transfer), write ready[X] = 1 at the receiver (cuStreamWriteValue32 fences first, so the data
    lands before the flag). Receiver, on the current stream: wait ready[X] == 1, write ready[X] = 0,
    compute, then write free[X] = 1 at the sender. The flags return to their initial values after
    every use (no sequence numbers), so a captured CUDA graph replays the same operations. A
    stream wait has no timeout on the device: Note [cp ring watchdog] bounds it from the host.

Note [cp ring watchdog]
    cuStreamWaitValue32 cannot time out, and an SM-side bounded wait would cost the SMs the ring
    exists to leave free; so the bound comes from the host, automatically. Every eager call on the
    copy-engine ring records an event after each step's wait (current stream) and each send (copy
    stream) and hands them to one daemon thread per process with a deadline of the communicator's
    timeout (COMMLIB_TIMEOUT_MS, else init_process_group's / Communicator's timeout). When a call's
    events are not all complete by then, the thread (1) names the first wait still pending (slot,
    step, the peer it waits for, or the peer that has not released a slot), (2) marks the ring
    failed, (3) unblocks this rank's streams: on a side stream it fills the call's receive slots
    with NaN and writes ready = free = 1 into this rank's flags, repeatedly, until the call's
    events complete (a side stream may share a hardware queue with the blocked one, so a write
    that does not complete within a poll moves to a fresh stream). The stuck call so produces NaN
    rows instead of a hang (merge rule: a NaN LSE poisons its row), and the next ring_attention
    on the communicator raises commlib.CommTimeoutError on every rank (the failure travels in the
    header all-gather), naming the rank, the peer and the slot. The ring of that communicator
    stays failed: its flags no longer match the peers'. Calls captured in a CUDA graph are not
    watched (a replay is not a ring_attention call): SymmetricTransport.synchronize(timeout_s)
    bounds a wait for a replay. The thread runs in the relaxed stream-capture mode, so its event
    queries never invalidate a graph that another thread captures meanwhile.
"""
from __future__ import annotations

import inspect
import math
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

MODES = ("auto", "pass_kv", "pass_q")
LAYOUTS = ("balanced", "round_robin")
PASS_Q_RETURNS = ("stream", "all_to_all")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_NAMES = "float32, float16, bfloat16, float64"

# select_mode's machine constants when commlib-tune has not measured them (see docs/cp.md):
# per-direction ring bandwidth in bytes/s and achieved attention FLOP/s, by device type.
DEFAULT_BW = {"cuda": 350e9, "cpu": 4e9}
DEFAULT_ATTN_FLOPS = {"cuda": 450e12, "cpu": 5e10}

AttnFn = Callable[..., Tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------

def _seqlens(what: str, arg: str, cu_seqlens) -> List[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"{what}: {arg} must be a 1-D integer tensor or sequence, got a "
                             f"{cu_seqlens.dim()}-D {cu_seqlens.dtype} tensor")
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        try:
            cu = [int(x) for x in cu_seqlens]
        except TypeError:
            raise TypeError(f"{what}: {arg} must be a 1-D integer tensor or sequence, "
                            f"got {type(cu_seqlens).__name__}") from None
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{what}: {arg} must start at 0, be non-decreasing and name at least one sequence; "
                         f"got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    return [b - a for a, b in zip(cu, cu[1:])]


def _check_world(what: str, world_size: int, rank: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what}: world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank must be in [0, {world_size}), got {rank!r}")


def _check_layout(what: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{what}: layout '{layout}' not supported; supported: {', '.join(LAYOUTS)}")


def _segments(length: int, seq: int, world_size: int, rank: int, layout: str) -> Tuple[Tuple[int, int], ...]:
    """Positions (begin, end) of ``rank``'s two pieces of a sequence of ``length`` new tokens."""
    if layout == "round_robin":
        return ((0, length), (length, length)) if seq % world_size == rank else ((0, 0), (0, 0))
    n = 2 * world_size
    c0, c1 = rank, n - 1 - rank
    return ((c0 * length // n, (c0 + 1) * length // n), (c1 * length // n, (c1 + 1) * length // n))


@dataclass(frozen=True)
class Shard:
    """One rank's tokens: ``index`` (int64) lists their rows in the unsharded packed tensor, in
    local order; ``cu_seqlens`` (int32) describes the local tokens per sequence (a sequence with no
    token here has length 0, so the batch size is the global one); ``first`` / ``second`` are the
    per-sequence token counts of the two chunks."""
    index: torch.Tensor
    cu_seqlens: torch.Tensor
    first: Tuple[int, ...]
    second: Tuple[int, ...]


def _shard(lens: Sequence[int], world_size: int, rank: int, layout: str) -> Shard:
    index, cu, first, second, start = [], [0], [], [], 0
    for b, length in enumerate(lens):
        (a0, e0), (a1, e1) = _segments(length, b, world_size, rank, layout)
        index.extend(range(start + a0, start + e0))
        index.extend(range(start + a1, start + e1))
        first.append(e0 - a0)
        second.append(e1 - a1)
        cu.append(cu[-1] + (e0 - a0) + (e1 - a1))
        start += length
    return Shard(torch.tensor(index, dtype=torch.int64), torch.tensor(cu, dtype=torch.int32), tuple(first),
                 tuple(second))


def shard(cu_seqlens, world_size: int, rank: int, *, layout: str = "balanced") -> Shard:
    """The tokens rank ``rank`` of ``world_size`` holds, for a batch of sequences whose new tokens
    are described by ``cu_seqlens`` (Note [balanced layout]). ``x[shard(...).index]`` takes this
    rank's rows of a packed ``[tokens, ...]`` tensor. Partial prefill: pass the new tokens'
    cu_seqlens (the cached tokens are not sharded)."""
    _check_world("shard", world_size, rank)
    _check_layout("shard", layout)
    return _shard(_seqlens("shard", "cu_seqlens", cu_seqlens), world_size, rank, layout)


def unshard(shards: Sequence[torch.Tensor], cu_seqlens, *, layout: str = "balanced") -> torch.Tensor:
    """The inverse of ``shard``: ``shards[r]`` is rank r's ``[local tokens, ...]`` tensor; returns
    the packed ``[tokens, ...]`` tensor in sequence order."""
    _check_layout("unshard", layout)
    lens = _seqlens("unshard", "cu_seqlens", cu_seqlens)
    if not shards:
        raise ValueError("unshard: shards must hold one tensor per rank, got none")
    world_size = len(shards)
    total = sum(lens)
    out = shards[0].new_empty((total,) + tuple(shards[0].shape[1:]))
    for r, part in enumerate(shards):
        idx = _shard(lens, world_size, r, layout).index
        if part.shape[0] != idx.numel():
            raise ValueError(f"unshard: shards[{r}] has {part.shape[0]} rows but rank {r} of {world_size} holds "
                             f"{idx.numel()} tokens of cu_seqlens")
        out[idx.to(part.device)] = part
    return out


# ---------------------------------------------------------------------------------------------
# Merge of partial attention states
# ---------------------------------------------------------------------------------------------

def _merge2(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """(o_a, lse_a) (+) (o_b, lse_b) in fp32; o [T, H, D], lse [H, T] (Note [merge of attention
    states] in csrc/kernels/merge_attn_states.cu: the CUDA kernel's arithmetic). A state with lse
    -inf (no key seen) contributes nothing, whatever its o holds; two such states give o 0, lse -inf."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    s = w_a + w_b
    lse = torch.where(s > 0, m_safe + torch.log(s), torch.full_like(s, float("-inf")))
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    f_a = (w_a * inv).transpose(0, 1).unsqueeze(-1)
    f_b = (w_b * inv).transpose(0, 1).unsqueeze(-1)
    zero = o_a.new_zeros(())
    nan = torch.isnan(lse_a) | torch.isnan(lse_b)  # a NaN LSE poisons the row (as on CUDA)
    lse = torch.where(nan, torch.full_like(lse, float("nan")), lse)
    f_a = torch.where(nan.transpose(0, 1).unsqueeze(-1), torch.full_like(f_a, float("nan")), f_a)
    return torch.where(f_a != 0, o_a * f_a, zero) + torch.where(f_b != 0, o_b * f_b, zero), lse


_merge_op: dict = {}


def _merge_kernel(t: torch.Tensor) -> bool:
    """Whether the fused CUDA merge (torch.ops.commlib.merge_attention_states[_]) takes ``t``."""
    if not t.is_cuda or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if "ok" not in _merge_op:
        from .. import _C  # noqa: F401 - loading the extension registers torch.ops.commlib
        _merge_op["ok"] = hasattr(torch.ops.commlib, "merge_attention_states_")
    return _merge_op["ok"]


def merge_attention_states(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *,
                           out_dtype: Optional[torch.dtype] = None):
    """Merges partial attention results over disjoint key sets: ``outs[s]`` ``[tokens, heads,
    head_dim]`` and ``lses[s]`` ``[heads, tokens]`` (natural-log LSE of the scaled scores; -inf
    for a token that saw no key). Returns ``(out, lse)``: out in ``out_dtype`` (default: the dtype
    of ``outs[0]``), lse in float32. The arithmetic is float32, max-subtracted (stable for any LSE
    magnitude); a state with LSE -inf contributes nothing (its out is not read), and a token whose
    every state is empty gets out 0, LSE -inf. CUDA tensors (float32 / float16 / bfloat16) take one
    fused kernel (``torch.ops.commlib.merge_attention_states``; Note [merge of attention states]),
    CPU tensors the same arithmetic in torch ops. Used by ring attention and usable for cascade /
    paged attention."""
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"merge_attention_states: need as many outs as lses, at least one; got {len(outs)} "
                         f"outs and {len(lses)} lses")
    o0 = outs[0]
    if o0.dim() != 3:
        raise ValueError(f"merge_attention_states: outs[0] must be [tokens, heads, head_dim], got {tuple(o0.shape)}")
    t, h, _ = o0.shape
    for s, (o, lse) in enumerate(zip(outs, lses)):
        if o.shape != o0.shape:
            raise ValueError(f"merge_attention_states: outs[{s}] has shape {tuple(o.shape)}, outs[0] {tuple(o0.shape)}")
        if tuple(lse.shape) != (h, t):
            raise ValueError(f"merge_attention_states: lses[{s}] has shape {tuple(lse.shape)}; expected "
                             f"[heads, tokens] = {(h, t)}")
        for name, x in ((f"outs[{s}]", o), (f"lses[{s}]", lse)):
            if x.dtype not in _DTYPES:
                raise TypeError(f"merge_attention_states: {name} has dtype {x.dtype}; supported: {_DTYPE_NAMES}")
            if x.device != o0.device:
                raise TypeError(f"merge_attention_states: {name} is on {x.device} but outs[0] on {o0.device}; "
                                "every state must be on one device")
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise TypeError(f"merge_attention_states: out_dtype {out_dtype} not supported; supported: {_DTYPE_NAMES}")
    if _merge_kernel(o0) and (out_dtype or o0.dtype) != torch.float64 and all(o.dtype != torch.float64 for o in outs):
        dt = o0.dtype if all(o.dtype == o0.dtype for o in outs) else torch.float32
        return torch.ops.commlib.merge_attention_states([o.to(dt) if o.stride(-1) == 1 else o.to(dt).contiguous()
                                                         for o in outs],
                                                        [x.float().contiguous() for x in lses], out_dtype or o0.dtype)
    o_acc = torch.zeros(o0.shape, dtype=torch.float32, device=o0.device)
    lse_acc = torch.full((h, t), float("-inf"), dtype=torch.float32, device=o0.device)
    for o, lse in zip(outs, lses):
        o_acc, lse_acc = _merge2(o_acc, lse_acc, o.float(), lse.float())
    return o_acc.to(out_dtype or o0.dtype), lse_acc


class _State:
    """A running (O, LSE) accumulator over this rank's query rows (fp32)."""

    def __init__(self, rows: int, heads: int, head_dim: int, device):
        self.out = torch.zeros(rows, heads, head_dim, dtype=torch.float32, device=device)
        self.lse = torch.full((heads, rows), float("-inf"), dtype=torch.float32, device=device)

    def merge(self, rows: Optional[torch.Tensor], o: torch.Tensor, lse: torch.Tensor) -> None:
        if _merge_kernel(o):
            # One fused in-place pass (Note [merge of attention states]); rows index the accumulator.
            lse = lse.float()
            torch.ops.commlib.merge_attention_states_(self.out, self.lse, [o if o.stride(-1) == 1 else o.contiguous()],
                                                      [lse if lse.stride(-1) == 1 else lse.contiguous()], rows)
            return
        if rows is None:
            self.out, self.lse = _merge2(self.out, self.lse, o.float(), lse.float())
            return
        o_new, lse_new = _merge2(self.out[rows], self.lse[:, rows], o.float(), lse.float())
        self.out[rows] = o_new
        self.lse[:, rows] = lse_new

    def merge_all(self, outs: List[torch.Tensor], lses: List[torch.Tensor]) -> None:
        """Merges partials over all rows at once (on CUDA one fused pass over all of them)."""
        if outs and _merge_kernel(outs[0]):
            torch.ops.commlib.merge_attention_states_(self.out, self.lse, outs, [x.float() for x in lses], None)
            return
        for o, lse in zip(outs, lses):
            self.merge(None, o, lse)


# ---------------------------------------------------------------------------------------------
# Attention calls
# ---------------------------------------------------------------------------------------------

def _sdpa_cpu_one(q, k, v, causal: bool, scale: float):
    """One sequence: q [Lq, H, D], k/v [Lk, Hkv, D] -> (o [Lq, H, D], lse [H, Lq]); causal is
    bottom-right aligned (query i sees keys up to i + Lk - Lq)."""
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    lq, lk = q.shape[0], k.shape[0]
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if causal and lq != lk:
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        bias = torch.zeros(lq, lk, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        o, lse = op(qt, kt, vt, 0.0, False, attn_mask=bias, scale=scale)
    else:
        o, lse = op(qt, kt, vt, 0.0, causal, scale=scale)
    return o[0].transpose(0, 1), lse[0].float()


def _attention_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    cu_q_l, cu_k_l = cu_q.tolist(), cu_k.tolist()
    h = q.shape[1]
    out = q.new_zeros(q.shape)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cu_q_l) - 1):
        q0, q1, k0, k1 = cu_q_l[b], cu_q_l[b + 1], cu_k_l[b], cu_k_l[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        if q.is_cuda:
            o_b, lse_b = _sdpa_cuda_one(q[q0:q1], k[k0:k1], v[k0:k1], causal, scale)
        else:
            o_b, lse_b = _sdpa_cpu_one(q[q0:q1], k[k0:k1], v[k0:k1], causal, scale)
        out[q0:q1] = o_b
        lse[:, q0:q1] = lse_b
    return out, lse


def _sdpa_cuda_one(q, k, v, causal: bool, scale: float):
    """One sequence on CUDA through the efficient-attention op (any float dtype, bottom-right
    causal mask type 2); LSE trimmed to the query count."""
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    mask_type = 2 if causal else 0  # 2: causal from bottom right
    o, lse = torch.ops.aten._efficient_attention_forward(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, None, None, None, None, 0.0, mask_type, True,
        scale=scale)[:2]
    return o[0], lse[0, :, :q.shape[0]].float()


def _flash_varlen_ok(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def default_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    """commlib's attention call (the ``attn_fn`` contract): FlashAttention-varlen semantics.

    q ``[Tq, H, D]``, k / v ``[Tk, Hkv, D]`` (H a multiple of Hkv), int32 cu_seqlens on q's
    device, ``causal`` bottom-right aligned; returns ``(out [Tq, H, D] in q's dtype, lse [H, Tq]
    float32)``. Every sequence has at least one query and one key. CUDA fp16/bf16:
    ``aten._flash_attention_forward`` (varlen, native GQA); other CUDA dtypes: the
    efficient-attention op per sequence; CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``
    per sequence (KV heads repeated for GQA).
    """
    if _flash_varlen_ok(q):
        o, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False, scale=scale)[:2]
        return o, lse.float()
    return _attention_per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)


# ---------------------------------------------------------------------------------------------
# Selection rule
# ---------------------------------------------------------------------------------------------

_tuned: dict = {}


def machine_constants(device_type: str, world_size: int):
    """(BW bytes/s, C FLOP/s) for select_mode: commlib-tune's measurement for this machine when
    cached (``commlib.tune.load_cp``), else the built-in defaults."""
    if device_type not in DEFAULT_BW:
        raise ValueError(f"select_mode: device type '{device_type}' not supported; supported: cpu, cuda")
    from ..tuned import cache_path, load_cp
    ck = (device_type, world_size, str(cache_path()))
    if ck not in _tuned:
        try:
            _tuned[ck] = load_cp(device_type, world_size)
        except Exception:  # noqa: BLE001 - a missing or unreadable cache means the defaults
            _tuned[ck] = None
    tuned = _tuned[ck]
    if tuned:
        return float(tuned["bw_bytes_per_s"]), float(tuned["attn_flops_per_s"])
    return DEFAULT_BW[device_type], DEFAULT_ATTN_FLOPS[device_type]


def select_mode(T: int, P: int, world_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, *, bw: Optional[float] = None, flops: Optional[float] = None,
                device_type: str = "cuda") -> str:
    """pass-KV or pass-Q for T new and P cached tokens (totals over the batch): Algorithm 5 of
    "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783).

    pass-KV when pass-KV's per-step transfer hides behind the step's attention,
    T >= N*C*NKV*e / (2*NH*BW), or when T/(T+P) >= 2*NKV/NH - 4*T*BW/(N*C*e); pass-Q otherwise.
    Full prefill (P = 0) is pass-KV; e is the element size in bytes. ``bw`` / ``flops`` default to
    ``machine_constants(device_type, world_size)``. ``head_dim`` cancels out of both conditions.
    """
    what = "select_mode"
    for name, value, low in (("T", T, 0), ("P", P, 0), ("world_size", world_size, 1), ("num_q_heads", num_q_heads, 1),
                             ("num_kv_heads", num_kv_heads, 1), ("head_dim", head_dim, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{what}: {name} must be an integer >= {low}, got {value!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{what}: num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if dtype not in _DTYPES:
        raise TypeError(f"{what}: dtype {dtype} not supported; supported: {_DTYPE_NAMES}")
    if P == 0:
        return "pass_kv"
    if T == 0:
        return "pass_q"
    if bw is None or flops is None:
        d_bw, d_flops = machine_constants(device_type, world_size)
        bw, flops = bw or d_bw, flops or d_flops
    e = torch.tensor([], dtype=dtype).element_size()
    n, nh, nkv = world_size, num_q_heads, num_kv_heads
    if T >= n * flops * nkv * e / (2.0 * nh * bw):
        return "pass_kv"
    if T / (T + P) >= 2.0 * nkv / nh - 4.0 * T * bw / (n * flops * e):
        return "pass_kv"
    return "pass_q"


# ---------------------------------------------------------------------------------------------
# Ring transports
# ---------------------------------------------------------------------------------------------

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


class CommTransport(_LocalSlots):
    """The ring over a ``commlib.Communicator``: each step is one ``all_to_all_v`` of bytes whose
    only non-zero splits are the step's peers (a correct ring step on CPU and CUDA; it completes
    inside ``start``). When the direct API gains send / recv, ``start`` becomes those calls."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size

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
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
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


class SymmetricTransport(RingTransport):
    """The ring on GPUs with no SM: slots in symmetric memory, each message one copy-engine
    transfer into the receiver's slot, the signals stream memory operations (Note [cp copy-engine
    ring]). Needs a CUDA build of commlib and a ``commlib.Communicator``."""

    _ALIGN = 256
    _MAX_SLOTS = 64
    _FLAGS_BYTES = 2 * 4 * _MAX_SLOTS  # ready[64], free[64] (int32), then the slots

    def __init__(self, comm, timeout_s: Optional[float] = None):
        from .. import _C
        if not hasattr(_C, "cp_symmetric_peer_views"):
            raise TypeError("SymmetricTransport: this commlib build has no CUDA; supported: a CUDA build")
        self._C = _C
        self._comm = weakref.ref(comm)  # the communicator owns this transport, not the reverse
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.timeout_s = float(_C.cp_comm_timeout_s(comm.native)) if timeout_s is None else float(timeout_s)
        self._key = None
        self._slots: dict = {}
        self._sender: dict = {}
        self._last_wait: list = []
        self._copy_stream = None
        self.failure: Optional[str] = None  # set by the watchdog (Note [cp ring watchdog])
        self._trace: Optional[list] = None  # this call's progress events, while watched

    @property
    def comm(self):
        return self._comm()

    def allocate(self, specs: dict, device) -> None:
        device = torch.device(device)
        key = (tuple(sorted((k, tuple(v[0]), v[1]) for k, v in specs.items())), device)
        if key == self._key:
            return  # the same layout: the flags' protocol covers reuse across calls
        offsets, off = {}, self._FLAGS_BYTES
        for name in sorted(specs):
            shape, dtype = specs[name]
            nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            offsets[name] = (off, nbytes)
            off += -(-nbytes // self._ALIGN) * self._ALIGN
        # A new layout may put one slot where a peer still reads or writes another of the last call:
        # drain every rank's ring work first (host sync; a repeated layout, e.g. decode, skips this).
        if self._key is not None:
            torch.cuda.synchronize(self._buf.device)
            self.comm.barrier()
        if self._key is None or off > self._buf.numel() or self._buf.device != device:
            # Collective: every rank has the same specs (the shapes come from the global layout).
            capacity = max(off, int(1.5 * self._buf.numel())) if self._key is not None else off
            buf = self.comm.symmetric_empty((capacity,), dtype=torch.uint8, device=device)
            views = self._C.cp_symmetric_peer_views(self.comm.native, buf)
            flags = buf[:self._FLAGS_BYTES].view(torch.int32).view(2, self._MAX_SLOTS)
            flags[0].zero_()   # ready[X]: this rank's slot X holds a message (written by its sender)
            flags[1].fill_(1)  # free[X]: the receiver of this rank's slot-X messages may take one
            torch.cuda.synchronize(device)
            self.comm.barrier()  # every rank's flags are initialised before any peer writes them
            self._buf, self._views = buf, views
            base = [v.data_ptr() for v in views]
            self._ready = lambda r, x: base[r] + 4 * x
            self._free = lambda r, x: base[r] + 4 * (self._MAX_SLOTS + x)
        self._key = key
        self._slots = {}
        for name, (o, nbytes) in offsets.items():
            shape, dtype = specs[name]
            self._slots[name] = [v[o:o + nbytes].view(dtype).view(shape) for v in self._views]
        if self._copy_stream is None or self._copy_stream.device != device:
            self._copy_stream = torch.cuda.Stream(device)

    @classmethod
    def _slot_index(cls, name: str) -> int:
        """Fixed flag index per slot name: kv0, kv1, q0, q1, then p1, p2, ..."""
        fixed = {"kv0": 0, "kv1": 1, "q0": 2, "q1": 3}
        x = fixed[name] if name in fixed else 3 + int(name[1:])
        if x >= cls._MAX_SLOTS:
            raise ValueError(f"ring_attention: the copy-engine ring supports world sizes up to "
                             f"{cls._MAX_SLOTS - 3}; slot {name} is past it")
        return x

    def slot(self, name: str) -> torch.Tensor:
        return self._slots[name][self.rank]

    def start(self, sends, recvs):
        cur = torch.cuda.current_stream()
        cs = self._copy_stream
        cs.wait_stream(cur)  # the sources are written
        me = self.rank
        for peer, name, src in sends:
            x = self._slot_index(name)
            dst = self._slots[name][peer]
            self._C.cp_stream_wait_value32(self._free(me, x), 1, cs.cuda_stream)
            self._C.cp_stream_write_value32(self._free(me, x), 0, cs.cuda_stream)
            with torch.cuda.stream(cs):
                dst.copy_(src)  # contiguous, same dtype: one cudaMemcpyAsync into the peer's slot
            # Default write: a fence first, so the copy lands before the flag is seen.
            self._C.cp_stream_write_value32(self._ready(peer, x), 1, cs.cuda_stream)
            src.record_stream(cs)
            self._progress(cs, f"rank {peer} to release slot {name} (this rank sends into it)")
        for peer, name in recvs:
            self._sender[name] = peer
        done = torch.cuda.Event()
        done.record(cs)
        return done, [name for _, name in recvs]

    def wait(self, token) -> None:
        done, names = token
        self._last_wait = names
        cur = torch.cuda.current_stream()
        cur.wait_event(done)  # this step's sends no longer read their sources
        for name in names:
            x = self._slot_index(name)
            self._C.cp_stream_wait_value32(self._ready(self.rank, x), 1, cur.cuda_stream)
            self._C.cp_stream_write_value32(self._ready(self.rank, x), 0, cur.cuda_stream)
            self._progress(cur, f"slot {name} from rank {self._sender.get(name)}")

    def release(self, names) -> None:
        cur = torch.cuda.current_stream()
        for name in names:
            x = self._slot_index(name)
            self._C.cp_stream_write_value32(self._free(self._sender[name], x), 1, cur.cuda_stream)

    # ---- Note [cp ring watchdog] ----
    def check(self) -> None:
        """Raises commlib.CommTimeoutError if the watchdog found this ring stuck."""
        if self.failure is not None:
            from ..errors import CommTimeoutError
            raise CommTimeoutError(self.failure)

    def begin_call(self) -> None:
        """Starts recording this call's progress (not during CUDA-graph capture)."""
        self._trace = None if torch.cuda.is_current_stream_capturing() else []

    def end_call(self) -> None:
        """Hands the call's progress events to the watchdog (deadline: now + the timeout)."""
        trace, self._trace = self._trace, None
        if trace and self._key is not None:
            recv = [name for name in self._slots if self._sender.get(name) is not None]
            _watchdog().watch(self, trace, time.monotonic() + self.timeout_s, recv)

    def _progress(self, stream, what: str) -> None:
        if self._trace is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
            self._trace.append((ev, what))

    _GRACE_S = 30.0  # how long the watchdog keeps unblocking one stuck call

    def _call_done(self, trace) -> bool:
        torch.cuda.set_device(self._buf.device)  # the watchdog thread's current device
        return all(ev.query() for ev, _ in trace)

    def _on_timeout(self, trace, recv_slots, elapsed) -> None:
        """The watchdog's action on a call past its deadline (Note [cp ring watchdog])."""
        pending = next((what for ev, what in trace if not ev.query()), "the end of the call")
        self.failure = (
            f"ring_attention: rank {self.rank}: the copy-engine ring did not complete within {self.timeout_s:g} s "
            f"(elapsed {elapsed:.1f} s): waiting for {pending}; this call's output was filled with NaN and the ring "
            "of this communicator is no longer usable (create a new communicator)")
        print(f"commlib: {self.failure}", file=sys.stderr, flush=True)
        device = self._buf.device
        stream, issued, end = torch.cuda.Stream(device), None, time.monotonic() + self._GRACE_S
        while time.monotonic() < end and not all(ev.query() for ev, _ in trace):
            if issued is not None and not issued.query():
                stream = torch.cuda.Stream(device)  # the last write sits behind the blocked queue
            self._unblock(stream, recv_slots)
            issued = torch.cuda.Event()
            issued.record(stream)
            time.sleep(_RingWatchdog._POLL_S)

    def _unblock(self, stream, recv_slots) -> None:
        """On ``stream``: NaN into this rank's receive slots, ready = free = 1 in its flags."""
        with torch.cuda.stream(stream):
            for name in recv_slots:
                slot = self._slots[name][self.rank]
                if slot.dtype.is_floating_point:
                    slot.fill_(float("nan"))
            self._buf[:self._FLAGS_BYTES].view(torch.int32).fill_(1)

    def synchronize(self, timeout_s: Optional[float] = None) -> None:
        """Waits for the current stream, at most ``timeout_s`` (default: the transport's timeout);
        raises ``commlib.CommTimeoutError`` naming the slots still waiting (for a replayed graph,
        which the watchdog does not see)."""
        from ..errors import CommTimeoutError as CommTimeout
        ev = torch.cuda.Event()
        ev.record()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while not ev.query():
            if time.monotonic() > deadline:
                raise CommTimeout(f"ring_attention: rank {self.rank}: the ring did not complete within "
                                  f"{self.timeout_s if timeout_s is None else timeout_s} s; " + self._stuck())
            time.sleep(1e-4)

    def _stuck(self) -> str:
        """Which flags block, read on a side stream (the blocked stream cannot run a copy)."""
        side = torch.cuda.Stream(self._buf.device)
        with torch.cuda.stream(side):
            flags = self._buf[:self._FLAGS_BYTES].view(torch.int32).view(2, -1).to("cpu", non_blocking=False)
        waits = [f"slot {name} from rank {self._sender[name]}" for name in self._last_wait
                 if flags[0, self._slot_index(name)] == 0]
        return ("the last step waits for " + ", ".join(waits)) if waits else \
            "a peer has not released a slot this rank sends into"


class _RingWatchdog:
    """The process's ring watchdog thread (Note [cp ring watchdog]). It calls two methods of a
    watched transport: ``_call_done(trace)`` (every event of the call complete) and
    ``_on_timeout(trace, recv_slots, elapsed)`` (record the failure, unblock the streams)."""

    _POLL_S = 0.01

    def __init__(self):
        self._lock = threading.Condition()
        self._calls: list = []
        self._thread = threading.Thread(target=self._run, name="commlib-cp-watchdog", daemon=True)
        self._thread.start()

    def watch(self, transport, trace, deadline, recv_slots) -> None:
        with self._lock:
            self._calls.append((weakref.ref(transport), trace, deadline, tuple(recv_slots), time.monotonic()))
            self._lock.notify()

    def pending(self) -> int:
        with self._lock:
            return len(self._calls)

    def _run(self) -> None:
        _relax_stream_capture_mode()
        while True:
            with self._lock:
                while not self._calls:
                    self._lock.wait()
                calls = list(self._calls)
            done, now = [], time.monotonic()
            for call in calls:
                ref, trace, deadline, recv_slots, started = call
                transport = ref()
                try:
                    if transport is None or transport._call_done(trace):
                        done.append(call)
                    elif now > deadline:
                        transport._on_timeout(trace, recv_slots, now - started)
                        done.append(call)
                except Exception as e:  # noqa: BLE001 - a broken context must not kill the thread
                    if transport is not None and transport.failure is None:
                        transport.failure = f"ring_attention: rank {transport.rank}: the ring watchdog failed: {e}"
                    done.append(call)
            with self._lock:
                self._calls = [c for c in self._calls if not any(c is d for d in done)]
            time.sleep(self._POLL_S)


def _relax_stream_capture_mode() -> None:
    """The calling thread's queries never invalidate another thread's CUDA-graph capture."""
    if torch.cuda.is_available():
        from .. import _C
        if hasattr(_C, "cp_relax_stream_capture_mode"):
            _C.cp_relax_stream_capture_mode()


_watchdog_lock = threading.Lock()
_watchdog_instance: list = []


def _watchdog() -> _RingWatchdog:
    with _watchdog_lock:
        if not _watchdog_instance:
            _watchdog_instance.append(_RingWatchdog())
        return _watchdog_instance[0]


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


# ---------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------

@dataclass
class _Call:
    """One attention call of a block pair: query rows (None: the whole block, else an index),
    packed key rows (None: the whole block), their cu_seqlens and maxima, and the mask."""
    q_rows: Optional[torch.Tensor]
    k_rows: Optional[torch.Tensor]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool


class _Plan:
    """Everything host-side about one ring_attention call: every rank's block layout and the calls
    of every block pair (Note [block pairs])."""

    def __init__(self, lens_q: List[int], cache: List[List[int]], world_size: int, layout: str, causal: bool,
                 device):
        self.n = world_size
        self.layout = layout
        self.causal = causal
        self.device = device
        self.shards = [_shard(lens_q, world_size, r, layout) for r in range(world_size)]
        self.cache = cache  # cache[r][b]: rank r's cached tokens of sequence b
        self.q_rows = [int(s.cu_seqlens[-1]) for s in self.shards]
        self.kv_rows = [self.q_rows[r] + sum(cache[r]) for r in range(world_size)]
        self._calls: dict = {}

    def calls(self, j: int, i: int) -> List[_Call]:
        """The calls for rank j's queries against rank i's keys."""
        key = (j, i)
        if key not in self._calls:
            self._calls[key] = self._make_calls(j, i)
        return self._calls[key]

    def _make_calls(self, j: int, i: int) -> List[_Call]:
        sj, si = self.shards[j], self.shards[i]
        nb = len(sj.first)
        # Query selections: "all", "first", "second"; key selections: prefix length per sequence.
        kv_all = [self.cache[i][b] + si.first[b] + si.second[b] for b in range(nb)]
        if not self.causal:
            specs = [("all", kv_all, False)]
        elif i == j:
            specs = [("all", kv_all, True)]
        elif self.layout == "round_robin":
            specs = [("all", kv_all, False)]
        elif i < j:
            specs = [("all", [self.cache[i][b] + si.first[b] for b in range(nb)], False)]
        else:
            specs = [("second", kv_all, False), ("first", list(self.cache[i]), False)]
        calls = []
        q_start = sj.cu_seqlens.tolist()
        k_start = [0]
        for b in range(nb):
            k_start.append(k_start[-1] + kv_all[b])
        for sel, k_len, causal in specs:
            q_idx, k_idx, cu_q, cu_k, max_q, max_k = [], [], [0], [0], 0, 0
            whole_q, whole_k = True, True
            for b in range(nb):
                if sel == "all":
                    q0, q1 = q_start[b], q_start[b + 1]
                elif sel == "first":
                    q0, q1 = q_start[b], q_start[b] + sj.first[b]
                else:
                    q0, q1 = q_start[b] + sj.first[b], q_start[b + 1]
                nq, nk = q1 - q0, k_len[b]
                if nq == 0 or nk == 0:
                    whole_q = whole_q and q_start[b + 1] == q_start[b]
                    whole_k = whole_k and kv_all[b] == 0
                    continue
                whole_q = whole_q and (q0, q1) == (q_start[b], q_start[b + 1])
                whole_k = whole_k and nk == kv_all[b]
                q_idx.extend(range(q0, q1))
                k_idx.extend(range(k_start[b], k_start[b] + nk))
                cu_q.append(cu_q[-1] + nq)
                cu_k.append(cu_k[-1] + nk)
                max_q, max_k = max(max_q, nq), max(max_k, nk)
            if not q_idx:
                continue
            dev = self.device
            calls.append(_Call(
                None if whole_q else torch.tensor(q_idx, dtype=torch.int64, device=dev),
                None if whole_k else torch.tensor(k_idx, dtype=torch.int64, device=dev),
                torch.tensor(cu_q, dtype=torch.int32, device=dev), torch.tensor(cu_k, dtype=torch.int32, device=dev),
                max_q, max_k, causal))
        return calls


_plans: dict = {}
_MAX_PLANS = 64


def _plan(lens_q, cache, world_size, layout, causal, device) -> _Plan:
    """A cached plan: a repeated layout (decode steps, CUDA-graph capture after a warm-up call)
    builds no index tensor and copies nothing from the host."""
    key = (tuple(lens_q), tuple(tuple(c) for c in cache), world_size, layout, causal, str(device))
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.pop(next(iter(_plans)))
        plan = _plans[key] = _Plan(list(lens_q), [list(c) for c in cache], world_size, layout, causal, device)
        for j in range(world_size):
            for i in range(world_size):
                plan.calls(j, i)
    return plan


def _block_attention(plan: _Plan, j: int, i: int, q_block, k_block, v_block, attn_fn, scale, state: _State):
    """Rank j's queries (q_block) against rank i's keys, merged into ``state``."""
    for c in plan.calls(j, i):
        q = q_block if c.q_rows is None else q_block.index_select(0, c.q_rows)
        if c.k_rows is None:
            k, v = k_block, v_block
        else:
            k, v = k_block.index_select(0, c.k_rows), v_block.index_select(0, c.k_rows)
        o, lse = attn_fn(q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal, scale)
        state.merge(c.q_rows, o, lse)


def _pack_kv(plan: _Plan, rank: int, k, v, kv_cache, rows: int):
    """This rank's K/V block, per sequence [cache, first chunk, second chunk], padded to ``rows``:
    [2, rows, Hkv, D]."""
    hkv, d = k.shape[1], k.shape[2]
    out = k.new_zeros((2, rows, hkv, d))
    lens_new = plan.shards[rank].cu_seqlens.tolist()
    cache = plan.cache[rank]
    if kv_cache is None:
        out[0, :k.shape[0]] = k
        out[1, :v.shape[0]] = v
        return out
    kc, vc = kv_cache[0], kv_cache[1]
    dst, src_c = 0, 0
    for b in range(len(cache)):
        nc, nn = cache[b], lens_new[b + 1] - lens_new[b]
        out[0, dst:dst + nc] = kc[src_c:src_c + nc]
        out[1, dst:dst + nc] = vc[src_c:src_c + nc]
        dst += nc
        out[0, dst:dst + nn] = k[lens_new[b]:lens_new[b] + nn]
        out[1, dst:dst + nn] = v[lens_new[b]:lens_new[b] + nn]
        dst += nn
        src_c += nc
    return out


def _pass_kv(plan, transport, rank, q, kv_local, attn_fn, scale, state):
    n = plan.n
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if n > 1:
        transport.allocate({"kv0": (tuple(kv_local.shape), kv_local.dtype),
                            "kv1": (tuple(kv_local.shape), kv_local.dtype)}, kv_local.device)
    cur, token = kv_local, None
    for s in range(n):
        src = (rank - s) % n
        if s + 1 < n:
            # Post step s+1's transfer before step s's attention (double-buffered slots).
            token = transport.start([(nxt, f"kv{(s + 1) % 2}", cur)], [(prv, f"kv{(s + 1) % 2}")])
        rows = plan.kv_rows[src]
        _block_attention(plan, rank, src, q, cur[0, :rows], cur[1, :rows], attn_fn, scale, state)
        if s + 1 < n:
            transport.wait(token)  # also: the send of step s+1 no longer reads cur
        if s >= 1:
            transport.release([f"kv{s % 2}"])
        if s + 1 < n:
            cur = transport.slot(f"kv{(s + 1) % 2}")


def _pack_partial(state: _State, rows: int) -> torch.Tensor:
    """A partial (O, LSE) as one fp32 message: O [rows, H, D] then LSE [H, rows] (padded)."""
    t, h, d = state.out.shape
    msg = torch.empty(rows * h * d + h * rows, dtype=torch.float32, device=state.out.device)
    o = msg[:rows * h * d].view(rows, h, d)
    lse = msg[rows * h * d:].view(h, rows)
    o[:t] = state.out
    lse[:, :t] = state.lse
    if rows > t:
        o[t:] = 0
        lse[:, t:] = float("-inf")
    return msg


def _unpack_partial(msg: torch.Tensor, rows: int, t: int, h: int, d: int):
    o = msg[:rows * h * d].view(rows, h, d)[:t]
    lse = msg[rows * h * d:].view(h, rows)[:, :t]
    return o, lse


def _pass_q(plan, transport, rank, q_local, k_res, v_res, attn_fn, scale, state, heads, head_dim, ret):
    n = plan.n
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    q_rows = max(plan.q_rows)
    q_pad = q_local.new_zeros((q_rows,) + tuple(q_local.shape[1:]))
    q_pad[:q_local.shape[0]] = q_local
    part_numel = q_rows * heads * head_dim + heads * q_rows
    if n > 1:
        specs = {"q0": (tuple(q_pad.shape), q_pad.dtype), "q1": (tuple(q_pad.shape), q_pad.dtype)}
        # Partial slot p{s}: filled at step s by rank + s (one sender per slot, Note [cp copy-engine ring]).
        specs.update({f"p{s}": ((part_numel,), torch.float32) for s in range(1, n)})
        transport.allocate(specs, q_local.device)
    cur, token, pending = q_pad, None, None
    held = []  # post-loop variant: (owner, message)
    for s in range(n):
        owner = (rank - s) % n
        if s + 1 < n:
            token = transport.start([(nxt, f"q{(s + 1) % 2}", cur)], [(prv, f"q{(s + 1) % 2}")])
        t_owner = plan.q_rows[owner]
        part = state if s == 0 else _State(t_owner, heads, head_dim, q_local.device)
        _block_attention(plan, owner, rank, cur[:t_owner], k_res, v_res, attn_fn, scale, part)
        if s + 1 < n:
            transport.wait(token)
        if s >= 1:
            transport.release([f"q{s % 2}"])
        if s + 1 < n:
            cur = transport.slot(f"q{(s + 1) % 2}")
        if s == 0:
            continue
        msg = _pack_partial(part, q_rows)
        if ret == "stream":
            # Send this step's partial to its owner; receive this rank's partial from (rank + s).
            slot = f"p{s}"
            if pending is not None:
                _merge_pending(transport, pending, state, q_rows, heads, head_dim)
            pending = (transport.start([(owner, slot, msg)], [((rank + s) % n, slot)]), slot)
        else:
            held.append((owner, msg, s))
    if pending is not None:
        _merge_pending(transport, pending, state, q_rows, heads, head_dim)
    if ret == "all_to_all" and n > 1:
        token = transport.start([(owner, f"p{s}", msg) for owner, msg, s in held],
                                [((rank + s) % n, f"p{s}") for s in range(1, n)])
        transport.wait(token)
        parts = [_unpack_partial(transport.slot(f"p{s}"), q_rows, state.out.shape[0], heads, head_dim)
                 for s in range(1, n)]
        state.merge_all([o for o, _ in parts], [lse for _, lse in parts])
        transport.release([f"p{s}" for s in range(1, n)])


def _merge_pending(transport, pending, state, q_rows, heads, head_dim):
    token, slot = pending
    transport.wait(token)
    o, lse = _unpack_partial(transport.slot(slot), q_rows, state.out.shape[0], heads, head_dim)
    state.merge(None, o, lse)
    transport.release([slot])


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
        t = torch.tensor(values, dtype=torch.int64)
        comm = self.comm
        if isinstance(comm, _ProcessGroupRef):
            n = dist.get_world_size(comm.group)
            dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(comm.group) == "nccl" \
                else torch.device("cpu")
            out = torch.empty(n * len(values), dtype=torch.int64, device=dev)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(out, t.to(dev), group=comm.group)
        else:
            n = comm.world_size
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
    # ring raise on every rank before anything is sent, and the communicator stays usable.
    local_error, args = None, None
    try:
        args = _check_args(what, rank, world_size, q, k, v, cu_seqlens_q, cu_seqlens_kv, causal, kv_cache, mode,
                           layout, pass_q_return)
    except (ValueError, TypeError) as e:
        local_error = e
    ring_failure = getattr(transport, "failure", None)
    if args is not None:
        lens_q, lens_kv, cache_local = args["lens_q"], args["lens_kv"], args["cache_local"]
        nb = len(lens_q)
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        header = [_MODE_CODES.get(mode, 0), _LAYOUT_CODES[layout], int(causal), _RETURN_CODES[pass_q_return], nb,
                  sum(lens_q), _digest(lens_q), _digest(lens_kv) if lens_kv is not None else -1, heads, kv_heads,
                  head_dim, _DTYPE_CODES[q.dtype], int(kv_cache is not None), int(attn_fn is not None)]
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
        if mode == "pass_kv":
            kv_local = _pack_kv(plan, rank, k, v, kv_cache, max(plan.kv_rows))
            _pass_kv(plan, transport, rank, q, kv_local, attn, scale, state)
        else:
            kv_local = _pack_kv(plan, rank, k, v, kv_cache, plan.kv_rows[rank])
            _pass_q(plan, transport, rank, q, kv_local[0], kv_local[1], attn, scale, state, heads, head_dim,
                    pass_q_return)
    finally:
        if watched:
            transport.end_call()
    out = state.out.to(q.dtype)
    return (out, state.lse) if return_lse else out


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


__all__ = ["MODES", "LAYOUTS", "PASS_Q_RETURNS", "Shard", "shard", "unshard", "merge_attention_states",
           "default_attention", "select_mode", "machine_constants", "ring_attention", "RingTransport",
           "DistTransport", "CommTransport", "SymmetricTransport"]
