"""torch.ops.commlib.reduce_scatter_out / all_gather_out / broadcast_ on CPU tensors (the same
torch-layer functions serve CUDA): results against fp64 / exact references on random inputs,
poisoned outputs, opcheck's schema and fake-tensor checks, and torch.compile(fullgraph=True) of the
Python methods (which trace to these ops).
"""
import torch

KiB = 1 << 10


def rand(rank, count, dtype=torch.float32, salt=0):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + salt)
    return (torch.rand(count, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)


def _ops(ctx):
    n, r = ctx.world_size, ctx.rank
    name = ctx.comm.group_name
    ops = torch.ops.commlib
    for count in (1, 7, 4097):
        inputs = [rand(q, count * n, salt=count) for q in range(n)]
        out = torch.full((count,), float("nan"))
        ops.reduce_scatter_out(inputs[r], "sum", name, out=out)
        expected = sum(x[r * count:(r + 1) * count].double() for x in inputs)
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
        mine = inputs[r][:count]
        out = torch.full((count * n,), float("nan"))
        ops.all_gather_out(mine, name, out=out)
        assert torch.equal(out, torch.cat([x[:count] for x in inputs])), f"all_gather_out {count}"
        t = inputs[r].clone() if r == n - 1 else torch.full((count * n,), float("nan"))
        ops.broadcast_(t, n - 1, name)
        assert torch.equal(t, inputs[n - 1]), f"broadcast_ {count}"
    tests = ("test_schema", "test_faketensor")
    x = rand(r, 8 * n)
    torch.library.opcheck(ops.reduce_scatter_out.default, (x, "sum", name), {"out": torch.empty(8)}, test_utils=tests)
    torch.library.opcheck(ops.all_gather_out.default, (x[:8], name), {"out": torch.empty(8 * n)}, test_utils=tests)
    torch.library.opcheck(ops.broadcast_.default, (x.clone(), 0, name), test_utils=tests)
    for op in (ops.reduce_scatter_out, ops.all_gather_out, ops.broadcast_):
        assert torch.Tag.pt2_compliant_tag in op.default.tags, op
    return True


def test_ops_results_and_opcheck(ranks):
    assert all(ranks(2).run(_ops))


def _compiled(ctx):
    n, r = ctx.world_size, ctx.rank
    comm = ctx.comm

    def fn(x, rs_out, ag_out):
        comm.reduce_scatter(rs_out, x * 2)
        comm.all_gather(ag_out, rs_out)
        comm.broadcast(ag_out, src=0)
        return ag_out + 1

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    count = 33
    inputs = [rand(q, count * n, salt=5) for q in range(n)]
    got = compiled(inputs[r], torch.empty(count), torch.empty(count * n))
    slices = [sum(2 * x[q * count:(q + 1) * count].double() for x in inputs) for q in range(n)]
    torch.testing.assert_close(got.double(), torch.cat(slices) + 1, rtol=1e-6, atol=1e-6)
    return True


def test_compiled_methods_trace_to_the_ops(ranks):
    assert all(ranks(2).run(_compiled))
