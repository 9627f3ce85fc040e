"""torch.ops.commlib on CUDA tensors (2 GPUs): the ops against the direct API, CUDA-graph capture of
the ops, and torch.compile(fullgraph=True, inductor) of the TP MLP and EP MoE blocks of
tests/ops_models.py against their fp64 references (bf16 here: the GPU fused kernel has no fp32).
"""
from __future__ import annotations

import pytest
import torch

import ops_models

pytestmark = pytest.mark.gpu


def rand(rank, count, dtype, salt=0):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + 31 * salt)
    return (torch.rand(count, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype).cuda()


def _ops_vs_direct(ctx):
    import commlib  # noqa: F401
    ops, name = torch.ops.commlib, ctx.comm.group_name
    for dtype in (torch.float32, torch.bfloat16):
        for count in (0, 1, 4097, (1 << 20) + 3):
            for algo in ("flat", "tree"):
                x = rand(ctx.rank, count, dtype)
                expect = ctx.comm.all_reduce_(x.clone(), algo=algo)
                before = x.clone()
                got = ops.all_reduce(x, "sum", name, algo)
                assert torch.equal(x, before) and torch.equal(got, expect), (dtype, count, algo)
                out = torch.full_like(x, float("nan"))
                ops.all_reduce_out(x, "sum", name, algo, out=out)
                assert torch.equal(out, expect), (dtype, count, algo)
                ops.all_reduce_(x, "sum", name, algo)
                assert torch.equal(x, expect), (dtype, count, algo)
    # Captured ops replay with new data.
    static = torch.zeros(32768, dtype=torch.bfloat16, device="cuda")
    ops.all_reduce_(static, "sum", name)  # GPU state made outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.all_reduce_(static, "sum", name)
        doubled = ops.all_reduce(static * 2, "sum", name)
    for step in range(3):
        static.copy_(rand(ctx.rank, 32768, torch.bfloat16, salt=step))
        graph.replay()
        torch.cuda.synchronize()
        expect = ctx.comm.all_reduce(rand(ctx.rank, 32768, torch.bfloat16, salt=step))
        assert torch.equal(static, expect), step
        assert torch.equal(doubled, ctx.comm.all_reduce(expect * 2)), step
    return True


def test_ops_match_direct_api_and_capture(ranks):
    ranks(2).run(_ops_vs_direct)


def _compiled_tp(ctx):
    return ops_models.compiled_tp_mlp(ctx, torch.device("cuda", ctx.device), torch.bfloat16, "inductor")


def test_compile_tensor_parallel_mlp_gpu(ranks):
    expect = ["all_reduce", "all_reduce_", "fused_allreduce_rmsnorm"]
    assert ranks(2).run(_compiled_tp) == [expect, expect]


def _compiled_moe(ctx):
    return ops_models.compiled_ep_moe(ctx, torch.device("cuda", ctx.device), torch.bfloat16, "inductor")


def test_compile_ep_moe_gpu(ranks):
    assert ranks(2).run(_compiled_moe) == [["ep_combine", "ep_dispatch"]] * 2
