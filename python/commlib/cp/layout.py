"""The layout of context-parallel tensors, and which tokens each rank holds.

Layouts follow FlashAttention's varlen API: q / k / v are ``[tokens, heads, head_dim]`` with the
sequences of a batch packed one after another, described by ``cu_seqlens`` (``[0, L0, L0 + L1,
...]``); the log-sum-exp (LSE) is ``[heads, tokens]`` in float32 (natural log, scaled scores).
``shard`` / ``unshard`` cut such a batch into ranks' shards and put it back together.

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
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

LAYOUTS = ("balanced", "round_robin")
# The dtypes of q / k / v and of attention states.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_NAMES = "float32, float16, bfloat16, float64"


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
    """The Shard of ``rank`` (cached: a ring call at a repeated layout builds nothing; callers never
    write into its tensors)."""
    return _shard_cached(tuple(int(x) for x in lens), world_size, rank, layout)


@functools.lru_cache(maxsize=256)
def _shard_cached(lens: Tuple[int, ...], world_size: int, rank: int, layout: str) -> Shard:
    pieces, cu, first, second, start = [], [0], [], [], 0
    for b, length in enumerate(lens):
        (a0, e0), (a1, e1) = _segments(length, b, world_size, rank, layout)
        pieces += [(start + a0, start + e0), (start + a1, start + e1)]
        first.append(e0 - a0)
        second.append(e1 - a1)
        cu.append(cu[-1] + (e0 - a0) + (e1 - a1))
        start += length
    parts = [torch.arange(a, e, dtype=torch.int64) for a, e in pieces if e > a]
    index = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return Shard(index, torch.tensor(cu, dtype=torch.int32), tuple(first), tuple(second))


def shard(cu_seqlens, world_size: int, rank: int, *, layout: str = "balanced") -> Shard:
    """The tokens rank ``rank`` of ``world_size`` holds, for a batch of sequences whose new tokens
    are described by ``cu_seqlens`` (Note [balanced layout]). ``x[shard(...).index]`` takes this
    rank's rows of a packed ``[tokens, ...]`` tensor. Partial prefill: pass the new tokens'
    cu_seqlens (the cached tokens are not sharded)."""
    _check_world("shard", world_size, rank)
    _check_layout("shard", layout)
    s = _shard(_seqlens("shard", "cu_seqlens", cu_seqlens), world_size, rank, layout)
    return Shard(s.index.clone(), s.cu_seqlens.clone(), s.first, s.second)  # the cache's tensors stay its own


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
