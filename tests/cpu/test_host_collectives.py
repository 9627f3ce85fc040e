"""CPU shared-memory collectives.

Reference: the documented reduction (Note [reduction order]: fp32, ranks in order 0..n-1, one
rounding) computed with torch on every rank, which must match bit for bit; an fp64 sum, which
must match within the dtype's rounding; and gloo on the same inputs. Outputs are poisoned first.
"""
import os

import pytest
import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SIZES_BYTES_EXTRA = [0, 1, 7, 1023, 4097]


def sizes_for(dtype):
    esize = torch.tensor([], dtype=dtype).element_size()
    return SIZES_BYTES_EXTRA + [(1 << 20) // esize + 3, (64 << 20) // esize]


def rank_input(rank, count, dtype, salt=0):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + salt)
    # Values away from 0 so prod/min/max are meaningful and sums are not trivially exact.
    return (torch.rand(count, generator=g) * 2 + 0.5).to(dtype)


def ordered_reference(inputs, op, world_size):
    acc = inputs[0].float()
    for x in inputs[1:]:
        x = x.float()
        if op in ("sum", "avg"):
            acc = acc + x
        elif op == "prod":
            acc = acc * x
        elif op == "min":
            acc = torch.minimum(acc, x)
        elif op == "max":
            acc = torch.maximum(acc, x)
    if op == "avg":
        acc = acc / float(world_size)
    return acc.to(inputs[0].dtype)


def _all_reduce_case(ctx, dtype_name, op, algos, sizes):
    dtype = DTYPES[dtype_name]
    n = ctx.world_size
    for count in sizes:
        inputs = [rank_input(r, count, dtype) for r in range(n)]
        expected = ordered_reference(inputs, op, n)
        results = {}
        for algo in algos:
            t = inputs[ctx.rank].clone()
            ctx.comm.all_reduce_(t, op=op, algo=algo)
            assert torch.equal(t.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               expected.view(torch.int16 if dtype != torch.float32 else torch.int32)), \
                f"{algo} {op} {dtype_name} count={count}: differs from the ordered fp32 reference"
            results[algo] = t
        if op in ("sum", "avg") and count:
            ref64 = sum(x.double() for x in inputs)
            if op == "avg":
                ref64 = ref64 / n
            tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            torch.testing.assert_close(results[algos[0]].double(), ref64, rtol=tol, atol=tol)
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_all_reduce_sum_all_sizes_flat_tree_bitwise(ranks, world_size, dtype_name):
    sizes = sizes_for(DTYPES[dtype_name])
    ranks(world_size).run(_all_reduce_case, dtype_name, "sum", ["flat", "tree", "auto"], sizes)


def _on_one_cpu(ctx, dtype_name, sizes):
    # Every rank on the same CPU (what the scheduler often does after a sleep): the waits see the
    # peer on their own CPU and yield at once (Note [host shm waiting]); results as anywhere else.
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        return _all_reduce_case(ctx, dtype_name, "sum", ["flat", "tree"], sizes)
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_with_every_rank_on_one_cpu(ranks, world_size):
    ranks(world_size).run(_on_one_cpu, "bfloat16", [1, 4097, 300_001, (1 << 20) + 3])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("op", ["avg", "min", "max", "prod"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_all_reduce_ops(ranks, world_size, op, dtype_name):
    ranks(world_size).run(_all_reduce_case, dtype_name, op, ["flat", "tree"], [1, 7, 4097, 300001])


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _out_of_place_case(ctx, dtype_name):
    # Reference: the in-place call on the same input, bit for bit; the input must stay as it was.
    dtype = DTYPES[dtype_name]
    esize = torch.tensor([], dtype=dtype).element_size()
    sizes = [0, 1, 7, 4097, (1 << 20) // esize + 3, (5 << 20) // esize]  # 5 MiB: many pipeline chunks
    for op in ("sum", "avg", "min", "max", "prod"):
        for count in sizes:
            inp = rank_input(ctx.rank, count, dtype, salt=11)
            for algo in ("flat", "tree", "auto"):
                in_place = ctx.comm.all_reduce_(inp.clone(), op=op, algo=algo)
                x = inp.clone()
                out = torch.full_like(inp, float("nan"))
                got = ctx.comm.all_reduce(x, op=op, algo=algo, out=out)
                where = f"{algo} {op} {dtype_name} count={count}"
                assert got is out, where
                assert torch.equal(_bits(out), _bits(in_place)), f"{where}: out of place differs from in place"
                assert torch.equal(_bits(x), _bits(inp)), f"{where}: input modified"
    # >= 8 MiB out of place streams the output (Note [host streaming stores]): an aligned output and
    # one offset by an element (ordinary stores up to the first 16-byte boundary), an odd count.
    count = (9 << 20) // esize + 5
    inp = rank_input(ctx.rank, count, dtype, salt=13)
    for algo in ("flat", "tree"):
        in_place = ctx.comm.all_reduce_(inp.clone(), op="sum", algo=algo)
        for offset in (0, 1):
            out = torch.full((count + offset,), float("nan"), dtype=dtype)[offset:]
            ctx.comm.all_reduce(inp, op="sum", algo=algo, out=out)
            assert torch.equal(_bits(out), _bits(in_place)), f"{algo} {dtype_name} offset={offset}: streamed differs"
    # out=tensor itself is the in-place call; a non-contiguous input is read through a copy.
    t = torch.full((6,), float(ctx.rank + 1))
    assert ctx.comm.all_reduce(t, out=t) is t
    assert torch.equal(t, torch.full((6,), float(sum(range(1, ctx.world_size + 1)))))
    base = rank_input(ctx.rank, 16 * 9, torch.float32, salt=12).reshape(16, 9)
    out = torch.full((16, 5), float("nan"))
    ctx.comm.all_reduce(base[:, ::2], out=out)
    expected = ordered_reference([rank_input(r, 16 * 9, torch.float32, salt=12).reshape(16, 9)[:, ::2]
                                  for r in range(ctx.world_size)], "sum", ctx.world_size)
    assert torch.equal(out, expected)
    return True


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_all_reduce_out_of_place_matches_in_place(ranks, dtype_name):
    ranks(2).run(_out_of_place_case, dtype_name)


def _against_gloo(ctx, dtype_name):
    import torch.distributed as dist
    group = ctx.gloo()
    dtype = DTYPES[dtype_name]
    for count in (1, 1023, 70001):
        x = rank_input(ctx.rank, count, dtype, salt=5)
        ours, theirs = x.clone(), x.clone()
        ctx.comm.all_reduce_(ours)
        dist.all_reduce(theirs, group=group)
        tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)
        # reduce_scatter / all_gather against gloo's
        n = ctx.world_size
        inp = rank_input(ctx.rank, count * n, dtype, salt=9)
        out = torch.full((count,), float("nan"), dtype=dtype)
        ctx.comm.reduce_scatter(out, inp)
        ref = inp.clone()
        dist.all_reduce(ref, group=group)
        torch.testing.assert_close(out.float(), ref[ctx.rank * count:(ctx.rank + 1) * count].float(), rtol=tol,
                                   atol=tol)
        gathered = torch.full((n * count,), float("nan"), dtype=dtype)
        ctx.comm.all_gather(gathered, x)
        ref_list = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(ref_list, x, group=group)
        assert torch.equal(gathered, torch.cat(ref_list))
    return True


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_against_gloo(ranks, world_size, dtype_name):
    ranks(world_size).run(_against_gloo, dtype_name)


def _reduce_scatter_all_gather(ctx, dtype_name):
    dtype = DTYPES[dtype_name]
    n = ctx.world_size
    for count in (0, 1, 7, 1023, 4097, (1 << 20) + 3):
        inputs = [rank_input(r, count * n, dtype, salt=1) for r in range(n)]
        full = ordered_reference(inputs, "sum", n)
        out = torch.full((count,), float("nan"), dtype=dtype)
        ctx.comm.reduce_scatter(out, inputs[ctx.rank], op="sum")
        assert torch.equal(out, full[ctx.rank * count:(ctx.rank + 1) * count]), f"reduce_scatter count={count}"
        mine = rank_input(ctx.rank, count, dtype, salt=2)
        gathered = torch.full((n * count,), float("nan"), dtype=dtype)
        ctx.comm.all_gather(gathered, mine)
        assert torch.equal(gathered, torch.cat([rank_input(r, count, dtype, salt=2) for r in range(n)]))
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_reduce_scatter_all_gather(ranks, world_size, dtype_name):
    ranks(world_size).run(_reduce_scatter_all_gather, dtype_name)


def _broadcast_all_to_all(ctx):
    n = ctx.world_size
    for count in (0, 1, 4097, (3 << 20) + 5):
        for src in range(n):
            t = rank_input(src, count, torch.float32, salt=3) if ctx.rank == src else torch.full((count,), -1.0)
            ctx.comm.broadcast(t, src=src)
            assert torch.equal(t, rank_input(src, count, torch.float32, salt=3))
    # int64 and bool travel as bytes
    t = torch.arange(10, dtype=torch.int64) * (ctx.rank + 1)
    ctx.comm.broadcast(t, src=n - 1)
    assert torch.equal(t, torch.arange(10) * n)
    # equal all_to_all: block r of rank q's input is q * 1000 + r
    for rows in (1, 5, 70001):
        inp = torch.stack([torch.full((rows, 3), float(ctx.rank * 1000 + r)) for r in range(n)]).reshape(n * rows, 3)
        out = torch.full((n * rows, 3), float("nan"))
        ctx.comm.all_to_all(out, inp)
        expect = torch.stack([torch.full((rows, 3), float(q * 1000 + ctx.rank)) for q in range(n)]).reshape(n * rows, 3)
        assert torch.equal(out, expect)
    # uneven: rank q sends (q + r) % 3 * 50001 rows to rank r (zero-sized blocks included)
    def rows_from(q, r):
        return ((q + r) % 3) * 50001
    in_splits = [rows_from(ctx.rank, r) for r in range(n)]
    out_splits = [rows_from(q, ctx.rank) for q in range(n)]
    inp = torch.cat([torch.arange(rows_from(ctx.rank, r), dtype=torch.float64) + ctx.rank * 1e7 + r * 1e6
                     for r in range(n)]).reshape(-1, 1).to(torch.float64)
    out = torch.full((sum(out_splits), 1), float("nan"), dtype=torch.float64)
    ctx.comm.all_to_all_v(out, inp, out_splits, in_splits)
    expect = torch.cat([torch.arange(rows_from(q, ctx.rank), dtype=torch.float64) + q * 1e7 + ctx.rank * 1e6
                        for q in range(n)]).reshape(-1, 1)
    assert torch.equal(out, expect)
    ctx.comm.barrier()
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_broadcast_and_all_to_all(ranks, world_size):
    ranks(world_size).run(_broadcast_all_to_all)


def _non_contiguous(ctx):
    base = rank_input(ctx.rank, 64 * 33, torch.bfloat16, salt=4).reshape(64, 33)
    view = base[:, 1::2]  # non-contiguous
    expected = ordered_reference([rank_input(r, 64 * 33, torch.bfloat16, salt=4).reshape(64, 33)[:, 1::2]
                                  for r in range(ctx.world_size)], "sum", ctx.world_size)
    ctx.comm.all_reduce_(view)
    assert torch.equal(view, expected)
    assert torch.equal(base[:, 0::2], rank_input(ctx.rank, 64 * 33, torch.bfloat16, salt=4).reshape(64, 33)[:, 0::2])
    out = torch.zeros(ctx.world_size * 8, 4)[:, ::2]
    ctx.comm.all_gather(out, torch.full((8, 2), float(ctx.rank)))
    assert torch.equal(out, torch.arange(ctx.world_size).float().repeat_interleave(8)[:, None].expand(-1, 2))
    return True


def test_non_contiguous(ranks):
    ranks(2).run(_non_contiguous)


def _bad_inputs(ctx):
    import commlib
    comm = ctx.comm
    cases = [
        (TypeError, "dtype int8 not supported", lambda: comm.all_reduce_(torch.ones(4, dtype=torch.int8))),
        (TypeError, "dtype mismatch", lambda: comm.reduce_scatter(torch.ones(2), torch.ones(4, dtype=torch.float16))),
        (ValueError, "must have world_size", lambda: comm.reduce_scatter(torch.ones(3), torch.ones(4))),
        (ValueError, "must have world_size", lambda: comm.all_gather(torch.ones(3), torch.ones(4))),
        (TypeError, "supported: cpu, cuda", lambda: comm.all_reduce_(torch.ones(4, device="meta"))),
        (ValueError, "op 'xor' not supported", lambda: comm.all_reduce_(torch.ones(4), op="xor")),
        (ValueError, "algo 'ring' not supported", lambda: comm.all_reduce_(torch.ones(4), algo="ring")),
        (ValueError, "src 9 out of range", lambda: comm.broadcast(torch.ones(4), src=9)),
        (ValueError, "split sizes sum to", lambda: comm.all_to_all_v(torch.ones(4), torch.ones(4), [1] * ctx.world_size,
                                                                      [2] * ctx.world_size)),
        (TypeError, "must be a torch.Tensor", lambda: comm.all_reduce_([1.0, 2.0])),
        (ValueError, r"out has shape \(3,\) but tensor has \(4,\)",
         lambda: comm.all_reduce(torch.ones(4), out=torch.empty(3))),
        (TypeError, "out has dtype torch.float16 but tensor has torch.float32",
         lambda: comm.all_reduce(torch.ones(4), out=torch.empty(4, dtype=torch.float16))),
        (TypeError, "out is on meta but tensor is on cpu",
         lambda: comm.all_reduce(torch.ones(4), out=torch.empty(4, device="meta"))),
        (ValueError, "out must be contiguous", lambda: comm.all_reduce(torch.ones(4), out=torch.empty(8)[::2])),
        (TypeError, "out must be a torch.Tensor or None", lambda: comm.all_reduce(torch.ones(4), out=[0.0] * 4)),
        (ValueError, "output overlaps input partly", lambda: (lambda b: comm.all_reduce(b[:8], out=b[2:]))(
            torch.ones(10))),
    ]
    for exc, text, call in cases:
        with pytest.raises(exc, match=text):
            call()
        # still usable
        t = torch.full((5,), float(ctx.rank + 1))
        comm.all_reduce_(t)
        assert torch.equal(t, torch.full((5,), float(sum(range(1, ctx.world_size + 1)))))
    # Mismatched collectives across ranks: every rank raises PeerError, and the next call works.
    with pytest.raises(commlib.PeerError, match="ranks disagree"):
        comm.all_reduce_(torch.ones(3 + ctx.rank))
    t = torch.ones(4)
    comm.all_reduce_(t)
    assert torch.equal(t, torch.full((4,), float(ctx.world_size)))
    # World size disagreement at creation raises on the calling rank.
    ws = ctx.world_size + (1 if ctx.rank == ctx.world_size - 1 else 0)
    with pytest.raises(commlib.PeerError, match="world_size mismatch"):
        commlib.Communicator(ctx.store, ctx.rank if ctx.rank < ws else 0, ws, "mismatch")
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_inputs_raise_and_communicator_stays_usable(ranks, world_size):
    ranks(world_size).run(_bad_inputs)


def _die_or_wait(ctx):
    import commlib
    comm = ctx.new_comm("dying", timeout=__import__("datetime").timedelta(seconds=60))
    comm.barrier()
    if ctx.rank == 1:
        os._exit(3)
    try:
        comm.all_reduce_(torch.ones(1000))
    except commlib.PeerError as e:
        return str(e)
    return "no error"


def test_killed_peer_raises_and_leaves_no_shm(ranks):
    from conftest import RankFailure, shm_segments
    pool = ranks(2)
    with pytest.raises(RankFailure) as info:
        pool.run(_die_or_wait, timeout=120)
    assert 1 in info.value.errors and info.value.errors[1][0] == "EOFError"
    assert not shm_segments()


def _survivor_message(ctx):
    return ctx.scratch.get("msg")


def _slow_peer(ctx):
    import datetime
    import time

    import commlib
    # 4 s, not less: creating the communicator is bounded by the same timeout, and on a loaded
    # 2-core machine one rank can start a few seconds after the other.
    comm = ctx.new_comm("slow", timeout=datetime.timedelta(seconds=4))
    comm.barrier()
    if ctx.rank == 1:
        time.sleep(8)
        return "slept"
    with pytest.raises(commlib.CommTimeoutError, match="Timed out .* rank 0 waiting for rank 1"):
        comm.all_reduce_(torch.ones(10))
    with pytest.raises(commlib.PeerError, match="unusable"):
        comm.all_reduce_(torch.ones(10))
    comm.close()
    return "timed out"


def test_slow_peer_times_out(ranks):
    assert ranks(2).run(_slow_peer) == ["timed out", "slept"]


def _knobs(ctx):
    import commlib
    names = [k[0] for k in commlib.knobs()]
    return names


def _large_world(ctx):
    _all_reduce_case(ctx, "bfloat16", "sum", ["flat", "tree"], [0, 1, 7, 1023, 4097, 300007])
    _all_reduce_case(ctx, "float32", "avg", ["flat", "tree"], [5, 70001])
    n = ctx.world_size
    count = 1237
    inputs = [rank_input(r, count * n, torch.float16, salt=11) for r in range(n)]
    out = torch.full((count,), float("nan"), dtype=torch.float16)
    ctx.comm.reduce_scatter(out, inputs[ctx.rank])
    assert torch.equal(out, ordered_reference(inputs, "sum", n)[ctx.rank * count:(ctx.rank + 1) * count])
    rows = [(ctx.rank * 7 + r * 3) % 5 for r in range(n)]
    recv = [(q * 7 + ctx.rank * 3) % 5 for q in range(n)]
    inp = torch.cat([torch.full((rows[r], 2), float(ctx.rank * 100 + r)) for r in range(n)])
    out = torch.full((sum(recv), 2), float("nan"))
    ctx.comm.all_to_all_v(out, inp, recv, rows)
    assert torch.equal(out, torch.cat([torch.full((recv[q], 2), float(q * 100 + ctx.rank)) for q in range(n)]))
    return True


@pytest.mark.parametrize("world_size", [5, 8])
def test_world_sizes_5_to_8(ranks, world_size):
    """The generic (non-power-of-two, > 4) shapes of every algorithm, small sizes."""
    pool = ranks(world_size)
    pool.run(_large_world)
    pool.close()
