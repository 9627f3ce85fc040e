"""The ring's steps: pass-KV (K/V blocks travel, every rank merges into its own state) and pass-Q
(queries travel; the partial (O, LSE) results return to their owners, streamed during the ring
or in one post-loop exchange)."""
from __future__ import annotations

import torch

from .merge import _State
from .plan import _Plan, _block_attention


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
    out, state_lse = state.partial()
    t, h, d = out.shape
    msg = torch.empty(rows * h * d + h * rows, dtype=torch.float32, device=out.device)
    o = msg[:rows * h * d].view(rows, h, d)
    lse = msg[rows * h * d:].view(h, rows)
    o[:t] = out
    lse[:, :t] = state_lse
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
        parts = [_unpack_partial(transport.slot(f"p{s}"), q_rows, state.rows, heads, head_dim)
                 for s in range(1, n)]
        state.merge_all([o for o, _ in parts], [lse for _, lse in parts])
        transport.release([f"p{s}" for s in range(1, n)])


def _merge_pending(transport, pending, state, q_rows, heads, head_dim):
    token, slot = pending
    transport.wait(token)
    o, lse = _unpack_partial(transport.slot(slot), q_rows, state.rows, heads, head_dim)
    state.merge(None, o, lse)
    transport.release([slot])
