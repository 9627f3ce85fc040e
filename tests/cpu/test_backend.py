"""The torch.distributed backend "ddacomm" on CPU tensors.

Reference: gloo on the same ranks and the same inputs (a gloo group built inside each test's
ddacomm world), and fp64 where gloo has no answer (AVG). Every output is poisoned before the call.
Each test function initialises and destroys its own default process group over a fresh
PrefixStore of the pool's store, so tests do not depend on each other.
"""
from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
import torch

FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-12}
COUNTS = [0, 1, 7, 4097, (1 << 18) + 3]  # the largest takes the tree path (>= 256 KiB)


@contextlib.contextmanager
def ddacomm_world(ctx, timeout_s: float = 120.0):
    """A default process group on "ddacomm" (and a gloo group of the same ranks for reference)."""
    import commlib  # noqa: F401  (registers "ddacomm")
    import torch.distributed as dist
    ctx.drop_default_group()
    n = ctx.scratch["worlds"] = ctx.scratch.get("worlds", 0) + 1
    store = dist.PrefixStore(f"ddacomm-test/{n}", ctx.store)
    dist.init_process_group("ddacomm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        gloo = dist.new_group(backend="gloo")
        yield dist.group.WORLD, gloo
    finally:
        dist.destroy_process_group()


def backend_of(group):
    return group._get_backend(torch.device("cpu"))


def rand(rank, count, dtype, salt=0):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + 31 * salt)
    x = torch.rand(count, generator=g, dtype=torch.float64) * 2 + 0.5
    if dtype.is_floating_point:
        return x.to(dtype)
    return (x * 1000).to(dtype)


def poison(like):
    if like.dtype.is_floating_point:
        return torch.full_like(like, float("nan"))
    if like.dtype == torch.bool:
        return torch.zeros_like(like)
    return torch.full_like(like, -7)


def assert_close(ours, ref, dtype, what):
    assert not (ours.dtype.is_floating_point and torch.isnan(ours).any()), f"{what}: output not fully written"
    if dtype.is_floating_point:
        torch.testing.assert_close(ours.double(), ref.double(), rtol=TOL[dtype], atol=TOL[dtype], msg=what)
    else:
        assert torch.equal(ours, ref), what


# ---------------------------------------------------------------------------------------------
def _all_reduce_family(ctx):
    import torch.distributed as dist
    n = ctx.world_size
    with ddacomm_world(ctx) as (world, gloo):
        assert dist.get_backend() == "ddacomm"
        backend = backend_of(world)
        assert type(backend).__name__ == "DdaBackend" and backend.has_fast_path
        fast0 = backend.num_fast_calls
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
               "product": dist.ReduceOp.PRODUCT}
        for dtype in FLOATS.values():
            for count in COUNTS:
                x = rand(ctx.rank, count, dtype)
                for name, op in ops.items():
                    ours, ref = x.clone(), x.clone()
                    dist.all_reduce(ours, op=op)
                    dist.all_reduce(ref, op=op, group=gloo)
                    assert_close(ours, ref, dtype, f"all_reduce {name} {dtype} count={count}")
                # AVG (gloo has none): against the fp64 mean
                ours = x.clone()
                dist.all_reduce(ours, op=dist.ReduceOp.AVG)
                mean = sum(rand(r, count, dtype).double() for r in range(n)) / n
                assert_close(ours, mean, dtype, f"all_reduce avg {dtype} count={count}")
        assert backend.num_fast_calls > fast0, "float all_reduce did not take commlib's path"
        # Integer dtypes and bitwise ops take commlib's path too (test_every_dtype_and_reduction has all).
        fallback0, fast0 = backend.num_fallback_calls, backend.num_fast_calls
        for dtype in (torch.int64, torch.int32):
            x = rand(ctx.rank, 1001, dtype, salt=2)
            ours, ref = x.clone(), x.clone()
            dist.all_reduce(ours)
            dist.all_reduce(ref, group=gloo)
            assert torch.equal(ours, ref)
        ours = torch.tensor([0b1010 | ctx.rank], dtype=torch.int64)
        dist.all_reduce(ours, op=dist.ReduceOp.BOR)
        ref = torch.tensor([0b1010 | ctx.rank], dtype=torch.int64)
        dist.all_reduce(ref, op=dist.ReduceOp.BOR, group=gloo)
        assert torch.equal(ours, ref)
        assert backend.num_fallback_calls == fallback0 and backend.num_fast_calls == fast0 + 3
        # Non-contiguous input on the fast path.
        # (reference: the fp64 sum; gloo rejects or mishandles strided views)
        base = rand(ctx.rank, 64 * 33, torch.float32, salt=3).reshape(64, 33)
        ours, ref = base.clone(), base.clone()
        dist.all_reduce(ours[:, 1::2])
        ref[:, 1::2] = sum(rand(q, 64 * 33, torch.float32, salt=3).reshape(64, 33).double()
                           for q in range(n))[:, 1::2].float()
        assert_close(ours, ref, torch.float32, "all_reduce non-contiguous")
        # async_op returns completed work and a completed future.
        t = rand(ctx.rank, 513, torch.bfloat16, salt=4)
        ref = t.clone()
        work = dist.all_reduce(t, async_op=True)
        assert work.wait()
        assert work.is_completed()
        fut = work.get_future()
        assert fut.done()
        dist.all_reduce(ref, group=gloo)
        assert_close(t, ref, torch.bfloat16, "all_reduce async")
        assert_close(fut.value()[0], ref, torch.bfloat16, "all_reduce future value")
        # coalesced (through the coalescing manager) and the deprecated list API
        xs = [rand(ctx.rank, c, torch.float32, salt=5) for c in (3, 0, 4099)]
        refs = [x.clone() for x in xs]
        with dist._coalescing_manager(group=world):
            for x in xs:
                dist.all_reduce(x)
        for x, ref in zip(xs, refs):
            dist.all_reduce(ref, group=gloo)
            assert_close(x, ref, torch.float32, "all_reduce coalesced")
        # reduce to every root: the root gets the sum, the others keep their input
        for dst in range(n):
            x = rand(ctx.rank, 777, torch.float16, salt=6)
            ours, ref = x.clone(), x.clone()
            dist.reduce(ours, dst=dst)
            dist.all_reduce(ref, group=gloo)
            if ctx.rank == dst:
                assert_close(ours, ref, torch.float16, f"reduce dst={dst}")
            else:
                assert torch.equal(ours, x), "reduce changed a non-root tensor"
            ints = torch.arange(5, dtype=torch.int64) + ctx.rank  # via gloo
            dist.reduce(ints, dst=dst)
            if ctx.rank == dst:
                assert torch.equal(ints, torch.arange(5) * n + n * (n - 1) // 2)
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_and_reduce_match_gloo(ranks, world_size):
    ranks(world_size).run(_all_reduce_family)


# ---------------------------------------------------------------------------------------------
def _gather_scatter_family(ctx):
    import torch.distributed as dist
    n = ctx.world_size
    with ddacomm_world(ctx) as (world, gloo):
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64):
            for count in (0, 1, 7, 70001):
                x = rand(ctx.rank, count, dtype, salt=1)
                if dtype == torch.bool:
                    x = x.to(torch.int64) % 2 == 1
                # broadcast from every root
                for src in range(n):
                    ours = x.clone() if ctx.rank == src else poison(x)
                    ref = x.clone() if ctx.rank == src else poison(x)
                    dist.broadcast(ours, src=src)
                    dist.broadcast(ref, src=src, group=gloo)
                    assert torch.equal(ours, ref), f"broadcast {dtype} count={count} src={src}"
                # all_gather (list), all_gather_into_tensor
                outs = [poison(x) for _ in range(n)]
                refs = [poison(x) for _ in range(n)]
                dist.all_gather(outs, x)
                dist.all_gather(refs, x, group=gloo)
                for o, r in zip(outs, refs):
                    assert torch.equal(o, r), f"all_gather {dtype} count={count}"
                flat = poison(torch.empty(n * count, dtype=dtype))
                dist.all_gather_into_tensor(flat, x)
                assert torch.equal(flat, torch.cat(refs)), f"all_gather_into_tensor {dtype} count={count}"
                # gather / scatter, object of truth: the all_gather above
                for dst in range(n):
                    gl = [poison(x) for _ in range(n)] if ctx.rank == dst else None
                    dist.gather(x, gather_list=gl, dst=dst)
                    if ctx.rank == dst:
                        for o, r in zip(gl, refs):
                            assert torch.equal(o, r), f"gather {dtype}"
                    out = poison(x)
                    chunks = [rand(r, count, dtype, salt=7 + dst) for r in range(n)] if ctx.rank == dst else None
                    if dtype == torch.bool and chunks is not None:
                        chunks = [c.to(torch.int64) % 2 == 1 for c in chunks]
                    dist.scatter(out, scatter_list=chunks, src=dst)
                    expect = rand(ctx.rank, count, dtype, salt=7 + dst)
                    if dtype == torch.bool:
                        expect = expect.to(torch.int64) % 2 == 1
                    assert torch.equal(out, expect), f"scatter {dtype} src={dst}"
        # 2-D all_gather_into_tensor (stacked on dim 0) and coalesced all_gather_into_tensor
        x = rand(ctx.rank, 6 * 5, torch.float32, salt=8).reshape(6, 5)
        out = torch.full((6 * n, 5), float("nan"))
        dist.all_gather_into_tensor(out, x)
        ref = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(ref, x, group=gloo)
        assert torch.equal(out, torch.cat(ref))
        xs = [rand(ctx.rank, c, torch.float16, salt=9) for c in (5, 1, 3001)]
        outs = [torch.full((n * c,), float("nan"), dtype=torch.float16) for c in (5, 1, 3001)]
        with dist._coalescing_manager(group=world):
            for o, x in zip(outs, xs):
                dist.all_gather_into_tensor(o, x)
        for o, c in zip(outs, (5, 1, 3001)):
            assert torch.equal(o, torch.cat([rand(r, c, torch.float16, salt=9) for r in range(n)]))
    return True


def _gather_scatter_coalesced_fast(ctx):
    """gather, scatter and the coalesced collectives on commlib's path (call counters), against gloo."""
    import warnings

    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    warnings.filterwarnings("ignore", category=FutureWarning)
    with ddacomm_world(ctx) as (world, gloo):
        backend = backend_of(world)
        fast0, fallback0, num_fast = backend.num_fast_calls, backend.num_fallback_calls, 0
        for dtype in (torch.float64, torch.bfloat16, torch.int8, torch.bool):
            for count in (0, 13, (1 << 21) // torch.empty(0, dtype=dtype).element_size() + 5):  # > one slot
                x = any_values(r, count, dtype)
                for root in range(n):
                    ours = [poison(x) for _ in range(n)] if r == root else None
                    ref = [poison(x) for _ in range(n)] if r == root else None
                    dist.gather(x, gather_list=ours, dst=root)
                    dist.gather(x, gather_list=ref, dst=root, group=gloo)
                    if r == root:
                        for q in range(n):
                            assert torch.equal(ours[q], ref[q]), f"gather {dtype} count={count} root={root}"
                            assert torch.equal(ours[q], any_values(q, count, dtype)), f"gather {dtype} from {q}"
                    chunks = [any_values(q, count, dtype, salt=root + 1) for q in range(n)] if r == root else None
                    out, out_ref = poison(x), poison(x)
                    dist.scatter(out, scatter_list=chunks, src=root)
                    dist.scatter(out_ref, scatter_list=chunks, src=root, group=gloo)
                    assert torch.equal(out, out_ref), f"scatter {dtype} count={count} root={root}"
                    assert torch.equal(out, any_values(r, count, dtype, salt=root + 1)), f"scatter {dtype}"
                    num_fast += 2
        # all_gather_coalesced (list of lists), all_reduce_coalesced, coalesced reduce_scatter_tensor
        xs = [any_values(r, c, torch.int32) for c in (5, 0, 4099)]
        outs = [[poison(x) for x in xs] for _ in range(n)]  # outs[rank][input]
        refs = [[poison(x) for x in xs] for _ in range(n)]
        dist.all_gather_coalesced(outs, xs)
        dist.all_gather_coalesced(refs, xs, group=gloo)
        num_fast += 1
        for q in range(n):
            for i, (a, b) in enumerate(zip(outs[q], refs[q])):
                assert torch.equal(a, b), "all_gather_coalesced"
                assert torch.equal(a, any_values(q, xs[i].numel(), torch.int32)), "all_gather_coalesced"
        ts = [any_values(r, c, torch.int32, salt=3) for c in (7, 0, 3001)]
        ours, ref = [t.clone() for t in ts], [t.clone() for t in ts]
        dist.all_reduce_coalesced(ours, op=dist.ReduceOp.MAX)
        dist.all_reduce_coalesced(ref, op=dist.ReduceOp.MAX, group=gloo)
        num_fast += 1
        for a, b in zip(ours, ref):
            assert torch.equal(a, b), "all_reduce_coalesced"
        ins = [any_values(r, n * c, torch.float64, salt=4) for c in (3, 1001)]
        outs = [poison(torch.empty(c, dtype=torch.float64)) for c in (3, 1001)]
        with dist._coalescing_manager(group=world):
            for o, i in zip(outs, ins):
                dist.reduce_scatter_tensor(o, i)
        num_fast += 1
        for o, i in zip(outs, ins):
            ref = torch.empty_like(o)
            dist.reduce_scatter_tensor(ref, i, group=gloo)
            if n == 2:
                assert torch.equal(o, ref), "reduce_scatter_tensor coalesced"
            else:
                torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
        assert backend.num_fast_calls == fast0 + num_fast, "a call left commlib's path"
        assert backend.num_fallback_calls == fallback0
        # Roots that disagree, and gather against scatter: "ranks disagree" everywhere, group usable.
        for call in (lambda: dist.gather(torch.ones(4), [torch.empty(4) for _ in range(n)] if r < 2 else None, dst=min(r, 1)),
                     lambda: dist.gather(torch.ones(4), [torch.empty(4) for _ in range(n)], dst=r) if r == 0 else
                     dist.scatter(torch.empty(4), None, src=0)):
            with pytest.raises(dist.DistBackendError, match="ranks disagree"):
                call()
            t = torch.ones(3)
            dist.all_reduce(t)
            assert t.tolist() == [float(n)] * 3
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_scatter_coalesced_take_shared_memory(ranks, world_size):
    ranks(world_size).run(_gather_scatter_coalesced_fast)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_broadcast_gather_scatter_match_gloo(ranks, world_size):
    ranks(world_size).run(_gather_scatter_family)


# ---------------------------------------------------------------------------------------------
def _reduce_scatter_family(ctx):
    import torch.distributed as dist
    n = ctx.world_size
    with ddacomm_world(ctx) as (world, gloo):
        for dtype in FLOATS.values():
            for count in (0, 1, 7, 4097, 300001):
                full = rand(ctx.rank, n * count, dtype, salt=11)
                ref = full.clone()
                dist.all_reduce(ref, group=gloo)
                mine = ref[ctx.rank * count:(ctx.rank + 1) * count]
                out = poison(torch.empty(count, dtype=dtype))
                dist.reduce_scatter_tensor(out, full)
                assert_close(out, mine, dtype, f"reduce_scatter_tensor {dtype} count={count}")
                out = poison(torch.empty(count, dtype=dtype))
                dist.reduce_scatter(out, list(full.chunk(n)) if count else [full[:0]] * n)
                assert_close(out, mine, dtype, f"reduce_scatter (list) {dtype} count={count}")
                for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
                    out = poison(torch.empty(count, dtype=dtype))
                    dist.reduce_scatter_tensor(out, full, op=op)
                    r = full.clone()
                    dist.all_reduce(r, op=op, group=gloo)
                    assert torch.equal(out, r[ctx.rank * count:(ctx.rank + 1) * count])
        # 2-D input, coalesced
        counts = (4, 1, 1025)
        fulls = [rand(ctx.rank, n * c, torch.float32, salt=12) for c in counts]
        outs = [torch.full((c,), float("nan")) for c in counts]
        with dist._coalescing_manager(group=world):
            for o, f in zip(outs, fulls):
                dist.reduce_scatter_tensor(o, f)
        for o, f, c in zip(outs, fulls, counts):
            r = f.clone()
            dist.all_reduce(r, group=gloo)
            assert_close(o, r[ctx.rank * c:(ctx.rank + 1) * c], torch.float32, "reduce_scatter coalesced")
        # int64 reduce_scatter goes to gloo
        full = torch.arange(n * 3, dtype=torch.int64) * (ctx.rank + 1)
        out = torch.full((3,), -7, dtype=torch.int64)
        dist.reduce_scatter_tensor(out, full)
        assert torch.equal(out, torch.arange(ctx.rank * 3, ctx.rank * 3 + 3) * (n * (n + 1) // 2))
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_matches_gloo(ranks, world_size):
    ranks(world_size).run(_reduce_scatter_family)


# ---------------------------------------------------------------------------------------------
def _all_to_all_family(ctx):
    import torch.distributed as dist
    n = ctx.world_size
    with ddacomm_world(ctx) as (world, gloo):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            # even splits, 2-D rows
            for rows in (1, 5, 4001):
                x = rand(ctx.rank, n * rows * 3, dtype, salt=13).reshape(n * rows, 3)
                out, ref = poison(x), poison(x)
                dist.all_to_all_single(out, x)
                dist.all_to_all_single(ref, x, group=gloo)
                assert torch.equal(out, ref), f"all_to_all_single even {dtype} rows={rows}"
            # uneven, zero-sized blocks included: rank q sends ((q + r) % 3) * 1001 rows to rank r
            def rows_from(q, r):
                return ((q + r) % 3) * 1001
            in_splits = [rows_from(ctx.rank, r) for r in range(n)]
            out_splits = [rows_from(q, ctx.rank) for q in range(n)]
            x = rand(ctx.rank, sum(in_splits) * 2, dtype, salt=14).reshape(-1, 2)
            out = poison(torch.empty(sum(out_splits), 2, dtype=dtype))
            ref = poison(out)
            dist.all_to_all_single(out, x, out_splits, in_splits)
            dist.all_to_all_single(ref, x, out_splits, in_splits, group=gloo)
            assert torch.equal(out, ref), f"all_to_all_single uneven {dtype}"
            # list form, equal shapes (against gloo)
            ins = [rand(ctx.rank, 6, dtype, salt=15 + r).reshape(2, 3) for r in range(n)]
            outs = [poison(x) for x in ins]
            refs = [poison(x) for x in ins]
            dist.all_to_all(outs, ins)
            dist.all_to_all(refs, ins, group=gloo)
            for o, r in zip(outs, refs):
                assert torch.equal(o, r), f"all_to_all (list) {dtype}"
            # list form with per-peer shapes (gloo refuses these; reference: what each peer sent)
            ins = [rand(ctx.rank, (ctx.rank + r) % 4 + 1, dtype, salt=15 + r) for r in range(n)]
            outs = [poison(torch.empty((q + ctx.rank) % 4 + 1, dtype=dtype)) for q in range(n)]
            dist.all_to_all(outs, ins)
            for q, o in enumerate(outs):
                assert torch.equal(o, rand(q, (q + ctx.rank) % 4 + 1, dtype, salt=15 + ctx.rank)), \
                    f"all_to_all (list, uneven) {dtype} from {q}"
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_matches_gloo(ranks, world_size):
    ranks(world_size).run(_all_to_all_family)


# ---------------------------------------------------------------------------------------------
ALL_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool]
ALL_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def any_values(rank, count, dtype, salt=0):
    """Fresh values over the dtype's whole range for integers (so sums and products wrap)."""
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + 31 * salt + 17)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if dtype.is_floating_point:
        return (torch.rand(count, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (count,), generator=g, dtype=torch.int64).to(dtype)


def exact_reference(op, xs):
    """The reduction of integer / bool tensors in rank order, wrapping like gloo (no gloo for int16)."""
    dtype = xs[0].dtype
    acc = xs[0].clone()
    for x in xs[1:]:
        if dtype == torch.bool and op == "SUM":  # gloo adds the bytes (wrapping): counts the trues
            acc = (acc.view(torch.uint8) + x.view(torch.uint8)).view(torch.bool)
        elif dtype == torch.bool:
            acc = {"MAX": acc | x, "BOR": acc | x, "PRODUCT": acc & x, "MIN": acc & x,
                   "BAND": acc & x, "BXOR": acc ^ x}[op]
        else:
            a, b = acc.long(), x.long()
            acc = {"SUM": a + b, "PRODUCT": a * b, "MIN": torch.minimum(a, b), "MAX": torch.maximum(a, b),
                   "BAND": a & b, "BOR": a | b, "BXOR": a ^ b}[op].to(dtype)
    return acc


def refused_by_gloo(op, dtype):
    floating = dtype.is_floating_point
    return (op == "AVG" and not floating) or (op in ("BAND", "BOR", "BXOR") and floating)


# ---------------------------------------------------------------------------------------------
def _p2p_objects_groups(ctx):
    import torch.distributed as dist
    n = ctx.world_size
    r = ctx.rank
    with ddacomm_world(ctx) as (world, gloo):
        dist.barrier()
        # send / recv in a ring (even ranks send first)
        nxt, prv = (r + 1) % n, (r - 1) % n
        x = rand(r, 1003, torch.float32, salt=20)
        got = torch.full_like(x, float("nan"))
        if r % 2 == 0:
            dist.send(x, dst=nxt)
            dist.recv(got, src=prv)
        else:
            dist.recv(got, src=prv)
            dist.send(x, dst=nxt)
        assert torch.equal(got, rand(prv, 1003, torch.float32, salt=20))
        # isend / irecv and batch_isend_irecv
        got = torch.full_like(x, float("nan"))
        ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, got, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert torch.equal(got, rand(prv, 1003, torch.float32, salt=20))
        # object collectives
        objs = [None] * n
        dist.all_gather_object(objs, {"rank": r, "payload": "x" * (r * 1000 + 1)})
        assert objs == [{"rank": q, "payload": "x" * (q * 1000 + 1)} for q in range(n)]
        lst = [("from", 0), list(range(5000))] if r == 0 else [None, None]
        dist.broadcast_object_list(lst, src=0)
        assert lst == [("from", 0), list(range(5000))]
        gathered = [None] * n if r == n - 1 else None
        dist.gather_object(("g", r), gathered, dst=n - 1)
        if r == n - 1:
            assert gathered == [("g", q) for q in range(n)]
        out = [None]
        dist.scatter_object_list(out, [("s", q) for q in range(n)] if r == 0 else None, src=0)
        assert out == [("s", r)]
        # subgroups: evens and odds (every rank creates both), ops inside against gloo
        evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
        g_even = dist.new_group(evens, backend="ddacomm")
        g_odd = dist.new_group(odds, backend="ddacomm")
        ref_even = dist.new_group(evens, backend="gloo")
        ref_odd = dist.new_group(odds, backend="gloo")
        mine, ref_group, members = (g_even, ref_even, evens) if r % 2 == 0 else (g_odd, ref_odd, odds)
        assert dist.get_backend(mine) == "ddacomm"
        assert dist.get_world_size(mine) == len(members)
        assert dist.get_rank(mine) == members.index(r)
        x = rand(r, 4099, torch.bfloat16, salt=21)
        ours, ref = x.clone(), x.clone()
        dist.all_reduce(ours, group=mine)
        dist.all_reduce(ref, group=ref_group)
        assert_close(ours, ref, torch.bfloat16, "subgroup all_reduce")
        objs = [None] * len(members)
        dist.all_gather_object(objs, r, group=mine)
        assert objs == members
        out = torch.full((len(members),), -1, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.tensor([r * 10]), group=mine)
        assert out.tolist() == [m * 10 for m in members]
        dist.barrier(group=mine)
        dist.destroy_process_group(g_even)
        dist.destroy_process_group(g_odd)
        # the world still works after subgroups are gone
        t = torch.ones(3)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((3,), float(n)))
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_p2p_objects_and_subgroups(ranks, world_size):
    ranks(world_size).run(_p2p_objects_groups)


# ---------------------------------------------------------------------------------------------
def _functional_collectives(ctx):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    n = ctx.world_size
    with ddacomm_world(ctx) as (world, gloo):
        x = rand(ctx.rank, 1000, torch.float32, salt=30)
        y = funcol.all_reduce(x, "sum", world)
        y = funcol.wait_tensor(y) if hasattr(funcol, "wait_tensor") else y
        ref = x.clone()
        dist.all_reduce(ref, group=gloo)
        assert_close(y, ref, torch.float32, "functional all_reduce")
        g = funcol.all_gather_tensor(x, 0, world)
        assert torch.equal(g, torch.cat([rand(q, 1000, torch.float32, salt=30) for q in range(n)]))
        rs = funcol.reduce_scatter_tensor(torch.cat([x] * n), "sum", 0, world)
        assert_close(rs, ref, torch.float32, "functional reduce_scatter")
    return True


def test_functional_collectives(ranks):
    ranks(2).run(_functional_collectives)


# ---------------------------------------------------------------------------------------------
def _bad_inputs(ctx):
    import torch.distributed as dist
    n = ctx.world_size
    with ddacomm_world(ctx) as (world, gloo):
        cases = [
            (ValueError, "must have world_size",
             lambda: dist.all_gather_into_tensor(torch.empty(n * 4 + 1), torch.ones(4))),
            (ValueError, "must have world_size",
             lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * n + 2))),
            (TypeError, "dtype mismatch",
             lambda: dist.all_gather_into_tensor(torch.empty(n * 4, dtype=torch.float16), torch.ones(4))),
            (ValueError, "split sizes sum to",
             lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n), [1] * n, [2] * n)),
            (ValueError, "has 5 elements but input has 4",
             lambda: dist.all_gather([torch.empty(4)] * (n - 1) + [torch.empty(5)], torch.ones(4))),
            (ValueError, "got 1 input tensors; expected world_size",
             lambda: dist.reduce_scatter(torch.empty(2), [torch.ones(2)])),
        ]
        for exc, text, call in cases:
            with pytest.raises(exc, match=text):
                call()
            t = torch.full((5,), float(ctx.rank + 1))
            dist.all_reduce(t)
            assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2))), "group unusable after an error"
    return True


def test_bad_inputs_raise_and_group_stays_usable(ranks):
    ranks(2).run(_bad_inputs)


# ---------------------------------------------------------------------------------------------
def _multi_host(ctx):
    """Ranks that look like different hosts (one each): no commlib communicator; all_reduce,
    all_gather and barrier run two-level (trivial intra-host legs, gloo between the hosts) and are
    still right (tests/cpu/test_hierarchy.py has the two-level paths in full)."""
    import torch.distributed as dist

    from commlib import backend_registration as reg
    real = reg._host_id
    reg._host_id = lambda: f"fake-host-{ctx.rank}"
    try:
        with ddacomm_world(ctx) as (world, gloo):
            backend = backend_of(world)
            assert not backend.has_fast_path
            x = rand(ctx.rank, 1001, torch.float32, salt=40)
            ours, ref = x.clone(), x.clone()
            dist.all_reduce(ours)
            dist.all_reduce(ref, group=gloo)
            assert_close(ours, ref, torch.float32, "multi-host all_reduce")
            outs = [torch.full_like(x, float("nan")) for _ in range(ctx.world_size)]
            dist.all_gather(outs, x)
            assert torch.equal(torch.cat(outs), torch.cat([rand(q, 1001, torch.float32, salt=40)
                                                           for q in range(ctx.world_size)]))
            dist.barrier()
            assert (backend.num_fast_calls, backend.num_hierarchical_calls) == (0, 3)
    finally:
        reg._host_id = real
    return True


def test_multi_host_group_runs_two_level(ranks):
    ranks(2).run(_multi_host)


# ---------------------------------------------------------------------------------------------
def _reinit_same_store(ctx):
    """destroy_process_group, then "ddacomm" again on the same store, three times: torch names the
    groups as before, so their store keys come back; a late rank (rank 0 in round 1, rank 1 in
    round 2) must not pair with what the last creation left there."""
    import time

    import torch.distributed as dist
    ctx.drop_default_group()
    n = ctx.scratch["reinit"] = ctx.scratch.get("reinit", 0) + 1
    store = dist.PrefixStore(f"ddacomm-reinit/{n}", ctx.store)
    timeout = timedelta(seconds=20)  # a regression fails here instead of waiting for torch's 30 min
    sums = []
    for round_ in range(3):
        if round_ > 0 and ctx.rank == round_ - 1:
            time.sleep(1.5)
        dist.init_process_group("ddacomm", store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
        try:
            sub = dist.new_group(list(range(ctx.world_size)), timeout=timeout)
            x = rand(ctx.rank, 1001, torch.float32, salt=50 + round_)
            dist.all_reduce(x)
            y = rand(ctx.rank, 7, torch.float32, salt=60 + round_)
            dist.all_reduce(y, group=sub)
            assert backend_of(dist.group.WORLD).num_fast_calls >= 1
            sums.append((x.double(), y.double()))
        finally:
            dist.destroy_process_group()
    for round_, (x, y) in enumerate(sums):
        expect_x = sum(rand(r, 1001, torch.float32, salt=50 + round_).double() for r in range(ctx.world_size))
        expect_y = sum(rand(r, 7, torch.float32, salt=60 + round_).double() for r in range(ctx.world_size))
        torch.testing.assert_close(x, expect_x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, expect_y, rtol=1e-5, atol=1e-5)
    return True


def test_reinit_on_the_same_store(ranks):
    ranks(2).run(_reinit_same_store)


# ---------------------------------------------------------------------------------------------
def _expect_group_timeout(ctx, call, what, phase, key):
    """Rank 0 runs `call` alone and must get the group's timeout; rank 1 waits for it to finish."""
    import re

    import torch.distributed as dist
    if ctx.rank != 0:
        ctx.store.wait([key])
        return None
    try:
        with pytest.raises(dist.DistBackendError, match="Timed out") as info:
            call()
    finally:
        ctx.store.set(key, b"1")
    text = str(info.value)
    for part in (what, "rank 0", "rank 1", f"phase '{phase}"):
        assert part in text, f"timeout message lacks {part!r}: {text}"
    # "Timed out after N ms" (host waits) or "... rank 0 waited N ms" (a GPU wait, reported at the next call)
    waited = int(re.search(r"(?:Timed out after|waited) (\d+) ms", text).group(1))
    # The group's 1 s bounded the wait, not the store's default (what it waited is in the message).
    assert waited < 10_000, text
    return text


def _timeouts(ctx, device):
    import torch.distributed as dist
    n = ctx.scratch["timeouts"] = ctx.scratch.get("timeouts", 0) + 1
    with ddacomm_world(ctx) as (world, gloo):
        opts = {} if device == "cpu" else {"device_ids": [ctx.device]}
        t = torch.ones(10, device=device)
        # The first call of a group: the lazy transport set-up waits for rank 1, which never calls.
        dist.barrier()  # the 1 s group's creation needs the ranks within 1 s of each other
        first = dist.new_group(backend="ddacomm", timeout=timedelta(seconds=1))
        phase = "shm/created" if device == "cpu" else "busid"
        _expect_group_timeout(ctx, lambda: dist.all_reduce(t, group=first), "allreduce", phase,
                              f"timeouts/{device}/{n}/first")
        # A later call: the transport is up; rank 1 skips the second all_reduce.
        dist.barrier()  # the 1 s group's creation needs the ranks within 1 s of each other
        later = dist.new_group(backend="ddacomm", timeout=timedelta(seconds=1))
        dist.all_reduce(t, group=later)
        if device == "cuda":
            torch.cuda.synchronize()
        assert t[0].item() == ctx.world_size
        def later_call():
            dist.all_reduce(t, group=later)
            if device == "cuda":  # the GPU wait times out in the kernel; the next call reports it
                torch.cuda.synchronize()
                dist.all_reduce(t, group=later)
        _expect_group_timeout(ctx, later_call, "all_reduce", "", f"timeouts/{device}/{n}/later")
        # A barrier whose peer never arrives, on a fresh 1 s group (its first call).
        dist.barrier()  # the 1 s group's creation needs the ranks within 1 s of each other
        third = dist.new_group(backend="ddacomm", timeout=timedelta(seconds=1))
        _expect_group_timeout(ctx, lambda: dist.barrier(group=third, **opts), "barrier", "",
                              f"timeouts/{device}/{n}/barrier")
        # Other groups are untouched.
        x = torch.full((4,), float(ctx.rank + 1), device=device)
        dist.all_reduce(x)
        assert x.cpu().tolist() == [ctx.world_size * (ctx.world_size + 1) / 2] * 4
    return True


# COMMLIB_TIMEOUT_MS, when set, overrides every group's timeout: these tests need the group's own.
GROUP_TIMEOUT_ONLY = {"COMMLIB_TIMEOUT_MS": "0"}


def test_group_timeout_bounds_every_wait(ranks):
    """A 1 s group whose rank 1 never calls: the first call (transport set-up), a later call and a
    barrier raise DistBackendError "Timed out" naming operation, ranks and phase, on rank 0."""
    ranks(2, env=GROUP_TIMEOUT_ONLY).run(_timeouts, "cpu")


@pytest.mark.gpu
def test_group_timeout_bounds_every_wait_cuda(ranks):
    """The same on CUDA tensors: set-up of the GPU transport, a GPU wait, a barrier."""
    ranks(2, env=GROUP_TIMEOUT_ONLY).run(_timeouts, "cuda")


def test_register_backend_is_idempotent():
    import torch.distributed as dist

    import commlib
    assert commlib.register_backend() and commlib.register_backend()
    assert dist.Backend.backend_list.count("ddacomm") == 1
    assert dist.Backend.backend_capability["ddacomm"] == ["cpu", "cuda"]
