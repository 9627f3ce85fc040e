"""Mixed sequences of CPU operations on one communicator (Note [host shm protocol]).

The per-operation tests run one operation at a time, with the reference computed between calls,
so the ranks start every call nearly together. A program interleaves operations back to back: a
layer's all_reduce, the fused all-reduce + RMSNorm, an EP dispatch/combine, a broadcast of
metadata, a barrier. The transport's state (round parity and double buffering, the pipeline's
reserved steps, the slot rotation, the fused and EP exchanges) must carry across any order of
them while a fast rank runs ahead into the next call. Every rank runs the same seeded random
sequence of bursts: 1-6 operations (sizes around the edges of 16 KiB slots and their pipeline
chunks; dtypes, ops, algorithms; in place and out of place; poisoned outputs) prepared first, then
called back to back with nothing in between, then checked.

Reference: computed on every rank from every rank's inputs (which every rank can generate): data
movement exactly; reductions bit for bit against the ordered fp32 reference (Note [reduction
order]) and within the dtype's rounding of fp64; the fused op bit for bit against
``reference_rmsnorm`` of that reduction; EP against the simulation of tests/ep_reference.py.
"""
import random

import pytest
import torch
from ep_reference import expert_fn, make_routing, make_tokens, reference_combine, simulate
from test_host_collectives import ordered_reference, rank_input

SLOT_BYTES = 16 << 10
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
MOVERS = FLOATS + [torch.int64, torch.uint8]  # dtypes of the operations that only move bytes
REDUCE_OPS = ["sum", "avg", "min", "max", "prod"]
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EP_SHAPE = dict(max_tokens=6, hidden=24, num_experts=12, topk=2)  # num_experts: a multiple of 2, 3, 4


def _count(rng, esize):
    """Element counts at the edges that matter with 16 KiB slots: 0, odd, one slot, a pipeline
    chunk, several of either."""
    slot = SLOT_BYTES // esize
    return rng.choice([0, 1, 7, 1023, slot - 1, slot, slot + 1, 2 * slot + 5, 7 * slot // 2, 13 * slot + 3])


def _data(rank, count, dtype, salt):
    if dtype.is_floating_point:
        return rank_input(rank, count, dtype, salt)
    g = torch.Generator().manual_seed(salt * 131 + rank)
    return torch.randint(0, 250, (count,), generator=g).to(dtype)


def _poison(shape, dtype):
    """NaN, or 251 (never drawn by _data) for integer dtypes."""
    shape = (shape,) if isinstance(shape, int) else shape
    return torch.full(shape, float("nan") if dtype.is_floating_point else 251).to(dtype)


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
                  .get(t.dtype, t.dtype))


def _assert_reduced(got, inputs, op, n, what):
    expected = ordered_reference(inputs, op, n)
    assert torch.equal(_bits(got), _bits(expected)), f"{what}: differs from the ordered fp32 reference"
    if op in ("sum", "avg") and got.numel():
        ref64 = sum(x.double() for x in inputs) / (n if op == "avg" else 1)
        torch.testing.assert_close(got.double(), ref64, rtol=TOL[got.dtype], atol=TOL[got.dtype])


# Each _prepare_X draws its parameters, makes every rank's inputs and this rank's poisoned outputs,
# and returns (call, check): call() runs the operation, check() asserts on its results (naming it).

def _prepare_all_reduce(comm, rng, salt, buf):
    rank, n, dtype = comm.rank, comm.world_size, rng.choice(FLOATS)
    count, op = _count(rng, dtype.itemsize), rng.choice(REDUCE_OPS)
    algo, in_place = rng.choice(["flat", "tree", "auto"]), rng.random() < 0.5
    what = f"all_reduce {op} {algo} {dtype} count={count} {'in place' if in_place else 'out of place'}"
    inputs = [_data(r, count, dtype, salt) for r in range(n)]
    mine = inputs[rank].clone()
    out = mine if in_place else _poison(count, dtype)

    def call():
        comm.all_reduce(mine, op=op, algo=algo, out=out)

    def check():
        if not in_place:
            assert torch.equal(_bits(mine), _bits(inputs[rank])), f"{what}: the input changed"
        _assert_reduced(out, inputs, op, n, what)
    return call, check


def _prepare_reduce_scatter(comm, rng, salt, buf):
    rank, n, dtype = comm.rank, comm.world_size, rng.choice(FLOATS)
    count, op = _count(rng, dtype.itemsize * n), rng.choice(REDUCE_OPS)
    what = f"reduce_scatter {op} {dtype} count={count}"
    inputs = [_data(r, n * count, dtype, salt) for r in range(n)]
    mine, out = inputs[rank].clone(), _poison(count, dtype)
    block = slice(rank * count, (rank + 1) * count)
    return lambda: comm.reduce_scatter(out, mine, op=op), \
        lambda: _assert_reduced(out, [x[block] for x in inputs], op, n, what)


def _prepare_all_gather(comm, rng, salt, buf):
    rank, n, dtype = comm.rank, comm.world_size, rng.choice(MOVERS)
    count = _count(rng, dtype.itemsize)
    what = f"all_gather {dtype} count={count}"
    inputs = [_data(r, count, dtype, salt) for r in range(n)]
    mine, out = inputs[rank].clone(), _poison(n * count, dtype)

    def check():
        assert torch.equal(out, torch.cat(inputs)), what
    return lambda: comm.all_gather(out, mine), check


def _prepare_broadcast(comm, rng, salt, buf):
    dtype, src = rng.choice(MOVERS), rng.randrange(comm.world_size)
    count = _count(rng, dtype.itemsize)
    what = f"broadcast {dtype} count={count} src={src}"
    data = _data(src, count, dtype, salt)
    t = data.clone() if comm.rank == src else _poison(count, dtype)

    def check():
        assert torch.equal(t, data), what
    return lambda: comm.broadcast(t, src), check


def _prepare_all_to_all_v(comm, rng, salt, buf):
    n, me, dtype, width = comm.world_size, comm.rank, rng.choice(MOVERS), rng.choice([1, 3, 64])
    # rows[s][d]: rows rank s sends to rank d (the same table on every rank); some pairs send nothing.
    rows = [[rng.choice([0, 1, 5, SLOT_BYTES // (width * dtype.itemsize) + 1]) for _ in range(n)] for _ in range(n)]
    what = f"all_to_all_v {dtype} width={width} rows={rows}"
    inputs = [_data(s, sum(rows[s]) * width, dtype, salt).view(-1, width) for s in range(n)]
    mine, out = inputs[me].clone(), _poison((sum(rows[s][me] for s in range(n)), width), dtype)
    expected = torch.cat([inputs[s][sum(rows[s][:me]):sum(rows[s][:me + 1])] for s in range(n)])

    def check():
        assert torch.equal(out, expected), what
    return lambda: comm.all_to_all_v(out, mine, [rows[s][me] for s in range(n)], rows[me]), check


def _prepare_fused(comm, rng, salt, buf):
    from commlib.fused import reference_rmsnorm, token_slice
    rank, n, dtype = comm.rank, comm.world_size, rng.choice(FLOATS)
    tokens, hidden = rng.choice([0, 1, n + 1, 9, 40]), rng.choice([8, 136, 520])
    mode = rng.choice(["replicated", "sharded"])
    what = f"fused_allreduce_rmsnorm {mode} {dtype} tokens={tokens} hidden={hidden}"
    xs = [_data(r, tokens * hidden, dtype, salt).view(tokens, hidden) - 1 for r in range(n)]
    residual0 = _data(n, tokens * hidden, dtype, salt + 1).view(tokens, hidden)
    weight = _data(n + 1, hidden, dtype, salt + 2)
    want_out, want_res = reference_rmsnorm(ordered_reference(xs, "sum", n), residual0, weight, 1e-6)
    x, residual, out = xs[rank].clone(), residual0.clone(), _poison((tokens, hidden), dtype)
    owned = slice(*token_slice(tokens, n, rank)) if mode == "sharded" else slice(0, tokens)

    def call():
        comm.fused_allreduce_rmsnorm(x, residual, weight, 1e-6, residual_mode=mode, out=out)

    def check():
        assert torch.equal(_bits(out), _bits(want_out)), f"{what}: out differs from all_reduce + reference_rmsnorm"
        assert torch.equal(_bits(residual[owned]), _bits(want_res[owned])), f"{what}: residual differs"
        foreign = torch.ones(tokens, dtype=torch.bool)
        foreign[owned] = False  # sharded: the rows this rank does not own come back untouched
        assert torch.equal(_bits(residual[foreign]), _bits(residual0[foreign])), f"{what}: foreign rows written"
    return call, check


def _prepare_ep(comm, rng, salt, buf):
    n, me, s = comm.world_size, comm.rank, EP_SHAPE
    kind = rng.choice(["random", "masked", "one_expert"])
    tokens = [rng.choice([0, 1, s["max_tokens"]]) for _ in range(n)]
    what = f"EP dispatch/combine {kind} tokens={tokens}"
    inputs = []
    for r in range(n):
        idx, w = make_routing(r, tokens[r], s["num_experts"], s["topk"], kind, salt)
        inputs.append((make_tokens(r, tokens[r], s["hidden"], buf.dtype, salt), idx, w))
    rows, _ = simulate(inputs, s["num_experts"], buf.capacity, n)
    L = s["num_experts"] // n
    got = {"out": _poison((tokens[me], s["hidden"]), buf.dtype)}

    def call():
        res = buf.dispatch(*inputs[me])
        # The views are valid until the next dispatch on the buffer, which may come in this burst.
        got["counts"], got["rows"] = res.expert_counts.clone(), res.expert_x.clone()
        buf.combine(expert_fn(res.expert_x, me * L), res.handle, out=got["out"])

    def check():
        for l in range(L):
            routes = rows[me * L + l]
            assert int(got["counts"][l]) == len(routes), f"{what}: expert {me * L + l} count"
            want = torch.stack([inputs[src][0][t] for (src, t, _) in routes]) if routes else \
                torch.empty(0, s["hidden"], dtype=buf.dtype)
            assert torch.equal(got["rows"][l, :len(routes)], want), f"{what}: expert {me * L + l} rows"
        want, _ = reference_combine(me, inputs, rows, s["num_experts"], n, s["hidden"], buf.dtype, buf.capacity)
        assert torch.equal(_bits(got["out"]), _bits(want)), f"{what}: combine differs from the ordered fp32 reference"
    return call, check


def _prepare_barrier(comm, rng, salt, buf):
    return comm.barrier, lambda: None


OPS = {name[len("_prepare_"):]: fn for name, fn in globals().items() if name.startswith("_prepare_")}


def _sequence(ctx, seed, num_bursts):
    import commlib
    comm = ctx.new_comm(f"sequence-{seed}")
    try:
        s = EP_SHAPE
        buf = commlib.EPBuffer(comm, s["max_tokens"], s["hidden"], s["num_experts"], s["topk"], torch.bfloat16)
        rng = random.Random(seed)  # the same sequence on every rank
        seen = set()
        for burst in range(num_bursts):
            names = [rng.choice(sorted(OPS)) for _ in range(rng.randint(1, 6))]
            ops = [OPS[name](comm, rng, 100 * burst + i, buf) for i, name in enumerate(names)]
            for call, _ in ops:  # back to back: a fast rank starts the next one at once
                call()
            for i, (_, check) in enumerate(ops):
                try:
                    check()
                except AssertionError as e:
                    raise AssertionError(f"seed {seed} burst {burst} ({', '.join(names)}), op {i}: {e}") from e
            seen.update(names)
        return sorted(seen)
    finally:
        comm.close()


# jitter: COMMLIB_HOST_TEST_JITTER_US, a random pause of up to that many µs after every wait
# (Note [host shm jitter]), so that ranks run ahead of each other.
@pytest.mark.parametrize("world_size,seed,jitter", [(2, 1, 0), (2, 2, 100), (3, 3, 100), (4, 4, 0), (4, 5, 100)])
def test_random_operation_sequences(ranks, world_size, seed, jitter):
    env = {"COMMLIB_SHM_SLOT_BYTES": str(SLOT_BYTES), "COMMLIB_HOST_TEST_JITTER_US": str(jitter)}
    results = ranks(world_size, env=env).run(_sequence, seed, 40)
    assert results[0] == sorted(OPS), f"the sequence left out {set(OPS) - set(results[0])}"


def _negative_jitter(ctx):
    comm = ctx.new_comm("negative-jitter")
    with pytest.raises(ValueError, match="COMMLIB_HOST_TEST_JITTER_US=-5 is negative"):
        comm.barrier()
    comm.close()
    return True


def test_negative_jitter_raises(ranks):
    ranks(2, env={"COMMLIB_HOST_TEST_JITTER_US": "-5"}).run(_negative_jitter)
