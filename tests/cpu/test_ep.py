"""EPBuffer dispatch / combine on CPU (shared-memory path).

Reference: a pure-torch simulation of every rank, computed on every rank from the same seeds:
expert rows gathered by routing in the documented order (source rank, token, k), truncated at the
capacity; combine as fp32 sum over k ascending of fp32(w) * fp32(y), rounded once (Note [EP layout]).
Dispatch must match bit for bit (it only moves data); combine must match bit for bit and, within
the dtype's rounding, an fp64 reference. A second check uses gloo all_to_all_single with host splits.
Outputs are poisoned before each call.
"""
import pytest
import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def make_routing(rank, num_tokens, num_experts, topk, kind, seed):
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + num_tokens)
    if kind == "random":  # distinct experts per token, like a real router
        idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(num_tokens)]) \
            if num_tokens else torch.empty(0, topk, dtype=torch.long)
    elif kind == "one_expert":  # every token to expert 0 (k > 0: the next experts), heavy skew
        idx = torch.arange(topk).repeat(num_tokens, 1)
    elif kind == "duplicates":  # every slot to the same expert: overflows the default capacity
        idx = torch.full((num_tokens, topk), num_experts - 1, dtype=torch.long)
    elif kind == "masked":  # some slots -1 (no expert)
        idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(num_tokens)]) \
            if num_tokens else torch.empty(0, topk, dtype=torch.long)
        idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    else:
        raise AssertionError(kind)
    w = torch.rand(num_tokens, topk, generator=g, dtype=torch.float32) + 0.1
    return idx.long(), w


def make_tokens(rank, num_tokens, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed * 31 + rank * 1009 + hidden)
    return (torch.randn(num_tokens, hidden, generator=g, dtype=torch.float64) + 0.25).to(dtype)


def expert_fn(expert_x, first_expert):
    """A deterministic stand-in for the experts: expert e scales by (e + 1) / 8 and adds e / 16."""
    e = torch.arange(first_expert, first_expert + expert_x.shape[0], dtype=torch.float32)[:, None, None]
    return (expert_x.float() * ((e + 1) / 8) + e / 16).to(expert_x.dtype)


def simulate(inputs, num_experts, capacity, world_size):
    """inputs[s] = (x, idx, w). Returns per-expert row lists [(s, t, k)] (kept) and totals."""
    rows = [[] for _ in range(num_experts)]
    for s, (_, idx, _) in enumerate(inputs):
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    rows[e].append((s, t, k))
    totals = [len(r) for r in rows]
    return rows, totals


def reference_combine(me, inputs, rows, num_experts, world_size, hidden, dtype, capacity):
    """The documented combine: per owner rank d an fp32 partial over k ascending (rounded to dtype),
    then the partials summed in fp32 in rank order and rounded once. Also an fp64 reference."""
    x, idx, w = inputs[me]
    L = num_experts // world_size
    kept = set()
    for e in range(num_experts):
        kept.update((s, t, k) for (s, t, k) in rows[e][:capacity])
    T = x.shape[0]
    out = torch.zeros(T, hidden, dtype=torch.float32)
    out64 = torch.zeros(T, hidden, dtype=torch.float64)
    for t in range(T):
        for d in range(world_size):
            routes = [k for k in range(idx.shape[1]) if int(idx[t, k]) >= 0 and int(idx[t, k]) // L == d]
            if not routes:
                continue
            partial = torch.zeros(hidden, dtype=torch.float32)
            for k in routes:
                if (me, t, k) in kept:
                    e = int(idx[t, k])
                    y = expert_fn(x[t][None, None], e)[0, 0]
                    partial = partial + w[t, k] * y.float()
                    out64[t] += w[t, k].double() * y.double()
            out[t] = out[t] + partial.to(dtype).float()
    return out.to(dtype), out64


def _dispatch_combine(ctx, cases):
    import commlib
    n, me = ctx.world_size, ctx.rank
    for case in cases:
        (num_experts, topk, hidden, dtype_name, kind, max_tokens, tokens_of, capacity) = case
        dtype = DTYPES[dtype_name]
        buf = commlib.EPBuffer(ctx.comm, max_tokens, hidden, num_experts, topk, dtype, capacity=capacity)
        cap = buf.capacity
        L = num_experts // n
        prev = None
        for seed in (1, 2):  # twice on one buffer: state from the first call must not leak
            inputs = []
            for s in range(n):
                T = tokens_of(s)
                idx, w = make_routing(s, T, num_experts, topk, kind, seed)
                inputs.append((make_tokens(s, T, hidden, dtype, seed), idx, w))
            rows, totals = simulate(inputs, num_experts, cap, n)
            x, idx, w = inputs[me]
            if prev is not None:
                prev.fill_(float("nan"))  # poison the registered rows the first call wrote
            if seed == 1:
                res = buf.dispatch(x, idx, w)
            else:  # the split phases, with unrelated work in between
                handle = buf.dispatch_send(x, idx, w)
                torch.randn(64, 64) @ torch.randn(64, 64)
                res = buf.dispatch_recv(handle)
                assert res.handle is handle
            prev = res.expert_x
            assert res.expert_x.shape == (L, cap, hidden)
            expect_counts = torch.tensor([min(totals[me * L + l], cap) for l in range(L)], dtype=torch.int32)
            assert torch.equal(res.expert_counts, expect_counts), (case, res.expert_counts, expect_counts)
            for l in range(L):
                e = me * L + l
                got = res.expert_x[l, :min(len(rows[e]), cap)]
                want = torch.stack([inputs[s][0][t] for (s, t, k) in rows[e][:cap]]) if rows[e] \
                    else torch.empty(0, hidden, dtype=dtype)
                assert torch.equal(got, want), f"{case}: expert {e} rows differ"
            expert_out = expert_fn(res.expert_x, me * L)
            out = torch.full((x.shape[0], hidden), float("nan"), dtype=dtype)
            if seed == 1:
                got = buf.combine(expert_out, res.handle, out=out)
            else:
                buf.combine_send(expert_out, res.handle, out=out)
                got = buf.combine_recv()
            assert got.data_ptr() == out.data_ptr()
            want, want64 = reference_combine(me, inputs, rows, num_experts, n, hidden, dtype, cap)
            assert torch.equal(out, want), f"{case}: combine differs from the ordered fp32 reference"
            tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}[dtype]  # two roundings
            torch.testing.assert_close(out.double(), want64, rtol=tol, atol=tol)
            if max(totals) > cap:
                worst = max(range(num_experts), key=lambda e: totals[e])
                with pytest.raises(ValueError, match=f"expert {worst} received {totals[worst]} routes but capacity is {cap}"):
                    buf.check()
            buf.check()  # clear (and nothing pending)
    return True


def cases_basic(n):
    even = lambda s: 6  # noqa: E731
    uneven = lambda s: [5, 0, 17, 1][s % 4]  # noqa: E731  (rank 1 has no tokens)
    return [
        (8, 2, 33, "bfloat16", "random", 6, even, None),
        (8, 1, 7, "float32", "random", 17, uneven, None),
        (16, 4, 64, "float16", "masked", 17, uneven, None),
        (8 * n, 8, 40, "bfloat16", "random", 9, lambda s: 9 - s, None),
        (256, 8, 24, "bfloat16", "random", 12, lambda s: 12 if s % 2 == 0 else 3, None),
        (8, 3, 16, "float32", "one_expert", 20, uneven, None),
        (8, 2, 16, "bfloat16", "duplicates", 17, uneven, None),  # overflows the default capacity
        (8, 2, 9, "float32", "random", 17, uneven, 3),           # small explicit capacity
    ]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dispatch_combine_matches_simulation(ranks, world_size):
    cases = [c for c in cases_basic(world_size) if c[0] % world_size == 0]
    ranks(world_size).run(_dispatch_combine, cases)


def _chunked(ctx):
    # Payloads larger than the shared-memory slot (4 MiB) go in several rounds.
    cases = [(4, 2, 2048, "float32", "random", 300, lambda s: 300 - 7 * s, None)]
    return _dispatch_combine(ctx, cases)


def test_dispatch_combine_large_payload(ranks):
    ranks(2).run(_chunked)


def _against_gloo(ctx):
    """Dispatch rows equal the rows a gloo all_to_all_single (host splits) delivers after sorting by
    expert; combine equals the weighted sum of the rows gloo sends back."""
    import torch.distributed as dist

    import commlib
    group = ctx.gloo()
    n, me = ctx.world_size, ctx.rank
    num_experts, topk, hidden, T = 4 * n, 2, 24, 11
    L = num_experts // n
    buf = commlib.EPBuffer(ctx.comm, T, hidden, num_experts, topk, torch.float32)
    x = make_tokens(me, T, hidden, torch.float32, 5)
    idx, w = make_routing(me, T, num_experts, topk, "random", 5)
    res = buf.dispatch(x, idx, w)
    # gloo path: routes sorted by (destination, expert, token, k); counts exchanged first
    flat = idx.reshape(-1)
    order = sorted(range(flat.numel()), key=lambda i: (int(flat[i]) // L, int(flat[i]), i))
    send = x[torch.tensor([i // topk for i in order], dtype=torch.long)]
    send_e = flat[torch.tensor(order, dtype=torch.long)]
    in_splits = [int(((send_e // L) == r).sum()) for r in range(n)]
    counts_in = torch.tensor(in_splits)
    counts_out = torch.empty_like(counts_in)
    dist.all_to_all_single(counts_out, counts_in, group=group)
    out_splits = counts_out.tolist()
    recv = torch.empty(sum(out_splits), hidden)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    recv_e = torch.empty(sum(out_splits), dtype=torch.long)
    dist.all_to_all_single(recv_e, send_e, out_splits, in_splits, group=group)
    for l in range(L):
        mine = recv[recv_e == me * L + l]  # source-rank order, then (token, k): the documented order
        assert torch.equal(res.expert_x[l, :int(res.expert_counts[l])], mine)
    # combine: experts applied to the gloo rows and sent back
    y_recv = expert_fn(recv[:, None, :], 0)[:, 0, :] * 0  # shape only
    for i in range(recv.shape[0]):
        y_recv[i] = expert_fn(recv[i][None, None], int(recv_e[i]))[0, 0]
    y_back = torch.empty_like(send)
    dist.all_to_all_single(y_back, y_recv, in_splits, out_splits, group=group)
    ref = torch.zeros(T, hidden, dtype=torch.float64)
    for j, i in enumerate(order):
        ref[i // topk] += w.reshape(-1)[i].double() * y_back[j].double()
    out = buf.combine(expert_fn(res.expert_x, me * L), res.handle)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_against_gloo_all_to_all(ranks, world_size):
    ranks(world_size).run(_against_gloo)


def _bad_inputs(ctx):
    import commlib
    comm = ctx.comm
    n = ctx.world_size
    buf = commlib.EPBuffer(comm, 4, 8, 2 * n, 2, torch.bfloat16)
    x = torch.randn(3, 8).bfloat16()
    idx = torch.tensor([[0, 1], [1, 0], [0, 1]])
    w = torch.ones(3, 2)
    cases = [
        (ValueError, f"num_experts {2 * n + 1} must be a positive multiple of world_size {n}",
         lambda: commlib.EPBuffer(comm, 4, 8, 2 * n + 1, 1, torch.bfloat16)),
        (ValueError, "topk 0 out of range; valid: 1..", lambda: commlib.EPBuffer(comm, 4, 8, 2 * n, 0)),
        (ValueError, "topk 17 out of range", lambda: commlib.EPBuffer(comm, 4, 8, 32 * n, 17)),
        (ValueError, "max_tokens_per_rank 0 must be >= 1", lambda: commlib.EPBuffer(comm, 0, 8, 2 * n, 1)),
        (ValueError, "capacity 1000 out of range", lambda: commlib.EPBuffer(comm, 4, 8, 2 * n, 2, capacity=1000)),
        (TypeError, "dtype torch.int32 not supported", lambda: commlib.EPBuffer(comm, 4, 8, 2 * n, 1, torch.int32)),
        (TypeError, "hidden must be an int", lambda: commlib.EPBuffer(comm, 4, 8.0, 2 * n, 1)),
        (TypeError, "x has dtype float32 but the buffer was created for bfloat16", lambda: buf.dispatch(x.float(), idx, w)),
        (ValueError, r"x must have shape \[num_tokens, 8\]", lambda: buf.dispatch(x[:, :7], idx, w)),
        (ValueError, "num_tokens 5 exceeds max_tokens_per_rank 4",
         lambda: buf.dispatch(torch.zeros(5, 8).bfloat16(), torch.zeros(5, 2).long(), torch.ones(5, 2))),
        (ValueError, r"topk_idx must have shape \[3, 2\]", lambda: buf.dispatch(x, idx[:, :1], w[:, :1])),
        (TypeError, "topk_idx has dtype float32; supported: int64", lambda: buf.dispatch(x, idx.float(), w)),
        (ValueError, r"topk_idx\[2\]\[1\] = 99 out of range; valid: -1 \(no expert\) or 0..",
         lambda: buf.dispatch(x, torch.tensor([[0, 1], [1, 0], [0, 99]]), w)),
        (ValueError, "topk_weights has shape", lambda: buf.dispatch(x, idx, w[:2])),
        (TypeError, "x must be a torch.Tensor", lambda: buf.dispatch([1.0], idx, w)),
    ]
    for exc, text, call in cases:
        with pytest.raises(exc, match=text):
            call()
    # still usable, and combine's own checks
    res = buf.dispatch(x, idx, w)
    y = res.expert_x.clone()
    with pytest.raises(ValueError, match="expert_out must have shape"):
        buf.combine(y[:, :1], res.handle)
    with pytest.raises(TypeError, match="expert_out has dtype float32"):
        buf.combine(y.float(), res.handle)
    with pytest.raises(TypeError, match="handle must be the EPHandle"):
        buf.combine(y, (1, 2))
    out = buf.combine(y, res.handle)
    torch.testing.assert_close(out.float(), (x.float() * 2), rtol=1e-2, atol=1e-2)
    t = torch.ones(3)
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(n)))
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_inputs_raise_and_buffer_stays_usable(ranks, world_size):
    ranks(world_size).run(_bad_inputs)
