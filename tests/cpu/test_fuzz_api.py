"""Property-based fuzzing of the direct API on CPU: every ``commlib.Communicator`` collective and
point-to-point verb, the fused all-reduce + residual + RMSNorm, and EPBuffer dispatch / combine.

Cases (tests/fuzz_cases.py): hypothesis draws shapes (0 elements, 0-d, odd and large sizes), views
(storage offsets, gaps, transposed, padded rows), every dtype an op takes, every reduction and
algorithm, at world sizes 2-4; the cases of a world size run on the ranks in one batch.
References: reductions bit for bit against the documented order (Note [reduction order]:
``ordered_reference``) and within rounding of fp64; data movement bit for bit against the inputs
(every rank makes every rank's input from the case's seed); fused against ``all_reduce`` +
``reference_rmsnorm``; EP against tests/ep_reference.py's simulation. Outputs are poisoned first,
and storage outside a view must keep its poison. Bad arguments must raise an error naming the
operation on every rank, and the communicator must work afterwards.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from hypothesis import strategies as st

from ep_reference import run_dispatch_combine
from fuzz_cases import (ALL_DTYPES, FLOATS, layouts, outside_untouched, placed, poison_value, run_cases, run_each,
                        salts, same_bits, shapes, values)
from test_fused_rmsnorm import make_inputs
from test_host_collectives import ordered_reference

REDUCTIONS = ("sum", "avg", "min", "max", "prod")
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _comm(ctx):
    """The fuzz communicator: a short timeout, so ranks out of step fail fast instead of hanging."""
    comm = ctx.scratch.get("fuzz-comm")
    if comm is None or comm.closed:
        comm = ctx.scratch["fuzz-comm"] = ctx.new_comm("fuzz", timeout=timedelta(seconds=30))
    return comm


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _check_fp64(got, inputs, op, n, dtype, where):
    """The reduction within the dtype's rounding of an fp64 one (tolerance relative to the magnitudes
    summed, as the terms may cancel)."""
    if op not in ("sum", "avg") or got.numel() == 0:
        return
    ref = sum(x.double() for x in inputs)
    scale = sum(x.double().abs() for x in inputs)
    if op == "avg":
        ref, scale = ref / n, scale / n
    err = (got.double() - ref).abs()
    assert bool((err <= TOL[dtype] * 4 * (scale + 1)).all()), f"{where}: beyond rounding of fp64 (max {err.max()})"


# ---- valid calls -----------------------------------------------------------------------------------
def all_reduce_cases(n):
    return st.fixed_dictionaries({
        "op": st.just("all_reduce"), "dtype": st.sampled_from(FLOATS), "reduce": st.sampled_from(REDUCTIONS),
        "as_enum": st.booleans(), "algo": st.sampled_from(("flat", "tree", "auto")),
        "form": st.sampled_from(("in_place", "out", "new", "out_is_tensor")), "shape": shapes(),
        "layout": layouts, "out_layout": st.sampled_from(("contiguous", "offset")), "salt": salts})


def _all_reduce(ctx, c):
    import torch.distributed as dist
    comm, n, dtype = _comm(ctx), ctx.world_size, ALL_DTYPES[c["dtype"]]
    inputs = [values(r, _numel(c["shape"]), dtype, c["salt"]).reshape(c["shape"]) for r in range(n)]
    expected = ordered_reference(inputs, c["reduce"], n)
    op = c["reduce"]
    if c["as_enum"]:
        op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "min": dist.ReduceOp.MIN,
              "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}[op]
    x, storage = placed(c["shape"], c["layout"], dtype, inputs[ctx.rank])
    if c["form"] in ("in_place", "out_is_tensor"):
        got = comm.all_reduce_(x, op, c["algo"]) if c["form"] == "in_place" else \
            comm.all_reduce(x, op, c["algo"], out=x)
        assert got is x
        assert outside_untouched(x, storage), "wrote outside the view"
    else:
        out, out_storage = placed(c["shape"], c["out_layout"], dtype)
        got = comm.all_reduce(x, op, c["algo"], out=out if c["form"] == "out" else None)
        assert same_bits(x, inputs[ctx.rank]), "input modified"
        if c["form"] == "out":
            assert got is out and outside_untouched(out, out_storage), "wrote outside out"
    assert same_bits(got, expected), "differs from the ordered fp32 reference"
    _check_fp64(got, inputs, c["reduce"], n, dtype, "all_reduce")


def reduce_scatter_cases(n):
    return st.fixed_dictionaries({
        "op": st.just("reduce_scatter"), "dtype": st.sampled_from(FLOATS), "reduce": st.sampled_from(REDUCTIONS),
        "shape": shapes(max_dims=2, large=30001), "in_layout": layouts, "out_layout": layouts,
        "in_place": st.booleans(), "salt": salts})


def _reduce_scatter(ctx, c):
    comm, n, me, dtype = _comm(ctx), ctx.world_size, ctx.rank, ALL_DTYPES[c["dtype"]]
    shape, count = tuple(c["shape"]), _numel(c["shape"])
    inputs = [values(r, n * count, dtype, c["salt"]).reshape((n,) + shape) for r in range(n)]
    full = ordered_reference(inputs, c["reduce"], n)
    inp, in_storage = placed((n,) + shape, c["in_layout"], dtype, inputs[me])
    if c["in_place"]:  # output is this rank's block of input
        out = inp[me]
        got = comm.reduce_scatter(out, inp, c["reduce"])
        others = [b for b in range(n) if b != me]
        assert same_bits(inp[others], inputs[me][others]), "other blocks of the input modified"
    else:
        out, out_storage = placed(shape, c["out_layout"], dtype)
        got = comm.reduce_scatter(out, inp, c["reduce"])
        assert same_bits(inp, inputs[me]), "input modified"
        assert outside_untouched(out, out_storage), "wrote outside the output view"
    assert got is out
    assert outside_untouched(inp, in_storage), "wrote outside the input view"
    assert same_bits(out, full[me]), "differs from the ordered fp32 reference"
    _check_fp64(out, [x[me] for x in inputs], c["reduce"], n, dtype, "reduce_scatter")


def all_gather_cases(n):
    return st.fixed_dictionaries({
        "op": st.just("all_gather"), "dtype": st.sampled_from(tuple(ALL_DTYPES)), "shape": shapes(max_dims=2),
        "in_layout": layouts, "out_layout": layouts, "in_place": st.booleans(), "salt": salts})


def _all_gather(ctx, c):
    comm, n, me, dtype = _comm(ctx), ctx.world_size, ctx.rank, ALL_DTYPES[c["dtype"]]
    shape = tuple(c["shape"])
    inputs = [values(r, _numel(shape), dtype, c["salt"]).reshape(shape) for r in range(n)]
    out, out_storage = placed((n,) + shape, c["out_layout"], dtype)
    if c["in_place"]:  # input is this rank's block of output
        inp = out[me]
        inp.copy_(inputs[me])
    else:
        inp, in_storage = placed(shape, c["in_layout"], dtype, inputs[me])
    assert comm.all_gather(out, inp) is out
    if not c["in_place"]:
        assert same_bits(inp, inputs[me]) and outside_untouched(inp, in_storage), "input modified"
    assert outside_untouched(out, out_storage), "wrote outside the output view"
    assert same_bits(out, torch.stack(inputs) if n else out), "differs from the ranks' inputs"


def broadcast_cases(n):
    return st.fixed_dictionaries({
        "op": st.just("broadcast"), "dtype": st.sampled_from(tuple(ALL_DTYPES)), "shape": shapes(),
        "layout": layouts, "src": st.integers(0, n - 1), "salt": salts})


def _broadcast(ctx, c):
    comm, dtype = _comm(ctx), ALL_DTYPES[c["dtype"]]
    shape, src = tuple(c["shape"]), c["src"]
    t, storage = placed(shape, c["layout"], dtype, values(ctx.rank, _numel(shape), dtype, c["salt"] + 1))
    if ctx.rank == src:
        t.copy_(values(src, _numel(shape), dtype, c["salt"]).reshape(shape))
    assert comm.broadcast(t, src=src) is t
    assert outside_untouched(t, storage), "wrote outside the view"
    assert same_bits(t, values(src, _numel(shape), dtype, c["salt"]).reshape(shape)), "differs from src's tensor"


def all_to_all_cases(n):
    side = st.integers(0, 9)
    return st.fixed_dictionaries({
        "op": st.just("all_to_all"), "dtype": st.sampled_from(tuple(ALL_DTYPES)),
        # splits[q][r]: rows rank q sends to rank r (None: equal splits of rows_each)
        "splits": st.one_of(st.none(), st.lists(st.lists(st.one_of(side, side, side, st.integers(0, 5000)),
                                                         min_size=n, max_size=n), min_size=n, max_size=n)),
        "rows_each": side, "tail": st.lists(st.integers(0, 5), max_size=2).map(tuple),
        "splits_as": st.sampled_from(("list", "tensor", "tuple")),
        "in_layout": layouts, "out_layout": layouts, "salt": salts})


def _all_to_all(ctx, c):
    comm, n, me, dtype = _comm(ctx), ctx.world_size, ctx.rank, ALL_DTYPES[c["dtype"]]
    tail = tuple(c["tail"])
    splits = c["splits"] or [[c["rows_each"]] * n for _ in range(n)]
    row = _numel(tail)
    inputs = [values(q, sum(splits[q]) * row, dtype, c["salt"] + q).reshape((sum(splits[q]),) + tail)
              for q in range(n)]
    inp, in_storage = placed(inputs[me].shape, c["in_layout"], dtype, inputs[me])
    out_rows = sum(splits[q][me] for q in range(n))
    out, out_storage = placed((out_rows,) + tail, c["out_layout"], dtype)
    if c["splits"] is None:
        got = comm.all_to_all(out, inp)
    else:
        ins, outs = splits[me], [splits[q][me] for q in range(n)]
        if c["splits_as"] == "tensor":
            ins, outs = torch.tensor(ins), torch.tensor(outs)
        elif c["splits_as"] == "tuple":
            ins, outs = tuple(ins), tuple(outs)
        got = comm.all_to_all_v(out, inp, outs, ins)
    assert got is out
    assert same_bits(inp, inputs[me]) and outside_untouched(inp, in_storage), "input modified"
    assert outside_untouched(out, out_storage), "wrote outside the output view"
    expected = torch.cat([inputs[q][sum(splits[q][:me]):sum(splits[q][:me + 1])] for q in range(n)])
    assert same_bits(out, expected), "differs from the rows the ranks sent"


def p2p_cases(n):
    return st.fixed_dictionaries({
        "op": st.just("p2p"), "dtype": st.sampled_from(tuple(ALL_DTYPES)),
        "shape": shapes(max_dims=2, large=600001), "send_layout": layouts, "recv_layout": layouts,
        "shift": st.integers(1, n - 1), "tag": st.integers(0, 7),
        "verb": st.sampled_from(("send_recv", "isend_irecv", "batch", "any_source")), "salt": salts})


def _p2p(ctx, c):
    comm, n, me, dtype = _comm(ctx), ctx.world_size, ctx.rank, ALL_DTYPES[c["dtype"]]
    shape, dst, src, tag = tuple(c["shape"]), (me + c["shift"]) % n, (me - c["shift"]) % n, c["tag"]
    mine = values(me, _numel(shape), dtype, c["salt"]).reshape(shape)
    send, send_storage = placed(shape, c["send_layout"], dtype, mine)
    recv, recv_storage = placed(shape, c["recv_layout"], dtype)
    if c["verb"] == "send_recv":
        comm.send(send, dst, tag)
        assert comm.recv(recv, src, tag) == src
    elif c["verb"] == "any_source":
        comm.send(send, dst, tag)
        got = comm.recv(recv, None, tag)
        # Every rank has received before any sends the next case's message: a rank ahead could
        # otherwise send one with the same tag, which this receive may match (any source).
        comm.barrier()
        assert got == src
    elif c["verb"] == "isend_irecv":
        works = [comm.irecv(recv, src, tag), comm.isend(send, dst, tag)]
        for w in works:
            w.wait()
    else:
        comm.batch_isend_irecv([("send", send, dst, tag), ("recv", recv, src, tag)]).wait()
    assert same_bits(send, mine) and outside_untouched(send, send_storage), "sent tensor modified"
    assert outside_untouched(recv, recv_storage), "wrote outside the receive view"
    assert same_bits(recv, values(src, _numel(shape), dtype, c["salt"]).reshape(shape)), "differs from what src sent"


def fused_cases(n):
    return st.fixed_dictionaries({
        "op": st.just("fused"), "dtype": st.sampled_from(FLOATS), "tokens": st.integers(0, 40),
        "hidden": st.one_of(st.integers(1, 40).map(lambda h: 8 * h), st.sampled_from((1024, 4104, 16384))),
        "mode": st.sampled_from(("replicated", "sharded", "sharded_slice")), "with_out": st.booleans(),
        "eps": st.sampled_from((1e-6, 1e-5, 0.1)), "salt": salts})


def _fused(ctx, c):
    from commlib.fused import reference_rmsnorm, token_slice
    comm, n, me, dtype = _comm(ctx), ctx.world_size, ctx.rank, ALL_DTYPES[c["dtype"]]
    tokens, hidden, eps = c["tokens"], c["hidden"], c["eps"]
    xs, residual0, weight = make_inputs(me, n, tokens, hidden, dtype, salt=c["salt"])
    summed = comm.all_reduce(xs[me])
    ref_out, ref_res = reference_rmsnorm(summed, residual0, weight, eps)
    begin, end = token_slice(tokens, n, me)
    mode = "sharded" if c["mode"] == "sharded_slice" else c["mode"]
    residual = residual0[begin:end].clone() if c["mode"] == "sharded_slice" else residual0.clone()
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype) if c["with_out"] else None
    x = xs[me].clone()
    got, got_res = comm.fused_allreduce_rmsnorm(x, residual, weight, eps, residual_mode=mode, out=out)
    assert got_res is residual and (out is None or got is out)
    assert same_bits(x, xs[me]), "x modified"
    assert same_bits(got, ref_out), "out differs from all_reduce + reference_rmsnorm"
    if c["mode"] == "replicated":
        assert same_bits(residual, ref_res), "residual differs"
    elif c["mode"] == "sharded":
        assert same_bits(residual[begin:end], ref_res[begin:end]), "owned residual rows differ"
        assert same_bits(residual[:begin], residual0[:begin]) and same_bits(residual[end:], residual0[end:]), \
            "rows not owned were written"
    else:
        assert same_bits(residual, ref_res[begin:end]), "residual slice differs"


CHECKS = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "all_gather": _all_gather,
          "broadcast": _broadcast, "all_to_all": _all_to_all, "p2p": _p2p, "fused": _fused}


def valid_cases(n):
    return st.one_of(all_reduce_cases(n), reduce_scatter_cases(n), all_gather_cases(n), broadcast_cases(n),
                     all_to_all_cases(n), p2p_cases(n), fused_cases(n))


def _valid_batch(ctx, cases):
    return run_each(cases, lambda c: CHECKS[c["op"]](ctx, c))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fuzz_collectives(ranks, world_size):
    count = {2: 30, 3: 15, 4: 10}[world_size]  # 4 ranks on 2 cores take turns: fewer cases
    run_cases(lambda: ranks(world_size), _valid_batch, valid_cases(world_size), count, f"api-valid-{world_size}")


# ---- EP dispatch / combine -------------------------------------------------------------------------
def ep_cases(n):
    @st.composite
    def case(draw):
        num_experts = n * draw(st.integers(1, 4))
        kind = draw(st.sampled_from(("random", "masked", "one_expert", "duplicates")))
        topk = draw(st.integers(1, min(num_experts, 16)))
        tokens = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=n)))
        max_tokens = max(tokens) + draw(st.integers(1, 3))
        # EPBuffer takes capacities up to max_tokens_per_rank * world_size * topk
        capacity = draw(st.one_of(st.none(), st.integers(1, min(12, max_tokens * n * topk))))
        return (num_experts, topk, 8 * draw(st.integers(1, 6)) + draw(st.sampled_from((0, 1, 3))),
                draw(st.sampled_from(FLOATS)), kind, max_tokens, tokens, capacity)
    return case()


def _ep_batch(ctx, cases):
    return run_each(cases, lambda c: run_dispatch_combine(ctx, [c], "cpu", comm=_comm(ctx)))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fuzz_ep_dispatch_combine(ranks, world_size):
    count = {2: 6, 3: 4, 4: 3}[world_size]
    run_cases(lambda: ranks(world_size), _ep_batch, ep_cases(world_size), count, f"api-ep-{world_size}")


# ---- bad arguments ---------------------------------------------------------------------------------
INTS = ("float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def bad_cases(n):
    count = st.integers(1, 9)
    return st.one_of(
        st.tuples(st.just("all_reduce_dtype"), st.sampled_from(INTS), count),
        st.tuples(st.just("all_reduce_op"), st.text("abcxyz_", min_size=1, max_size=6), count),
        st.tuples(st.just("all_reduce_algo"), st.sampled_from(("ring", "nvls", "", "FLAT")), count),
        st.tuples(st.just("all_reduce_out_shape"), count, st.integers(1, 3)),
        st.tuples(st.just("all_reduce_out_dtype"), st.sampled_from(FLOATS), st.sampled_from(FLOATS + INTS)),
        st.tuples(st.just("reduce_scatter_size"), count, st.integers(-2, 3).filter(bool)),
        st.tuples(st.just("reduce_scatter_dtype"), st.sampled_from(FLOATS), st.sampled_from(FLOATS + INTS)),
        st.tuples(st.just("reduce_scatter_int"), st.sampled_from(INTS), count),
        st.tuples(st.just("all_gather_size"), count, st.integers(-2, 3).filter(bool)),
        st.tuples(st.just("all_gather_dtype"), st.sampled_from(tuple(ALL_DTYPES)), st.sampled_from(tuple(ALL_DTYPES))),
        st.tuples(st.just("broadcast_src"), st.one_of(st.integers(-50, -1), st.integers(n, n + 50))),
        st.tuples(st.just("all_to_all_negative"), st.integers(0, n - 1), st.integers(-5, -1)),
        # (an empty list means equal splits, as in torch.distributed.all_to_all_single)
        st.tuples(st.just("all_to_all_count"), st.sampled_from([k for k in range(1, n + 3) if k != n])),
        st.tuples(st.just("all_to_all_sum"), st.integers(0, n - 1), st.integers(-1, 2).filter(bool)),
        st.tuples(st.just("all_to_all_rows"), st.integers(1, 4 * n).filter(lambda r: r % n)),
        st.tuples(st.just("all_to_all_row_bytes"), st.integers(1, 4), st.integers(1, 4)),
        st.tuples(st.just("all_to_all_one_split"), st.booleans()),
        # (src -1 is kAnySource on the native layer: the Python API's None)
        st.tuples(st.just("p2p_peer"), st.sampled_from(("send", "recv")),
                  st.one_of(st.integers(-5, -2), st.integers(n, n + 3), st.just("self"))),
        st.tuples(st.just("fused_hidden"), st.integers(1, 40).filter(lambda h: h % 8)),
        st.tuples(st.just("fused_weight"), st.integers(1, 4), st.integers(1, 3)),
        st.tuples(st.just("fused_dtype"), st.sampled_from(FLOATS), st.sampled_from(FLOATS + ("int32",))),
        st.tuples(st.just("fused_residual"), st.integers(1, 9), st.integers(1, 3)),
        st.tuples(st.just("ranks_disagree_count"), count),
        st.tuples(st.just("ranks_disagree_op"), st.sampled_from(("all_reduce", "reduce_scatter", "all_gather",
                                                                 "broadcast"))),
    )


def _bad_call(ctx, case):
    """Returns (exception class, message pattern, call) for a bad case."""
    import commlib
    comm, n, me = _comm(ctx), ctx.world_size, ctx.rank
    kind, *a = case
    D = ALL_DTYPES
    if kind == "all_reduce_dtype":
        return TypeError, f"all_reduce: dtype {a[0]} not supported", lambda: comm.all_reduce_(torch.ones(a[1], dtype=D[a[0]]))
    if kind == "all_reduce_op":
        if a[0].lower() in REDUCTIONS:
            return None
        return ValueError, "all_reduce: op .* not supported", lambda: comm.all_reduce(torch.ones(a[1]), op=a[0])
    if kind == "all_reduce_algo":
        return ValueError, "all_reduce: algo .* not supported", lambda: comm.all_reduce_(torch.ones(a[1]), algo=a[0])
    if kind == "all_reduce_out_shape":
        return ValueError, "all_reduce: out has shape", lambda: comm.all_reduce(torch.ones(a[0]), out=torch.empty(a[0] + a[1]))
    if kind == "all_reduce_out_dtype":
        if a[0] == a[1]:
            return None
        return TypeError, "all_reduce: out has dtype", lambda: comm.all_reduce(
            torch.ones(4, dtype=D[a[0]]), out=torch.empty(4, dtype=D[a[1]]))
    if kind == "reduce_scatter_size":
        return ValueError, "reduce_scatter: input has .* must have world_size", lambda: comm.reduce_scatter(
            torch.empty(a[0]), torch.ones(max(0, n * a[0] + a[1])))
    if kind == "reduce_scatter_dtype":
        if a[0] == a[1]:
            return None
        return TypeError, "reduce_scatter: dtype mismatch", lambda: comm.reduce_scatter(
            torch.empty(2, dtype=D[a[1]]), torch.ones(2 * n, dtype=D[a[0]]))
    if kind == "reduce_scatter_int":
        return TypeError, f"reduce_scatter: dtype {a[0]} not supported", lambda: comm.reduce_scatter(
            torch.empty(a[1], dtype=D[a[0]]), torch.ones(a[1] * n, dtype=D[a[0]]))
    if kind == "all_gather_size":
        return ValueError, "all_gather: output has .* must have world_size", lambda: comm.all_gather(
            torch.empty(max(0, n * a[0] + a[1])), torch.ones(a[0]))
    if kind == "all_gather_dtype":
        if a[0] == a[1]:
            return None
        return TypeError, "all_gather: dtype mismatch", lambda: comm.all_gather(
            torch.empty(2 * n, dtype=D[a[1]]), torch.ones(2, dtype=D[a[0]]))
    if kind == "broadcast_src":
        return ValueError, f"broadcast: src {a[0]} out of range", lambda: comm.broadcast(torch.ones(3), src=a[0])
    if kind == "all_to_all_negative":
        splits = [1] * n
        splits[a[0]] = a[1]
        return ValueError, f"all_to_all: input split size {a[1]} is negative", lambda: comm.all_to_all_v(
            torch.empty(n), torch.ones(n), [1] * n, splits)
    if kind == "all_to_all_count":
        return ValueError, f"all_to_all: input split sizes have {a[0]} entries", lambda: comm.all_to_all_v(
            torch.empty(n), torch.ones(n), [1] * n, [1] * a[0])
    if kind == "all_to_all_sum":
        splits = [1] * n
        splits[a[0]] += a[1]
        return ValueError, "all_to_all: input split sizes sum to", lambda: comm.all_to_all_v(
            torch.empty(n), torch.ones(n), [1] * n, splits)
    if kind == "all_to_all_rows":
        return ValueError, "all_to_all: input has .* not divisible by world_size", lambda: comm.all_to_all(
            torch.empty(n * a[0], 2), torch.ones(a[0], 2))
    if kind == "all_to_all_row_bytes":
        if a[0] == a[1]:
            return None
        return ValueError, "all_to_all: input rows have", lambda: comm.all_to_all(
            torch.empty(n, a[1]), torch.ones(n, a[0]))
    if kind == "all_to_all_one_split":
        s = [1] * n
        return ValueError, "all_to_all: pass both", lambda: comm.all_to_all_v(
            torch.empty(n), torch.ones(n), s if a[0] else None, None if a[0] else s)
    if kind == "p2p_peer":
        peer = me if a[1] == "self" else a[1]
        verb = comm.send if a[0] == "send" else comm.recv
        return ValueError, rf"{a[0]}: (dst|src) {peer} out of range", lambda: verb(torch.ones(2), peer)
    bf = torch.bfloat16
    if kind == "fused_hidden":
        h = a[0]
        return ValueError, f"fused_allreduce_rmsnorm: hidden size {h} not supported", \
            lambda: comm.fused_allreduce_rmsnorm(torch.ones(2, h, dtype=bf), torch.ones(2, h, dtype=bf),
                                                 torch.ones(h, dtype=bf))
    if kind == "fused_weight":
        h = 8 * a[0]
        return ValueError, "fused_allreduce_rmsnorm: weight must have shape", \
            lambda: comm.fused_allreduce_rmsnorm(torch.ones(2, h, dtype=bf), torch.ones(2, h, dtype=bf),
                                                 torch.ones(h + a[1], dtype=bf))
    if kind == "fused_dtype":
        if a[0] == a[1]:
            return None
        return TypeError, "fused_allreduce_rmsnorm: dtype mismatch", \
            lambda: comm.fused_allreduce_rmsnorm(torch.ones(2, 8, dtype=D[a[0]]), torch.ones(2, 8, dtype=D[a[1]]),
                                                 torch.ones(8, dtype=D[a[0]]))
    if kind == "fused_residual":
        t = a[0]
        return ValueError, "fused_allreduce_rmsnorm: residual must have shape", \
            lambda: comm.fused_allreduce_rmsnorm(torch.ones(t, 8, dtype=bf), torch.ones(t + a[1], 8, dtype=bf),
                                                 torch.ones(8, dtype=bf))
    if kind == "ranks_disagree_count":  # valid on each rank, but the ranks' sizes differ
        return commlib.PeerError, "all_reduce: ranks disagree", lambda: comm.all_reduce_(torch.ones(a[0] + me))
    if kind == "ranks_disagree_op":  # rank 0 calls another operation than the others
        calls = {"all_reduce": lambda: comm.all_reduce_(torch.ones(n)),
                 "reduce_scatter": lambda: comm.reduce_scatter(torch.empty(1), torch.ones(n)),
                 "all_gather": lambda: comm.all_gather(torch.empty(n), torch.ones(1)),
                 "broadcast": lambda: comm.broadcast(torch.ones(n), 0)}
        other = "all_gather" if a[0] != "all_gather" else "broadcast"
        return commlib.PeerError, "ranks disagree", calls[a[0] if me == 0 else other]
    raise AssertionError(kind)


def _bad_one(ctx, case):
    made = _bad_call(ctx, case)
    if made is None:  # the draw happened to be valid
        return
    exc, pattern, call = made
    with pytest.raises(exc, match=pattern):
        call()
    # still usable
    n, comm = ctx.world_size, _comm(ctx)
    t = torch.full((5,), float(ctx.rank + 1))
    comm.all_reduce_(t)
    assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2))), "communicator unusable after the error"


def _bad_batch(ctx, cases):
    return run_each(cases, lambda c: _bad_one(ctx, c))


@pytest.mark.parametrize("world_size", [2, 3])
def test_fuzz_bad_arguments(ranks, world_size):
    run_cases(lambda: ranks(world_size), _bad_batch, bad_cases(world_size), 60, f"api-bad-{world_size}")
