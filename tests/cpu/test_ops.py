"""torch.ops.commlib on CPU tensors (docs/ops.md), world 2 through the test launcher.

References: the direct Python API on the same inputs (bitwise: the ops run the same code), fp64
sums of every rank's input (regenerated from the same seeds), gloo all_to_all_single, and the fp64
models of tests/ops_models.py for torch.compile(fullgraph=True). Outputs are poisoned first.
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ops_models

ROOT = Path(__file__).resolve().parents[2]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rand(rank, count, dtype, salt=0):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + 31 * salt)
    return (torch.rand(count, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)


def _all_reduce_ops(ctx):
    import commlib  # noqa: F401  (loads the ops)
    ops = torch.ops.commlib
    name, n = ctx.comm.group_name, ctx.world_size
    for dtype in DTYPES:
        for count in (0, 1, 7, 4097, 70001):
            x = rand(ctx.rank, count, dtype)
            expect = ctx.comm.all_reduce_(x.clone())  # the direct API: the same bits
            fp64 = sum(rand(r, count, dtype).double() for r in range(n))
            tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
            torch.testing.assert_close(expect.double(), fp64, rtol=tol, atol=tol)
            before = x.clone()
            got = ops.all_reduce(x, "sum", name)
            assert (count == 0 or got.data_ptr() != x.data_ptr()) and torch.equal(x, before), "all_reduce wrote its input"
            assert torch.equal(got, expect), f"all_reduce {dtype} {count}"
            out = torch.full_like(x, float("nan"))
            ops.all_reduce_out(x, "sum", name, out=out)
            assert torch.equal(out, expect) and torch.equal(x, before), f"all_reduce_out {dtype} {count}"
            y = x.clone()
            ops.all_reduce_(y, "sum", name, "tree")
            assert torch.equal(y, expect), f"all_reduce_ {dtype} {count}"
        x = rand(ctx.rank, 1001, dtype, salt=1)
        got = ops.all_reduce(x, "max", name, "flat")
        assert torch.equal(got, torch.stack([rand(r, 1001, dtype, salt=1) for r in range(n)]).amax(0))
    # The Python API's out-of-place / in-place pair.
    x = rand(ctx.rank, 333, torch.float32, salt=2)
    before = x.clone()
    y = ctx.comm.all_reduce(x)
    assert y.data_ptr() != x.data_ptr() and torch.equal(x, before)
    assert ctx.comm.all_reduce_(x) is x and torch.equal(x, y)
    return True


def test_all_reduce_ops(ranks):
    ranks(2).run(_all_reduce_ops)


def _all_to_all_v_op(ctx):
    import torch.distributed as dist
    import commlib  # noqa: F401
    n, me = ctx.world_size, ctx.rank
    rows = lambda q, r: ((q * 5 + r * 3) % 4) * 3  # noqa: E731  (zero-row blocks included)
    ins = [rows(me, r) for r in range(n)]
    outs = [rows(q, me) for q in range(n)]
    inp = torch.randn(sum(ins), 5, dtype=torch.float64) + me
    ref = torch.empty(sum(outs), 5, dtype=torch.float64)
    dist.all_to_all_single(ref, inp, outs, ins, group=ctx.gloo())
    got = torch.ops.commlib.all_to_all_v(inp, outs, ins, ctx.comm.group_name)
    assert torch.equal(got, ref)
    out = torch.full_like(ref, float("nan"))
    torch.ops.commlib.all_to_all_v_out(inp, outs, ins, ctx.comm.group_name, out=out)
    assert torch.equal(out, ref)
    out = torch.full_like(ref, float("nan"))
    ctx.comm.all_to_all_v(out, inp, outs, ins)  # the direct API, all_to_all_single's argument order
    assert torch.equal(out, ref)
    even = torch.arange(n * 4 * 3, dtype=torch.float32).reshape(n * 4, 3) + 100 * me
    got = torch.ops.commlib.all_to_all_v(even, [], [], ctx.comm.group_name)
    expect = torch.cat([(torch.arange(n * 4 * 3, dtype=torch.float32).reshape(n * 4, 3) + 100 * q)[me * 4:(me + 1) * 4]
                        for q in range(n)])
    assert torch.equal(got, expect)
    return True


def test_all_to_all_v_op(ranks):
    ranks(2).run(_all_to_all_v_op)


def _ep_ops(ctx):
    import commlib
    n = ctx.world_size
    buf = commlib.EPBuffer(ctx.comm, ops_models.MAX_TOKENS, ops_models.HIDDEN, 2 * n, 2, torch.bfloat16)
    full, local = ops_models.moe_weights(ctx.rank, n)
    w_e = local.to(torch.bfloat16)
    x, idx, w = ops_models.moe_inputs(ctx.rank, n, torch.bfloat16, "cpu", salt=3)
    res = buf.dispatch(x, idx, w)
    counts = res.expert_counts.clone()
    rows = [res.expert_x[e, :int(counts[e])].clone() for e in range(len(counts))]
    expect = buf.combine(torch.bmm(res.expert_x, w_e), res.handle)
    ex, ec = torch.ops.commlib.ep_dispatch(x, idx.int(), w, buf.name)
    assert torch.equal(ec, counts)
    for e in range(len(counts)):
        assert torch.equal(ex[e, :int(counts[e])], rows[e]), f"expert {e}"
    got = torch.ops.commlib.ep_combine(torch.bmm(ex, w_e), idx, buf.name)
    assert torch.equal(got, expect), "ep_combine differs from EPBuffer.combine"
    torch.testing.assert_close(got.double(), ops_models.moe_reference(x, idx, w, full), rtol=6e-2, atol=6e-2)
    buf.check()
    # Meta kernels: the buffer's shapes, no communication.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fx, fi, fw = mode.from_tensor(x), mode.from_tensor(idx), mode.from_tensor(w)
        ex, ec = torch.ops.commlib.ep_dispatch(fx, fi, fw, buf.name)
        assert ex.shape == (2, buf.capacity, ops_models.HIDDEN) and ex.dtype == torch.bfloat16
        assert ec.shape == (2,) and ec.dtype == torch.int32
        assert torch.ops.commlib.ep_combine(ex, fi, buf.name).shape == x.shape
    return True


def test_ep_ops_match_epbuffer(ranks):
    ranks(2).run(_ep_ops)


def _fused_op(ctx):
    import commlib
    from commlib.fused import reference_rmsnorm
    comm, name = ctx.comm, ctx.comm.group_name
    for dtype in (torch.float32, torch.bfloat16):
        x = rand(ctx.rank, 5 * 64, dtype, salt=4).reshape(5, 64)
        residual = rand(0, 5 * 64, dtype, salt=5).reshape(5, 64)
        weight = rand(0, 64, dtype, salt=6)
        summed = comm.all_reduce(x)
        ref_out, ref_res = reference_rmsnorm(summed, residual, weight, 1e-5)
        res = residual.clone()
        out = torch.ops.commlib.fused_allreduce_rmsnorm(x, res, weight, 1e-5, name)
        assert torch.equal(out, ref_out) and torch.equal(res, ref_res), dtype
        res, out = residual.clone(), torch.full_like(x, float("nan"))
        torch.ops.commlib.fused_allreduce_rmsnorm_out(x, res, weight, 1e-5, name, "replicated", 0, "p2p", out=out)
        assert torch.equal(out, ref_out) and torch.equal(res, ref_res), dtype
        res = residual.clone()
        out, ret = commlib.fused.fused_allreduce_rmsnorm(comm, x, res, weight, 1e-5)
        assert ret is res and torch.equal(out, ref_out) and torch.equal(res, ref_res), dtype
    return True


def test_fused_op(ranks):
    ranks(2).run(_fused_op)


def _opcheck(ctx):
    """torch.library.opcheck: the schemas' mutation annotations match what the kernels do, and the
    Meta kernels agree with the real ones (every rank runs the same sequence of collectives)."""
    import commlib  # noqa: F401
    name = ctx.comm.group_name
    tests = ("test_schema", "test_faketensor")
    x = rand(ctx.rank, 40, torch.float32).reshape(5, 8)
    ops = torch.ops.commlib
    torch.library.opcheck(ops.all_reduce.default, (x, "sum", name), test_utils=tests)
    torch.library.opcheck(ops.all_reduce_.default, (x.clone(), "sum", name), test_utils=tests)
    torch.library.opcheck(ops.all_reduce_out.default, (x, "sum", name), {"out": torch.empty_like(x)}, test_utils=tests)
    torch.library.opcheck(ops.all_to_all_v.default, (x[:4], [], [], name), test_utils=tests)
    splits = [1, 3] if ctx.rank == 0 else [2, 2]  # rank 0 sends 1 row to itself, 3 to rank 1
    recv = [1, 2] if ctx.rank == 0 else [3, 2]
    torch.library.opcheck(ops.all_to_all_v.default, (x[:4], recv, splits, name), test_utils=tests)
    torch.library.opcheck(ops.fused_allreduce_rmsnorm.default, (x, x.clone() * 0.5, x[0].clone(), 1e-5, name),
                          test_utils=tests)
    torch.library.opcheck(ops.fused_allreduce_rmsnorm_out.default, (x, x.clone() * 0.5, x[0].clone(), 1e-5, name),
                          {"out": torch.empty_like(x)}, test_utils=tests)
    for op in (ops.all_reduce, ops.all_reduce_, ops.all_reduce_out, ops.all_to_all_v, ops.all_to_all_v_out,
               ops.ep_dispatch, ops.ep_combine, ops.fused_allreduce_rmsnorm, ops.fused_allreduce_rmsnorm_out):
        assert torch.Tag.pt2_compliant_tag in op.default.tags, op
    return True


def test_opcheck(ranks):
    ranks(2).run(_opcheck)


def _names(ctx):
    import commlib
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"all_reduce: group_name 'nope' names no open communicator in this "
                                         r"process; open: .*'test-default'"):
        torch.ops.commlib.all_reduce(x, "sum", "nope")
    with pytest.raises(ValueError, match=r"ep_dispatch: buffer_name 'nope' names no live EP buffer"):
        torch.ops.commlib.ep_dispatch(x.reshape(1, 4), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), "nope")
    with pytest.raises(ValueError, match=r"all_reduce: op 'median' not supported"):
        torch.ops.commlib.all_reduce(x, "median", ctx.comm.group_name)
    # A second open communicator may not take the name; after close the name is free again.
    with pytest.raises(ValueError, match=r"Communicator: name 'test-default' already names an open communicator"):
        ctx.new_comm("test-default")
    other = ctx.new_comm("ops-names")
    assert torch.equal(torch.ops.commlib.all_reduce(x, "sum", "ops-names"), x * ctx.world_size)
    other.close()
    with pytest.raises(ValueError, match=r"all_reduce: group_name 'ops-names' names no open communicator"):
        torch.ops.commlib.all_reduce(x, "sum", "ops-names")
    again = ctx.new_comm("ops-names")
    assert torch.equal(again.all_reduce(x), x * ctx.world_size)
    again.close()
    # EP buffers: distinct default names; a chosen name is the caller's to keep unique.
    bufs = [commlib.EPBuffer(ctx.comm, 4, 8, 2 * ctx.world_size, 1, torch.float32) for _ in range(2)]
    assert bufs[0].name != bufs[1].name and bufs[0].name.startswith("test-default/ep")
    mine = commlib.EPBuffer(ctx.comm, 4, 8, 2 * ctx.world_size, 1, torch.float32, name="ops-ep")
    with pytest.raises(ValueError, match=r"EPBuffer: name 'ops-ep' already names a live EP buffer"):
        commlib.EPBuffer(ctx.comm, 4, 8, 2 * ctx.world_size, 1, torch.float32, name="ops-ep")
    del mine
    commlib.EPBuffer(ctx.comm, 4, 8, 2 * ctx.world_size, 1, torch.float32, name="ops-ep")  # free again
    # The communicator still works after the refused calls.
    assert torch.equal(torch.ops.commlib.all_reduce(x, "sum", ctx.comm.group_name), x * ctx.world_size)
    assert commlib.Communicator is not None
    return True


def test_group_names(ranks):
    ranks(2).run(_names)


def _ddacomm_group_name(ctx):
    """A "ddacomm" process group's communicator is named "ddacomm-<group name>" in the ops."""
    import torch.distributed as dist
    from test_backend import ddacomm_world
    with ddacomm_world(ctx) as (world, gloo):
        name = "ddacomm-" + world.group_name
        x = rand(ctx.rank, 4097, torch.float32, salt=8)
        ref = x.clone()
        dist.all_reduce(ref, group=gloo)
        got = torch.ops.commlib.all_reduce(x, "sum", name)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        out = torch.ops.commlib.fused_allreduce_rmsnorm(x.reshape(-1, 1)[:4096].reshape(64, 64), torch.zeros(64, 64),
                                                        torch.ones(64), 1e-5, name)
        assert out.shape == (64, 64) and not torch.isnan(out).any()
    return name


def test_ddacomm_group_communicator_by_name(ranks):
    names = ranks(2).run(_ddacomm_group_name)
    assert names[0] == names[1] and names[0].startswith("ddacomm-")


# ---- torch.compile(fullgraph=True): no graph break, the same results as eager ----

def _compiled_tp(ctx, backend):
    return ops_models.compiled_tp_mlp(ctx, "cpu", torch.float32, backend)


def test_compile_tensor_parallel_mlp(ranks):
    """Inductor (C++ codegen with gcc): a small column/row-parallel MLP with all_reduce, all_reduce_ and
    the fused all-reduce + RMSNorm, compiled into one graph."""
    graphs_ops = ranks(2).run(_compiled_tp, "inductor")
    expect = ["all_reduce", "all_reduce_", "fused_allreduce_rmsnorm"]
    assert graphs_ops == [expect, expect]


def _compiled_moe(ctx, backend):
    return ops_models.compiled_ep_moe(ctx, "cpu", torch.float32, backend)


def test_compile_ep_moe(ranks):
    """Inductor: EP dispatch -> per-expert linear -> combine, compiled into one graph."""
    assert ranks(2).run(_compiled_moe, "inductor") == [["ep_combine", "ep_dispatch"]] * 2


def _out_forms_input(q, n):
    """Rank q's all_to_all_v input, regenerated by every rank for the reference; rank q sends rank r
    ((q + r) % 3) + 1 rows."""
    counts = [((q + r) % 3) + 1 for r in range(n)]
    return torch.randn(sum(counts), 3, generator=torch.Generator().manual_seed(4099 + q)), counts


def _compiled_out_forms(ctx):
    """The out= and all_to_all_v forms of the Python API compile into one graph too."""
    comm, n, me = ctx.comm, ctx.world_size, ctx.rank
    inp, ins = _out_forms_input(me, n)
    outs = [_out_forms_input(q, n)[1][me] for q in range(n)]

    def fn(x, out, inp, recv):
        comm.all_reduce(x * 2, out=out)
        comm.all_to_all_v(recv, inp + 1, outs, ins)
        return out + 1, recv * 3

    recorder = ops_models.GraphRecorder("aot_eager")
    compiled = torch.compile(fn, backend=recorder, fullgraph=True)
    x = rand(me, 100, torch.float32, salt=9)
    with torch.no_grad(), ops_models.fresh_compile():
        out, recv = torch.full_like(x, float("nan")), torch.full((sum(outs), 3), float("nan"))
        got_out, got_recv = compiled(x, out, inp, recv)
    blocks = []
    for q in range(n):
        theirs, counts = _out_forms_input(q, n)
        start = sum(counts[:me])
        blocks.append(theirs[start:start + counts[me]] + 1)
    ref = torch.cat(blocks)
    assert torch.equal(recv, ref) and torch.equal(got_recv, ref * 3)
    expect = sum(rand(r, 100, torch.float32, salt=9).double() * 2 for r in range(n))
    torch.testing.assert_close(out.double(), expect, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_out, out + 1)
    assert len(recorder.graphs) == 1
    return sorted(recorder.graphs[0])


def test_compile_out_forms(ranks):
    """aot_eager (no code generation needed to show the graph and its functionalisation)."""
    assert ranks(2).run(_compiled_out_forms) == [["all_reduce_out", "all_to_all_v_out"]] * 2


# ---- Python API details ----

def test_timeout_error_renamed():
    import commlib
    import commlib.errors
    assert issubclass(commlib.CommTimeoutError, commlib.CommError)
    assert "TimeoutError" not in commlib.__all__ and "TimeoutError" not in commlib.errors.__all__
    with pytest.warns(DeprecationWarning, match="commlib.TimeoutError is deprecated; use commlib.CommTimeoutError"):
        assert commlib.TimeoutError is commlib.CommTimeoutError
    with pytest.warns(DeprecationWarning, match="commlib.errors.TimeoutError is deprecated"):
        assert commlib.errors.TimeoutError is commlib.CommTimeoutError
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from commlib import *", scope)  # noqa: S102
    assert "TimeoutError" not in scope and scope["CommTimeoutError"] is commlib.CommTimeoutError
    with pytest.raises(AttributeError):
        commlib.NoSuchName  # noqa: B018


def test_backend_registration_failure_warns():
    """A failing register_backend() at import is a warning naming the error, and import still works."""
    code = ("import warnings, torch.distributed as dist\n"
            "def broken(*a, **k): raise RuntimeError('registry is full')\n"
            "dist.Backend.register_backend = broken\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import commlib\n"
            "print([str(w.message) for w in caught if 'ddacomm' in str(w.message)])\n"
            "print(commlib.Communicator.__name__)\n")
    env_path = str(ROOT / "python")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": env_path,
                              "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})  # commlib's import, not torch's
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert "RuntimeError: registry is full" in lines[0], run.stdout
    assert lines[1] == "Communicator"
