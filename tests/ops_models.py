"""Models for the torch.ops.commlib tests (CPU and GPU): a tensor-parallel MLP and an expert-parallel
MoE block written against the Python API, run eagerly and under torch.compile(fullgraph=True).

References are fp64 and computed on every rank from the same seeds: the tensor-parallel shards
are slices of full weight matrices, so the reference is the unsharded MLP; every rank can build
every expert's weights, so the MoE reference is each token's weighted sum over its experts.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

HIDDEN, FFN, TOKENS, EPS = 64, 128, 12, 1e-5
TOL = {torch.float32: 2e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


def _full(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5


def tp_weights(rank, world_size):
    """fp64 full weights and this rank's shards: column-parallel [FFN/n, H], row-parallel [H, FFN/n]."""
    full = {f"w{i}": _full(100 + i, FFN, HIDDEN) if i % 2 else _full(100 + i, HIDDEN, FFN) for i in range(1, 7)}
    full["norm"] = torch.rand(HIDDEN, generator=torch.Generator().manual_seed(99), dtype=torch.float64) + 0.5
    step = FFN // world_size
    rows = slice(rank * step, (rank + 1) * step)
    shard = {k: (v[rows] if int(k[1]) % 2 else v[:, rows]) for k, v in full.items() if k != "norm"}
    shard["norm"] = full["norm"]
    return full, shard


def tp_block(comm, x, residual, w):
    """Three column-parallel -> act -> row-parallel layers, reduced by commlib three ways: all_reduce
    (out of place), all_reduce_ (in place), and the fused all-reduce + residual add + RMSNorm."""
    a = comm.all_reduce(F.linear(F.gelu(F.linear(x, w["w1"])), w["w2"]))
    b = F.linear(F.silu(F.linear(a, w["w3"])), w["w4"])
    comm.all_reduce_(b)
    c = F.linear(F.gelu(F.linear(b, w["w5"])), w["w6"])
    return comm.fused_allreduce_rmsnorm(c, residual, w["norm"], EPS)


def tp_reference(x, residual, full):
    x, residual = x.double().cpu(), residual.double().cpu()
    a = F.linear(F.gelu(F.linear(x, full["w1"])), full["w2"])
    b = F.linear(F.silu(F.linear(a, full["w3"])), full["w4"])
    r = residual + F.linear(F.gelu(F.linear(b, full["w5"])), full["w6"])
    out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * full["norm"]
    return out, r


def tp_inputs(rank, dtype, device, salt):
    g = torch.Generator().manual_seed(7 + salt)  # the same activations on every rank (TP)
    x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    residual = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    return x.to(dtype).to(device), residual.to(dtype).to(device)


NUM_EXPERTS_PER_RANK, TOPK, MAX_TOKENS = 2, 2, 16


def moe_block(buf, x, topk_idx, topk_weights, expert_w):
    """Dispatch -> one linear per local expert -> combine."""
    res = buf.dispatch(x, topk_idx, topk_weights)
    return buf.combine(torch.bmm(res.expert_x, expert_w), res.handle)


def moe_weights(rank, world_size):
    """fp64 weights of every expert [E, H, H] and this rank's local experts' slice."""
    num_experts = NUM_EXPERTS_PER_RANK * world_size
    full = _full(300, num_experts, HIDDEN, HIDDEN)
    return full, full[rank * NUM_EXPERTS_PER_RANK:(rank + 1) * NUM_EXPERTS_PER_RANK]


def moe_inputs(rank, world_size, dtype, device, salt):
    num_tokens = 9 + 2 * rank  # uneven across ranks
    g = torch.Generator().manual_seed(1000 * salt + rank)
    x = torch.randn(num_tokens, HIDDEN, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(NUM_EXPERTS_PER_RANK * world_size, generator=g)[:TOPK]
                       for _ in range(num_tokens)])
    idx[0, 1] = -1  # a route to no expert
    w = torch.rand(num_tokens, TOPK, generator=g, dtype=torch.float32) + 0.1
    return x.to(dtype).to(device), idx.to(device), w.to(device)


def moe_reference(x, idx, w, full):
    x = x.double().cpu()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                out[t] += float(w[t, k]) * (x[t] @ full[e])
    return out


def fresh_compile() -> contextlib.ExitStack:
    """No compiled code from the caches: inductor's and AOTAutograd's caches do not key on a custom
    op's schema, so a build with another schema would replay stale calls (torch 2.14)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    torch._dynamo.reset()
    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


class GraphRecorder:
    """A torch.compile backend that keeps the Dynamo graphs it is given and hands them to `inner`."""

    def __init__(self, inner: str):
        self.inner = inner
        self.graphs: list[set] = []  # per graph: the commlib ops it calls ("all_reduce", ...)

    def __call__(self, gm, example_inputs):
        ops = set()
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, (torch._ops.OpOverload,
                                                                       torch._ops.OpOverloadPacket)):
                namespace, _, name = node.target._schema.name.partition("::") \
                    if isinstance(node.target, torch._ops.OpOverload) else node.target._qualified_op_name.partition("::")
                if namespace == "commlib":
                    ops.add(name)
        self.graphs.append(ops)
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend(self.inner)(gm, example_inputs)


def compiled_tp_mlp(ctx, device, dtype, backend):
    """Eager and torch.compile(fullgraph=True) TP MLP against the fp64 reference; returns the
    commlib ops Dynamo put into the one graph."""
    comm = ctx.comm
    full, shard = tp_weights(ctx.rank, ctx.world_size)
    w = {k: v.to(dtype).to(device) for k, v in shard.items()}
    recorder = GraphRecorder(backend)
    compiled = torch.compile(lambda x, r: tp_block(comm, x, r, w), backend=recorder, fullgraph=True)
    tol = TOL[dtype]
    with torch.no_grad(), fresh_compile():
        for salt in range(2):  # a second call with new data reuses the graph
            x, residual = tp_inputs(ctx.rank, dtype, device, salt)
            ref_out, ref_res = tp_reference(x, residual, full)
            x_before = x.clone()
            res_e, res_c = residual.clone(), residual.clone()
            out_e, ret_e = tp_block(comm, x, res_e, w)
            out_c, ret_c = compiled(x, res_c)
            assert torch.equal(x, x_before), "the out-of-place all_reduce changed its input"
            assert ret_e is res_e and torch.equal(res_c, ret_c), "the residual is updated in place"
            for what, got, ref in (("eager out", out_e, ref_out), ("compiled out", out_c, ref_out),
                                   ("eager residual", res_e, ref_res), ("compiled residual", res_c, ref_res)):
                assert not torch.isnan(got).any(), what
                torch.testing.assert_close(got.double().cpu(), ref, rtol=tol, atol=tol, msg=what)
            torch.testing.assert_close(out_c, out_e, rtol=tol, atol=tol)
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs)} graphs (recompiled or broken)"
    return sorted(recorder.graphs[0])


def compiled_ep_moe(ctx, device, dtype, backend):
    """Eager and torch.compile(fullgraph=True) MoE block against the fp64 reference."""
    import commlib
    n = ctx.world_size
    full, local = moe_weights(ctx.rank, n)
    expert_w = local.to(dtype).to(device)
    buf = commlib.EPBuffer(ctx.comm, MAX_TOKENS, HIDDEN, NUM_EXPERTS_PER_RANK * n, TOPK, dtype, device)
    recorder = GraphRecorder(backend)
    compiled = torch.compile(lambda x, i, w: moe_block(buf, x, i, w, expert_w), backend=recorder, fullgraph=True)
    tol = TOL[dtype]
    with torch.no_grad(), fresh_compile():
        for salt in range(2):
            x, idx, w = moe_inputs(ctx.rank, n, dtype, device, salt)
            ref = moe_reference(x, idx, w, full)
            eager = moe_block(buf, x, idx, w, expert_w)
            got = compiled(x, idx, w)
            for what, t in (("eager", eager), ("compiled", got)):
                assert t.shape == x.shape and not torch.isnan(t).any(), what
                torch.testing.assert_close(t.double().cpu(), ref, rtol=tol, atol=tol, msg=f"MoE {what}")
            torch.testing.assert_close(got, eager, rtol=tol, atol=tol)
    buf.check()
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs)} graphs (recompiled or broken)"
    return sorted(recorder.graphs[0])
