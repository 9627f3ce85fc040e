"""Property-based fuzzing of the torch.distributed backend "ddacomm" on CPU tensors: all_reduce,
reduce, reduce_scatter_tensor, all_gather_into_tensor, broadcast, all_to_all_single (equal and
uneven splits), gather, scatter, send / recv and batch_isend_irecv.

Cases (tests/fuzz_cases.py): hypothesis draws every dtype the backend moves, every reduction valid
for it, shapes (0 elements, 0-d, odd and large sizes), views (storage offsets, gaps, transposed,
padded rows) and roots, at world sizes 2-4; one world size's cases run on the ranks in one batch,
in one "ddacomm" group. References: float32 / float16 / bfloat16 reductions bit for bit against the
documented order (Note [reduction order]: ``ordered_reference``); float64, integer and bool
reductions against torch in their own type, as gloo reduces them (integers and bool byte for byte;
AVG: the fp64 mean); data
movement bit for bit against the inputs. Outputs are poisoned first; storage outside a view must
keep its poison. Bad arguments must raise on every rank and leave the group usable.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from fuzz_cases import (ALL_DTYPES, layouts, outside_untouched, placed, run_cases, run_each, salts, same_bits,
                        shapes, values)
from test_backend import ddacomm_world
from test_host_collectives import ordered_reference

REDUCED_IN_FP32 = ("float32", "float16", "bfloat16")
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
ORDERED = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}


def _valid_op(dtype_name, op):
    floating = ALL_DTYPES[dtype_name].is_floating_point
    return not (op == "AVG" and not floating) and not (op.startswith("B") and floating)


def reduction_cases(n):
    return st.fixed_dictionaries({
        "op": st.sampled_from(("all_reduce", "reduce", "reduce_scatter_tensor")),
        "dtype": st.sampled_from(tuple(ALL_DTYPES)), "reduce": st.sampled_from(OPS), "shape": shapes(max_dims=2),
        "in_layout": layouts, "out_layout": layouts, "root": st.integers(0, n - 1), "salt": salts,
    }).filter(lambda c: _valid_op(c["dtype"], c["reduce"]))


def _reference(ctx, inputs, c):
    """The reduction of ``inputs`` (one per rank) that "ddacomm" must give: float32 / float16 / bfloat16
    in the documented order; float64 and integers in their own type (integers wrap, as gloo's do);
    bool on its bytes (sum adds them, max / bor or, product / min / band and, bxor xor)."""
    n, dtype = ctx.world_size, ALL_DTYPES[c["dtype"]]
    if c["dtype"] in REDUCED_IN_FP32:
        return ordered_reference(inputs, ORDERED[c["reduce"]], n)
    if c["reduce"] == "AVG":
        return (sum(x.double() for x in inputs) / n).to(dtype)
    xs = [x.view(torch.uint8) if dtype == torch.bool else x for x in inputs]
    combine = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
               "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[c["reduce"]]
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = combine(acc, x)
    return acc.view(torch.bool) if dtype == torch.bool else acc


def _reduction(ctx, world, gloo, c):
    import torch.distributed as dist
    n, me, dtype = ctx.world_size, ctx.rank, ALL_DTYPES[c["dtype"]]
    op = getattr(dist.ReduceOp, c["reduce"])
    shape = tuple(c["shape"])
    whole = (n,) + shape if c["op"] == "reduce_scatter_tensor" else shape
    count = 1
    for s in whole:
        count *= s
    inputs = [values(r, count, dtype, c["salt"]).reshape(whole) for r in range(n)]
    expected = _reference(ctx, inputs, c)
    x, storage = placed(whole, c["in_layout"], dtype, inputs[me])
    if c["op"] == "all_reduce":
        dist.all_reduce(x, op=op, group=world)
        got = x
    elif c["op"] == "reduce":
        dist.reduce(x, dst=c["root"], op=op, group=world)
        got = x if me == c["root"] else None
    else:
        out, out_storage = placed(shape, c["out_layout"], dtype)
        dist.reduce_scatter_tensor(out, x, op=op, group=world)
        assert same_bits(x, inputs[me]), "input modified"
        assert outside_untouched(out, out_storage), "wrote outside the output view"
        got, expected = out, expected[me]
    assert outside_untouched(x, storage), "wrote outside the input view"
    if got is None:
        return
    if c["dtype"] == "float64":
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    else:
        assert same_bits(got, expected), "differs from the reference"


def movement_cases(n):
    side = st.integers(0, 6)
    p2p = ("send_recv", "batch_isend_irecv")
    return st.fixed_dictionaries({
        "op": st.sampled_from(("all_gather_into_tensor", "broadcast", "all_to_all_single", "gather", "scatter")
                              + p2p),
        "dtype": st.sampled_from(tuple(ALL_DTYPES)), "shape": shapes(max_dims=2),
        "in_layout": layouts, "out_layout": layouts, "root": st.integers(0, n - 1), "shift": st.integers(1, n - 1),
        # all_to_all_single: splits[q][r] rows from rank q to rank r (None: equal splits of rows_each)
        "splits": st.one_of(st.none(), st.lists(st.lists(st.one_of(side, side, side, st.integers(0, 3000)),
                                                         min_size=n, max_size=n), min_size=n, max_size=n)),
        "rows_each": side, "salt": salts})


def _movement(ctx, world, gloo, c):
    import torch.distributed as dist
    n, me, dtype, root = ctx.world_size, ctx.rank, ALL_DTYPES[c["dtype"]], c["root"]
    shape = tuple(c["shape"])
    numel = 1
    for s in shape:
        numel *= s

    def of(r, salt=0):
        return values(r, numel, dtype, c["salt"] + salt).reshape(shape)

    if c["op"] == "all_to_all_single":
        tail = shape[1:] if len(shape) >= 1 else ()
        row = 1
        for s in tail:
            row *= s
        splits = c["splits"] or [[c["rows_each"]] * n for _ in range(n)]
        inputs = [values(q, sum(splits[q]) * row, dtype, c["salt"] + q).reshape((sum(splits[q]),) + tail)
                  for q in range(n)]
        x, x_storage = placed(inputs[me].shape, c["in_layout"], dtype, inputs[me])
        out, out_storage = placed((sum(splits[q][me] for q in range(n)),) + tail, c["out_layout"], dtype)
        if c["splits"] is None:
            dist.all_to_all_single(out, x, group=world)
        else:
            dist.all_to_all_single(out, x, [splits[q][me] for q in range(n)], splits[me], group=world)
        assert same_bits(x, inputs[me]) and outside_untouched(x, x_storage), "input modified"
        assert outside_untouched(out, out_storage), "wrote outside the output view"
        expected = torch.cat([inputs[q][sum(splits[q][:me]):sum(splits[q][:me + 1])] for q in range(n)])
        assert same_bits(out, expected), "differs from the rows the ranks sent"
        return
    x, x_storage = placed(shape, c["in_layout"], dtype, of(me))
    if c["op"] == "all_gather_into_tensor":
        out, out_storage = placed((n,) + shape, c["out_layout"], dtype)
        dist.all_gather_into_tensor(out, x, group=world)
        assert outside_untouched(out, out_storage), "wrote outside the output view"
        assert same_bits(out, torch.stack([of(r) for r in range(n)])), "differs from the ranks' inputs"
    elif c["op"] == "broadcast":
        dist.broadcast(x, src=root, group=world)
        assert same_bits(x, of(root)), "differs from src's tensor"
    elif c["op"] == "gather":
        outs = [placed(shape, c["out_layout"], dtype) for _ in range(n)] if me == root else None
        dist.gather(x, [v for v, _ in outs] if outs else None, dst=root, group=world)
        if outs:
            for r, (v, storage) in enumerate(outs):
                assert same_bits(v, of(r)) and outside_untouched(v, storage), f"block of rank {r} differs"
    elif c["op"] == "scatter":
        ins = [placed(shape, c["out_layout"], dtype, of(r, 1)) for r in range(n)] if me == root else None
        dist.scatter(x, [v for v, _ in ins] if ins else None, src=root, group=world)
        assert same_bits(x, values(me, numel, dtype, c["salt"] + 1).reshape(shape)), "differs from src's block"
    else:
        dst, src = (me + c["shift"]) % n, (me - c["shift"]) % n
        recv, recv_storage = placed(shape, c["out_layout"], dtype)
        if c["op"] == "send_recv":
            dist.send(x, dst, group=world)
            dist.recv(recv, src, group=world)
        else:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, dst, group=world),
                                             dist.P2POp(dist.irecv, recv, src, group=world)]):
                w.wait()
        assert outside_untouched(recv, recv_storage), "wrote outside the receive view"
        assert same_bits(recv, of(src)), "differs from what src sent"
        assert same_bits(x, of(me)), "sent tensor modified"
    assert outside_untouched(x, x_storage), "wrote outside the input view"


def _batch(ctx, cases):
    with ddacomm_world(ctx) as (world, gloo):
        return run_each(cases, lambda c: (_movement if c["op"] in MOVEMENT else _reduction)(ctx, world, gloo, c))


MOVEMENT = ("all_gather_into_tensor", "broadcast", "all_to_all_single", "gather", "scatter", "send_recv",
            "batch_isend_irecv")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fuzz_backend(ranks, world_size):
    count = {2: 30, 3: 15, 4: 8}[world_size]  # 4 ranks on 2 cores take turns: fewer cases
    strategy = st.one_of(reduction_cases(world_size), movement_cases(world_size))
    run_cases(lambda: ranks(world_size), _batch, strategy, count, f"backend-valid-{world_size}")


# Cases the fuzzing found, shrunk, kept as regular ones; beside each, the views of the same op that
# take the same path.
FOUND = [
    # a strided bool sum came back through torch's bool copy, which turns the byte 2 of two trues
    # into 1 (Note [bool bytes] in csrc/torch/torch_common.hpp)
    {"op": "all_reduce", "dtype": "bool", "reduce": "SUM", "shape": (2,), "in_layout": "strided",
     "out_layout": "contiguous", "root": 0, "salt": 0},
    {"op": "all_reduce", "dtype": "bool", "reduce": "SUM", "shape": (5, 7), "in_layout": "transposed",
     "out_layout": "contiguous", "root": 0, "salt": 3},
    {"op": "reduce_scatter_tensor", "dtype": "bool", "reduce": "SUM", "shape": (9,), "in_layout": "strided",
     "out_layout": "padded", "root": 0, "salt": 5},
    {"op": "reduce_scatter_tensor", "dtype": "bool", "reduce": "SUM", "shape": (4, 3), "in_layout": "offset",
     "out_layout": "transposed", "root": 0, "salt": 6},
    {"op": "reduce", "dtype": "bool", "reduce": "SUM", "shape": (11,), "in_layout": "strided",
     "out_layout": "contiguous", "root": 1, "salt": 7},
]


@pytest.mark.parametrize("world_size", [2, 3])
def test_found_cases(ranks, world_size):
    per_rank = ranks(world_size).run(_batch, FOUND)
    assert per_rank == [[]] * world_size, per_rank


# ---- bad arguments ---------------------------------------------------------------------------------
def bad_cases(n):
    return st.one_of(
        st.tuples(st.just("avg_int"), st.sampled_from(("int64", "int32", "int16", "int8", "uint8", "bool"))),
        st.tuples(st.just("bitwise_float"), st.sampled_from(("float32", "float16", "bfloat16", "float64")),
                  st.sampled_from(("BAND", "BOR", "BXOR"))),
        st.tuples(st.just("reduce_scatter_size"), st.integers(1, 9), st.integers(-2, 3).filter(bool)),
        st.tuples(st.just("all_gather_size"), st.integers(1, 9), st.integers(-2, 3).filter(bool)),
        st.tuples(st.just("all_to_all_negative"), st.integers(0, n - 1), st.integers(-5, -1)),
        st.tuples(st.just("all_to_all_sum"), st.integers(0, n - 1), st.integers(-1, 2).filter(bool)),
        st.tuples(st.just("ranks_disagree_dtype"), st.sampled_from(tuple(ALL_DTYPES)),
                  st.sampled_from(tuple(ALL_DTYPES))),
        st.tuples(st.just("ranks_disagree_count"), st.integers(1, 9)),
    )


def _bad_one(ctx, world, case):
    import torch.distributed as dist
    n, me = ctx.world_size, ctx.rank
    kind, *a = case
    D = ALL_DTYPES
    if kind == "avg_int":
        exc, call = RuntimeError, lambda: dist.all_reduce(torch.ones(3, dtype=D[a[0]]), op=dist.ReduceOp.AVG,
                                                          group=world)
    elif kind == "bitwise_float":
        exc, call = RuntimeError, lambda: dist.all_reduce(torch.ones(3, dtype=D[a[0]]),
                                                          op=getattr(dist.ReduceOp, a[1]), group=world)
    elif kind == "reduce_scatter_size":
        exc, call = (ValueError, RuntimeError), lambda: dist.reduce_scatter_tensor(
            torch.empty(a[0]), torch.ones(max(0, n * a[0] + a[1])), group=world)
    elif kind == "all_gather_size":
        exc, call = (ValueError, RuntimeError), lambda: dist.all_gather_into_tensor(
            torch.empty(max(0, n * a[0] + a[1])), torch.ones(a[0]), group=world)
    elif kind == "all_to_all_negative":
        splits = [1] * n
        splits[a[0]] = a[1]
        exc, call = (ValueError, RuntimeError), lambda: dist.all_to_all_single(
            torch.empty(n), torch.ones(n), [1] * n, splits, group=world)
    elif kind == "all_to_all_sum":
        splits = [1] * n
        splits[a[0]] += a[1]
        exc, call = (ValueError, RuntimeError), lambda: dist.all_to_all_single(
            torch.empty(n), torch.ones(n), [1] * n, splits, group=world)
    elif kind == "ranks_disagree_dtype":  # rank 0 passes another dtype than the others
        if a[0] == a[1]:
            return
        t = torch.ones(4, dtype=D[a[0] if me == 0 else a[1]])
        if torch.ones(1, dtype=D[a[0]]).element_size() == torch.ones(1, dtype=D[a[1]]).element_size():
            # A movement compares byte counts, not dtypes (as NCCL does): the bytes arrive.
            dist.broadcast(t, 0, group=world)
            assert torch.equal(t.view(torch.uint8), torch.ones(4, dtype=D[a[0]]).view(torch.uint8))
            exc, call = None, None
        else:
            exc, call = dist.DistBackendError, lambda: dist.broadcast(t, 0, group=world)
    else:  # ranks_disagree_count
        exc, call = dist.DistBackendError, lambda: dist.all_reduce(torch.ones(a[0] + me), group=world)
    if call is not None:
        with pytest.raises(exc) as info:
            call()
        text = str(info.value)
        assert_names_operation(text)
    t = torch.full((5,), float(me + 1))
    dist.all_reduce(t, group=world)
    assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2))), "group unusable after the error"


def assert_names_operation(text):
    assert any(name in text for name in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                                         "allreduce", "reduce", "AVG", "ranks disagree")), \
        f"the error does not name the operation: {text}"


def _bad_batch(ctx, cases):
    with ddacomm_world(ctx) as (world, _):
        return run_each(cases, lambda c: _bad_one(ctx, world, c))


@pytest.mark.parametrize("world_size", [2, 3])
def test_fuzz_backend_bad_arguments(ranks, world_size):
    run_cases(lambda: ranks(world_size), _bad_batch, bad_cases(world_size), 30, f"backend-bad-{world_size}")
