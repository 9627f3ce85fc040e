"""Two-level collectives of a "ddacomm" group spanning several hosts (Note [hierarchical collectives]).

COMMLIB_TEST_HOST_ID makes the ranks of this machine act as several hosts. Reference: gloo over the
same ranks and inputs (a gloo group built inside each test's ddacomm world), the exact integer
reduction, and for the fused all-reduce + RMSNorm ``commlib.fused.reference_rmsnorm`` of the
exact sum (integer-valued x, so every reduction order gives the same sum). Every output is
poisoned first; every result is also checked to be the same bits on every rank, and the backend's
counters prove which path ran.
"""
from __future__ import annotations

import os

import pytest
import torch

from ddacomm_worlds import as_host
from test_backend import ALL_DTYPES, any_values, backend_of, ddacomm_world, exact_reference, poison

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def same_on_every_rank(t, gloo, what):
    """Asserts every rank holds the same bytes as rank 0."""
    import torch.distributed as dist
    mine = t.contiguous().view(torch.uint8).reshape(-1).clone() if t.numel() else torch.empty(0, dtype=torch.uint8)
    first = mine.clone()
    dist.broadcast(first, src=0, group=gloo)
    assert torch.equal(mine, first), f"{what}: rank {dist.get_rank()} differs from rank 0"


def check(ours, ref, dtype, what):
    if dtype.is_floating_point:
        assert not torch.isnan(ours).any(), f"{what}: output not fully written"
        torch.testing.assert_close(ours.double(), ref.double(), rtol=TOL[dtype], atol=TOL[dtype], msg=what)
    elif dtype == torch.bool:  # gloo adds bool bytes; commlib's legs keep 0 / 1: equal as truth values
        assert torch.equal(ours.view(torch.uint8).ne(0), ref.view(torch.uint8).ne(0)), what
    else:
        assert torch.equal(ours, ref), what


def refused_by_gloo(op, dtype):
    floating = dtype.is_floating_point
    return (op == "AVG" and not floating) or (op in ("BAND", "BOR", "BXOR") and floating)


# ---------------------------------------------------------------------------------------------
def _collectives(ctx, hosts):
    """``hosts[r]``: the host of rank r. Every op, against gloo, through init_process_group."""
    import torch.distributed as dist
    n, me = ctx.world_size, ctx.rank
    with as_host(hosts[me]), ddacomm_world(ctx) as (world, gloo):
        backend = backend_of(world)
        sizes = [hosts.count(h) for h in sorted(set(hosts))]
        assert not backend.has_fast_path and backend.hierarchical
        num_hosts, local_size, host_index, local_rank = backend.host_layout
        assert (num_hosts, local_size) == (len(sizes), sizes[0])
        calls0, fallback0 = backend.num_hierarchical_calls, backend.num_fallback_calls
        import commlib
        planned0 = commlib.plan_counters()
        assert backend.num_fast_calls == 0
        calls = 0
        dtypes = [d for d in ALL_DTYPES if d != torch.int16]  # gloo has no int16
        for dtype in dtypes:
            for count in (0, 5, 1001):
                xs = [any_values(q, count, dtype) for q in range(n)]
                for name in OPS:
                    if refused_by_gloo(name, dtype):
                        continue
                    what = f"all_reduce {name} {dtype} count={count} hosts={hosts}"
                    op = getattr(dist.ReduceOp, name)
                    ours = xs[me].clone()
                    dist.all_reduce(ours, op=op)
                    calls += 1
                    if name == "AVG":  # gloo has no AVG: its SUM over n
                        ref = xs[me].clone()
                        dist.all_reduce(ref, group=gloo)
                        ref = ref.double() / n
                    else:
                        ref = xs[me].clone()
                        dist.all_reduce(ref, op=op, group=gloo)
                    if not dtype.is_floating_point and name != "AVG":
                        ref = exact_reference(name, xs)
                    check(ours, ref, dtype, what)
                    same_on_every_rank(ours, gloo, what)
            # reduce_scatter (tensor and list forms)
            count = 37
            for name in ("SUM", "MAX", "PRODUCT" if dtype.is_floating_point else "BXOR"):
                op = getattr(dist.ReduceOp, name)
                full = [any_values(q, count * n, dtype, salt=1) for q in range(n)]
                out = poison(torch.empty(count, dtype=dtype))
                dist.reduce_scatter_tensor(out, full[me], op=op)
                out_list = poison(torch.empty(count, dtype=dtype))
                dist.reduce_scatter(out_list, list(full[me].chunk(n)), op=op)
                calls += 2
                if dtype.is_floating_point:
                    ref = torch.empty_like(out)
                    dist.reduce_scatter_tensor(ref, full[me], op=op, group=gloo)
                else:
                    ref = exact_reference(name, full)[me * count:(me + 1) * count]
                check(out, ref, dtype, f"reduce_scatter_tensor {name} {dtype} hosts={hosts}")
                assert torch.equal(out.view(torch.uint8), out_list.view(torch.uint8)), f"reduce_scatter list {dtype}"
            # all_gather (tensor and list forms), broadcast from every root
            for count in (0, 3, 4099):
                x = any_values(me, count, dtype, salt=2)
                flat = poison(torch.empty(n * count, dtype=dtype))
                dist.all_gather_into_tensor(flat, x)
                outs = [poison(x) for _ in range(n)]
                dist.all_gather(outs, x)
                calls += 2
                expect = torch.cat([any_values(q, count, dtype, salt=2) for q in range(n)])
                assert torch.equal(flat.view(torch.uint8), expect.view(torch.uint8)), f"all_gather {dtype} {count}"
                assert torch.equal(torch.cat(outs).view(torch.uint8), expect.view(torch.uint8)), "all_gather list"
                for src in range(n):
                    t = x.clone() if me == src else poison(x)
                    dist.broadcast(t, src=src)
                    calls += 1
                    expect = any_values(src, count, dtype, salt=2)
                    assert torch.equal(t.view(torch.uint8), expect.view(torch.uint8)), f"broadcast {dtype} src={src}"
        # AVG of reduce_scatter, a strided all_reduce, async works
        full = any_values(me, 64 * n, torch.float32, salt=3)
        out = poison(torch.empty(64))
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.AVG)
        mean = sum(any_values(q, 64 * n, torch.float32, salt=3).double() for q in range(n)) / n
        check(out, mean[me * 64:(me + 1) * 64], torch.float32, "reduce_scatter avg")
        base = any_values(me, 40 * 9, torch.float32, salt=4).reshape(40, 9)
        ours = base.clone()
        dist.all_reduce(ours[:, 1::2])
        ref = sum(any_values(q, 40 * 9, torch.float32, salt=4).reshape(40, 9).double() for q in range(n))
        check(ours[:, 1::2], ref[:, 1::2], torch.float32, "all_reduce strided")
        assert torch.equal(ours[:, 0::2], base[:, 0::2]), "all_reduce strided wrote outside the view"
        t = any_values(me, 513, torch.bfloat16, salt=5)
        work = dist.all_reduce(t, async_op=True)
        assert work.wait() and work.is_completed()
        calls += 3
        for _ in range(3):
            dist.barrier()
            calls += 1
        assert backend.num_hierarchical_calls == calls0 + calls, "a call left the two-level path"
        assert backend.num_fallback_calls == fallback0 and backend.num_fast_calls == 0
        planned = commlib.plan_counters()  # every two-level call ran its plan (Note [plan])
        assert planned["two_level"] - planned0["two_level"] == calls and planned["inner"] == planned0["inner"]
        # Left to the group's gloo: PREMUL-free ops without a two-level shape.
        x = any_values(me, 10, torch.float32, salt=6)
        outs = [poison(x) for _ in range(n)]
        dist.all_to_all(outs, [x.clone() for _ in range(n)])
        assert backend.num_fallback_calls == fallback0 + 1
        assert torch.equal(outs[0], any_values(0, 10, torch.float32, salt=6))
        # Bad input: a clear error on the calling rank, group still usable.
        with pytest.raises(ValueError, match="world_size"):
            dist.all_gather_into_tensor(torch.empty(3 * n + 1), torch.ones(3))
        t = torch.full((5,), float(me + 1))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2)))
    return True


@pytest.mark.parametrize("hosts", [
    (0, 0, 1, 1),          # world 4: 2 hosts x 2
    (0, 0, 1, 1, 2, 2),    # world 6: 3 hosts x 2
    (0, 0, 0, 1, 1, 1),    # world 6: 2 hosts x 3
    (0, 1, 0, 1),          # world 4: hosts interleaved with the ranks
], ids=["4=2x2", "6=3x2", "6=2x3", "4=2x2-interleaved"])
def test_collectives_match_gloo(ranks, hosts):
    """all_reduce (every dtype x reduction gloo has, sizes 0 / 5 / 1001), reduce_scatter (tensor, list,
    AVG), all_gather (tensor, list), broadcast from every root, barrier, strided and async calls: all
    two-level (counted), against gloo / the exact reduction, same bits on every rank."""
    ranks(len(hosts)).run(_collectives, list(hosts))


# ---------------------------------------------------------------------------------------------
def _uneven(ctx, hosts):
    import torch.distributed as dist
    n, me = ctx.world_size, ctx.rank
    with as_host(hosts[me]), ddacomm_world(ctx) as (world, gloo):
        backend = backend_of(world)
        assert not backend.hierarchical and backend.host_layout is None
        x = any_values(me, 1001, torch.float32)
        ours, ref = x.clone(), x.clone()
        dist.all_reduce(ours)
        dist.all_reduce(ref, group=gloo)
        assert torch.equal(ours, ref)
        flat = poison(torch.empty(n * 7))
        dist.all_gather_into_tensor(flat, any_values(me, 7, torch.float32))
        assert torch.equal(flat, torch.cat([any_values(q, 7, torch.float32) for q in range(n)]))
        dist.barrier()
        assert backend.num_hierarchical_calls == 0 and backend.num_fallback_calls >= 2
        from commlib.fused import fused_allreduce_rmsnorm
        with pytest.raises(ValueError, match="different numbers of ranks"):
            fused_allreduce_rmsnorm(world, torch.ones(2, 8), torch.ones(2, 8), torch.ones(8))
    return True


def test_uneven_hosts_run_flat(ranks):
    """Hosts of 3 and 1 ranks: no two-level path (the group's gloo takes every call), results as gloo's;
    the fused all-reduce + RMSNorm, which has no flat form, raises ValueError on the calling rank."""
    ranks(4).run(_uneven, [0, 0, 0, 1])


def _forced_flat(ctx):
    import torch.distributed as dist
    me = ctx.rank
    os.environ["COMMLIB_HIER_ALGO"] = "flat"
    try:
        with as_host(me // 2), ddacomm_world(ctx) as (world, gloo):
            backend = backend_of(world)
            assert backend.hierarchical
            import commlib
            planned0 = commlib.plan_counters()
            x = any_values(me, 100, torch.float32)
            ours, ref = x.clone(), x.clone()
            dist.all_reduce(ours)
            dist.all_reduce(ref, group=gloo)
            dist.barrier()
            assert torch.equal(ours, ref)
            assert backend.num_hierarchical_calls == 0
            planned = commlib.plan_counters()  # the plan said inner: the group's own gloo, counted
            assert planned["inner"] - planned0["inner"] == 2 and planned["two_level"] == planned0["two_level"]
    finally:
        os.environ.pop("COMMLIB_HIER_ALGO", None)
    return True


def test_hier_algo_flat_keeps_the_flat_path(ranks):
    """COMMLIB_HIER_ALGO=flat: the same multi-host group runs every call on gloo (the crossover's override)."""
    ranks(4).run(_forced_flat)


# ---------------------------------------------------------------------------------------------
def _fused(ctx, hosts):
    from commlib.fused import fused_allreduce_rmsnorm, reference_rmsnorm
    n, me = ctx.world_size, ctx.rank
    with as_host(hosts[me]), ddacomm_world(ctx) as (world, gloo):
        backend = backend_of(world)
        assert backend.hierarchical
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for tokens, hidden in ((1, 64), (5, 8), (33, 256), (0, 16)):
                g = torch.Generator().manual_seed(77 * tokens + hidden)
                # integer-valued x: every reduction order gives the exact sum
                xs = [torch.randint(-8, 9, (tokens, hidden), generator=torch.Generator().manual_seed(q * 1000 + tokens))
                      .to(dtype) for q in range(n)]
                residual0 = (torch.rand(tokens, hidden, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
                weight = (torch.rand(hidden, generator=g, dtype=torch.float64) + 0.5).to(dtype)
                residual = residual0.clone()
                out = poison(residual0)
                got, res = fused_allreduce_rmsnorm(world, xs[me], residual, weight, 1e-6, out=out)
                assert got is out and res is residual
                summed = sum(x.double() for x in xs).to(dtype)
                ref_out, ref_res = reference_rmsnorm(summed, residual0, weight, 1e-6)
                what = f"fused {dtype} tokens={tokens} hidden={hidden} hosts={hosts}"
                assert torch.equal(out.view(torch.uint8), ref_out.view(torch.uint8)), what
                assert torch.equal(residual.view(torch.uint8), ref_res.view(torch.uint8)), what + " residual"
                same_on_every_rank(out, gloo, what)
        # random x: against the same arithmetic on this group's all-reduce (bitwise), and fp64 (close)
        x = (torch.rand(19, 128, generator=torch.Generator().manual_seed(me), dtype=torch.float64) - 0.5).to(torch.bfloat16)
        residual0 = torch.rand(19, 128, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(torch.bfloat16)
        weight = torch.ones(128, dtype=torch.bfloat16)
        residual = residual0.clone()
        out, _ = fused_allreduce_rmsnorm(world, x, residual, weight, 1e-5)
        same_on_every_rank(out, gloo, "fused random")
        summed = sum((torch.rand(19, 128, generator=torch.Generator().manual_seed(q), dtype=torch.float64) - 0.5)
                     .to(torch.bfloat16).double() for q in range(n))
        r64 = residual0.double() + summed
        ref64 = r64 / torch.sqrt((r64 * r64).mean(dim=1, keepdim=True) + 1e-5)
        torch.testing.assert_close(out.double(), ref64, rtol=3e-2, atol=3e-2)
        with pytest.raises(ValueError, match="replicated"):
            fused_allreduce_rmsnorm(world, x, residual, weight, residual_mode="sharded")
    return True


@pytest.mark.parametrize("hosts", [(0, 0, 1, 1), (0, 0, 1, 1, 2, 2), (0, 0, 0, 1, 1, 1)],
                         ids=["4=2x2", "6=3x2", "6=2x3"])
def test_fused_allreduce_rmsnorm_two_level(ranks, hosts):
    """Fused all-reduce + RMSNorm on a multi-host group (norm on the reduced shard, then the intra
    gather): bitwise against reference_rmsnorm of the exact sum, bf16 / fp16 / fp32, 0 / 1 / odd
    token counts; random inputs same on every rank and close to fp64; sharded mode refused."""
    ranks(len(hosts)).run(_fused, list(hosts))


# ---------------------------------------------------------------------------------------------
def _crossover(ctx, tmpdir):
    import torch.distributed as dist

    from commlib.perf import tune
    me = ctx.rank
    path = os.path.join(tmpdir, f"tune-{me}.txt")
    with as_host(me // 2), ddacomm_world(ctx) as (world, gloo):
        # measured on this group's layout: one entry per op, every rank the same answer
        entries = tune.measure_hierarchical(sizes=(1024, 65536), iters=2, device="cpu")
        assert [e["op"] for e in entries] == list(tune.HIER_OPS)
        assert all((e["num_hosts"], e["local_size"]) == (2, 2) and e["min_bytes"] >= 0 for e in entries)
        answers = [None] * ctx.world_size
        dist.all_gather_object(answers, entries, group=gloo)
        assert all(a == entries for a in answers), "ranks measured different crossovers"
        tune.save_hierarchical(entries, path)
        tune.save_hierarchical([{"op": "all_reduce", "num_hosts": 2, "local_size": 2, "min_bytes": 4096},
                                {"op": "barrier", "num_hosts": 2, "local_size": 2, "min_bytes": 1}], path)
        saved = tune.read_file(path)["hierarchical"]
        assert sorted(e["op"] for e in saved) == sorted(tune.HIER_OPS)
        assert "hierarchical op=all_reduce num_hosts=2 local_size=2 min_bytes=4096" in open(path).read().splitlines()
        # a group created with that file: all_reduce below 4096 bytes and barrier flat, the rest two-level
        os.environ["COMMLIB_TUNE_FILE"] = path
        try:
            group = dist.new_group(backend="ddacomm")
        finally:
            os.environ.pop("COMMLIB_TUNE_FILE", None)
        backend = backend_of(group)
        h0, f0 = backend.num_hierarchical_calls, backend.num_fallback_calls
        small, large = torch.full((1023,), float(me)), torch.full((1024,), float(me))
        dist.all_reduce(small, group=group)
        dist.barrier(group=group)
        assert (backend.num_hierarchical_calls, backend.num_fallback_calls) == (h0, f0 + 2)
        dist.all_reduce(large, group=group)
        assert (backend.num_hierarchical_calls, backend.num_fallback_calls) == (h0 + 1, f0 + 2)
        assert torch.equal(small, torch.full((1023,), 6.0)) and torch.equal(large, torch.full((1024,), 6.0))
    return True


def test_tuned_crossover(ranks, tmp_path):
    """commlib.perf.tune.measure_hierarchical on a 2 x 2 group (same answer on every rank), save_hierarchical,
    and a group reading that file: all_reduce under min_bytes and the barrier run flat, larger two-level."""
    ranks(4).run(_crossover, str(tmp_path))


def _one_host_fused(ctx):
    from commlib.fused import fused_allreduce_rmsnorm, reference_rmsnorm
    n, me = ctx.world_size, ctx.rank
    with ddacomm_world(ctx) as (world, gloo):
        assert backend_of(world).has_fast_path and not backend_of(world).hierarchical
        xs = [torch.randint(-8, 9, (9, 64), generator=torch.Generator().manual_seed(q)).to(torch.bfloat16)
              for q in range(n)]
        residual0 = torch.rand(9, 64, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
        weight = torch.full((64,), 1.5, dtype=torch.bfloat16)
        residual = residual0.clone()
        out, _ = fused_allreduce_rmsnorm(world, xs[me], residual, weight, 1e-6)
        ref_out, ref_res = reference_rmsnorm(sum(x.double() for x in xs).to(torch.bfloat16), residual0, weight, 1e-6)
        assert torch.equal(out.view(torch.uint8), ref_out.view(torch.uint8))
        assert torch.equal(residual.view(torch.uint8), ref_res.view(torch.uint8))
    return True


def test_fused_on_a_one_host_group(ranks):
    """fused_allreduce_rmsnorm(group, ...) on a one-host "ddacomm" group runs on the group's communicator
    ("ddacomm-" + group name): bitwise against reference_rmsnorm."""
    ranks(4).run(_one_host_fused)
