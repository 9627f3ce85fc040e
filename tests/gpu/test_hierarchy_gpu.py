"""Two-level collectives of a multi-host "ddacomm" group on CUDA tensors (Note [hierarchical collectives]).

COMMLIB_TEST_HOST_ID makes the ranks act as hosts: world 2 as 2 hosts x 1, world 4 as 2 hosts x 2.
With COMMLIB_TEST_SHARE_GPUS=1 the ranks share one GPU; NCCL refuses two ranks on one GPU, so the
inter-host leg then runs on gloo's CUDA paths (COMMLIB_TEST_HIER_INTER_GLOO=1, set by the test);
with a GPU per rank it runs on NCCL as in production. The intra-host legs are the intra "ddacomm"
backend's (commlib's GPU all-reduce where it applies, else NCCL on the host's ranks, which also
needs distinct GPUs: world 4 skips when shared). Reference: the exact sum of integer-valued inputs
(every order gives it), fp64 for random inputs, the fused op's CPU reference (bitwise); results
checked the same on every rank; the backend's counters prove the two-level path ran.
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def hier_world(ctx, host, inter_gloo):
    import commlib  # noqa: F401  (registers "ddacomm")
    import torch.distributed as dist
    ctx.drop_default_group()
    env = {"COMMLIB_TEST_HOST_ID": f"host-{host}", "COMMLIB_TEST_HIER_INTER_GLOO": "1" if inter_gloo else "0"}
    os.environ.update(env)
    n = ctx.scratch["worlds"] = ctx.scratch.get("worlds", 0) + 1
    store = dist.PrefixStore(f"ddacomm-hier-gpu-test/{n}", ctx.store)
    try:
        dist.init_process_group("ddacomm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                                timeout=timedelta(seconds=120))
        gloo = dist.new_group(backend="gloo")
        yield dist.group.WORLD, gloo
    finally:
        for k in env:
            os.environ.pop(k, None)
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.destroy_process_group()


def same_on_every_rank(t, gloo, what):
    import torch.distributed as dist
    mine = t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).clone()
    first = mine.clone()
    dist.broadcast(first, src=0, group=gloo)
    assert torch.equal(mine, first), f"{what}: rank {dist.get_rank()} differs from rank 0"


def ints(rank, count, dtype, salt=0):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + 31 * salt)
    return torch.randint(-8, 9, (count,), generator=g).to(dtype)


def _hier_cuda(ctx, local_size, inter_gloo):
    import torch.distributed as dist

    from commlib.fused import fused_allreduce_rmsnorm, reference_rmsnorm
    n, me = ctx.world_size, ctx.rank
    dev = torch.device("cuda", ctx.device)
    with hier_world(ctx, me // local_size, inter_gloo) as (world, gloo):
        backend = world._get_backend(dev)
        assert backend.hierarchical and backend.host_layout[:2] == (n // local_size, local_size)
        calls0 = backend.num_hierarchical_calls
        calls = 0
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for count in (0, 1, 4097, (1 << 20) + 3):
                xs = [ints(q, count, dtype) for q in range(n)]
                exact = sum(x.double() for x in xs).to(dtype)
                for op, ref in ((dist.ReduceOp.SUM, exact), (dist.ReduceOp.MAX, torch.stack(xs).amax(0) if count else exact)):
                    t = xs[me].to(dev)
                    dist.all_reduce(t, op=op)
                    calls += 1
                    what = f"all_reduce {op} {dtype} count={count}"
                    assert torch.equal(t.cpu().view(torch.uint8), ref.view(torch.uint8)), what
                    same_on_every_rank(t, gloo, what)
            # random values: close to fp64, the same bits everywhere
            xs = [(torch.rand(3001, generator=torch.Generator().manual_seed(q), dtype=torch.float64) - 0.5)
                  .to(dtype) for q in range(n)]
            t = xs[me].to(dev)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            calls += 1
            tol = 3e-2 if dtype == torch.bfloat16 else 4e-3 if dtype == torch.float16 else 1e-5
            torch.testing.assert_close(t.cpu().double(), sum(x.double() for x in xs) / n, rtol=tol, atol=tol)
            same_on_every_rank(t, gloo, f"all_reduce avg {dtype}")
        # reduce_scatter, all_gather, broadcast, barrier
        count = 1000
        full = [ints(q, count * n, torch.float32, salt=1) for q in range(n)]
        out = torch.full((count,), float("nan"), device=dev)
        dist.reduce_scatter_tensor(out, full[me].to(dev))
        calls += 1
        assert torch.equal(out.cpu(), sum(full)[me * count:(me + 1) * count]), "reduce_scatter"
        x = ints(me, 777, torch.bfloat16, salt=2)
        flat = torch.full((777 * n,), float("nan"), dtype=torch.bfloat16, device=dev)
        dist.all_gather_into_tensor(flat, x.to(dev))
        calls += 1
        assert torch.equal(flat.cpu(), torch.cat([ints(q, 777, torch.bfloat16, salt=2) for q in range(n)])), "all_gather"
        for src in range(n):
            t = x.to(dev) if me == src else torch.full((777,), float("nan"), dtype=torch.bfloat16, device=dev)
            dist.broadcast(t, src=src)
            calls += 1
            assert torch.equal(t.cpu(), ints(src, 777, torch.bfloat16, salt=2)), f"broadcast src={src}"
        dist.barrier()
        calls += 1
        assert backend.num_hierarchical_calls == calls0 + calls, "a call left the two-level path"
        # fused all-reduce + RMSNorm: bitwise against the CPU reference of the exact sum
        for tokens, hidden in ((1, 1024), (7, 2048), (64, 4096)):
            xs = [ints(q, tokens * hidden, torch.bfloat16, salt=3).reshape(tokens, hidden) for q in range(n)]
            g = torch.Generator().manual_seed(tokens)
            residual0 = (torch.rand(tokens, hidden, generator=g, dtype=torch.float64) * 2 - 1).to(torch.bfloat16)
            weight = (torch.rand(hidden, generator=g, dtype=torch.float64) + 0.5).to(torch.bfloat16)
            residual = residual0.to(dev)
            out, _ = fused_allreduce_rmsnorm(world, xs[me].to(dev), residual, weight.to(dev), 1e-6)
            ref_out, ref_res = reference_rmsnorm(sum(x.double() for x in xs).to(torch.bfloat16), residual0, weight, 1e-6)
            what = f"fused tokens={tokens} hidden={hidden}"
            assert torch.equal(out.cpu().view(torch.uint8), ref_out.view(torch.uint8)), what
            assert torch.equal(residual.cpu().view(torch.uint8), ref_res.view(torch.uint8)), what + " residual"
            same_on_every_rank(out, gloo, what)
    return True


def _shared(world_size):
    return torch.cuda.is_available() and torch.cuda.device_count() < world_size


@pytest.mark.parametrize("world_size,local_size", [(2, 1), (4, 2)], ids=["2=2x1", "4=2x2"])
def test_two_level_cuda(ranks, world_size, local_size):
    """all_reduce (bf16 / fp16 / fp32, sum / max / avg, 0 to 1 Mi elements), reduce_scatter, all_gather,
    broadcast from every root, barrier and the fused all-reduce + RMSNorm on CUDA tensors, two-level."""
    shared = _shared(world_size)
    if shared and local_size > 1:
        pytest.skip("the intra-host leg's NCCL needs a GPU per rank of a host")
    ranks(world_size).run(_hier_cuda, local_size, shared)
