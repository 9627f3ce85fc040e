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
from ep_reference import expert_fn, make_routing, make_tokens, run_dispatch_combine


def _dispatch_combine(ctx, cases):
    return run_dispatch_combine(ctx, cases, "cpu")


def cases_basic(n):
    even = (6,)
    uneven = (5, 0, 17, 1)  # rank 1 has no tokens
    return [
        (8, 2, 33, "bfloat16", "random", 6, even, None),
        (8, 1, 7, "float32", "random", 17, uneven, None),
        (16, 4, 64, "float16", "masked", 17, uneven, None),
        (8 * n, 8, 40, "bfloat16", "random", 9, (9, 8, 7, 6), None),
        (256, 8, 24, "bfloat16", "random", 12, (12, 3), None),
        (8, 3, 16, "float32", "one_expert", 20, uneven, None),
        (8, 2, 16, "bfloat16", "duplicates", 17, uneven, None),  # overflows the default capacity
        (8, 2, 9, "float32", "random", 17, uneven, 3),           # small explicit capacity
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_dispatch_combine_matches_simulation(ranks, world_size):
    cases = [c for c in cases_basic(world_size) if c[0] % world_size == 0]
    ranks(world_size).run(_dispatch_combine, cases)


def _chunked(ctx):
    # Payloads larger than the shared-memory slot (4 MiB) go in several rounds.
    cases = [(4, 2, 2048, "float32", "random", 300, (300, 293), None)]
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
    assert buf.kernels == "host"  # CPU buffers run the shared-memory path
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
    comm.all_reduce_(t)
    assert torch.equal(t, torch.full((3,), float(n)))
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_inputs_raise_and_buffer_stays_usable(ranks, world_size):
    ranks(world_size).run(_bad_inputs)


def _all_to_all_v_tensor_splits(ctx):
    """The dynamic all_to_all_v on CPU tensors: split sizes given as tensors (read on the host here),
    against gloo all_to_all_single with the same splits."""
    import torch.distributed as dist
    n, me = ctx.world_size, ctx.rank
    group = ctx.gloo()
    rows = lambda q, r: ((q * 5 + r * 3) % 4) * 3  # noqa: E731  (zero-row blocks included)
    ins = torch.tensor([rows(me, r) for r in range(n)])
    outs = torch.tensor([rows(q, me) for q in range(n)])
    inp = torch.randn(int(ins.sum()), 5, dtype=torch.float64) + me
    out = torch.full((int(outs.sum()), 5), float("nan"), dtype=torch.float64)
    ctx.comm.all_to_all_v(out, inp, outs, ins)
    ref = torch.empty_like(out)
    dist.all_to_all_single(ref, inp, outs.tolist(), ins.tolist(), group=group)
    assert torch.equal(out, ref)
    with pytest.raises(TypeError, match="both be tensors or both sequences"):
        ctx.comm.all_to_all_v(out, inp, outs.tolist(), ins)
    with pytest.raises(ValueError, match="pass both output_split_sizes and input_split_sizes"):
        ctx.comm.all_to_all_v(out, inp, None, ins)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_v_tensor_splits_cpu(ranks, world_size):
    ranks(world_size).run(_all_to_all_v_tensor_splits)
