"""The plan of one ring_attention call, host-side: every rank's block layout and the attention
calls of every block pair, cached across calls of the same layout.

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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .layout import _shard
from .merge import _State


@dataclass
class _Call:
    """One attention call of a block pair: query rows (None: the whole block, else an index),
    packed key rows (None: the whole block), their cu_seqlens and maxima, and the mask. q_span /
    k_span: the rows as one range (start, stop) where the index is one (a single sequence's
    chunk), so the call reads a view of the block instead of a gathered copy."""
    q_rows: Optional[torch.Tensor]
    k_rows: Optional[torch.Tensor]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    q_span: Optional[tuple] = None
    k_span: Optional[tuple] = None


def _span(idx: List[int]) -> Optional[tuple]:
    """(start, stop) when ``idx`` is one ascending run of rows, else None."""
    return (idx[0], idx[0] + len(idx)) if idx and idx == list(range(idx[0], idx[0] + len(idx))) else None


def _rows(block: torch.Tensor, rows: Optional[torch.Tensor], span: Optional[tuple]) -> torch.Tensor:
    """The rows of ``block`` one call reads: the block, a view of a range of it (when its first
    row lies 16-byte aligned, as the attention kernels' vector loads want), or a gathered copy."""
    if rows is None:
        return block
    if span is not None and block.is_contiguous() and (block.data_ptr() + span[0] * block.stride(0) *
                                                       block.element_size()) % 16 == 0:
        return block[span[0]:span[1]]
    return block.index_select(0, rows)


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
                max_q, max_k, causal, None if whole_q else _span(q_idx), None if whole_k else _span(k_idx)))
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
        q = _rows(q_block, c.q_rows, c.q_span)
        k, v = _rows(k_block, c.k_rows, c.k_span), _rows(v_block, c.k_rows, c.k_span)
        o, lse = attn_fn(q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal, scale)
        state.merge(c.q_rows, o, lse, owned=True)
