"""The torch.distributed backend "ddacomm" on CPU tensors: every dtype x reduction against gloo, and
calls on which the ranks disagree (split from test_backend.py, whose helpers it uses)."""
from __future__ import annotations

import pytest
import torch

from fuzz_cases import same_bits
from test_backend import (ALL_DTYPES, ALL_OPS, any_values, assert_close, backend_of, ddacomm_world, exact_reference,
                          poison, refused_by_gloo)


def _every_dtype_and_reduction(ctx, counts):
    import torch.distributed as dist
    n = ctx.world_size
    with ddacomm_world(ctx) as (world, gloo):
        backend = backend_of(world)
        fast0, fallback0, num_fast = backend.num_fast_calls, backend.num_fallback_calls, 0
        for dtype in ALL_DTYPES:
            for count in counts:
                xs = [any_values(q, count, dtype) for q in range(n)]
                for name in ALL_OPS:
                    op = getattr(dist.ReduceOp, name)
                    what = f"all_reduce {name} {dtype} count={count}"
                    ours = xs[ctx.rank].clone()
                    if refused_by_gloo(name, dtype):
                        # The same refusal as gloo (RuntimeError, not a communication error), group usable.
                        with pytest.raises(RuntimeError) as info:
                            dist.all_reduce(ours, op=op)
                        assert not isinstance(info.value, dist.DistBackendError), what
                        if dtype != torch.int16:
                            with pytest.raises(RuntimeError):
                                dist.all_reduce(xs[ctx.rank].clone(), op=op, group=gloo)
                        continue
                    dist.all_reduce(ours, op=op)
                    num_fast += 1
                    if dtype == torch.int16:
                        ref = exact_reference(name, xs)  # gloo has no int16
                    else:
                        ref = xs[ctx.rank].clone()
                        dist.all_reduce(ref, op=op, group=gloo)
                        if not dtype.is_floating_point:
                            assert torch.equal(ref.view(torch.uint8), exact_reference(name, xs).view(torch.uint8)), \
                                f"{what}: gloo disagrees"
                    if dtype.is_floating_point and n > 2:  # gloo adds in another order past 2 ranks
                        assert_close(ours, ref, dtype, what)
                    else:  # bitwise, like gloo (bool SUM included: the byte sum, 2 where two ranks hold true)
                        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)), what
            # reduce_scatter_tensor and reduce of each dtype
            count = counts[-1]
            for name in ("SUM", "MAX", "BXOR" if not dtype.is_floating_point else "PRODUCT"):
                op = getattr(dist.ReduceOp, name)
                full = [any_values(q, count * n, dtype, salt=1) for q in range(n)]
                out = poison(torch.empty(count, dtype=dtype))
                dist.reduce_scatter_tensor(out, full[ctx.rank], op=op)
                num_fast += 1
                if dtype.is_floating_point:
                    ref = torch.empty_like(out)
                    dist.reduce_scatter_tensor(ref, full[ctx.rank], op=op, group=gloo)
                    if n > 2:
                        assert_close(out, ref, dtype, f"reduce_scatter {name} {dtype}")
                    else:
                        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), f"reduce_scatter {dtype}"
                else:
                    ref = exact_reference(name, full)[ctx.rank * count:(ctx.rank + 1) * count]
                    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), f"reduce_scatter {name} {dtype}"
        assert backend.num_fast_calls == fast0 + num_fast, "a reduction left commlib's path"
        assert backend.num_fallback_calls == fallback0
        # complex: torch hands the backend the real view, which commlib reduces.
        z = torch.complex(any_values(ctx.rank, 33, torch.float32), any_values(ctx.rank, 33, torch.float32, salt=5))
        ours, ref = z.clone(), z.clone()
        dist.all_reduce(ours)
        dist.all_reduce(ref, group=gloo)
        torch.testing.assert_close(ours, ref, rtol=0 if n == 2 else 1e-6, atol=0 if n == 2 else 1e-6)
        assert backend.num_fast_calls == fast0 + num_fast + 1
        # A dtype commlib has no type for goes to gloo after the ranks agree; gloo refuses uint16.
        with pytest.raises(RuntimeError) as ours_error:
            dist.all_reduce(torch.ones(3, dtype=torch.uint16))
        with pytest.raises(RuntimeError) as gloo_error:
            dist.all_reduce(torch.ones(3, dtype=torch.uint16), group=gloo)
        assert str(ours_error.value).splitlines()[0] == str(gloo_error.value).splitlines()[0]
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_dtype_and_reduction_matches_gloo(ranks, world_size):
    """Every dtype x reduction torch accepts on CPU, against gloo (bitwise at 2 ranks; integers and
    bool bitwise at any size; int16, which gloo lacks, against the exact wrapping reduction); the
    pairs gloo refuses are refused the same way. Sizes: empty, small (one round), and large enough
    for the tree pipeline at 2 ranks."""
    counts = [0, 5, 4099, (1 << 16) + 3] if world_size == 2 else [7, 4099]
    ranks(world_size).run(_every_dtype_and_reduction, counts)


def _mismatches(ctx):
    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    with ddacomm_world(ctx) as (world, gloo):
        cases = {
            "dtype": lambda: dist.all_reduce(torch.ones(10, dtype=torch.float32 if r == 0 else torch.float64)),
            "large dtype": lambda: dist.all_reduce(torch.ones(1 << 18, dtype=torch.float32 if r == 0 else torch.int64)),
            "reduction": lambda: dist.all_reduce(torch.ones(10), op=dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX),
            "size": lambda: dist.all_reduce(torch.ones(10 + r)),
            "op": lambda: dist.all_reduce(torch.ones(8)) if r == 0 else dist.broadcast(torch.ones(8), src=0),
            "gloo dtype": lambda: dist.all_reduce(torch.ones(10, dtype=torch.uint16 if r == 0 else torch.int16)),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(
                torch.empty(4, dtype=torch.int32 if r == 0 else torch.int64),
                torch.ones(4 * n, dtype=torch.int32 if r == 0 else torch.int64)),
        }
        for name, call in cases.items():
            with pytest.raises(dist.DistBackendError, match="ranks disagree") as info:
                call()
            if name in ("dtype", "size", "reduction"):
                assert "rank 0 called all_reduce(float32, 10 elements, sum)" in str(info.value) or r != 0, str(info.value)
            # The group is still usable.
            t = torch.full((5,), float(r + 1))
            dist.all_reduce(t)
            assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2))), f"group unusable after {name}"
    return True


def test_cross_rank_mismatch_raises_on_every_rank(ranks):
    """Rank 0 float32 vs rank 1 float64 (small and tree-sized), different reductions, sizes, operations,
    a dtype bound for gloo vs one for commlib: DistBackendError "ranks disagree" on every rank, group
    usable afterwards."""
    ranks(2).run(_mismatches)


def _bool_bytes(ctx, count):
    import torch.distributed as dist
    n, me = ctx.world_size, ctx.rank

    def of(rank, salt=0):  # bytes 0, 1 and 2 (a bool sum's true + true)
        return torch.tensor([(rank + salt + i) % 3 for i in range(count)], dtype=torch.uint8).view(torch.bool)

    def strided(fill=None):  # a view with gaps, poisoned around
        storage = torch.full((2 * count + 1,), 7, dtype=torch.uint8).view(torch.bool)
        view = storage[1::2]
        if fill is not None:
            view.view(torch.uint8).copy_(fill.view(torch.uint8))
        return view

    def cat(xs):  # torch.cat of bool tensors would turn a 2 into 1
        return torch.cat([x.view(torch.uint8) for x in xs]).view(torch.bool)

    with ddacomm_world(ctx) as (world, _):
        out = torch.empty(n * count, dtype=torch.bool)
        dist.all_gather_into_tensor(out, strided(of(me)))
        assert same_bits(out, cat([of(r) for r in range(n)])), "all_gather_into_tensor"
        outs = [strided() for _ in range(n)]
        dist.all_gather(outs, strided(of(me)))
        assert all(same_bits(outs[r], of(r)) for r in range(n)), "all_gather (list)"
        x = strided(of(me))
        dist.broadcast(x, src=n - 1)
        assert same_bits(x, of(n - 1)), "broadcast"
        x = strided()
        dist.scatter(x, [strided(of(r, 1)) for r in range(n)] if me == 0 else None, src=0)
        assert same_bits(x, of(me, 1)), "scatter"
        outs = [strided() for _ in range(n)] if me == 0 else None
        dist.gather(strided(of(me, 2)), outs, dst=0)
        assert me != 0 or all(same_bits(outs[r], of(r, 2)) for r in range(n)), "gather"
        out = torch.empty(n * count, dtype=torch.bool)
        dist.all_to_all_single(out, cat([of(me, 3 + r) for r in range(n)]))
        assert same_bits(out, cat([of(r, 3 + me) for r in range(n)])), "all_to_all_single"
        x = strided()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, strided(of(me, 4)), (me + 1) % n),
                                        dist.P2POp(dist.irecv, x, (me - 1) % n)])
        for w in works:
            w.wait()
        assert same_bits(x, of((me - 1) % n, 4)), "send / recv"
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_bool_bytes_move_as_bytes(ranks, world_size):
    """A bool tensor holding 2s (what a bool sum gives, as gloo's) keeps its bytes through every
    data movement, from and into strided views (Note [bool bytes]): one round and several."""
    for count in (5, 70001):
        ranks(world_size).run(_bool_bytes, count)
