"""GPU reduce_scatter, all_gather, broadcast and all_to_all (equal splits) over NVLink peer memory:
commlib's push-exchange kernels (docs/gpu-collectives.md), through the direct API and through the
"ddacomm" torch backend.

References, per test: reduce_scatter against the documented ordered fp32 reduction (Note [reduction
order]: ranks in order 0..n-1, one rounding, avg = sum / n) computed on the CPU, bit for bit, and an
fp64 sum within the dtype's rounding; the data-movement ops against the exact bytes every rank's
input holds (each rank regenerates its peers' inputs from their seeds); NCCL on the same inputs
where an NCCL group can exist (marked ``nccl``). Inputs are fresh random values (never zeros);
outputs are poisoned first and sit between NaN / sentinel guard regions, so an element left
unwritten or written out of bounds fails. The backend tests read the call counters: every call
checked went through commlib's path (num_fast_calls), none to the inner NCCL (num_fallback_calls).
"""
from __future__ import annotations

import functools
import os
from datetime import timedelta

import pytest
import torch
from ddacomm_worlds import ddacomm_world, fast_path_counts

pytestmark = pytest.mark.gpu

FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Every dtype the data-movement kernels take (they move bytes).
MOVABLE = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int8,
           torch.uint8, torch.bool]
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SIZES = [1, 2, 7, 8, 9, 17, 255, 1023, 4097, 65537, (1 << 20) + 3]


@functools.lru_cache(maxsize=64)
def _cpu_input(rank, count, dtype, salt):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + 104729 * salt + 17)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if dtype.is_floating_point:
        return (torch.rand(count, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(1 << 30)), min(info.max, 1 << 30), (count,), generator=g, dtype=torch.int64
                         ).to(dtype)


def rank_input(rank, count, dtype, salt=0):
    return _cpu_input(rank, count, dtype, salt).clone()


def poison_value(dtype):
    if dtype == torch.bool:
        return True
    return float("nan") if dtype.is_floating_point else -7


def guarded(count, dtype, pad, dev):
    """A [pad | count | pad] buffer filled with the poison value, and its middle window."""
    buf = torch.full((count + 2 * pad,), poison_value(dtype), dtype=dtype, device=dev)
    return buf, buf[pad:pad + count]


def check_guards(buf, count, pad, what):
    cpu = buf.cpu()
    fill = torch.full((pad,), poison_value(buf.dtype), dtype=buf.dtype)
    if buf.dtype.is_floating_point:
        ok = torch.isnan(cpu[:pad].float()).all() and torch.isnan(cpu[pad + count:].float()).all()
    else:
        ok = torch.equal(cpu[:pad], fill) and torch.equal(cpu[pad + count:], fill)
    assert ok, f"{what}: wrote outside the output (count={count}, pad={pad})"


def same_bytes(got, expected, what):
    got = got.cpu()
    if got.dtype.is_floating_point:  # bitwise: NaN-safe, and -0.0 != 0.0
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), what
    else:
        assert torch.equal(got, expected), what


def ordered_reference(inputs, op, n):
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float()
    if op == "avg":
        acc = acc / torch.full_like(acc, float(n))
    return acc.to(inputs[0].dtype)


# ---- the direct API ----

def meant_variant(op, message_bytes, world_size):
    """The kernel the direct API means for a message (Note [plan], Note [push exchange]): at world 1 the
    local copy; else the LL kernels up to COMMLIB_FLAT_LL_MAX_BYTES (default 256 KiB) of the whole
    message, broadcast never."""
    if world_size == 1:
        return "local_copy"
    ll = message_bytes <= int(os.environ.get("COMMLIB_FLAT_LL_MAX_BYTES") or 262144) and op != "broadcast"
    if op == "reduce_scatter":
        return "reduce_scatter_ll" if ll else "reduce_scatter"
    return "exchange_ll" if ll else "exchange"


def counted(comm, op, t, call):
    """Runs call() (one `op` with input t) and asserts that exactly the planned variant ran, once, and
    that it is the one meant for the message."""
    import commlib
    plan = comm.plan(op, t)
    message = t.numel() * t.element_size() * (comm.world_size if op == "all_gather" else 1)
    assert plan.variant == meant_variant(op, message, comm.world_size), f"{op}: planned {plan.reason}"
    before = commlib.plan_counters()
    call()
    after = commlib.plan_counters()
    ran = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert ran == ({plan.variant: 1} if t.numel() else {}), f"{op}: planned {plan.reason}; ran {ran}"


def _reduce_scatter_case(ctx, comm, count, dtype, op, pad, salt=0):
    dev = torch.device("cuda", ctx.device)
    n, r = ctx.world_size, ctx.rank
    inputs = [rank_input(q, count * n, dtype, salt) for q in range(n)]
    src_buf, src = guarded(count * n, dtype, pad, dev)
    src.copy_(inputs[r])
    buf, out = guarded(count, dtype, pad, dev)
    counted(comm, "reduce_scatter", src, lambda: comm.reduce_scatter(out, src, op=op))
    check_guards(buf, count, pad, "reduce_scatter")
    same_bytes(src, inputs[r], "reduce_scatter changed its input")
    mine = [x[r * count:(r + 1) * count] for x in inputs]
    got = out.cpu()
    expected = ordered_reference(mine, op, n)
    assert torch.equal(got.view(INT_VIEW[dtype]), expected.view(INT_VIEW[dtype])), \
        f"reduce_scatter {op} {dtype} count={count} pad={pad}: differs from the ordered fp32 reference"
    ref64 = sum(x.double() for x in mine) / (n if op == "avg" else 1)
    torch.testing.assert_close(got.double(), ref64, rtol=TOL[dtype], atol=TOL[dtype])


def _all_gather_case(ctx, comm, count, dtype, pad, salt=0):
    dev = torch.device("cuda", ctx.device)
    n, r = ctx.world_size, ctx.rank
    inputs = [rank_input(q, count, dtype, salt) for q in range(n)]
    src_buf, src = guarded(count, dtype, pad, dev)
    src.copy_(inputs[r])
    buf, out = guarded(count * n, dtype, pad, dev)
    counted(comm, "all_gather", src, lambda: comm.all_gather(out, src))
    check_guards(buf, count * n, pad, "all_gather")
    same_bytes(out, torch.cat(inputs), f"all_gather {dtype} count={count} pad={pad}")


def _broadcast_case(ctx, comm, count, dtype, pad, root, salt=0):
    dev = torch.device("cuda", ctx.device)
    buf, t = guarded(count, dtype, pad, dev)
    if ctx.rank == root:
        t.copy_(rank_input(root, count, dtype, salt))
    counted(comm, "broadcast", t, lambda: comm.broadcast(t, src=root))
    check_guards(buf, count, pad, "broadcast")
    same_bytes(t, rank_input(root, count, dtype, salt), f"broadcast {dtype} count={count} root={root}")


def _all_to_all_case(ctx, comm, block, dtype, pad, salt=0):
    dev = torch.device("cuda", ctx.device)
    n, r = ctx.world_size, ctx.rank
    inputs = [rank_input(q, block * n, dtype, salt) for q in range(n)]
    src_buf, src = guarded(block * n, dtype, pad, dev)
    src.copy_(inputs[r])
    buf, out = guarded(block * n, dtype, pad, dev)
    counted(comm, "all_to_all", src, lambda: comm.all_to_all(out, src))
    check_guards(buf, block * n, pad, "all_to_all")
    expected = torch.cat([inputs[q][r * block:(r + 1) * block] for q in range(n)])
    same_bytes(out, expected, f"all_to_all {dtype} block={block} pad={pad}")


def _reduce_scatter_all(ctx, dtype_name, op):
    dtype = FLOATS[dtype_name]
    for count in SIZES:
        for pad in (0, 1, 8):  # aligned, unaligned by one element, aligned with an offset
            _reduce_scatter_case(ctx, ctx.comm, count, dtype, op, pad)
    return True


# Messages up to COMMLIB_FLAT_LL_MAX_BYTES (256 KiB) take the LL kernels, larger ones the barrier
# kernels; with 0 every size takes the barrier kernels.
NO_LL = {"COMMLIB_FLAT_LL_MAX_BYTES": "0"}
KERNELS = {"ll-and-barrier": None, "barrier-only": NO_LL}


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype_name", list(FLOATS))
def test_reduce_scatter_matches_ordered_and_fp64_references(ranks, dtype_name, op, kernels):
    assert all(ranks(2, env=KERNELS[kernels]).run(_reduce_scatter_all, dtype_name, op))


def _movement_all(ctx, which):
    for d, dtype in enumerate(MOVABLE):
        for i, count in enumerate(SIZES):
            for pad in (0, 1, 8):
                if which == "all_gather":
                    _all_gather_case(ctx, ctx.comm, count, dtype, pad)
                elif which == "broadcast":  # every root, in turn
                    root = (d + i + pad) % ctx.world_size
                    _broadcast_case(ctx, ctx.comm, count, dtype, pad, root, salt=root)
                else:
                    _all_to_all_case(ctx, ctx.comm, count, dtype, pad)
    return True


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("which", ["all_gather", "broadcast", "all_to_all"])
def test_data_movement_every_dtype_odd_sizes(ranks, which, kernels):
    assert all(ranks(2, env=KERNELS[kernels]).run(_movement_all, which))


def _empty_and_random_sizes(ctx):
    dev = torch.device("cuda", ctx.device)
    n = ctx.world_size
    e = torch.empty(0, device=dev)
    ctx.comm.reduce_scatter(torch.empty(0, device=dev), e)
    ctx.comm.all_gather(torch.empty(0, device=dev), e)
    ctx.comm.broadcast(torch.empty(0, device=dev), src=n - 1)
    ctx.comm.all_to_all(torch.empty(0, device=dev), e)
    g = torch.Generator().manual_seed(42)  # same sizes on every rank
    sizes = torch.randint(1, 200_000, (12,), generator=g).tolist()
    for i, count in enumerate(sizes):
        dtype = list(FLOATS.values())[i % 3]
        _reduce_scatter_case(ctx, ctx.comm, count, dtype, "sum", pad=i % 5, salt=i)
        _all_gather_case(ctx, ctx.comm, count, MOVABLE[i % len(MOVABLE)], pad=i % 3, salt=i)
        _broadcast_case(ctx, ctx.comm, count, dtype, pad=i % 2, root=i % n, salt=i)
        _all_to_all_case(ctx, ctx.comm, count, MOVABLE[(i + 3) % len(MOVABLE)], pad=i % 4, salt=i)
    return True


def test_zero_elements_and_random_sizes(ranks):
    assert all(ranks(2).run(_empty_and_random_sizes))


def _in_place(ctx):
    dev = torch.device("cuda", ctx.device)
    n, r = ctx.world_size, ctx.rank
    for count in (1, 4097, 65537):
        inputs = [rank_input(q, count, torch.bfloat16, 5) for q in range(n)]
        out = torch.full((count * n,), float("nan"), dtype=torch.bfloat16, device=dev)
        mine = out[r * count:(r + 1) * count]
        mine.copy_(inputs[r])
        ctx.comm.all_gather(out, mine)  # FSDP's layout: the input is this rank's block of the output
        same_bytes(out, torch.cat(inputs), f"in-place all_gather count={count}")
        # reduce_scatter into this rank's slice of its own input
        full = [rank_input(q, count * n, torch.float32, 6) for q in range(n)]
        x = full[r].to(dev)
        ctx.comm.reduce_scatter(x[r * count:(r + 1) * count], x)
        expected = ordered_reference([f[r * count:(r + 1) * count] for f in full], "sum", n)
        same_bytes(x[r * count:(r + 1) * count], expected, f"in-place reduce_scatter count={count}")
    return True


def test_in_place_forms(ranks):
    assert all(ranks(2).run(_in_place))


# A workspace of 64 KiB: every message above 32 KiB / world runs as several calls.
SMALL_WORKSPACE = {"COMMLIB_GPU_WORKSPACE_BYTES": "65536"}


def _chunked(ctx):
    for count in (4095, 65537, 300_007):
        _reduce_scatter_case(ctx, ctx.comm, count, torch.bfloat16, "avg", pad=1, salt=count)
        _all_gather_case(ctx, ctx.comm, count, torch.int8, pad=3, salt=count)
        _broadcast_case(ctx, ctx.comm, count, torch.float32, pad=1, root=1, salt=count)
        _all_to_all_case(ctx, ctx.comm, count, torch.float16, pad=1, salt=count)
    return True


def test_messages_larger_than_the_workspace(ranks):
    assert all(ranks(2, env=SMALL_WORKSPACE).run(_chunked))


def test_ll_messages_larger_than_one_ll_call(ranks):
    # LL up to 8 MiB: blocks above the 512 KiB of payload per call run as several LL calls.
    assert all(ranks(2, env={"COMMLIB_FLAT_LL_MAX_BYTES": str(8 << 20)}).run(_chunked))


def _graph_replay(ctx):
    dev = torch.device("cuda", ctx.device)
    n, r = ctx.world_size, ctx.rank
    count, dtype = 30_001, torch.bfloat16
    comm = ctx.comm
    rs_in = torch.empty(count * n, dtype=dtype, device=dev)
    rs_out = torch.empty(count, dtype=dtype, device=dev)
    ag_out = torch.empty(count * n, dtype=dtype, device=dev)
    bc = torch.empty(count + 1, dtype=torch.float32, device=dev)
    a2a_in = torch.empty(count * n, dtype=torch.int32, device=dev)
    a2a_out = torch.empty(count * n, dtype=torch.int32, device=dev)

    def body():
        comm.reduce_scatter(rs_out, rs_in, op="sum")
        comm.all_gather(ag_out, rs_out)  # consumes the reduce_scatter: order matters
        comm.broadcast(bc, src=n - 1)
        comm.all_to_all(a2a_out, a2a_in)

    body()  # first use outside capture (creates the GPU state)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            body()
    torch.cuda.synchronize()
    for i in range(50):
        ins = [rank_input(q, count * n, dtype, 100 + i) for q in range(n)]
        rs_in.copy_(ins[r])
        if r == n - 1:
            bc.copy_(rank_input(n - 1, count + 1, torch.float32, 200 + i))
        else:
            bc.fill_(float("nan"))
        a2a = [rank_input(q, count * n, torch.int32, 300 + i) for q in range(n)]
        a2a_in.copy_(a2a[r])
        for t in (rs_out, ag_out, a2a_out):
            t.fill_(poison_value(t.dtype))
        graph.replay()
        torch.cuda.synchronize()
        slices = [ordered_reference([x[q * count:(q + 1) * count] for x in ins], "sum", n) for q in range(n)]
        same_bytes(rs_out, slices[r], f"replay {i}: reduce_scatter")
        same_bytes(ag_out, torch.cat(slices), f"replay {i}: all_gather")
        same_bytes(bc, rank_input(n - 1, count + 1, torch.float32, 200 + i), f"replay {i}: broadcast")
        same_bytes(a2a_out, torch.cat([a2a[q][r * count:(r + 1) * count] for q in range(n)]), f"replay {i}: a2a")
    return True


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_cuda_graph_capture_and_replay(ranks, kernels):
    assert all(ranks(2, env=KERNELS[kernels]).run(_graph_replay))


def _bad_inputs(ctx):
    dev = torch.device("cuda", ctx.device)
    n = ctx.world_size
    x = torch.ones(4 * n, device=dev)
    with pytest.raises(TypeError, match=r"reduce_scatter: dtype int32 not supported; supported: float32"):
        ctx.comm.reduce_scatter(torch.ones(4, dtype=torch.int32, device=dev), x.int())
    with pytest.raises(ValueError, match=r"reduce_scatter: input has"):
        ctx.comm.reduce_scatter(torch.ones(5, device=dev), x)
    with pytest.raises(ValueError, match=r"all_gather: output has"):
        ctx.comm.all_gather(torch.ones(3, device=dev), x)
    with pytest.raises(ValueError, match=r"broadcast: src 7 out of range; valid: 0\.\." + str(n - 1)):
        ctx.comm.broadcast(x, src=7)
    with pytest.raises(ValueError, match=r"reduce_scatter: op max not supported for CUDA tensors; supported: sum, avg"):
        ctx.comm.reduce_scatter(torch.ones(4, device=dev), x, op="max")
    # Still usable, and the results right.
    out = torch.empty(4, device=dev)
    ctx.comm.reduce_scatter(out, x)
    assert torch.equal(out, torch.full_like(out, float(n)))
    return True


def test_bad_inputs_raise_synchronously(ranks):
    assert all(ranks(2).run(_bad_inputs))


def _timeout(ctx, which):
    import commlib
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm(f"timeout-{which}", timeout=timedelta(seconds=2))
    n = ctx.world_size
    x = torch.ones(4 * n, device=dev)
    out = torch.empty(4 * n, device=dev)
    comm.all_gather(out, x[:4])  # both ranks: creates the GPU state
    torch.cuda.synchronize()
    if ctx.rank == 0:  # rank 1 never joins: rank 0's wait must expire, not hang
        if which == "reduce_scatter":
            comm.reduce_scatter(out[:4], x)
        elif which == "all_gather":
            comm.all_gather(out, x[:4])
        elif which == "broadcast":
            comm.broadcast(x, src=0)
        else:
            comm.all_to_all(out, x)
        torch.cuda.synchronize()
        with pytest.raises(commlib.CommTimeoutError, match=r"rank 0 waited \d+ ms for rank 1 at phase '"):
            comm.check_gpu_error()
        with pytest.raises(commlib.CommTimeoutError, match=r"all_gather: Timed out in an earlier GPU wait"):
            comm.all_gather(out, x[:4])
    comm.close()
    return True


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("which", ["reduce_scatter", "all_gather", "broadcast", "all_to_all"])
def test_device_wait_times_out_with_a_clear_error(ranks, which, kernels):
    assert all(ranks(2, env=KERNELS[kernels]).run(_timeout, which, timeout=120))


def _after_all_to_all_v(ctx, late_rank):
    """all_to_all_v (host splits, through the workspace), then barrier kernels of every kind, with
    one rank arriving late at each: every call's barrier must wait for that rank's pushes, not take
    a flag value left by all_to_all_v (whose phases once lay beyond the next calls' values, so the
    next all_gather read the late peer's block before it was pushed)."""
    import time
    dev = torch.device("cuda", ctx.device)
    comm, n, r = ctx.comm, ctx.world_size, ctx.rank
    count = 300_007  # above the LL limit: the push exchange and the flat kernels, through the workspace
    for i in range(3):
        rows = [(s + d + i) % 4 + 1 for d in range(n) for s in range(n)]  # rows[s * n + d]: s sends d
        ins, outs = [rows[r * n + d] for d in range(n)], [rows[s * n + r] for s in range(n)]
        x = torch.cat([torch.full((ins[d], 3), float(r * 100 + d), device=dev) for d in range(n)])
        want = torch.cat([torch.full((outs[s], 3), float(s * 100 + r)) for s in range(n)])
        out = torch.full((sum(outs), 3), float("nan"), device=dev)
        comm.all_to_all_v(out, x, outs, ins)
        same_bytes(out, want, f"all_to_all_v {i}")
        for which in ("all_gather", "reduce_scatter", "all_reduce_flat", "all_reduce_tree"):
            salt = 97 * i + len(which)
            if r == late_rank:
                torch.cuda.synchronize()
                time.sleep(0.05)  # the peers' kernels reach the barrier first
            if which == "all_gather":
                _all_gather_case(ctx, comm, count, torch.float16, pad=1, salt=salt)
            elif which == "reduce_scatter":
                _reduce_scatter_case(ctx, comm, count, torch.bfloat16, "sum", pad=1, salt=salt)
            else:
                inputs = [rank_input(q, count, torch.bfloat16, salt) for q in range(n)]
                got = comm.all_reduce(inputs[r].to(dev), "sum", which.split("_")[-1])
                same_bytes(got, ordered_reference(inputs, "sum", n), f"{which} after all_to_all_v")
            out.fill_(float("nan"))
            comm.all_to_all_v(out, x, outs, ins)  # so the next barrier call follows one too
            same_bytes(out, want, f"all_to_all_v after {which}")
    return True


@pytest.mark.parametrize("late_rank", [0, 1])
def test_barrier_calls_after_all_to_all_v(ranks, late_rank):
    assert all(ranks(2).run(_after_all_to_all_v, late_rank))


def _few_sizes(ctx):
    for dtype in FLOATS.values():
        for count in (1, 9, 4097, 60_001):
            ctx.progress(f"collectives {dtype} count={count}")
            for op in ("sum", "avg"):
                _reduce_scatter_case(ctx, ctx.comm, count, dtype, op, pad=1, salt=count)
            _all_gather_case(ctx, ctx.comm, count, dtype, pad=1, salt=count)
            _broadcast_case(ctx, ctx.comm, count, dtype, pad=1, root=ctx.world_size - 1, salt=count)
            _all_to_all_case(ctx, ctx.comm, count, dtype, pad=1, salt=count)
    return True


# World 1 (no peers: the local copies only), the generic kernels (3) and the 4 / 8 specialisations;
# need that many GPUs, or COMMLIB_TEST_SHARE_GPUS=1.
@pytest.mark.parametrize("world_size", [1, 3, 4, 8])
def test_other_world_sizes(ranks, world_size):
    assert all(ranks(world_size).run(_few_sizes))
    assert all(ranks(world_size, env=NO_LL).run(_few_sizes))


# ---- the "ddacomm" torch backend ----

def _backend_ops(ctx, async_op):
    """Every routed verb once per size/dtype: exact results and one fast call each, no fallback."""
    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    dev = torch.device("cuda", ctx.device)
    with ddacomm_world(ctx, device_id=True, with_nccl=False) as (world, _):
        for dtype in (torch.bfloat16, torch.float32, torch.int64):
            for count in (0, 1, 7, 4097, 65537):
                salt = count + 11
                ins = [rank_input(q, count * n, dtype, salt) for q in range(n)]
                x = ins[r].to(dev)
                fast0, fallback0 = fast_path_counts(world)
                calls = 0

                def done(work):
                    if async_op:
                        work.wait()

                if dtype.is_floating_point:
                    out = torch.full((count,), float("nan"), dtype=dtype, device=dev)
                    done(dist.reduce_scatter_tensor(out, x, async_op=async_op))
                    expected = ordered_reference([i[r * count:(r + 1) * count] for i in ins], "sum", n)
                    same_bytes(out, expected, f"reduce_scatter_tensor {dtype} {count}")
                    outs = [torch.full((count,), float("nan"), dtype=dtype, device=dev)]
                    done(dist.reduce_scatter(outs[0], list(x.chunk(n)) if count else [x[:0]] * n,
                                             op=dist.ReduceOp.AVG, async_op=async_op))
                    expected = ordered_reference([i[r * count:(r + 1) * count] for i in ins], "avg", n)
                    same_bytes(outs[0], expected, f"reduce_scatter (list, avg) {dtype} {count}")
                    calls += 2
                mine = x[:count]
                out = torch.full((count * n,), poison_value(dtype), dtype=dtype, device=dev)
                done(dist.all_gather_into_tensor(out, mine, async_op=async_op))
                same_bytes(out, torch.cat([i[:count] for i in ins]), f"all_gather_into_tensor {dtype} {count}")
                outs = [torch.full((count,), poison_value(dtype), dtype=dtype, device=dev) for _ in range(n)]
                done(dist.all_gather(outs, mine, async_op=async_op))
                for q in range(n):
                    same_bytes(outs[q], ins[q][:count], f"all_gather (list) {dtype} {count} from {q}")
                t = x.clone() if r == n - 1 else torch.full_like(x, poison_value(dtype))
                done(dist.broadcast(t, src=n - 1, async_op=async_op))
                same_bytes(t, ins[n - 1], f"broadcast {dtype} {count}")
                out = torch.full((count * n,), poison_value(dtype), dtype=dtype, device=dev)
                done(dist.all_to_all_single(out, x, async_op=async_op))
                same_bytes(out, torch.cat([i[r * count:(r + 1) * count] for i in ins]), f"all_to_all_single {count}")
                calls += 4
                torch.cuda.synchronize()
                assert fast_path_counts(world) == (fast0 + calls, fallback0), \
                    f"{dtype} count={count}: not every call took commlib's path"
    return True


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_backend_routes_to_commlib_with_exact_results(ranks, async_op):
    assert all(ranks(2).run(_backend_ops, async_op))


def _backend_graph(ctx):
    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    count = 8192
    with ddacomm_world(ctx, device_id=True, with_nccl=False) as (world, _):
        x = torch.empty(count * n, device="cuda", dtype=torch.bfloat16)
        rs = torch.empty(count, device="cuda", dtype=torch.bfloat16)
        ag = torch.empty(count * n, device="cuda", dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(rs, x.fill_(1))  # warm-up outside capture
        dist.all_gather_into_tensor(ag, rs)
        torch.cuda.synchronize()
        fast0, fallback0 = fast_path_counts(world)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dist.reduce_scatter_tensor(rs, x)
            dist.all_gather_into_tensor(ag, rs)
        assert fast_path_counts(world) == (fast0 + 2, fallback0), "the captured calls are not commlib's"
        for step in range(5):
            ins = [rank_input(q, count * n, torch.bfloat16, 400 + step) for q in range(n)]
            x.copy_(ins[r])
            ag.fill_(float("nan"))
            graph.replay()
            slices = [ordered_reference([i[q * count:(q + 1) * count] for i in ins], "sum", n) for q in range(n)]
            same_bytes(ag, torch.cat(slices), f"graph replay {step}")
    return True


def test_backend_cuda_graph_capture(ranks):
    assert all(ranks(2).run(_backend_graph))


def _backend_vs_nccl(ctx):
    """Above and below the crossovers (COMMLIB_*_MAX_BYTES=1 MiB here): commlib below, NCCL above,
    both against NCCL on the same inputs."""
    import commlib
    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    dev = torch.device("cuda", ctx.device)
    with ddacomm_world(ctx, device_id=True) as (world, nccl):
        for dtype in FLOATS.values():
            for count in (3, 4096, 262147, 4 << 20):
                x = rank_input(r, count * n, dtype, 9).to(dev)
                below = count * n * x.element_size() <= (1 << 20)
                fast0, fallback0 = fast_path_counts(world)
                plans0 = commlib.plan_counters()
                ours, theirs = torch.empty(count, dtype=dtype, device=dev), torch.empty(count, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(ours, x)
                dist.reduce_scatter_tensor(theirs, x, group=nccl)
                torch.testing.assert_close(ours.float(), theirs.float(), rtol=TOL[dtype], atol=TOL[dtype])
                ours, theirs = torch.empty(count * n, dtype=dtype, device=dev), torch.empty_like(x)
                dist.all_to_all_single(ours, x)
                dist.all_to_all_single(theirs, x, group=nccl)
                assert torch.equal(ours, theirs)
                torch.cuda.synchronize()
                expected = (fast0 + 2, fallback0) if below else (fast0, fallback0 + 2)
                assert fast_path_counts(world) == expected, f"count={count}: wrong route"
                # The plan says the same (Note [plan]): the backend counts nccl for what it hands on.
                plans = commlib.plan_counters()
                ran = {k: plans[k] - plans0[k] for k in plans if plans[k] != plans0[k]}
                if below:
                    assert "nccl" not in ran and sum(ran.values()) == 2, f"count={count}: ran {ran}"
                else:
                    assert ran == {"nccl": 2}, f"count={count}: ran {ran}"
    return True


@pytest.mark.nccl
def test_backend_against_nccl_and_crossover(ranks):
    env = {"COMMLIB_REDUCE_SCATTER_MAX_BYTES": str(1 << 20), "COMMLIB_ALL_TO_ALL_MAX_BYTES": str(1 << 20)}
    assert all(ranks(2, env=env).run(_backend_vs_nccl))
