"""Reference for EPBuffer tests (CPU and GPU): routings, tokens, a stand-in for the experts, and a
pure-torch simulation of every rank of Note [EP layout] (computed on every rank from the same seeds)."""
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
    e = torch.arange(first_expert, first_expert + expert_x.shape[0], dtype=torch.float32,
                     device=expert_x.device)[:, None, None]
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


def run_dispatch_combine(ctx, cases, device="cpu", transport="auto", comm=None):
    """Every case twice on one buffer (the second with split phases and poisoned rows): expert rows and
    counts bit for bit, combine bit for bit and within rounding of fp64, overflow raised by check().
    ``comm``: the communicator (default ``ctx.comm``)."""
    import pytest

    import commlib
    n, me = ctx.world_size, ctx.rank
    for case in cases:
        (num_experts, topk, hidden, dtype_name, kind, max_tokens, tokens_of, capacity) = case
        ctx.progress(f"EP {case}")
        dtype = DTYPES[dtype_name]
        before = commlib.plan_counters()
        buf = commlib.EPBuffer(comm or ctx.comm, max_tokens, hidden, num_experts, topk, dtype, device=device,
                               capacity=capacity, transport=transport)
        cap = buf.capacity
        L = num_experts // n
        prev = None
        for seed in (1, 2):  # twice on one buffer: state from the first call must not leak
            inputs = []
            for s in range(n):
                T = tokens_of[s % len(tokens_of)]  # tokens of rank s (cycled)
                idx, w = make_routing(s, T, num_experts, topk, kind, seed)
                inputs.append((make_tokens(s, T, hidden, dtype, seed), idx, w))
            rows, totals = simulate(inputs, num_experts, cap, n)
            x, idx, w = (t.to(device) for t in inputs[me])
            if prev is not None:
                prev.fill_(float("nan"))  # poison the registered rows the first call wrote
            if seed == 1:
                res = buf.dispatch(x, idx, w)
            else:  # the split phases, with unrelated work in between
                handle = buf.dispatch_send(x, idx, w)
                torch.randn(64, 64, device=device) @ torch.randn(64, 64, device=device)
                res = buf.dispatch_recv(handle)
                assert res.handle is handle
            prev = res.expert_x
            assert res.expert_x.shape == (L, cap, hidden)
            expect_counts = torch.tensor([min(totals[me * L + l], cap) for l in range(L)], dtype=torch.int32)
            assert torch.equal(res.expert_counts.cpu(), expect_counts), (case, res.expert_counts, expect_counts)
            for l in range(L):
                e = me * L + l
                got = res.expert_x[l, :min(len(rows[e]), cap)].cpu()
                want = torch.stack([inputs[s][0][t] for (s, t, k) in rows[e][:cap]]) if rows[e] \
                    else torch.empty(0, hidden, dtype=dtype)
                assert torch.equal(got, want), f"{case}: expert {e} rows differ"
            expert_out = expert_fn(res.expert_x, me * L)
            out = torch.full((x.shape[0], hidden), float("nan"), dtype=dtype, device=device)
            if seed == 1:
                got = buf.combine(expert_out, res.handle, out=out)
            else:
                buf.combine_send(expert_out, res.handle, out=out)
                got = buf.combine_recv()
            assert got.data_ptr() == out.data_ptr()
            out = out.cpu()
            want, want64 = reference_combine(me, inputs, rows, num_experts, n, hidden, dtype, cap)
            assert torch.equal(out, want), f"{case}: combine differs from the ordered fp32 reference"
            tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}[dtype]  # two roundings
            torch.testing.assert_close(out.double(), want64, rtol=tol, atol=tol)
            if max(totals) > cap:
                worst = max(range(num_experts), key=lambda e: (totals[e], e))  # ties: the larger id
                with pytest.raises(ValueError, match=f"expert {worst} received {totals[worst]} routes but capacity is {cap}"):
                    buf.check()
            buf.check()  # clear (and nothing pending)
        # Every call of the case ran the variant the buffer names (Note [plan]); a decode case with
        # COMMLIB_EP_LL=1 whose rows are not whole 16-byte packs runs the flag kernels.
        ran = {k for k, v in commlib.plan_counters().items() if v != before[k]}
        meant = {"host": "ep_host", "flags": "ep_normal", "ll": "ep_ll", "nvshmem": "ep_nvshmem"}[buf.kernels]
        assert ran == {meant}, f"{case}: buffer kernels {buf.kernels!r}, plans run {ran}"
    return True


def check_dead_peer_times_out(ctx, name, dead=None, timeout_s=2.0, **buffer_kwargs):
    """Rank ``dead`` (default: the last) never joins the second dispatch: every other rank's kernel
    gives up within the communicator's timeout (not a hang) and records that it waited for ``dead``.
    Returns the buffer's kernels name."""
    from datetime import timedelta

    import pytest

    import commlib
    n = ctx.world_size
    dead = n - 1 if dead is None else dead
    num_experts = 8 if n <= 4 else 2 * n
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm(name, timeout=timedelta(seconds=timeout_s))
    buf = commlib.EPBuffer(comm, 4, 1024, num_experts, 2, torch.bfloat16, device=dev, **buffer_kwargs)
    kernels = buf.kernels
    idx, w = make_routing(ctx.rank, 4, num_experts, 2, "random", 3)
    x, idx, w = make_tokens(ctx.rank, 4, 1024, torch.bfloat16, 3).to(dev), idx.to(dev), w.to(dev)
    res = buf.dispatch(x, idx, w)
    buf.combine(expert_fn(res.expert_x, ctx.rank * buf.num_local_experts), res.handle)
    torch.cuda.synchronize()
    comm.barrier()
    if ctx.rank != dead:
        buf.dispatch(x, idx, w)
        torch.cuda.synchronize()
        with pytest.raises(commlib.CommTimeoutError, match=rf"rank {ctx.rank} waited \d+ ms for rank {dead} "):
            comm.check_gpu_error()
    comm.close()
    return kernels
