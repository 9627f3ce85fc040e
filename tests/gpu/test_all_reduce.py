"""GPU all-reduce (flat one-shot, tree two-shot) over NVLink peer memory. Needs >= 2 GPUs.

References, per test: the documented ordered fp32 reduction (Note [reduction order]: ranks in
order 0..n-1, one rounding, avg = sum / n) computed on the CPU, which every algorithm must match
bit for bit; an fp64 sum within the dtype's rounding; NCCL on the same inputs within bf16/fp16
tolerance. Inputs are random (never zeros); user buffers carry NaN guard regions so a write out of
bounds, or an element left unwritten, fails the test.
"""
import functools
import os
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SIZES = [1, 2, 7, 8, 9, 15, 16, 17, 255, 1023, 4097, 65535, 65537, (1 << 20) + 3, 3 * (1 << 20) + 7]


@functools.lru_cache(maxsize=16)  # the CPU references dominate the run time; every case reuses them
def rank_input(rank, count, dtype, salt=0):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + salt)
    return (torch.rand(count, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)


def ordered_reference(inputs, op, n):
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float()
    if op == "avg":
        acc = acc / torch.full_like(acc, float(n))  # a true division, also on CUDA
    return acc.to(inputs[0].dtype)


@functools.lru_cache(maxsize=8)
def references(count, dtype, op, n, salt):
    """(inputs of every rank, the ordered fp32 result, the fp64 result) for one case."""
    inputs = [rank_input(r, count, dtype, salt) for r in range(n)]
    ref64 = sum(x.double() for x in inputs) / (n if op == "avg" else 1)
    return inputs, ordered_reference(inputs, op, n), ref64


def bits(t):
    return t.contiguous().view(INT_VIEW[t.dtype])


def meant_variant(algo, nbytes, symmetric=False):
    """The kernel an explicit algo means for a message of nbytes (Note [plan]): flat is the LL kernel
    up to COMMLIB_FLAT_LL_MAX_BYTES (default 256 KiB), tree reduces a symmetric tensor in place up
    to 16 MiB. None for auto (the plan's limits decide)."""
    if algo == "flat":
        return "flat_ll" if nbytes <= int(os.environ.get("COMMLIB_FLAT_LL_MAX_BYTES") or 262144) else "flat"
    if algo == "tree":
        return "tree_zero_copy" if symmetric and nbytes <= (16 << 20) else "tree"
    return None


def run_counted(comm, t, call, algo, symmetric=False):
    """Runs call() (one all_reduce of t) and asserts that exactly the planned variant ran, once, and
    that it is the one algo means."""
    import commlib
    plan = comm.plan("all_reduce", t, algo=algo)
    meant = meant_variant(algo, t.numel() * t.element_size(), symmetric)
    assert meant is None or plan.variant == meant, f"algo {algo}: planned {plan.reason}, meant {meant}"
    before = commlib.plan_counters()
    call()
    after = commlib.plan_counters()
    ran = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert ran == ({plan.variant: 1} if t.numel() else {}), f"planned {plan.reason}; ran {ran}"
    return plan


def _run_case(ctx, comm, count, dtype, op, algo, pad, salt=0):
    """All-reduces a [pad | count | pad] window of a NaN-filled buffer; returns the result (CPU)."""
    dev = torch.device("cuda", ctx.device)
    n = ctx.world_size
    inputs, expected, ref64 = references(count, dtype, op, n, salt)
    buf = torch.full((count + 2 * pad,), float("nan"), dtype=dtype, device=dev)
    view = buf[pad:pad + count]
    view.copy_(inputs[ctx.rank])
    run_counted(comm, view, lambda: comm.all_reduce_(view, op=op, algo=algo), algo)
    out = buf.cpu()
    assert torch.isnan(out[:pad].float()).all() and torch.isnan(out[pad + count:].float()).all(), \
        f"{algo} wrote outside the tensor (count={count}, pad={pad})"
    got = out[pad:pad + count]
    assert torch.equal(bits(got), bits(expected)), \
        f"{algo} {op} {dtype} count={count} pad={pad}: differs from the ordered fp32 reference"
    torch.testing.assert_close(got.double(), ref64, rtol=TOL[dtype], atol=TOL[dtype])
    return got


def _vs_references(ctx, dtype_name, op):
    dtype = DTYPES[dtype_name]
    for count in SIZES:
        for pad in (0, 1, 8):  # aligned, unaligned by one element, aligned with an offset
            results = [_run_case(ctx, ctx.comm, count, dtype, op, algo, pad) for algo in ("flat", "tree", "auto")]
            assert torch.equal(bits(results[0]), bits(results[1])), "flat != tree"
    return True


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_all_reduce_matches_ordered_and_fp64_references(ranks, dtype_name, op):
    assert all(ranks(2).run(_vs_references, dtype_name, op))


def _random_sizes_and_zero(ctx):
    g = torch.Generator().manual_seed(42)  # same sizes on every rank
    sizes = [0] + torch.randint(1, 300_000, (20,), generator=g).tolist()
    for i, count in enumerate(sizes):
        for algo in ("flat", "tree"):
            dtype = list(DTYPES.values())[i % 3]
            if count == 0:
                t = torch.empty(0, dtype=dtype, device=f"cuda:{ctx.device}")
                assert ctx.comm.all_reduce_(t, algo=algo).numel() == 0
            else:
                _run_case(ctx, ctx.comm, count, dtype, "sum", algo, pad=i % 5, salt=i)
    return True


def test_random_odd_sizes_and_empty(ranks):
    assert all(ranks(2).run(_random_sizes_and_zero))


def _against_nccl(ctx):
    import torch.distributed as dist
    ctx.gloo()
    if "nccl" not in ctx.scratch:
        ctx.scratch["nccl"] = dist.new_group(backend="nccl")
    nccl = ctx.scratch["nccl"]
    dev = torch.device("cuda", ctx.device)
    for dtype in DTYPES.values():
        for count in (3, 4096, 262147, 4 << 20):
            x = rank_input(ctx.rank, count, dtype, salt=3).to(dev)
            theirs = x.clone()
            dist.all_reduce(theirs, group=nccl)
            for algo in ("flat", "tree", "auto"):
                ours = x.clone()
                ctx.comm.all_reduce_(ours, algo=algo)
                torch.testing.assert_close(ours.float(), theirs.float(), rtol=TOL[dtype], atol=TOL[dtype])
    return True


@pytest.mark.nccl
def test_against_nccl(ranks):
    assert all(ranks(2).run(_against_nccl))


def _out_of_place(ctx):
    dev = torch.device("cuda", ctx.device)
    n = ctx.world_size
    for dtype in DTYPES.values():
        for count in (1, 1023, 65537, (1 << 20) + 3):
            inputs, expected, _ = references(count, dtype, "sum", n, 5)
            for algo in ("flat", "tree", "auto"):
                x = inputs[ctx.rank].to(dev)
                out = torch.full((count,), float("nan"), dtype=dtype, device=dev)
                assert ctx.comm.all_reduce(x, algo=algo, out=out) is out
                assert torch.equal(bits(out.cpu()), bits(expected)), f"out= {algo} {dtype} count={count}"
                assert torch.equal(bits(x.cpu()), bits(inputs[ctx.rank])), "out= changed the input"
    x = torch.ones(4, device=dev)
    with pytest.raises(ValueError, match="all_reduce"):
        ctx.comm.all_reduce(x, out=torch.empty(5, device=dev))
    return True


def test_out_of_place(ranks):
    assert all(ranks(2).run(_out_of_place))


def _workspace_chunking(ctx):
    # COMMLIB_GPU_WORKSPACE_BYTES=131072: halves of 64 KiB, so these run as many chunks.
    comm = ctx.new_comm("small-workspace")
    for dtype in DTYPES.values():
        for count in (32768 + 1, 300_001):
            for algo in ("flat", "tree"):
                _run_case(ctx, comm, count, dtype, "avg", algo, pad=3)
    comm.close()
    return True


def test_messages_larger_than_the_workspace(ranks):
    assert all(ranks(2, env={"COMMLIB_GPU_WORKSPACE_BYTES": "131072"}).run(_workspace_chunking))


# Tree with a 3-block grid and 64 KiB workspace halves: every thread runs many batched iterations
# and the element-exact tail loop, and one launch runs many chunks (Note [tree all-reduce]).
TREE_STRESS_ENV = {"COMMLIB_GPU_WORKSPACE_BYTES": "131072", "COMMLIB_ALLREDUCE_MAX_BLOCKS": "3"}


def _tree_small_grid_many_chunks(ctx):
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm("tree-stress")
    for dtype in DTYPES.values():
        for count in (1, 9, 4097, 32768 + 1, 300_001):
            for op in ("sum", "avg"):
                for pad in (0, 1):
                    flat = _run_case(ctx, comm, count, dtype, op, "flat", pad, salt=5)
                    tree = _run_case(ctx, comm, count, dtype, op, "tree", pad, salt=5)
                    assert torch.equal(bits(flat), bits(tree)), f"flat != tree (count={count})"
            inputs = [rank_input(r, count, dtype, salt=13) for r in range(ctx.world_size)]
            t = comm.symmetric_empty((count,), dtype, dev)
            t.copy_(inputs[ctx.rank])
            comm.all_reduce_(t, algo="tree")
            assert torch.equal(bits(t.cpu()), bits(ordered_reference(inputs, "sum", ctx.world_size))), \
                f"symmetric tree {dtype} count={count}"
    comm.close()
    return True


def test_tree_small_grid_and_many_chunks(ranks):
    assert all(ranks(2, env=TREE_STRESS_ENV).run(_tree_small_grid_many_chunks))


def _graph_replay(ctx, algo, symmetric):
    dev = torch.device("cuda", ctx.device)
    n, count, dtype = ctx.world_size, 50_001, torch.bfloat16
    comm = ctx.comm
    g = torch.Generator(device=dev).manual_seed(7)  # same on every rank: every rank knows all inputs
    base = torch.rand(n, count, generator=g, device=dev) * 2 - 1
    delta = torch.rand(n, count, generator=g, device=dev) * 0.01 + 0.001
    src = torch.empty(count, dtype=dtype, device=dev)
    if symmetric:
        work = comm.symmetric_empty((count,), dtype, dev)
    else:
        work = torch.empty(count, dtype=dtype, device=dev)
    out = torch.empty(count, dtype=dtype, device=dev)
    comm.all_reduce_(src.fill_(1), algo=algo)  # first use outside capture (creates GPU state)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            work.copy_(src)
            comm.all_reduce_(work, algo=algo)
            comm.all_reduce_(work, op="avg", algo=algo)  # two ops per replay
            out.copy_(work)
    torch.cuda.synchronize()
    for i in range(1000):
        inputs = (base + i * delta).to(dtype)  # changes between replays
        src.copy_(inputs[ctx.rank])
        out.fill_(float("nan"))
        graph.replay()
        first = ordered_reference(list(inputs), "sum", n)
        expected = ordered_reference([first] * n, "avg", n)
        assert torch.equal(bits(out), bits(expected)), f"replay {i}: wrong result"
    return True


@pytest.mark.parametrize("symmetric", [False, True], ids=["copy-in", "symmetric"])
@pytest.mark.parametrize("algo", ["flat", "tree", "auto"])
def test_cuda_graph_1000_replays_with_changing_inputs(ranks, algo, symmetric):
    assert all(ranks(2).run(_graph_replay, algo, symmetric))


# Note [programmatic dependent launch] (csrc/kernels/launch.cuh): with COMMLIB_PDL=1 the flat and LL
# kernels (two per replay, back to back) may start while the previous kernel finishes.
PDL_ENVS = {"ll": {"COMMLIB_PDL": "1"}, "flat-barrier": {"COMMLIB_PDL": "1", "COMMLIB_FLAT_LL_MAX_BYTES": "0"}}


@pytest.mark.parametrize("kernel", list(PDL_ENVS))
def test_cuda_graph_replays_with_pdl(ranks, kernel):
    assert all(ranks(2, env=PDL_ENVS[kernel]).run(_graph_replay, "flat", False))


def test_two_streams_with_pdl(ranks):
    # Calls that change streams wait for the previous stream with an event (a full dependency).
    assert all(ranks(2, env=PDL_ENVS["ll"]).run(_two_communicators_two_streams))


def test_tree_graph_replays_many_chunks_per_launch(ranks):
    # 50_001 bf16 elements over 64 KiB halves: two chunks per launch, two launches per replay.
    assert all(ranks(2, env=TREE_STRESS_ENV).run(_graph_replay, "tree", False))


# Launch geometries the tuning sweep explores (Note [tree geometry] in all_reduce_tree.cu): smaller
# CTAs, more CTAs than SMs, one warp per CTA with many packs per thread (the unrolled loops' partial
# batches). Each must give flat's and the CPU order's bits.
TREE_GEOMETRY_ENVS = {
    "512x512-128": {"COMMLIB_TREE_THREADS": "512", "COMMLIB_TREE_MIN_PACKS": "512", "COMMLIB_TREE_MAX_BLOCKS": "128"},
    "128x64-256": {"COMMLIB_TREE_THREADS": "128", "COMMLIB_TREE_MIN_PACKS": "64", "COMMLIB_TREE_MAX_BLOCKS": "256"},
    "32x1-7": {"COMMLIB_TREE_THREADS": "32", "COMMLIB_TREE_MIN_PACKS": "1", "COMMLIB_TREE_MAX_BLOCKS": "7"},
}


def _symmetric_zero_copy(ctx):
    dev = torch.device("cuda", ctx.device)
    for dtype in DTYPES.values():
        for count in (1, 17, 65537, (1 << 21) + 5):
            inputs = [rank_input(r, count, dtype, salt=11) for r in range(ctx.world_size)]
            for algo in ("tree", "flat", "auto"):
                t = ctx.comm.symmetric_empty((count,), dtype, dev)
                t.copy_(inputs[ctx.rank])
                run_counted(ctx.comm, t, lambda: ctx.comm.all_reduce_(t, algo=algo), algo, symmetric=True)
                assert torch.equal(bits(t.cpu()), bits(ordered_reference(inputs, "sum", ctx.world_size))), \
                    f"symmetric {algo} {dtype} count={count}"
    # 2-D symmetric tensor, and one reused many times (the end barrier keeps iterations apart).
    t = ctx.comm.symmetric_empty((64, 129), torch.float32, dev)
    for i in range(50):
        t.fill_(float(ctx.rank + 1 + i))
        ctx.comm.all_reduce_(t, algo="tree")
        assert torch.equal(t, torch.full_like(t, float(sum(r + 1 + i for r in range(ctx.world_size)))))
    # Dropped right after the calls on it are enqueued (no synchronisation): the tensor's release
    # waits for them before it unmaps (docs/architecture.md, Memory and synchronisation).
    count = (1 << 22) + 3
    inputs = [rank_input(r, count, torch.float32, salt=12) for r in range(ctx.world_size)]
    want = bits(ordered_reference(inputs, "sum", ctx.world_size))
    outs = []
    for _ in range(6):
        t = ctx.comm.symmetric_empty((count,), torch.float32, dev)
        t.copy_(inputs[ctx.rank])
        ctx.comm.all_reduce_(t, algo="tree")
        outs.append(t.clone())
        del t
    torch.cuda.synchronize(dev)
    for out in outs:
        assert torch.equal(bits(out.cpu()), want)
    return True


def test_symmetric_empty_zero_copy(ranks):
    assert all(ranks(2).run(_symmetric_zero_copy))


@pytest.mark.parametrize("geometry", list(TREE_GEOMETRY_ENVS))
def test_tree_geometries_match_references(ranks, geometry):
    env = TREE_GEOMETRY_ENVS[geometry]
    assert all(ranks(2, env=env).run(_vs_references, "bfloat16", "avg"))
    assert all(ranks(2, env=env).run(_symmetric_zero_copy))
    assert all(ranks(2, env=env).run(_graph_replay, "tree", True))
    assert all(ranks(2, env=env).run(_graph_replay, "tree", False))


def _bad_tree_knob(ctx):
    dev = torch.device("cuda", ctx.device)
    with pytest.raises(ValueError, match=r"COMMLIB_TREE_THREADS=100 invalid; valid: 0 or a multiple of 32"):
        with ctx.new_comm("bad-tree-knob") as comm:  # the knobs are read when the GPU state is made
            comm.all_reduce_(torch.ones(8, device=dev), algo="tree")
    return True


def test_bad_tree_knob_is_a_clear_error(ranks):
    assert all(ranks(2, env={"COMMLIB_TREE_THREADS": "100"}).run(_bad_tree_knob))


def _symmetric_mismatch(ctx):
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm("mismatch")
    comm.all_reduce_(torch.ones(4, device=dev))
    import commlib
    with pytest.raises(commlib.PeerError, match=r"symmetric allocation mismatch"):
        comm.symmetric_empty((1024 * (ctx.rank + 1) * 1024,), torch.float32, dev)
    comm.close()
    return True


def test_symmetric_size_mismatch_is_an_error(ranks):
    assert all(ranks(2).run(_symmetric_mismatch))


def _two_communicators_two_streams(ctx):
    dev = torch.device("cuda", ctx.device)
    a, b = ctx.new_comm("two-a"), ctx.new_comm("two-b")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    n = ctx.world_size
    for i in range(20):
        count = 1000 + 977 * i
        xs = [rank_input(r, count, torch.bfloat16, salt=i) for r in range(n)]
        ys = [rank_input(r, count + 1, torch.float32, salt=i) for r in range(n)]
        x, y = xs[ctx.rank].to(dev), ys[ctx.rank].to(dev)
        z = y.clone()
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            a.all_reduce_(x, algo="flat" if i % 2 else "tree")
            b.all_reduce_(y, algo="tree")
        with torch.cuda.stream(s2):  # same communicator, another stream, no user sync in between
            a.all_reduce_(z, algo="flat")
        torch.cuda.synchronize()
        assert torch.equal(bits(x.cpu()), bits(ordered_reference(xs, "sum", n)))
        assert torch.equal(bits(y.cpu()), bits(ordered_reference(ys, "sum", n)))
        assert torch.equal(bits(z.cpu()), bits(ordered_reference(ys, "sum", n)))
    a.close()
    b.close()
    return True


def test_two_communicators_and_two_streams(ranks):
    assert all(ranks(2).run(_two_communicators_two_streams))


def _other_device(ctx):
    # Rank r uses the other rank's GPU: device ordinals differ from ranks, and the two processes
    # still map each other's memory (bus ids are exchanged, not ordinals).
    other = (ctx.device + 1) % torch.cuda.device_count()
    dev = torch.device("cuda", other)
    comm = ctx.new_comm("other-device")
    with torch.cuda.device(other):
        for count in (5, 70001):
            _run_case_on(ctx, comm, dev, count)
    comm.close()
    return True


def _run_case_on(ctx, comm, dev, count):
    inputs = [rank_input(r, count, torch.float16, salt=5) for r in range(ctx.world_size)]
    for algo in ("flat", "tree"):
        t = inputs[ctx.rank].to(dev)
        comm.all_reduce_(t, algo=algo)
        assert torch.equal(bits(t.cpu()), bits(ordered_reference(inputs, "sum", ctx.world_size)))


def test_non_default_device_ordering(ranks):
    assert all(ranks(2).run(_other_device))


def _bad_inputs(ctx):
    import commlib
    dev = torch.device("cuda", ctx.device)
    x = torch.ones(8, device=dev)
    with pytest.raises(ValueError, match=r"all_reduce: op max not supported for CUDA tensors; supported: sum, avg"):
        ctx.comm.all_reduce_(x, op="max")
    with pytest.raises(ValueError, match=r"algo 'nccl' needs an NCCL engine"):
        ctx.comm.all_reduce_(x, algo="nccl")
    with pytest.raises(TypeError, match=r"dtype int32 not supported; supported: float32, float16, bfloat16"):
        ctx.comm.all_reduce_(torch.ones(8, dtype=torch.int32, device=dev))
    ctx.comm.all_reduce_(x)  # still usable
    assert torch.equal(x, torch.full_like(x, float(ctx.world_size)))
    assert isinstance(commlib.CommTimeoutError("x"), RuntimeError)
    return True


def test_bad_inputs_raise_synchronously(ranks):
    assert all(ranks(2).run(_bad_inputs))


def _timeout(ctx):
    import commlib
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm("timeout", timeout=timedelta(seconds=2))
    comm.all_reduce_(torch.ones(4, device=dev))  # both ranks: creates the GPU state
    torch.cuda.synchronize()
    if ctx.rank == 0:  # rank 1 never joins: rank 0's wait must expire, not hang
        comm.all_reduce_(torch.ones(4, device=dev), algo="flat")
        torch.cuda.synchronize()
        with pytest.raises(commlib.CommTimeoutError, match=r"rank 0 waited \d+ ms for rank 1 at phase '"):
            comm.check_gpu_error()
        with pytest.raises(commlib.CommTimeoutError, match=r"all_reduce: Timed out in an earlier GPU wait"):
            comm.all_reduce_(torch.ones(4, device=dev))
    comm.close()
    return True


def test_device_wait_times_out_with_a_clear_error(ranks):
    assert all(ranks(2).run(_timeout, timeout=120))


# ---- the barrier-free LL variant of flat (COMMLIB_FLAT_LL_MAX_BYTES): same references ----
LL_ENV = {"COMMLIB_FLAT_LL_MAX_BYTES": str(1 << 30)}  # every flat call uses LL (> 256 KiB: several calls)


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_ll_matches_ordered_reference_and_tree(ranks, dtype_name, op):
    assert all(ranks(2, env=LL_ENV).run(_vs_references, dtype_name, op))


def test_ll_random_sizes(ranks):
    assert all(ranks(2, env=LL_ENV).run(_random_sizes_and_zero))


@pytest.mark.parametrize("algo", ["flat", "auto"])
def test_ll_cuda_graph_1000_replays(ranks, algo):
    assert all(ranks(2, env=LL_ENV).run(_graph_replay, algo, False))


def _ll_timeout(ctx):
    import commlib
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm("ll-timeout", timeout=timedelta(seconds=2))
    comm.all_reduce_(torch.ones(4, device=dev))
    torch.cuda.synchronize()
    if ctx.rank == 0:
        comm.all_reduce_(torch.ones(4, device=dev), algo="flat")
        torch.cuda.synchronize()
        with pytest.raises(commlib.CommTimeoutError, match=r"rank 0 waited \d+ ms for rank 1 at phase 'LL data"):
            comm.check_gpu_error()
    comm.close()
    return True


def test_ll_wait_times_out_with_a_clear_error(ranks):
    assert all(ranks(2, env=LL_ENV).run(_ll_timeout, timeout=120))


# ---- more ranks (the generic world-size path for 3, the 4/8 specialisations); need that many GPUs,
# or COMMLIB_TEST_SHARE_GPUS=1 (the protocol on one GPU) ----
def _few_sizes(ctx):
    for dtype in DTYPES.values():
        for count in (1, 9, 4097, 300_001):
            for algo in ("flat", "tree"):
                for op in ("sum", "avg"):
                    ctx.progress(f"all_reduce {dtype} count={count} {algo} {op}")
                    _run_case(ctx, ctx.comm, count, dtype, op, algo, pad=1)
    return True


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_more_ranks(ranks, world_size):
    assert all(ranks(world_size).run(_few_sizes))
    assert all(ranks(world_size, env=LL_ENV).run(_few_sizes))


NO_LL_ENV = {"COMMLIB_FLAT_LL_MAX_BYTES": "0"}  # the barrier flat kernel at every size


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_flat_without_ll_matches_references(ranks, dtype_name):
    assert all(ranks(2, env=NO_LL_ENV).run(_vs_references, dtype_name, "avg"))


def test_flat_without_ll_graph_replays(ranks):
    assert all(ranks(2, env=NO_LL_ENV).run(_graph_replay, "flat", False))


# ---- the plan (Note [plan]): above tree's limit the plan is NCCL, which the direct API does not have ----
def _nccl_planned_runs_tree(ctx):
    dev = torch.device("cuda", ctx.device)
    count = (1 << 20) + 3  # bf16: 2 MiB + 6 bytes > COMMLIB_TREE_MAX_BYTES below
    inputs, expected, _ = references(count, torch.bfloat16, "sum", ctx.world_size, 5)
    t = inputs[ctx.rank].to(dev)
    plan = run_counted(ctx.comm, t, lambda: ctx.comm.all_reduce_(t), "auto")
    assert plan.variant == "tree" and plan.reason.startswith(
        "tree (nccl planned; the direct API has no NCCL engine): "), plan.reason
    assert ctx.comm.plan("all_reduce", t, nccl=True).variant == "nccl"
    assert torch.equal(bits(t.cpu()), bits(expected))
    return True


def test_direct_api_runs_tree_where_the_plan_says_nccl(ranks):
    assert all(ranks(2, env={"COMMLIB_TREE_MAX_BYTES": str(1 << 20)}).run(_nccl_planned_runs_tree))
