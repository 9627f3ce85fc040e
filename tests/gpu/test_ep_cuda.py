"""EPBuffer and the dynamic all_to_all_v on CUDA (2 GPUs; the EPBuffer tests also at world 1, on
one GPU: every kernel path but the NVLink traffic). (Named test_ep_cuda.py: pytest's
default import mode forbids two test modules named test_ep.py.)

References: the pure-torch simulation of every rank (tests/ep_reference.py; Note [EP layout]),
bit for bit for dispatch rows, counts and combine, and the CPU shared-memory path of the same
EPBuffer API on the same inputs, bit for bit. all_to_all_v: the rows every rank's deterministic
input must deliver. Outputs are poisoned (NaN) before every call, including graph replays.
"""
import os

import pytest
import torch
from ep_reference import check_dead_peer_times_out, expert_fn, make_routing, make_tokens, reference_combine, run_dispatch_combine, simulate

pytestmark = pytest.mark.gpu
# World sizes of the EPBuffer tests: 1 runs every kernel path except the NVLink traffic on one GPU
# (tests/conftest.py runs a GPU test when there are as many GPUs as its world_size).
WORLDS = [1, 2]


def _cases(ctx, which):
    n = ctx.world_size
    uneven = (5, 0, 17, 1)  # rank 1 has no tokens
    cases = {
        "basic": [
            (8, 2, 4096, "bfloat16", "random", 32, (32, 29), None),
            (16, 4, 7168, "bfloat16", "masked", 17, uneven, None),
            (256, 8, 7168, "bfloat16", "random", 40, (40, 3), None),
            (8, 1, 33, "float32", "random", 17, uneven, None),    # odd hidden: element path
            (8, 3, 100, "float16", "one_expert", 20, uneven, None),
            (8, 2, 64, "bfloat16", "duplicates", 17, uneven, None),  # overflow
            (8, 2, 64, "float32", "random", 17, uneven, 3),          # small capacity
            (64, 8, 256, "bfloat16", "random", 600, (600, 599), None),  # many routes per block
            # top-k 5..7, zero tokens on a rank, skew, and the grid shapes of Note [EP GPU protocol]
            (16, 5, 256, "bfloat16", "random", 33, (33, 0), None),
            (32, 6, 520, "float16", "one_expert", 24, (24, 7), None),
            (64, 7, 4096, "bfloat16", "masked", 40, (1, 40), None),
            (8, 2, 64, "bfloat16", "random", 4, (0,), None),             # no tokens anywhere
            (8, 2, 4096, "bfloat16", "random", 1, (1,), None),           # one token: rows split over warps
            (256, 8, 7168, "bfloat16", "random", 512, (512, 300), None),  # DeepSeek-like, many blocks
            (256, 8, 7168, "bfloat16", "one_expert", 64, (64, 64), 40),   # skew past a small capacity
        ],
        # Decode grids (Note [EP GPU protocol]): few token chunks, each chunk's columns spread over
        # several blocks (column parts; 132 SMs give 128 blocks at most). Part sizes that do not divide
        # the row, trailing empty parts, the element path, and the lead's meta read by the other parts.
        "column_parts": [
            (8, 2, 4104, "bfloat16", "random", 1, (1,), None),            # 1 chunk x 8 parts; 513 packs
            (8, 2, 33, "float32", "random", 1, (1,), None),               # element path; parts 5..7 empty
            (16, 8, 4104, "bfloat16", "one_expert", 3, (3, 1), None),     # 2 chunks x 8, last chunk short
            (256, 8, 7168, "bfloat16", "random", 8, (8, 0), None),        # DeepSeek-like: 4 chunks x 8
            (8, 2, 1000, "float16", "duplicates", 2, (2, 1), 1),          # overflow at decode, capacity 1
            (32, 4, 520, "float32", "masked", 48, (48, 47), None),        # 24 chunks x 5 parts
            (8, 2, 4096, "bfloat16", "random", 128, (128, 128), None),    # 64 chunks x 2 parts
            (16, 4, 7168, "bfloat16", "random", 1, (0, 1), None),         # one rank without tokens
        ],
    }[which]
    return [c for c in cases if c[0] % n == 0]


def _dispatch_combine(ctx, which):
    import commlib
    try:
        before = commlib.plan_counters()
        result = run_dispatch_combine(ctx, _cases(ctx, which), f"cuda:{ctx.device}")
        after = commlib.plan_counters()
        ran = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        # Without COMMLIB_EP_LL the flag kernels run every call; with it, at least the decode grids run LL.
        if os.environ.get("COMMLIB_EP_LL") != "1":
            assert ran.get("ep_normal", 0) > 0 and "ep_ll" not in ran, ran
        return result
    finally:
        # Give the cached blocks back: with COMMLIB_TEST_SHARE_GPUS, every pool's ranks share one
        # GPU, and at world 8 two pools' caches of the largest case did not fit beside each other.
        torch.cuda.empty_cache()


@pytest.mark.parametrize("world_size", WORLDS)
def test_dispatch_combine_matches_simulation(ranks, world_size):
    ranks(world_size).run(_dispatch_combine, "basic")


@pytest.mark.parametrize("world_size", WORLDS)
def test_decode_column_parts_match_simulation(ranks, world_size):
    ranks(world_size).run(_dispatch_combine, "column_parts")


def _same_as_cpu(ctx):
    """GPU and CPU paths of one API give the same bits on the same inputs."""
    import commlib
    n, me = ctx.world_size, ctx.rank
    E, K, H, T = 32, 8, 7168, 64
    gpu = commlib.EPBuffer(ctx.comm, T, H, E, K, torch.bfloat16, device=f"cuda:{ctx.device}")
    cpu = commlib.EPBuffer(ctx.comm, T, H, E, K, torch.bfloat16)
    x = make_tokens(me, T, H, torch.bfloat16, 9)
    idx, w = make_routing(me, T, E, K, "random", 9)
    rg = gpu.dispatch(x.cuda(), idx.cuda(), w.cuda())
    rc = cpu.dispatch(x, idx, w)
    assert torch.equal(rg.expert_counts.cpu(), rc.expert_counts)
    for l in range(E // n):
        c = int(rc.expert_counts[l])
        assert torch.equal(rg.expert_x[l, :c].cpu(), rc.expert_x[l, :c])
    og = gpu.combine(expert_fn(rg.expert_x, me * (E // n)), rg.handle)
    oc = cpu.combine(expert_fn(rc.expert_x, me * (E // n)), rc.handle)
    assert torch.equal(og.cpu(), oc)
    return True


@pytest.mark.parametrize("world_size", WORLDS)
def test_gpu_matches_cpu_bitwise(ranks, world_size):
    ranks(world_size).run(_same_as_cpu)


def _ep_step(buf, x, idx, w, out, split, first_expert):
    """Dispatch, the identity-like experts of tests/ep_reference.py, combine into `out` (fused or the
    split phases); returns the dispatch result."""
    if split:
        res = buf.dispatch_recv(buf.dispatch_send(x, idx, w))
        buf.combine_send(expert_fn(res.expert_x, first_expert), res.handle, out=out)
        buf.combine_recv()
    else:
        res = buf.dispatch(x, idx, w)
        buf.combine(expert_fn(res.expert_x, first_expert), res.handle, out=out)
    return res


def _graph_replay(ctx, split):
    """Dispatch + experts + combine captured once (fused or split phases), replayed with new routing
    and tokens each time, including a routing that overflows the capacity (check() raises after it)."""
    import commlib
    n, me = ctx.world_size, ctx.rank
    dev = torch.device("cuda", ctx.device)
    E, K, H, T = 16, 4, 1024, 48
    L = E // n
    buf = commlib.EPBuffer(ctx.comm, T, H, E, K, torch.bfloat16, device=dev)
    sx = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
    sidx = torch.zeros(T, K, dtype=torch.long, device=dev)
    sw = torch.zeros(T, K, dtype=torch.float32, device=dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)

    def step():
        return _ep_step(buf, sx, sidx, sw, out, split, me * L)

    def load(seed, kind):
        inputs = []
        for s in range(n):
            idx, w = make_routing(s, T, E, K, kind, seed)
            inputs.append((make_tokens(s, T, H, torch.bfloat16, seed), idx, w))
        x, idx, w = inputs[me]
        sx.copy_(x)
        sidx.copy_(idx)
        sw.copy_(w)
        return inputs

    load(100, "random")
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture
    torch.cuda.current_stream(dev).wait_stream(stream)
    ctx.comm.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = step()
    cap = buf.capacity
    for seed, kind in [(1, "random"), (2, "masked"), (3, "one_expert"), (5, "duplicates"), (4, "random")]:
        inputs = load(seed, kind)
        out.fill_(float("nan"))
        res.expert_x.fill_(float("nan"))  # the registered rows the replay must rewrite
        graph.replay()
        torch.cuda.synchronize(dev)
        rows, totals = simulate(inputs, E, cap, n)
        for l in range(L):
            e = me * L + l
            assert int(res.expert_counts[l]) == min(totals[e], cap), f"replay {seed}: count of expert {e}"
            kept = rows[e][:cap]
            want = torch.stack([inputs[s][0][t] for (s, t, k) in kept]) if kept else torch.empty(0, H).bfloat16()
            assert torch.equal(res.expert_x[l, :len(kept)].cpu(), want), f"replay {seed}: expert {e}"
        want, _ = reference_combine(me, inputs, rows, E, n, H, torch.bfloat16, cap)
        assert torch.equal(out.cpu(), want), f"replay {seed}: combine"
        if max(totals) > cap:
            with pytest.raises(ValueError, match="capacity overflow"):
                buf.check()
        buf.check()
    return True


# Note [programmatic dependent launch] (csrc/kernels/launch.cuh): the same tests with each kernel
# allowed to start while the previous kernel of its stream finishes.
PDL = {"COMMLIB_PDL": "1"}


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("pdl", [False, True], ids=["stream-order", "pdl"])
@pytest.mark.parametrize("split", [False, True])
def test_graph_replay_with_changing_routing(ranks, split, pdl, world_size):
    ranks(world_size, env=PDL if pdl else None).run(_graph_replay, split)


def _back_to_back(ctx, split):
    """Eager dispatch + experts + combine, several calls with new routing each and no host sync in
    between (inputs staged on the GPU first), every call's output checked at the end against the
    documented combine. Split phases make dispatch_send -> dispatch_recv, combine_send ->
    combine_recv and combine_recv -> the next dispatch_send direct kernel-to-kernel pairs."""
    import commlib
    n, me = ctx.world_size, ctx.rank
    dev = torch.device("cuda", ctx.device)
    E, K, H, T = 16, 4, 4104, 8  # a decode grid: few chunks, each row over several column parts
    L = E // n
    buf = commlib.EPBuffer(ctx.comm, T, H, E, K, torch.bfloat16, device=dev)
    steps = [(21, "random"), (22, "masked"), (23, "one_expert"), (24, "random"), (25, "masked"), (26, "random")]
    all_inputs = []
    for seed, kind in steps:
        inputs = []
        for s in range(n):
            idx, w = make_routing(s, T, E, K, kind, seed)
            inputs.append((make_tokens(s, T, H, torch.bfloat16, seed), idx, w))
        all_inputs.append(inputs)
    staged = [tuple(t.to(dev) for t in inputs[me]) for inputs in all_inputs]
    outs = [torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev) for _ in steps]
    torch.cuda.synchronize(dev)
    ctx.comm.barrier()
    for (x, idx, w), out in zip(staged, outs):
        _ep_step(buf, x, idx, w, out, split, me * L)
    torch.cuda.synchronize(dev)
    for (seed, kind), inputs, out in zip(steps, all_inputs, outs):
        rows, _ = simulate(inputs, E, buf.capacity, n)
        want, _ = reference_combine(me, inputs, rows, E, n, H, torch.bfloat16, buf.capacity)
        assert torch.equal(out.cpu(), want), f"call {seed} ({kind}): combine"
    buf.check()
    return True


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("pdl", [False, True], ids=["stream-order", "pdl"])
@pytest.mark.parametrize("split", [False, True])
def test_eager_back_to_back_calls(ranks, split, pdl, world_size):
    ranks(world_size, env=PDL if pdl else None).run(_back_to_back, split)


@pytest.mark.parametrize("world_size", WORLDS)
def test_pdl_every_grid_shape(ranks, world_size):
    # Both case lists (every grid shape of Note [EP GPU protocol]) with COMMLIB_PDL=1.
    pool = ranks(world_size, env=PDL)
    pool.run(_dispatch_combine, "column_parts")
    pool.run(_dispatch_combine, "basic")


# Note [EP LL protocol]: decode-grid buffers over flag-carrying lines (COMMLIB_EP_LL=1), the same
# references and the same bits as the flag kernels.
LL = {"COMMLIB_EP_LL": "1"}


def _ll_suite(ctx):
    import commlib
    dev = f"cuda:{ctx.device}"
    # Which buffers take the LL path: decode grids whose rows are whole 16-byte packs.
    for T, H, dtype, want in [(8, 4104, torch.bfloat16, "ll"), (1, 7168, torch.bfloat16, "ll"),
                              (48, 1024, torch.float16, "ll"), (8, 33, torch.float32, "flags"),
                              (1024, 4096, torch.bfloat16, "flags")]:
        buf = commlib.EPBuffer(ctx.comm, T, H, 16, 2, dtype, device=dev)
        assert buf.kernels == want, (T, H, dtype, buf.kernels)
    # The decode grids run the LL kernels, counted per dispatch / combine call (Note [plan]); the
    # element-path case (hidden 33, fp32) runs the flag kernels (run_dispatch_combine checks each
    # case's plans against its buffer's kernels).
    before = commlib.plan_counters()
    _dispatch_combine(ctx, "column_parts")
    after = commlib.plan_counters()
    ran = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert ran.get("ep_ll", 0) > 0, ran
    _dispatch_combine(ctx, "basic")
    _same_as_cpu(ctx)
    for split in (False, True):
        _graph_replay(ctx, split)
        _back_to_back(ctx, split)
    return True


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("pdl", [False, True], ids=["stream-order", "pdl"])
def test_ll_path_matches_simulation(ranks, pdl, world_size):
    ranks(world_size, env={**LL, **(PDL if pdl else {})}).run(_ll_suite)


@pytest.mark.parametrize("world_size", [4, 8])
def test_more_ranks(ranks, world_size):
    # The cases whose expert count the world size divides, flag then LL kernels. Needs world_size
    # GPUs, or COMMLIB_TEST_SHARE_GPUS=1.
    ranks(world_size).run(_dispatch_combine, "basic")
    ranks(world_size, env=LL).run(_dispatch_combine, "column_parts")
    ranks(world_size, env=LL).run(_dispatch_combine, "basic")


def _freed_in_flight(ctx):
    """A buffer dropped right after its combine is enqueued (no synchronisation, as a serving loop
    that rebuilds its buffers does): its kernels still finish on the memory it mapped. Every
    round's output matches the one of a buffer kept alive, bit for bit; then a new buffer and an
    all_reduce work."""
    import commlib
    dev = f"cuda:{ctx.device}"
    E, K, H, T = 16, 4, 7168, 512  # long enough a combine that the drop races it
    x = make_tokens(ctx.rank, T, H, torch.bfloat16, seed=5).to(dev)
    idx, w = (t.to(dev) for t in make_routing(ctx.rank, T, E, K, "random", seed=5))
    kept = commlib.EPBuffer(ctx.comm, T, H, E, K, torch.bfloat16, device=dev)
    res = kept.dispatch(x, idx, w)
    want = kept.combine(res.expert_x, res.handle).clone()
    outs = []
    for _ in range(6):
        buf = commlib.EPBuffer(ctx.comm, T, H, E, K, torch.bfloat16, device=dev)
        res = buf.dispatch(x, idx, w)
        outs.append(buf.combine(res.expert_x, res.handle, out=torch.full_like(x, float("nan"))))
        del buf, res
    torch.cuda.synchronize()
    for out in outs:
        assert torch.equal(out, want)
    y = torch.full((4097,), float(ctx.rank + 1), device=dev)
    ctx.comm.all_reduce_(y)
    assert torch.equal(y, torch.full_like(y, ctx.world_size * (ctx.world_size + 1) / 2))
    return True


@pytest.mark.parametrize("world_size", WORLDS)
def test_buffer_dropped_while_its_kernels_run(ranks, world_size):
    assert all(ranks(world_size).run(_freed_in_flight))


def _ll_dead_peer(ctx):
    return check_dead_peer_times_out(ctx, "ep-ll-timeout") == "ll"


def test_ll_dead_peer_times_out(ranks):
    assert all(ranks(2, env=LL).run(_ll_dead_peer, timeout=120))


def _bad_pdl_knob(ctx):
    import re

    import commlib
    dev = torch.device("cuda", ctx.device)
    idx, w = make_routing(ctx.rank, 4, 8, 2, "random", 1)
    # The knob is read with the communicator's GPU configuration on its first GPU use (the buffer's
    # creation, by the code: not yet seen on a GPU, so the dispatch is inside the check too); a failed
    # read is not kept, so a second attempt raises the same.
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape("COMMLIB_PDL=2 invalid; valid: 0, 1")):
            buf = commlib.EPBuffer(ctx.comm, 4, 64, 8, 2, torch.bfloat16, device=dev)
            buf.dispatch(make_tokens(ctx.rank, 4, 64, torch.bfloat16, 1).to(dev), idx.to(dev), w.to(dev))
    return True


def test_bad_pdl_knob_is_a_clear_error(ranks):
    ranks(2, env={"COMMLIB_PDL": "2"}).run(_bad_pdl_knob)


def _invalid_ids(ctx):
    import commlib
    buf = commlib.EPBuffer(ctx.comm, 4, 64, 8, 2, torch.bfloat16, device=f"cuda:{ctx.device}")
    idx = torch.tensor([[0, 1], [2, 99], [3, -7], [1, 2]], device=f"cuda:{ctx.device}")
    x = torch.randn(4, 64, device=f"cuda:{ctx.device}").bfloat16()
    res = buf.dispatch(x, idx, torch.ones(4, 2, device=f"cuda:{ctx.device}"))
    buf.combine(res.expert_x, res.handle)
    with pytest.raises(ValueError, match="2 topk_idx entries were out of range"):
        buf.check()
    buf.check()
    return True


def test_invalid_expert_ids_are_flagged(ranks):
    ranks(2).run(_invalid_ids)


def _out_of_order(ctx):
    """Calls out of the dispatch/combine alternation raise on the host before any launch, and the
    buffer keeps working."""
    import commlib
    dev = f"cuda:{ctx.device}"
    buf = commlib.EPBuffer(ctx.comm, 4, 64, 8, 2, torch.bfloat16, device=dev)
    x = torch.randn(4, 64, device=dev).bfloat16()
    idx = torch.tensor([[0, 5], [2, 7], [3, 4], [1, 6]], device=dev)
    w = torch.ones(4, 2, device=dev)
    with pytest.raises(ValueError, match="out of order"):
        buf.combine(torch.zeros(4, buf.capacity, 64, device=dev).bfloat16(),
                    commlib.EPHandle(idx, w, 4))
    res = buf.dispatch(x, idx, w)
    with pytest.raises(ValueError, match="out of order: expected combine"):
        buf.dispatch(x, idx, w)
    out = buf.combine(res.expert_x, res.handle)
    torch.testing.assert_close(out.float(), x.float() * 2, rtol=1e-2, atol=1e-2)
    handle = buf.dispatch_send(x, idx, w)
    with pytest.raises(ValueError, match="out of order: expected dispatch_recv"):
        buf.combine(res.expert_x, res.handle)
    res = buf.dispatch_recv(handle)
    out = buf.combine(res.expert_x, res.handle)
    torch.testing.assert_close(out.float(), x.float() * 2, rtol=1e-2, atol=1e-2)
    buf.check()
    return True


def test_calls_out_of_order_raise(ranks):
    ranks(2).run(_out_of_order)


# ---- dynamic all_to_all_v ----

def rows_from(q, r, salt):
    return ((q * 7 + r * 3 + salt) % 5) * 37 + (salt % 3)


def _a2a_expect(ctx, salt, hidden, dtype):
    n, me = ctx.world_size, ctx.rank
    parts = [torch.arange(rows_from(q, me, salt) * hidden, dtype=torch.float64).reshape(-1, hidden) + q * 1e4 + me * 1e3
             for q in range(n)]
    return torch.cat(parts).to(dtype)


def _a2a_input(ctx, salt, hidden, dtype):
    n, me = ctx.world_size, ctx.rank
    parts = [torch.arange(rows_from(me, r, salt) * hidden, dtype=torch.float64).reshape(-1, hidden) + me * 1e4 + r * 1e3
             for r in range(n)]
    return torch.cat(parts).to(dtype)


def _all_to_all_v(ctx):
    n, me = ctx.world_size, ctx.rank
    dev = torch.device("cuda", ctx.device)
    comm = ctx.comm
    for hidden, dtype in [(64, torch.bfloat16), (7, torch.float32), (4096, torch.bfloat16)]:
        for symmetric in (False, True):
            for salt in range(3):
                inp = _a2a_input(ctx, salt, hidden, dtype).to(dev)
                ins = torch.tensor([rows_from(me, r, salt) for r in range(n)], device=dev)
                outs = torch.tensor([rows_from(q, me, salt) for q in range(n)], device=dev)
                total = int(outs.sum())
                cap = total + 5
                out = comm.symmetric_empty([cap, hidden], dtype, dev) if symmetric else \
                    torch.empty(cap, hidden, dtype=dtype, device=dev)
                out.fill_(float("nan"))
                comm.all_to_all_v(out, inp, outs, ins)
                got = out.cpu()
                assert torch.equal(got[:total], _a2a_expect(ctx, salt, hidden, dtype)), (hidden, symmetric, salt)
                assert torch.isnan(got[total:].float()).all(), "wrote past the received rows"
    # host splits and equal splits on CUDA
    x = torch.arange(n * 6 * 3, dtype=torch.float32, device=dev).reshape(n * 6, 3) + me * 1000
    y = torch.full_like(x, float("nan"))
    comm.all_to_all(y, x)
    expect = torch.cat([torch.arange(n * 6 * 3, dtype=torch.float32).reshape(n * 6, 3)[me * 6:(me + 1) * 6] + q * 1000
                        for q in range(n)])
    assert torch.equal(y.cpu(), expect)
    # mismatched device splits: flagged, raised by check_all_to_all, and the communicator still works
    bad = torch.tensor([1] * n, device=dev) + (1 if me == 0 else 0)
    comm.all_to_all_v(torch.empty(8 * n, 4, device=dev), torch.ones(8 * n, 4, device=dev),
                      bad, torch.tensor([1] * n, device=dev))
    if n > 1:
        with pytest.raises(ValueError, match="invalid device splits"):
            comm.check_all_to_all()
    comm.check_all_to_all()
    comm.all_to_all(y, x)
    assert torch.equal(y.cpu(), expect)
    return True


def test_all_to_all_v_device_splits(ranks):
    ranks(2).run(_all_to_all_v)


def _a2a_graph(ctx):
    """Splits change between replays of one captured all_to_all_v: no host read of the splits."""
    n, me = ctx.world_size, ctx.rank
    dev = torch.device("cuda", ctx.device)
    hidden, dtype = 128, torch.bfloat16
    cap_in, cap_out = 5 * 37 * n + 8, 5 * 37 * n + 8
    sin = torch.zeros(cap_in, hidden, dtype=dtype, device=dev)
    sout = torch.zeros(cap_out, hidden, dtype=dtype, device=dev)
    ins = torch.zeros(n, dtype=torch.long, device=dev)
    outs = torch.zeros(n, dtype=torch.long, device=dev)
    ctx.comm.all_to_all_v(sout, sin, outs, ins)  # set-up outside capture
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ctx.comm.all_to_all_v(sout, sin, outs, ins)
    for salt in range(4):
        x = _a2a_input(ctx, salt, hidden, dtype)
        sin[:x.shape[0]].copy_(x)
        ins.copy_(torch.tensor([rows_from(me, r, salt) for r in range(n)]))
        outs.copy_(torch.tensor([rows_from(q, me, salt) for q in range(n)]))
        sout.fill_(float("nan"))
        graph.replay()
        want = _a2a_expect(ctx, salt, hidden, dtype)
        assert torch.equal(sout[:want.shape[0]].cpu(), want), f"replay {salt}"
    ctx.comm.check_all_to_all()
    return True


def test_all_to_all_v_graph_replay_with_changing_splits(ranks):
    ranks(2).run(_a2a_graph)
