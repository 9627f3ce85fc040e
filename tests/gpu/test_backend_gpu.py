"""The torch.distributed backend "ddacomm" on CUDA tensors (2 GPUs).

Reference: an NCCL group of the same ranks inside the same "ddacomm" world, on the same inputs;
every output poisoned first. Also: a tensor-parallel MLP forward (ddacomm vs nccl), CUDA-graph
capture of dist.all_reduce, and torch.compile of a function calling functional all_reduce. Those
three also read the backend's call counters: each call they check went through commlib's path
(num_fast_calls), none to the inner NCCL (num_fallback_calls), so NCCL alone cannot pass them.
"""
from __future__ import annotations

import pytest
import torch
from ddacomm_worlds import ddacomm_world, fast_path_counts

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rand(rank, count, dtype, salt=0, device="cuda"):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + 31 * salt)
    x = torch.rand(count, generator=g, dtype=torch.float64) * 2 + 0.5
    x = x.to(dtype) if dtype.is_floating_point else (x * 1000).to(dtype)
    return x.to(device)


def poison(like):
    if like.dtype.is_floating_point:
        return torch.full_like(like, float("nan"))
    return torch.full_like(like, -7)


def close(ours, ref, what):
    assert not (ours.dtype.is_floating_point and torch.isnan(ours).any()), f"{what}: output not fully written"
    if ours.dtype.is_floating_point:
        tol = TOL.get(ours.dtype, 1e-12)
        torch.testing.assert_close(ours.double(), ref.double(), rtol=tol, atol=tol, msg=what)
    else:
        assert torch.equal(ours, ref), what


def _every_op_vs_nccl(ctx):
    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    with ddacomm_world(ctx, device_id=True) as (world, nccl):
        assert dist.get_backend() == "ddacomm"
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for count in (0, 1, 7, 4097, 32768, (1 << 20) + 3, 16 << 20):
                x = rand(r, count, dtype)
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
                    ours, ref = x.clone(), x.clone()
                    dist.all_reduce(ours, op=op)
                    dist.all_reduce(ref, op=op, group=nccl)
                    close(ours, ref, f"all_reduce {op} {dtype} {count}")
                # async_op on an internal stream: wait() orders the current stream after it
                ours, ref = x.clone(), x.clone()
                work = dist.all_reduce(ours, async_op=True)
                work.wait()
                dist.all_reduce(ref, group=nccl)
                close(ours, ref, f"all_reduce async {dtype} {count}")
                fut = dist.all_reduce(x.clone(), async_op=True).get_future()
                close(fut.wait()[0], ref, f"all_reduce future value {dtype} {count}")
        # int64 all_reduce (NCCL underneath)
        x = rand(r, 1001, torch.int64)
        ours, ref = x.clone(), x.clone()
        dist.all_reduce(ours)
        dist.all_reduce(ref, group=nccl)
        close(ours, ref, "all_reduce int64")
        for dtype in (torch.bfloat16, torch.int64):
            x = rand(r, 4099, dtype, salt=1)
            for src in range(n):
                ours = x.clone() if r == src else poison(x)
                ref = x.clone() if r == src else poison(x)
                dist.broadcast(ours, src=src)
                dist.broadcast(ref, src=src, group=nccl)
                close(ours, ref, f"broadcast {dtype}")
                ours, ref = x.clone(), x.clone()
                dist.reduce(ours, dst=src)
                dist.reduce(ref, dst=src, group=nccl)
                if r == src:
                    close(ours, ref, f"reduce {dtype}")
            outs, refs = [poison(x) for _ in range(n)], [poison(x) for _ in range(n)]
            dist.all_gather(outs, x)
            dist.all_gather(refs, x, group=nccl)
            close(torch.cat(outs), torch.cat(refs), f"all_gather {dtype}")
            flat = poison(torch.empty(n * x.numel(), dtype=dtype, device="cuda"))
            dist.all_gather_into_tensor(flat, x)
            close(flat, torch.cat(refs), f"all_gather_into_tensor {dtype}")
            full = rand(r, n * 4099, dtype, salt=2)
            out, ref = poison(x), poison(x)
            dist.reduce_scatter_tensor(out, full)
            dist.reduce_scatter_tensor(ref, full, group=nccl)
            close(out, ref, f"reduce_scatter_tensor {dtype}")
            out = poison(x)
            dist.reduce_scatter(out, list(full.chunk(n)))
            close(out, ref, f"reduce_scatter {dtype}")
            # all_to_all even / uneven / list
            a = rand(r, n * 6, dtype, salt=3).reshape(n * 3, 2)
            out, ref = poison(a), poison(a)
            dist.all_to_all_single(out, a)
            dist.all_to_all_single(ref, a, group=nccl)
            close(out, ref, f"all_to_all_single {dtype}")
            ins_s = [((r + q) % 3) * 5 for q in range(n)]
            outs_s = [((q + r) % 3) * 5 for q in range(n)]
            a = rand(r, sum(ins_s), dtype, salt=4)
            out = poison(torch.empty(sum(outs_s), dtype=dtype, device="cuda"))
            ref = poison(out)
            dist.all_to_all_single(out, a, outs_s, ins_s)
            dist.all_to_all_single(ref, a, outs_s, ins_s, group=nccl)
            close(out, ref, f"all_to_all_single uneven {dtype}")
            ins = [rand(r, 8, dtype, salt=5 + q) for q in range(n)]
            outs, refs = [poison(t) for t in ins], [poison(t) for t in ins]
            dist.all_to_all(outs, ins)
            dist.all_to_all(refs, ins, group=nccl)
            close(torch.cat(outs), torch.cat(refs), f"all_to_all {dtype}")
            # gather / scatter
            gl = [poison(x) for _ in range(n)] if r == 0 else None
            dist.gather(x, gl, dst=0)
            if r == 0:
                close(torch.cat(gl), torch.cat([rand(q, 4099, dtype, salt=1) for q in range(n)]), "gather")
            out = poison(x)
            dist.scatter(out, [rand(q, 4099, dtype, salt=6) for q in range(n)] if r == 0 else None, src=0)
            close(out, rand(r, 4099, dtype, salt=6), "scatter")
        # coalesced
        xs = [rand(r, c, torch.bfloat16, salt=7) for c in (3, 4097)]
        refs = [t.clone() for t in xs]
        with dist._coalescing_manager(group=world):  # ends in allreduce_coalesced (NCCL underneath)
            for t in xs:
                dist.all_reduce(t)
        for t, ref in zip(xs, refs):
            dist.all_reduce(ref, group=nccl)
            close(t, ref, "all_reduce coalesced")
        # p2p, batch_isend_irecv, barrier, objects, subgroup
        nxt, prv = (r + 1) % n, (r - 1) % n
        x = rand(r, 1003, torch.float32, salt=8)
        got = poison(x)
        ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, got, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        close(got, rand(prv, 1003, torch.float32, salt=8), "batch_isend_irecv")
        dist.barrier()
        objs = [None] * n
        dist.all_gather_object(objs, {"r": r})
        assert objs == [{"r": q} for q in range(n)]
        sub = dist.new_group([0, 1], backend="ddacomm")
        t = torch.full((5,), float(r + 1), device="cuda")
        dist.all_reduce(t, group=sub)
        close(t, torch.full((5,), 3.0, device="cuda"), "subgroup all_reduce")
    return True


@pytest.mark.nccl
def test_every_op_matches_nccl(ranks):
    ranks(2).run(_every_op_vs_nccl)


def _tp_mlp(ctx):
    """Column-parallel Linear then row-parallel Linear (hidden 8192, bf16): ddacomm vs nccl."""
    import commlib
    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    hidden, ffn, tokens = 8192, 4 * 8192, 16
    with ddacomm_world(ctx) as (world, nccl):
        g = torch.Generator(device="cuda").manual_seed(7)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        g.manual_seed(100 + r)
        w1 = torch.randn(ffn // n, hidden, device="cuda", dtype=torch.bfloat16, generator=g) / hidden ** 0.5
        w2 = torch.randn(hidden, ffn // n, device="cuda", dtype=torch.bfloat16, generator=g) / ffn ** 0.5

        def forward(group):
            h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1))
            y = torch.nn.functional.linear(h, w2)
            dist.all_reduce(y, group=group)
            return y

        fast0, fallback0 = fast_path_counts(world)
        plans0 = commlib.plan_counters()
        ours = forward(world)
        assert fast_path_counts(world) == (fast0 + 1, fallback0), "the MLP's all_reduce did not take commlib's path"
        plans = commlib.plan_counters()
        ran = {k: plans[k] - plans0[k] for k in plans if plans[k] != plans0[k]}
        # 256 KiB at world 2: one commlib all-reduce kernel ran (Note [plan]), none of it NCCL's.
        assert len(ran) == 1 and set(ran) <= {"flat_ll", "flat", "tree"} and sum(ran.values()) == 1, ran
        ref = forward(nccl)
        torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)
    return True


@pytest.mark.nccl
def test_tensor_parallel_mlp_matches_nccl(ranks):
    ranks(2).run(_tp_mlp)


def _graph_capture(ctx):
    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    with ddacomm_world(ctx) as (world, nccl):
        static = torch.zeros(32768, device="cuda", dtype=torch.bfloat16)
        dist.all_reduce(static)  # warm-up (creates the inner NCCL communicator outside capture)
        torch.cuda.synchronize()
        fast0, fallback0 = fast_path_counts(world)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dist.all_reduce(static)
        # The captured call is commlib's kernel (replays do not pass through the host).
        assert fast_path_counts(world) == (fast0 + 1, fallback0), "the captured all_reduce is not commlib's"
        for step in range(3):
            src = rand(r, 32768, torch.bfloat16, salt=step)
            static.copy_(src)
            graph.replay()
            expect = sum(rand(q, 32768, torch.bfloat16, salt=step).double() for q in range(n))
            close(static, expect, f"graph replay {step}")
    return True


def test_cuda_graph_capture_of_all_reduce(ranks):
    ranks(2).run(_graph_capture)


def _compiled(ctx):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    n, r = ctx.world_size, ctx.rank
    with ddacomm_world(ctx) as (world, nccl):
        def fn(x):
            return funcol.all_reduce(x * 2, "sum", world) + 1

        compiled = torch.compile(fn, fullgraph=True)
        x = rand(r, 4096, torch.float32, salt=9)
        expect = sum(rand(q, 4096, torch.float32, salt=9).double() * 2 for q in range(n)) + 1
        fast0, fallback0 = fast_path_counts(world)
        close(compiled(x), expect, "compiled funcol.all_reduce")
        assert fast_path_counts(world) == (fast0 + 1, fallback0), "the compiled all_reduce did not take commlib's path"
        close(fn(x), expect, "eager funcol.all_reduce")
        assert fast_path_counts(world) == (fast0 + 2, fallback0), "the eager all_reduce did not take commlib's path"
    return True


def test_torch_compile_functional_all_reduce(ranks):
    ranks(2).run(_compiled)
