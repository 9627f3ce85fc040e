"""EPBuffer over NVSHMEM (transport="nvshmem"; Note [EP NVSHMEM protocol]) at world 1 and 2 (with
COMMLIB_TEST_SHARE_GPUS=1 two PEs share one GPU), on a communicator whose ranks act as two hosts
(COMMLIB_TEST_HOST_ID; Note [communicator hosts]: no peer memory is mapped there, so only NVSHMEM
carries the rows, and "auto" picks it), and at wider worlds (4, 12: past the peer-memory kernels' 8
ranks; 33: past one warp of ranks, the upper half of the 64-bit rank sets) against the simulation,
with a dead peer of rank >= 8 (and >= 32) timing out.

References: the pure-torch simulation of every rank (tests/ep_reference.py; Note [EP layout]) bit
for bit, and the peer-memory kernels (transport="peer") on the same inputs, bit for bit: expert
rows, counts, positions, combine output and the overflow word. Outputs are poisoned (NaN) before
every call, including graph replays.
"""
import pytest
import torch
from ddacomm_worlds import as_host
from ep_reference import DTYPES, check_dead_peer_times_out, expert_fn, make_routing, make_tokens, run_dispatch_combine

import commlib
from commlib import _nvshmem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.nvshmem,
    pytest.mark.skipif(not _nvshmem.available(),
                       reason="needs nvshmem4py and a commlib build with the NVSHMEM kernels"),
]
WORLDS = [1, 2]

# (num_experts, topk, hidden, dtype, routing, max_tokens, tokens of each rank (cycled), capacity)
CASES = [
    (8, 2, 4096, "bfloat16", "random", 32, (32, 29), None),
    (16, 4, 7168, "bfloat16", "masked", 17, (5, 0, 17, 1), None),
    (8, 1, 33, "float32", "random", 17, (5, 0, 17, 1), None),        # odd hidden: element path
    (8, 3, 100, "float16", "one_expert", 20, (5, 0, 17, 1), None),
    (8, 2, 64, "bfloat16", "duplicates", 17, (5, 0, 17, 1), None),   # overflow
    (8, 2, 64, "float32", "random", 17, (5, 0, 17, 1), 3),           # small capacity
    (64, 8, 256, "bfloat16", "random", 600, (600, 599), None),      # many tokens per block
    (8, 2, 64, "bfloat16", "random", 4, (0,), None),                 # no tokens anywhere
    (8, 2, 4096, "bfloat16", "random", 1, (1,), None),               # one token
    (256, 8, 7168, "bfloat16", "random", 128, (128, 77), None),      # DeepSeek-like
]


def _cases(ctx):
    return [c for c in CASES if c[0] % ctx.world_size == 0]


def _simulation(ctx):
    try:
        return run_dispatch_combine(ctx, _cases(ctx), f"cuda:{ctx.device}", transport="nvshmem")
    finally:
        torch.cuda.empty_cache()


@pytest.mark.parametrize("world_size", WORLDS)
def test_nvshmem_matches_simulation(ranks, world_size):
    ranks(world_size).run(_simulation)


def _inputs(ctx, case, seed):
    num_experts, topk, hidden, dtype_name, kind, max_tokens, tokens_of, capacity = case
    T = tokens_of[ctx.rank % len(tokens_of)]
    idx, w = make_routing(ctx.rank, T, num_experts, topk, kind, seed)
    x = make_tokens(ctx.rank, T, hidden, DTYPES[dtype_name], seed)
    dev = f"cuda:{ctx.device}"
    return x.to(dev), idx.to(dev), w.to(dev)


def _run_once(buf, x, idx, w):
    res = buf.dispatch(x, idx, w)
    expert_out = expert_fn(res.expert_x, buf.comm.rank * buf.num_local_experts)
    out = torch.full_like(x, float("nan"))
    buf.combine(expert_out, res.handle, out=out)
    counts = res.expert_counts.clone()
    rows = [res.expert_x[l, :int(counts[l])].clone() for l in range(buf.num_local_experts)]
    return rows, counts, buf._buf.recv_pos.clone(), out


def _same_as_peer(ctx):
    """NVSHMEM and peer memory, same inputs: every result bit for bit (two calls each, the second
    with other routing), including the overflow word."""
    for case in _cases(ctx):
        num_experts, topk, hidden, dtype_name, kind, max_tokens, tokens_of, capacity = case
        ctx.progress(f"nvshmem vs peer {case}")
        dev = f"cuda:{ctx.device}"
        bufs = {t: commlib.EPBuffer(ctx.comm, max_tokens, hidden, num_experts, topk, DTYPES[dtype_name], device=dev,
                                    capacity=capacity, transport=t) for t in ("peer", "nvshmem")}
        assert bufs["nvshmem"].kernels == "nvshmem" and bufs["nvshmem"].transport == "nvshmem"
        for seed in (3, 4):
            x, idx, w = _inputs(ctx, case, seed)
            got = {t: _run_once(b, x, idx, w) for t, b in bufs.items()}
            (rows_p, counts_p, pos_p, out_p), (rows_n, counts_n, pos_n, out_n) = got["peer"], got["nvshmem"]
            assert torch.equal(counts_p, counts_n), (case, counts_p, counts_n)
            for l, (a, b) in enumerate(zip(rows_p, rows_n)):
                assert torch.equal(a, b), f"{case}: local expert {l} rows differ"
            assert not out_n.isnan().any(), f"{case}: combine left rows unwritten"
            assert torch.equal(out_p, out_n), f"{case}: combine differs"
            # Positions of the routes to this rank's experts (others are unspecified).
            L = num_experts // ctx.world_size
            for s in range(ctx.world_size):
                T = tokens_of[s % len(tokens_of)]
                sidx, _ = make_routing(s, T, num_experts, topk, kind, seed)
                mine = (sidx >= ctx.rank * L) & (sidx < (ctx.rank + 1) * L)
                a, b = pos_p[s, :T].cpu(), pos_n[s, :T].cpu()
                assert torch.equal(a[mine], b[mine]), f"{case}: recv_pos of source {s} differs"
            torch.cuda.synchronize()
            assert torch.equal(bufs["peer"].overflow_word.cpu(), bufs["nvshmem"].overflow_word.cpu()), case
        for b in bufs.values():
            b.overflow_word.zero_()
    torch.cuda.empty_cache()
    return True


@pytest.mark.parametrize("world_size", WORLDS)
def test_nvshmem_bitwise_as_peer_memory(ranks, world_size):
    ranks(world_size).run(_same_as_peer)


def _graph_replay(ctx):
    """A captured dispatch + combine replayed with routing and tokens that change between replays
    (fewer tokens than captured: masked by -1 routes) gives the peer-memory results each time."""
    num_experts, topk, hidden, max_tokens = 16, 4, 2048, 24
    dev = f"cuda:{ctx.device}"
    dtype = torch.bfloat16
    nv = commlib.EPBuffer(ctx.comm, max_tokens, hidden, num_experts, topk, dtype, device=dev, transport="nvshmem")
    peer = commlib.EPBuffer(ctx.comm, max_tokens, hidden, num_experts, topk, dtype, device=dev, transport="peer")
    x = torch.zeros(max_tokens, hidden, dtype=dtype, device=dev)
    idx = torch.full((max_tokens, topk), -1, dtype=torch.int64, device=dev)
    w = torch.zeros(max_tokens, topk, dtype=torch.float32, device=dev)
    out = torch.full_like(x, float("nan"))
    first = nv.num_local_experts * ctx.rank

    def step():
        res = nv.dispatch(x, idx, w)
        nv.combine(expert_fn(res.expert_x, first), res.handle, out=out)

    step()  # first call outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ctx.comm.barrier()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    for seed, kind in ((5, "random"), (6, "one_expert"), (7, "masked"), (8, "random")):
        live = max_tokens - 3 * (seed % 2)
        sidx, sw = make_routing(ctx.rank, live, num_experts, topk, kind, seed)
        sx = make_tokens(ctx.rank, live, hidden, dtype, seed)
        x.zero_()
        x[:live] = sx.to(dev)
        idx.fill_(-1)
        idx[:live] = sidx.to(dev)
        w.zero_()
        w[:live] = sw.to(dev)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rows_p, counts_p, _, out_p = _run_once(peer, x, idx, w)
        counts_n = nv._last[1].clone()
        assert torch.equal(counts_p, counts_n), (seed, counts_p, counts_n)
        for l in range(nv.num_local_experts):
            assert torch.equal(rows_p[l], nv._last[0][l, :int(counts_n[l])]), f"replay {seed}: expert {l} rows differ"
        assert torch.equal(out, out_p), f"replay {seed}: combine differs"
    nv.check()
    return True


@pytest.mark.parametrize("world_size", WORLDS)
def test_nvshmem_graph_replay_changing_routing(ranks, world_size):
    ranks(world_size).run(_graph_replay)


def _overflow(ctx):
    """Duplicated experts past a small capacity: the same overflow word and check() error on every
    rank as peer memory."""
    num_experts, topk, hidden, max_tokens, cap = 8, 4, 64, 16, 2
    dev = f"cuda:{ctx.device}"
    words, errors = {}, {}
    for t in ("peer", "nvshmem"):
        buf = commlib.EPBuffer(ctx.comm, max_tokens, hidden, num_experts, topk, torch.float32, device=dev,
                               capacity=cap, transport=t)
        idx, w = make_routing(ctx.rank, max_tokens, num_experts, topk, "duplicates", 9)
        x = make_tokens(ctx.rank, max_tokens, hidden, torch.float32, 9).to(dev)
        _run_once(buf, x, idx.to(dev), w.to(dev))
        torch.cuda.synchronize()
        words[t] = buf.overflow_word.cpu().clone()
        with pytest.raises(ValueError, match="expert capacity overflow") as e:
            buf.check()
        errors[t] = str(e.value)
        buf.check()  # cleared
    assert words["nvshmem"][0] > 0, words
    assert torch.equal(words["peer"], words["nvshmem"]), words
    assert errors["peer"] == errors["nvshmem"]
    return True


@pytest.mark.parametrize("world_size", WORLDS)
def test_nvshmem_overflow_flag(ranks, world_size):
    ranks(world_size).run(_overflow)


def _across_hosts(ctx):
    """Every case on a communicator spanning hosts: "auto" is NVSHMEM, the results are the
    simulation's bit for bit, peer memory is refused with a clear error and the buffer still works."""
    dev = f"cuda:{ctx.device}"
    with as_host(ctx.rank):
        comm = ctx.new_comm("ep-hosts")
    try:
        assert comm.num_hosts == ctx.world_size
        buf = commlib.EPBuffer(comm, 4, 64, 8, 2, torch.float32, device=dev)
        assert buf.transport == "nvshmem" and buf.kernels == "nvshmem"
        with pytest.raises(ValueError, match="transport 'peer' needs every rank on one host"):
            commlib.EPBuffer(comm, 4, 64, 8, 2, torch.float32, device=dev, transport="peer")
        with pytest.raises(commlib.PeerError, match=r"GPU peer memory unavailable: its 2 ranks span 2 hosts"):
            comm.all_reduce(torch.randn(1000, device=dev))
        run_dispatch_combine(ctx, _cases(ctx), dev, transport="auto", comm=comm)
    finally:
        comm.close()
        torch.cuda.empty_cache()
    return True


def test_nvshmem_across_emulated_hosts(ranks):
    assert ranks(2).run(_across_hosts) == [True, True]


def _dead_peer_across_hosts(ctx):
    with as_host(ctx.rank):
        return check_dead_peer_times_out(ctx, "ep-hosts-timeout") == "nvshmem"


def _dead_peer(ctx):
    """The NVSHMEM kernels bound their waits and report whom they waited for, as the peer-memory
    kernels do."""
    return check_dead_peer_times_out(ctx, "ep-nvshmem-timeout", transport="nvshmem") == "nvshmem"


def test_nvshmem_dead_peer_times_out(ranks):
    assert all(ranks(2).run(_dead_peer, timeout=120))


def test_nvshmem_dead_peer_times_out_across_hosts(ranks):
    assert all(ranks(2).run(_dead_peer_across_hosts, timeout=120))


# Worlds past the peer-memory kernels' 8 ranks. The simulation is the reference (the peer-memory
# kernels match it bit for bit where they run). On one GPU every PE takes turns with the others, so
# the cases are small; each spreads every source's tokens over ranks across the whole world.
WIDE_WORLDS = [4, 12]
# One past a warp of ranks: the rank sets' upper 32 bits, the per-rank loops' second lap.
PAST_WARP_WORLD = 33


def _wide_cases(n):
    # (num_experts, topk, hidden, dtype, routing, max_tokens, tokens of each rank (cycled), capacity)
    return [
        (2 * n, 2, 64, "bfloat16", "random", 9, (9, 0, 5, 1), None),
        (4 * n, 8, 40, "float32", "masked", 5, (5, 3), None),            # many owners a token
        (n, 1, 33, "float16", "random", 4, (4, 1), None),                # odd hidden: element path
        (2 * n, 4, 64, "bfloat16", "duplicates", 6, (6, 2), 3),           # overflow, small capacity
    ]


def _wide_simulation(ctx):
    try:
        return run_dispatch_combine(ctx, _wide_cases(ctx.world_size), f"cuda:{ctx.device}", transport="nvshmem")
    finally:
        torch.cuda.empty_cache()


@pytest.mark.parametrize("world_size", WIDE_WORLDS)
def test_nvshmem_wide_world_matches_simulation(ranks, world_size):
    ranks(world_size).run(_wide_simulation, timeout=1200)


@pytest.mark.parametrize("world_size", [PAST_WARP_WORLD])
def test_nvshmem_past_one_warp_of_ranks(ranks, world_size):
    ranks(world_size).run(_wide_simulation, timeout=1800)


def _wide_dead_peer(ctx):
    """The last rank never joins the second dispatch: every other rank's kernel gives up within the
    timeout and records the last rank as the one it waited for (a peer past the communicator's
    per-rank device tables, kMaxDeviceRanks)."""
    return check_dead_peer_times_out(ctx, "ep-nvshmem-wide-timeout", timeout_s=20, transport="nvshmem") == "nvshmem"


@pytest.mark.parametrize("world_size", [WIDE_WORLDS[-1], PAST_WARP_WORLD])
def test_nvshmem_wide_dead_peer_times_out(ranks, world_size):
    assert all(ranks(world_size).run(_wide_dead_peer, timeout=600))
