"""The plan (Note [plan], csrc/core/plan.hpp) of CPU calls: what Communicator.plan says is what
runs, as the per-variant counters (commlib.plan_counters()) record it, for the direct API and the
"ddacomm" backend; reasons are readable lines; COMMLIB_LOG_PLAN logs once per shape.

Reference: the host limit as configured (COMMLIB_HOST_TREE_THRESHOLD, set per test), and the
reduction itself against an fp64 sum of every rank's input (outputs poisoned first).
"""
from __future__ import annotations

import os
import re
import tempfile
from datetime import timedelta

import pytest
import torch

KiB = 1 << 10
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "fused_allreduce_rmsnorm")


def rank_input(rank: int, count: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 104729 * count + salt)
    return torch.rand(count, generator=g, dtype=torch.float64).to(torch.float32) * 2 - 1


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def _host_all_reduce_plans(ctx, threshold: int, counts: list):
    import commlib
    os.environ["COMMLIB_HOST_TREE_THRESHOLD"] = str(threshold)
    comm = ctx.new_comm()  # resolves its configuration with the threshold above
    try:
        n = ctx.world_size
        for count in counts:
            t = rank_input(ctx.rank, count)
            plan = comm.plan("all_reduce", t)
            expected = "host_tree" if count * 4 >= threshold else "host_flat"
            assert plan.variant == expected, (count, plan.reason)
            sign = ">=" if expected == "host_tree" else "<"
            assert re.fullmatch(rf"{expected}: \d+ (B|KiB) {sign} host_tree_min \d+ KiB", plan.reason), plan.reason
            out = torch.full_like(t, float("nan"))
            before = commlib.plan_counters()
            comm.all_reduce(t, out=out)
            assert delta(before, commlib.plan_counters()) == {expected: 1}, (count, expected)
            ref = sum(rank_input(r, count).double() for r in range(n))
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
            # An explicit algo wins over the limit, and is what runs.
            for algo in ("flat", "tree"):
                plan = comm.plan("all_reduce", t, algo=algo)
                assert plan.variant == "host_" + algo and f"algo='{algo}' requested" in plan.reason
                before = commlib.plan_counters()
                comm.all_reduce_(t.clone(), algo=algo)
                assert delta(before, commlib.plan_counters()) == {"host_" + algo: 1}
    finally:
        comm.close()
        del os.environ["COMMLIB_HOST_TREE_THRESHOLD"]
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_host_all_reduce_plan_is_what_runs(ranks, world_size):
    counts = [0, 1, 255, 256, 257, 4097, 70_001]  # around a 1 KiB threshold (256 fp32 elements)
    assert ranks(world_size).run(_host_all_reduce_plans, 1 * KiB, counts) == [True] * world_size


def test_host_all_reduce_default_threshold(ranks):
    counts = [(256 * KiB) // 4 - 1, (256 * KiB) // 4]  # COMMLIB_HOST_TREE_THRESHOLD's default: 262144
    assert ranks(2).run(_host_all_reduce_plans, 256 * KiB, counts) == [True, True]


def _host_exchange_plans(ctx):
    import commlib
    comm, n = ctx.comm, ctx.world_size
    x = rank_input(ctx.rank, 6 * n)
    cases = {
        "reduce_scatter": lambda: comm.reduce_scatter(torch.full((6,), float("nan")), x),
        "all_gather": lambda: comm.all_gather(torch.full((6 * n * n,), float("nan")), x),
        "broadcast": lambda: comm.broadcast(x.clone(), src=0),
        "all_to_all": lambda: comm.all_to_all(torch.full_like(x, float("nan")), x),
    }
    for op, call in cases.items():
        plan = comm.plan(op, x)
        assert plan.variant == "host_exchange" and plan.reason == "host_exchange: CPU tensors", plan.reason
        # The backend's plan (NCCL attached) is the same on CPU: NCCL never takes CPU tensors.
        assert comm.plan(op, x, nccl=True).variant == "host_exchange"
        before = commlib.plan_counters()
        call()
        assert delta(before, commlib.plan_counters()) == {"host_exchange": 1}, op
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_host_exchange_plan_is_what_runs(ranks, world_size):
    assert ranks(world_size).run(_host_exchange_plans) == [True] * world_size


def _fused_host_plan(ctx):
    import commlib
    comm, n = ctx.comm, ctx.world_size
    tokens, hidden = 5, 64
    x = rank_input(ctx.rank, tokens * hidden).view(tokens, hidden)
    residual = rank_input(99, tokens * hidden).view(tokens, hidden)
    weight = torch.ones(hidden)
    plan = comm.plan("fused_allreduce_rmsnorm", x)
    assert plan.variant == "fused_host" and plan.reason == "fused_host: CPU tensors"
    before = commlib.plan_counters()
    out = comm.fused_allreduce_rmsnorm(x, residual, weight)
    assert delta(before, commlib.plan_counters()) == {"fused_host": 1}
    total = sum(rank_input(r, tokens * hidden).double().view(tokens, hidden) for r in range(n)) + \
        rank_input(99, tokens * hidden).double().view(tokens, hidden)
    ref = total / torch.sqrt((total * total).mean(dim=-1, keepdim=True) + 1e-6)
    got = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    return True


def test_fused_host_plan_is_what_runs(ranks):
    assert ranks(2).run(_fused_host_plan) == [True, True]


def _backend_plans(ctx):
    import commlib  # noqa: F401  (registers "ddacomm")
    import torch.distributed as dist
    ctx.drop_default_group()
    n = ctx.scratch["worlds"] = ctx.scratch.get("worlds", 0) + 1
    os.environ["COMMLIB_HOST_TREE_THRESHOLD"] = str(1 * KiB)
    try:
        dist.init_process_group("ddacomm", store=dist.PrefixStore(f"plan-test/{n}", ctx.store), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timedelta(seconds=120))
        for count, expected in ((16, "host_flat"), (4096, "host_tree")):
            t = rank_input(ctx.rank, count)
            before = commlib.plan_counters()
            dist.all_reduce(t)
            assert delta(before, commlib.plan_counters()) == {expected: 1}, count
            torch.testing.assert_close(t.double(), sum(rank_input(r, count).double() for r in range(ctx.world_size)),
                                       rtol=1e-5, atol=1e-5)
        # The exchange ops: one host_exchange each, as through the direct API.
        n = ctx.world_size
        x = rank_input(ctx.rank, 4 * n, salt=3)
        out = torch.full((4,), float("nan"))
        before = commlib.plan_counters()
        dist.reduce_scatter_tensor(out, x)
        assert delta(before, commlib.plan_counters()) == {"host_exchange": 1}
        mine = sum(rank_input(r, 4 * n, salt=3).double() for r in range(n))[4 * ctx.rank:4 * ctx.rank + 4]
        torch.testing.assert_close(out.double(), mine, rtol=1e-5, atol=1e-5)
        gathered = torch.full((4 * n * n,), float("nan"))
        before = commlib.plan_counters()
        dist.all_gather_into_tensor(gathered, x)
        assert delta(before, commlib.plan_counters()) == {"host_exchange": 1}
        assert torch.equal(gathered, torch.cat([rank_input(r, 4 * n, salt=3) for r in range(n)]))
    finally:
        del os.environ["COMMLIB_HOST_TREE_THRESHOLD"]
        if dist.is_initialized():
            dist.destroy_process_group()
    return True


def test_backend_host_all_reduce_counts_the_planned_variant(ranks):
    assert ranks(2).run(_backend_plans) == [True, True]


def _log_plan(ctx):
    import commlib
    comm = ctx.comm
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            for _ in range(3):  # three calls of each shape: one line each
                comm.all_reduce_(rank_input(ctx.rank, 8))
                comm.all_reduce_(rank_input(ctx.rank, 100_000))
            comm.all_reduce_(rank_input(ctx.rank, 8).to(torch.bfloat16))  # another dtype: another line
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        lines = [line for line in log.read().splitlines() if line.startswith("commlib plan:")]
    del commlib
    return lines


def test_log_plan_once_per_shape(ranks):
    results = ranks(2, env={"COMMLIB_LOG_PLAN": "1"}).run(_log_plan)
    for rank, lines in enumerate(results):
        assert len(lines) == 3, lines
        assert all(f"rank {rank} all_reduce" in line for line in lines), lines
        assert re.search(r"all_reduce 32 bytes float32 -> host_flat: 32 B < host_tree_min 256 KiB$", lines[0]), lines
        assert re.search(r"all_reduce 400000 bytes float32 -> host_tree: 400000 B >= host_tree_min 256 KiB$",
                         lines[1]), lines
        assert re.search(r"all_reduce 16 bytes bfloat16 -> host_flat", lines[2]), lines


def test_no_log_without_the_knob(ranks):
    assert ranks(2).run(_log_plan) == [[], []]


def _bad_plans(ctx):
    comm = ctx.comm
    t = torch.ones(4)
    with pytest.raises(ValueError, match=r"Communicator.plan: op 'all_reduce_' not known; known: all_reduce, "
                                         r"reduce_scatter, all_gather, broadcast, all_to_all, fused_allreduce_rmsnorm"):
        comm.plan("all_reduce_", t)
    with pytest.raises(TypeError, match=r"Communicator.plan: tensor must be a torch.Tensor"):
        comm.plan("all_reduce", [1.0])
    with pytest.raises(ValueError, match=r"all_reduce: algo nccl not supported for CPU tensors; supported: auto, "
                                         r"flat, tree"):
        comm.plan("all_reduce", t, algo="nccl")
    with pytest.raises(ValueError, match=r"all_reduce: algo 'fastest'"):
        comm.plan("all_reduce", t, algo="fastest")
    with pytest.raises(ValueError, match=r"x of shape \[tokens, hidden\]"):
        comm.plan("fused_allreduce_rmsnorm", t)
    # The communicator still works after refused plans.
    out = comm.all_reduce(rank_input(ctx.rank, 5))
    torch.testing.assert_close(out.double(), sum(rank_input(r, 5).double() for r in range(ctx.world_size)))
    return True


def test_plan_refuses_bad_arguments_clearly(ranks):
    assert ranks(2).run(_bad_plans) == [True, True]


def _gpu_plans_without_gpu(ctx):
    """The plan is pure: a CUDA call's plan needs no GPU (device="cuda", meta tensors for the shape)."""
    import commlib
    saved_home = os.environ.get("HOME")
    with tempfile.TemporaryDirectory() as home:
        os.environ["HOME"] = home  # no tune file from the machine: the built-in table
        comm = ctx.new_comm()
        before = commlib.plan_counters()
        try:
            def plan(op, numel, dtype=torch.bfloat16, shape=None, **kw):
                t = torch.empty(shape if shape is not None else (numel,), dtype=dtype, device="meta")
                return comm.plan(op, t, device="cuda", **kw)

            # all_reduce at world 2, bf16 (built-in: flat to 512 KiB, tree to 256 MiB; LL to 256 KiB).
            assert plan("all_reduce", 32 * KiB).reason == "flat_ll: 64 KiB <= flat_ll_max 256 KiB"
            assert plan("all_reduce", 150 * KiB).reason == "flat: 300 KiB <= flat_max 512 KiB"
            assert plan("all_reduce", 512 * KiB).reason == "tree: 1 MiB <= tree_max 256 MiB"
            big = plan("all_reduce", 256 * (1 << 20))
            assert big.variant == "tree"
            assert big.reason == "tree (nccl planned; the direct API has no NCCL engine): 512 MiB > tree_max 256 MiB"
            assert plan("all_reduce", 256 * (1 << 20), nccl=True).reason == "nccl: 512 MiB > tree_max 256 MiB"
            assert plan("all_reduce", 16, algo="tree").reason == "tree: algo='tree' requested"
            forced = plan("all_reduce", 16, algo="flat")
            assert forced.variant == "flat_ll" and forced.reason == "flat_ll: algo='flat' requested"
            assert forced.geometry["chunk_bytes"] == 512 * KiB and forced.geometry["pdl"] is False
            with pytest.raises(ValueError, match=r"all_reduce: algo 'nccl' needs an NCCL engine"):
                plan("all_reduce", 16, algo="nccl")
            # One rank: the input is the sum (a copy, or nothing in place); an explicit algo keeps its kernel.
            alone_store = torch.distributed.PrefixStore(f"world-one/{ctx.rank}", ctx.store)
            with commlib.Communicator(alone_store, 0, 1, f"world-one-{ctx.rank}") as one:
                meta = torch.empty(4096, dtype=torch.bfloat16, device="meta")
                alone = one.plan("all_reduce", meta, device="cuda")
                assert alone.variant == "local_copy" and alone.reason == "local_copy: world_size 1", alone.reason
                assert alone.geometry["grid"] == 0
                assert one.plan("all_reduce", meta, device="cuda", algo="flat").variant == "flat_ll"
                assert one.plan("all_reduce", meta, device="cuda", algo="tree").variant == "tree"
                assert one.plan("all_reduce", meta, device="cpu").variant == "host_flat"
            with pytest.raises(TypeError, match=r"all_reduce: dtype int32 not supported"):
                plan("all_reduce", 16, dtype=torch.int32)
            # The exchange ops (built-in at world 2: commlib's kernel to 16 MiB of message).
            assert plan("all_gather", 32 * KiB).reason == "exchange_ll: 128 KiB <= flat_ll_max 256 KiB"
            assert plan("reduce_scatter", 64 * KiB).reason == "reduce_scatter_ll: 128 KiB <= flat_ll_max 256 KiB"
            assert plan("reduce_scatter", 1 << 20).reason == "reduce_scatter: 2 MiB > flat_ll_max 256 KiB"
            assert plan("broadcast", 16).reason == "exchange: broadcast has no LL kernel"
            over = plan("all_to_all", 16 << 20)
            assert over.reason == "exchange (nccl planned; the direct API has no NCCL engine): 32 MiB > flat_ll_max 256 KiB"
            assert plan("all_to_all", 16 << 20, nccl=True).reason == "nccl: 32 MiB > commlib_max 16 MiB"
            # Fused all-reduce + RMSNorm (hidden 8192): one-shot, two-shot LL, barrier kernel.
            one = plan("fused_allreduce_rmsnorm", 0, shape=(4, 8192))
            assert one.reason == "fused_oneshot: 4 tokens <= oneshot_max_tokens 32", one.reason
            g = one.geometry
            assert g["grid"] >= 1 and g["grid"] % g["row_ctas"] == 0 and 32 <= g["block"] <= 512
            assert g["packs_per_thread"] in (1, 2, 4)
            ll = plan("fused_allreduce_rmsnorm", 0, shape=(16, 8192), residual_mode="sharded")
            assert ll.reason == "fused_ll: 8 rows per rank <= fused_ll_max_rows 16", ll.reason
            p2p = plan("fused_allreduce_rmsnorm", 0, shape=(64, 8192))
            assert p2p.variant == "fused_p2p" and "32 rows per rank" in p2p.reason, p2p.reason
            assert plan("fused_allreduce_rmsnorm", 0, shape=(4, 8192), num_sms=7).geometry["grid"] == 7
        finally:
            comm.close()
            if saved_home is None:
                del os.environ["HOME"]
            else:
                os.environ["HOME"] = saved_home
    assert commlib.plan_counters() == before, "planning ran something"
    return True


def test_gpu_plans_are_pure_and_readable(ranks):
    assert ranks(2).run(_gpu_plans_without_gpu) == [True, True]


def test_counters_list_every_variant_and_reset():
    import commlib
    counters = commlib.plan_counters()
    for name in ("flat_ll", "flat", "tree", "tree_zero_copy", "nccl", "reduce_scatter_ll", "reduce_scatter",
                 "exchange_ll", "exchange", "local_copy", "host_flat", "host_tree", "host_exchange", "fused_oneshot",
                 "fused_ll", "fused_p2p", "fused_multimem", "fused_host", "ep_ll", "ep_normal", "ep_nvshmem",
                 "ep_host", "two_level", "inner"):
        assert name in counters and counters[name] >= 0
    commlib.reset_plan_counters()
    assert set(commlib.plan_counters().values()) == {0}
