"""GPU fused all-reduce + residual add + RMSNorm (P2P kernel). Needs >= 2 GPUs.

References: commlib's unfused GPU ``all_reduce`` followed by ``commlib.fused.reference_rmsnorm``
computed on the CPU (Note [fused rmsnorm arithmetic]) must match bit for bit; an fp64 computation
within the dtype's rounding; NCCL-free. Outputs are NaN-poisoned first; sharded rows a rank does
not own must come back untouched. The multimem variant runs only where the environment allows
NVLink multicast (never on the lent machines, docs/architecture.md, Safety); there, its refusal is tested.
"""
import functools
import re

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
# Larger counts: test_fused_gpu_many_chunks (CPU references are slow). With the default knobs at world 2,
# 16 tokens sharded is the two-shot LL kernel (one-shot ends at 8 sharded tokens, the LL kernel at 16
# rows per rank), replicated the one-shot kernel; 1-7 one-shot either way; 33 and more the barrier kernel.
TOKENS = [1, 2, 3, 7, 16, 33, 128, 1001]
HIDDEN = [1024, 1032, 4096, 8192, 16384]


def make_inputs(world_size, tokens, hidden, dtype, salt=0):
    def gen(seed):
        return torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=gen(7 * r + 1000 * tokens + hidden + salt), dtype=torch.float64)
          .to(dtype) for r in range(world_size)]
    residual = (torch.randn(tokens, hidden, generator=gen(99 + tokens + salt), dtype=torch.float64) * 2).to(dtype)
    weight = (1 + 0.25 * torch.randn(hidden, generator=gen(5 + hidden + salt), dtype=torch.float64)).to(dtype)
    return xs, residual, weight


def bits(t):
    return t.contiguous().view(torch.int16)


def counted_fused(comm, x, meant, where, call, num_sms, mode):
    """Runs call() (one fused call on x) and asserts that exactly the planned variant ran, once, and
    that it is `meant` (a variant name; None: whatever the plan says)."""
    import commlib
    plan = comm.plan("fused_allreduce_rmsnorm", x, num_sms=num_sms or 0, residual_mode=mode)
    assert meant is None or plan.variant == meant, f"{where}: planned {plan.reason}, meant {meant}"
    before = commlib.plan_counters()
    call()
    after = commlib.plan_counters()
    ran = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert ran == {plan.variant: 1}, f"{where}: planned {plan.reason}; ran {ran}"


def _gpu_case(ctx, dtype_name, tokens_list, hidden_list, num_sms_list=(None,), eps=1e-6, meant=None):
    """meant(tokens, hidden) -> the variant the test means to run (Note [plan]), or None."""
    from commlib.fused import reference_rmsnorm
    dev = torch.device("cuda", ctx.device)
    dtype = DTYPES[dtype_name]
    n, rank = ctx.world_size, ctx.rank
    comm = ctx.comm
    for hidden in hidden_list:
        for tokens in tokens_list:
            ctx.progress(f"fused {dtype_name} tokens={tokens} hidden={hidden}")
            xs, residual0, weight = make_inputs(n, tokens, hidden, dtype)
            x = xs[rank].to(dev)
            summed = x.clone()
            comm.all_reduce_(summed)
            ref_out, ref_res = reference_rmsnorm(summed.cpu(), residual0, weight, eps)
            r64 = residual0.double() + sum(t.double() for t in xs)
            out64 = r64 / torch.sqrt((r64 * r64).mean(dim=1, keepdim=True) + eps) * weight.double()
            begin, end = comm.token_slice(tokens)
            for num_sms in num_sms_list:
                for mode in ("replicated", "sharded"):
                    where = f"{mode} {dtype_name} tokens={tokens} hidden={hidden} num_sms={num_sms} rank={rank}"
                    residual = residual0.to(dev)
                    out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device=dev)
                    counted_fused(comm, x, meant(tokens, hidden) if meant else None, where,
                                  lambda: comm.fused_allreduce_rmsnorm(x, residual, weight.to(dev), eps,
                                                                       residual_mode=mode, out=out, num_sms=num_sms),
                                  num_sms, mode)
                    got_out, got_res = out.cpu(), residual.cpu()
                    assert torch.equal(bits(got_out), bits(ref_out)), f"{where}: out differs from unfused"
                    lo, hi = (0, tokens) if mode == "replicated" else (begin, end)
                    assert torch.equal(bits(got_res[lo:hi]), bits(ref_res[lo:hi])), f"{where}: residual differs"
                    if mode == "sharded":
                        keep = torch.ones(tokens, dtype=torch.bool)
                        keep[begin:end] = False
                        assert torch.equal(bits(got_res[keep]), bits(residual0[keep])), f"{where}: wrote foreign rows"
                        res_slice = residual0[begin:end].to(dev)
                        out2 = torch.full_like(out, float("nan"))
                        comm.fused_allreduce_rmsnorm(x, res_slice, weight.to(dev), eps, residual_mode="sharded",
                                                     out=out2, num_sms=num_sms)
                        assert torch.equal(bits(out2.cpu()), bits(ref_out)), f"{where}: slice layout out"
                        assert torch.equal(bits(res_slice.cpu()), bits(ref_res[begin:end])), f"{where}: slice res"
                    torch.testing.assert_close(got_out.double(), out64, rtol=TOL[dtype], atol=TOL[dtype],
                                               msg=f"{where}: vs fp64")
    return True


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_fused_gpu_matches_unfused_bitwise(ranks, dtype_name):
    ranks(2).run(_gpu_case, dtype_name, TOKENS, HIDDEN)


def test_fused_gpu_num_sms(ranks):
    ranks(2).run(_gpu_case, "bfloat16", [1, 5, 300], [8192], (1, 2, 4, 16, 32, 132))


def test_fused_gpu_many_chunks(ranks):
    # A 1 MiB workspace holds a few rows of hidden 8192 per half: many chunks, the last one short.
    ranks(2, env={"COMMLIB_GPU_WORKSPACE_BYTES": str(1 << 20)}).run(_gpu_case, "bfloat16", [1, 77, 1000], [8192])


NO_ONESHOT = {"COMMLIB_FUSED_ONESHOT_MAX_TOKENS": "0", "COMMLIB_FUSED_ONESHOT_SHARDED_MAX_TOKENS": "0"}
NO_LL = {"COMMLIB_FUSED_LL_MAX_BYTES": "0", **NO_ONESHOT}


def _variant(default, exceptions, tokens, hidden):
    return exceptions.get((tokens, hidden), default)


def meant(default, exceptions=None):
    """_gpu_case's `meant`: `default`, or exceptions[(tokens, hidden)]. A partial of a module function,
    not a lambda: the rank processes are spawned, and what they run must pickle."""
    return functools.partial(_variant, default, exceptions or {})


p2p = meant("fused_p2p")


def test_fused_gpu_barrier_kernel_small_tokens(ranks):
    # No LL kernel (two-shot or one-shot): even 1 token runs the barrier kernel (rs_rmsnorm_ag_p2p.cu).
    ranks(2, env=NO_LL).run(_gpu_case, "bfloat16", [1, 2, 3, 33], [1024, 8192], (None, 1, 3), meant=p2p)


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_fused_gpu_more_ranks(ranks, world_size):
    # Token counts that no world size divides, and none at all on some ranks (1 token); the LL
    # kernels (default at these sizes), then the barrier kernel. Needs world_size GPUs, or
    # COMMLIB_TEST_SHARE_GPUS=1.
    ranks(world_size).run(_gpu_case, "bfloat16", [1, 5, 301], [1032, 8192])
    ranks(world_size, env=NO_LL).run(_gpu_case, "bfloat16", [5, 301], [8192], (None, 3), meant=p2p)


def test_fused_gpu_barrier_kernel_row_groups(ranks):
    # The barrier kernel's phase B gives each row a group of 32..512 threads, chosen from the rows
    # per CTA (Note [fused p2p phase B]): 301 tokens (slices of 151 and 150 rows) on 1, 20, 40 and
    # 132 CTAs give groups of 32, 64, 128 and 256 threads; hidden 8 (one pack), 1032 (129 packs:
    # zero-padded tree) and 16384 (64 packs per thread of a warp). Same bits for every group size.
    ranks(2, env=NO_LL).run(_gpu_case, "bfloat16", [301], [8, 1032, 16384], (1, 20, 40, 132), meant=p2p)


# The barrier kernel's pipelined chunk loop (Note [fused p2p persistent]) and replicated mode's
# residual gather, every rank normalising the residual rows it receives (Note [fused p2p residual
# gather]). A small workspace makes many chunks: 64 KiB holds 7 rows of hidden 1032 per half, 1 MiB
# 16 rows of hidden 8192, so 77 and 1001 tokens run 6..72 chunks, an odd or even count, the last one
# short. The LL kernel is off so that 3 tokens (one short chunk) run the barrier kernel too; num_sms
# 3 gives blocks uneven row counts, 132 groups of up to 512 threads per row (phase C's row groups).
@pytest.mark.parametrize("workspace,hidden", [(1 << 16, 1032), (1 << 20, 8192)])
def test_fused_gpu_chunk_loop_and_gather(ranks, workspace, hidden):
    env = {"COMMLIB_GPU_WORKSPACE_BYTES": str(workspace), **NO_LL}
    ranks(2, env=env).run(_gpu_case, "bfloat16", [3, 77, 1001], [hidden], (None, 3, 132), meant=p2p)


def test_fused_gpu_chunk_loop_fp16_default_workspace(ranks):
    # The default workspace (64 MiB: 1024 rows of hidden 8192 per half) and 2100 tokens (1050 per
    # rank): sharded, 2 chunks, the second short; replicated, 8 MiB chunks of 512 rows (512, 512, 26;
    # kFusedRepSplitBytes); fp16.
    ranks(2).run(_gpu_case, "float16", [2100], [8192])


def _dead_peer(ctx):
    # Rank 1 never joins the second call: rank 0's barrier kernel must time out with a clear error,
    # not hang, and report it on the next call.
    import commlib
    from datetime import timedelta
    dev = torch.device("cuda", ctx.device)
    comm = ctx.new_comm("fused-timeout", timeout=timedelta(seconds=2))
    x = torch.randn(300, 1024, device=dev, dtype=torch.bfloat16)  # 150 rows per rank: barrier kernel
    w = torch.ones(1024, dtype=torch.bfloat16, device=dev)
    comm.fused_allreduce_rmsnorm(x, x.clone(), w)  # both ranks: creates the GPU state
    torch.cuda.synchronize()
    if ctx.rank == 0:
        comm.fused_allreduce_rmsnorm(x, x.clone(), w)
        torch.cuda.synchronize()
        with pytest.raises(commlib.CommTimeoutError, match=r"rank 0 waited \d+ ms for rank 1 at phase 'inputs ready"):
            comm.check_gpu_error()
        with pytest.raises(commlib.CommTimeoutError, match=r"Timed out in an earlier GPU wait of this communicator"):
            comm.fused_allreduce_rmsnorm(x, x.clone(), w)
    comm.close()
    return True


def test_fused_gpu_dead_peer_times_out(ranks):
    assert all(ranks(2).run(_dead_peer, timeout=120))


def _graph_chunks(ctx, tokens):
    # Graph replay of multi-chunk calls in both modes: each replay advances the call counter by the
    # chunk count (odd here, so consecutive replays start in different workspace halves), with an
    # eager all_reduce (the reference) between replays.
    from commlib.fused import reference_rmsnorm
    dev = torch.device("cuda", ctx.device)
    comm = ctx.comm
    n, rank, hidden, dtype, eps = ctx.world_size, ctx.rank, 8192, torch.bfloat16, 1e-5
    for mode in ("replicated", "sharded"):
        xs, residual0, weight = make_inputs(n, tokens, hidden, dtype, salt=31)
        x = xs[rank].to(dev)
        w = weight.to(dev)
        residual = residual0.to(dev)
        out = torch.empty_like(x)
        comm.fused_allreduce_rmsnorm(x, residual, w, eps, out=out, residual_mode=mode)  # first-use set-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.fused_allreduce_rmsnorm(x, residual, w, eps, out=out, residual_mode=mode)
        lo, hi = (0, tokens) if mode == "replicated" else comm.token_slice(tokens)
        for step in range(3):
            x.copy_(make_inputs(n, tokens, hidden, dtype, salt=40 + step)[0][rank].to(dev))
            residual.copy_(residual0.to(dev))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            summed = x.clone()
            comm.all_reduce_(summed)
            ref_out, ref_res = reference_rmsnorm(summed.cpu(), residual0, weight, eps)
            where = f"{mode} graph replay {step}"
            assert torch.equal(bits(out.cpu()), bits(ref_out)), f"{where}: out"
            assert torch.equal(bits(residual.cpu()[lo:hi]), bits(ref_res[lo:hi])), f"{where}: residual"
    return True


def test_fused_gpu_graph_replay_chunks(ranks):
    # 1 MiB workspace, 281 tokens (141 rows per rank): 9 chunks of 16 rows.
    ranks(2, env={"COMMLIB_GPU_WORKSPACE_BYTES": str(1 << 20)}).run(_graph_chunks, 281)


# Huge LL limits and no one-shot: the two-shot LL kernel runs whenever the slice fits the LL buffer.
LL_ALWAYS = {"COMMLIB_FUSED_LL_MAX_BYTES": str(1 << 30), "COMMLIB_FUSED_LL_MAX_ROWS": str(1 << 30), **NO_ONESHOT}


def test_fused_gpu_ll_kernel_large_slices(ranks):
    # A huge LL limit: the LL kernel (rs_rmsnorm_ag_p2p_ll.cu) runs whenever the slice fits the LL
    # buffer (40 tokens of hidden 16384 does not: the launcher falls back to the barrier kernel).
    ranks(2, env=LL_ALWAYS).run(_gpu_case, "float16", [1, 5, 40], [8192, 16384], (None, 1, 7),
                                meant=meant("fused_ll", {(40, 16384): "fused_p2p"}))


@pytest.mark.parametrize("row_ctas", ["1", "2", "4", "8"])
def test_fused_gpu_ll_row_split(ranks, row_ctas):
    # COMMLIB_FUSED_LL_ROW_CTAS: each row of the LL kernel split over 1..8 CTAs of a cluster (Note
    # [fused LL row split]); hidden 8 (one pack: the split is capped at one CTA), 1032 (zero-padded
    # tree), 8192 and 16384 (4 packs per thread at one CTA per row); num_sms 1 and 3 cap the split,
    # 16 loops clusters over rows. Same bits as the unfused reference for every split.
    ranks(2, env={"COMMLIB_FUSED_LL_ROW_CTAS": row_ctas, **LL_ALWAYS}).run(
        _gpu_case, "bfloat16", [1, 2, 7, 16], [8, 1032, 8192, 16384], (None, 1, 3, 16),
        meant=meant("fused_ll"))


@pytest.mark.parametrize("row_ctas", ["1", "2", "8"])
def test_fused_gpu_one_shot(ranks, row_ctas):
    # The one-shot LL kernel (Note [fused one-shot]) whenever every row fits the LL buffer: every rank
    # normalises every row; sharded, the owners' residual rows travel with x. Token counts not
    # divisible by 2 (1, 7, 33), a cluster looping over rows (num_sms 1, 3), rows split over 2 / 8
    # CTAs, hidden 8 .. 16384 (33 tokens of hidden 16384 do not fit: the launcher falls back).
    env = {"COMMLIB_FUSED_ONESHOT_MAX_TOKENS": str(1 << 30), "COMMLIB_FUSED_ONESHOT_SHARDED_MAX_TOKENS": str(1 << 30),
           "COMMLIB_FUSED_LL_ROW_CTAS": row_ctas}
    ranks(2, env=env).run(_gpu_case, "bfloat16", [1, 2, 7, 16, 33], [8, 1032, 8192, 16384], (None, 1, 3, 16),
                          meant=meant("fused_oneshot", {(33, 16384): "fused_p2p"}))


@pytest.mark.parametrize("oneshot", ["0", "64"])
def test_fused_gpu_ll_push_ctas(ranks, oneshot):
    # COMMLIB_FUSED_LL_BYTES_PER_CTA small: up to 128 CTAs, most of them only pushing (and gathering)
    # while one CTA per row normalises; two-shot (oneshot 0) and one-shot LL kernels.
    env = {"COMMLIB_FUSED_LL_BYTES_PER_CTA": "512", "COMMLIB_FUSED_ONESHOT_MAX_TOKENS": oneshot,
           "COMMLIB_FUSED_ONESHOT_SHARDED_MAX_TOKENS": oneshot}
    ranks(2, env=env).run(_gpu_case, "bfloat16", [1, 7, 16, 32], [1032, 8192],
                          meant=meant("fused_ll" if oneshot == "0" else "fused_oneshot"))


def _mixed_sequence(ctx):
    # LL and barrier fused calls interleaved with LL/flat all-reduces on one communicator: they share
    # the call counter, the LL buffer halves and the workspace halves (Note [fused LL layout]).
    from commlib.fused import reference_rmsnorm
    dev = torch.device("cuda", ctx.device)
    comm = ctx.comm
    n, rank, hidden, dtype, eps = ctx.world_size, ctx.rank, 4096, torch.bfloat16, 1e-6
    for step, tokens in enumerate([1, 300, 2, 3, 1000, 1, 64, 5]):
        xs, residual0, weight = make_inputs(n, tokens, hidden, dtype, salt=100 + step)
        x = xs[rank].to(dev)
        summed = x.clone()
        comm.all_reduce_(summed)  # an all-reduce between fused calls
        ref_out, ref_res = reference_rmsnorm(summed.cpu(), residual0, weight, eps)
        residual = residual0.to(dev)
        out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device=dev)
        mode = "replicated" if step % 2 == 0 else "sharded"
        comm.fused_allreduce_rmsnorm(x, residual, weight.to(dev), eps, residual_mode=mode, out=out)
        torch.cuda.synchronize()
        assert torch.equal(bits(out.cpu()), bits(ref_out)), f"step {step} ({tokens} tokens, {mode}): out"
        lo, hi = (0, tokens) if mode == "replicated" else comm.token_slice(tokens)
        assert torch.equal(bits(residual.cpu()[lo:hi]), bits(ref_res[lo:hi])), f"step {step}: residual"
    return True


# Note [programmatic dependent launch] (csrc/kernels/launch.cuh): the LL and flat kernels may start
# while the previous kernel of their stream finishes.
PDL = {"COMMLIB_PDL": "1"}


@pytest.mark.parametrize("pdl", [False, True], ids=["stream-order", "pdl"])
def test_fused_gpu_mixed_kernels_and_all_reduce(ranks, pdl):
    ranks(2, env=PDL if pdl else None).run(_mixed_sequence)


def _back_to_back(ctx):
    # Fused calls (one-shot LL, two-shot LL, barrier kernel) and LL all-reduces back to back with no
    # host sync in between (inputs staged first), every result checked at the end: with COMMLIB_PDL=1
    # each kernel is scheduled while the previous one finishes.
    from commlib.fused import reference_rmsnorm
    dev = torch.device("cuda", ctx.device)
    comm = ctx.comm
    n, rank, hidden, dtype, eps = ctx.world_size, ctx.rank, 4096, torch.bfloat16, 1e-6
    steps = [(1, "replicated"), (4, "sharded"), (16, "sharded"), (24, "replicated"), (2, "sharded"),
             (33, "replicated"), (7, "replicated"), (1, "replicated")]
    staged, refs = [], []
    for step, (tokens, mode) in enumerate(steps):
        xs, residual0, weight = make_inputs(n, tokens, hidden, dtype, salt=300 + step)
        summed = sum(t.double() for t in xs)  # a second all-reduce input, checked against the ordered sum
        x = xs[rank].to(dev)
        ref_sum = x.clone()
        comm.all_reduce_(ref_sum)
        refs.append((reference_rmsnorm(ref_sum.cpu(), residual0, weight, eps), ref_sum.cpu(), summed))
        out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device=dev)
        staged.append((x, x.clone(), residual0.to(dev), weight.to(dev), out, mode))
    torch.cuda.synchronize()
    comm.barrier()
    for x, x_ar, residual, w, out, mode in staged:
        comm.fused_allreduce_rmsnorm(x, residual, w, eps, residual_mode=mode, out=out)
        comm.all_reduce_(x_ar)  # a flat / LL all-reduce right after the fused kernel
    torch.cuda.synchronize()
    for step, ((tokens, mode), (x, x_ar, residual, w, out, _), ((ref_out, ref_res), ref_sum, summed)) in enumerate(
            zip(steps, staged, refs)):
        assert torch.equal(bits(out.cpu()), bits(ref_out)), f"step {step} ({tokens} tokens, {mode}): out"
        lo, hi = (0, tokens) if mode == "replicated" else comm.token_slice(tokens)
        assert torch.equal(bits(residual.cpu()[lo:hi]), bits(ref_res[lo:hi])), f"step {step}: residual"
        assert torch.equal(bits(x_ar.cpu()), bits(ref_sum)), f"step {step}: all_reduce"
        torch.testing.assert_close(x_ar.cpu().double(), summed, rtol=TOL[dtype], atol=TOL[dtype])
    return True


@pytest.mark.parametrize("pdl", [False, True], ids=["stream-order", "pdl"])
def test_fused_gpu_back_to_back(ranks, pdl):
    ranks(2, env=PDL if pdl else None).run(_back_to_back)


@pytest.mark.parametrize("row_ctas", ["1", "2"])
def test_fused_gpu_pdl_ll_kernels(ranks, row_ctas):
    # COMMLIB_PDL=1 with the two-shot LL kernel (clusters of 2: both launch attributes) and the
    # one-shot kernel.
    ranks(2, env={"COMMLIB_FUSED_LL_ROW_CTAS": row_ctas, **LL_ALWAYS, **PDL}).run(
        _gpu_case, "bfloat16", [1, 7, 16], [1032, 8192], (None, 3))
    ranks(2, env={"COMMLIB_FUSED_LL_ROW_CTAS": row_ctas, **PDL}).run(_gpu_case, "bfloat16", [1, 2, 7, 16], [8192])


def _bad_pdl_knob(ctx):
    dev = torch.device("cuda", ctx.device)
    x = torch.randn(2, 1024, device=dev, dtype=torch.bfloat16)  # LL kernel
    with pytest.raises(ValueError, match=re.escape("COMMLIB_PDL=2 invalid; valid: 0, 1")):
        ctx.comm.fused_allreduce_rmsnorm(x, x.clone(), torch.ones(1024, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match=re.escape("COMMLIB_PDL=2 invalid; valid: 0, 1")):
        ctx.comm.all_reduce_(x, algo="flat")
    return True


def test_fused_gpu_bad_pdl_knob(ranks):
    ranks(2, env={"COMMLIB_PDL": "2"}).run(_bad_pdl_knob)


def test_fused_gpu_knob_num_sms(ranks):
    ranks(2, env={"COMMLIB_FUSED_NUM_SMS": "3"}).run(_gpu_case, "float16", [1, 64], [4096])


def _graph_and_compile(ctx, tokens):
    from commlib.fused import reference_rmsnorm
    dev = torch.device("cuda", ctx.device)
    comm = ctx.comm
    n, rank, hidden, dtype, eps = ctx.world_size, ctx.rank, 8192, torch.bfloat16, 1e-5
    xs, residual0, weight = make_inputs(n, tokens, hidden, dtype, salt=11)
    x = xs[rank].to(dev)
    w = weight.to(dev)
    residual = residual0.to(dev)
    out = torch.empty_like(x)

    def expected(x_now, residual_now):
        summed = x_now.clone()
        comm.all_reduce_(summed)
        return reference_rmsnorm(summed.cpu(), residual_now.cpu(), weight, eps)

    # CUDA graph capture: warm up eagerly (first-use set-up), capture, replay on fresh inputs.
    comm.fused_allreduce_rmsnorm(x, residual, w, eps, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.fused_allreduce_rmsnorm(x, residual, w, eps, out=out)
    for step in range(4):  # several replays: both LL buffer / workspace halves, twice
        new_x = make_inputs(n, tokens, hidden, dtype, salt=20 + step)[0][rank].to(dev)
        x.copy_(new_x)
        residual.copy_(residual0.to(dev))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_res = expected(x, residual0)
        assert torch.equal(bits(out.cpu()), bits(ref_out)), f"graph replay {step}: out"
        assert torch.equal(bits(residual.cpu()), bits(ref_res)), f"graph replay {step}: residual"

    # torch.compile (inductor, fullgraph) around the op with ops before and after it.
    def layer(x, residual, w):
        out = torch.empty_like(x)
        torch.ops.commlib.fused_allreduce_rmsnorm_out(x * 1, residual, w, eps, comm.group_name,
                                                      "replicated", 0, "auto", out=out)
        return out + 0

    compiled = torch.compile(layer, fullgraph=True)
    residual = residual0.to(dev)
    got = compiled(x, residual, w)
    ref_out, ref_res = expected(x, residual0)
    assert torch.equal(bits(got.cpu()), bits(ref_out)) and torch.equal(bits(residual.cpu()), bits(ref_res))
    return True


# 37: barrier kernel; 4: one-shot LL kernel (default limit), or the two-shot LL kernel without it.
@pytest.mark.parametrize("pdl", [False, True], ids=["stream-order", "pdl"])
@pytest.mark.parametrize("tokens, env", [(37, {}), (4, {}), (4, NO_ONESHOT)],
                         ids=["barrier", "one-shot", "two-shot-ll"])
def test_fused_gpu_graph_capture_and_compile(ranks, tokens, env, pdl):
    ranks(2, env={**env, **PDL} if pdl else env).run(_graph_and_compile, tokens)


def _bad_inputs_gpu(ctx):
    dev = torch.device("cuda", ctx.device)
    comm = ctx.comm
    x = torch.randn(4, 1024, device=dev)
    with pytest.raises(TypeError, match="float32"):
        comm.fused_allreduce_rmsnorm(x, x.clone(), torch.ones(1024, device=dev))
    xb = x.bfloat16()
    with pytest.raises(TypeError, match="device mismatch"):
        comm.fused_allreduce_rmsnorm(xb, xb.clone(), torch.ones(1024, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="hidden size 1020"):
        comm.fused_allreduce_rmsnorm(xb[:, :1020], xb[:, :1020].clone(), torch.ones(1020, dtype=torch.bfloat16,
                                                                                     device=dev))
    # (multimem's refusal: test_fused_gpu_multimem_refused, with a kill switch of its own.)
    return _gpu_case(ctx, "bfloat16", [5], [1024])


def test_fused_gpu_bad_inputs(ranks):
    ranks(2).run(_bad_inputs_gpu)


# ---- multimem (NVLink multicast): refused on the lent machines, run only where allowed ----

KILL_SWITCH = {"COMMLIB_DISABLE_MULTICAST": "1"}  # adds a kill switch; never removes one


def _multimem_refused_gpu(ctx):
    import commlib
    dev = torch.device("cuda", ctx.device)
    comm = ctx.comm
    x = torch.randn(8, 1024, device=dev).bfloat16()
    residual = x.clone()
    weight = torch.ones(1024, dtype=torch.bfloat16, device=dev)
    out = torch.full_like(x, float("nan"))
    with pytest.raises(ValueError, match="multicast refused: COMMLIB_DISABLE_MULTICAST=1"):
        comm.fused_allreduce_rmsnorm(x, residual, weight, out=out, algo="multimem")
    # The communicator's own entry refuses too, before its GPU state (or anything CUDA) is made.
    with pytest.raises(ValueError, match="multicast transport: NVLink multicast refused"):
        commlib._C.multicast_workspace_bytes(comm.group_name, ctx.device)
    assert commlib._C.multicast_objects_created() == 0
    # Nothing was touched, and the communicator still works.
    assert torch.isnan(out.float()).all() and torch.equal(residual, x)
    return _gpu_case(ctx, "bfloat16", [1, 33], [1024])


@pytest.mark.parametrize("world_size", [1, 2])
def test_fused_gpu_multimem_refused(ranks, world_size):
    ranks(world_size, env=KILL_SWITCH).run(_multimem_refused_gpu)


def _multimem_case(ctx, dtype_name, tokens_list, hidden_list, eps=1e-6):
    dev = torch.device("cuda", ctx.device)
    dtype = DTYPES[dtype_name]
    n, rank, comm = ctx.world_size, ctx.rank, ctx.comm
    for hidden in hidden_list:
        for tokens in tokens_list:
            xs, residual0, weight = make_inputs(n, tokens, hidden, dtype, salt=3)
            x = xs[rank].to(dev)
            r64 = residual0.double() + sum(t.double() for t in xs)
            out64 = r64 / torch.sqrt((r64 * r64).mean(dim=1, keepdim=True) + eps) * weight.double()
            begin, end = comm.token_slice(tokens)
            for mode in ("replicated", "sharded"):
                where = f"multimem {mode} {dtype_name} tokens={tokens} hidden={hidden} rank={rank}"
                residual = residual0.to(dev)
                out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device=dev)
                comm.fused_allreduce_rmsnorm(x, residual, weight.to(dev), eps, residual_mode=mode, out=out,
                                             algo="multimem")
                torch.testing.assert_close(out.cpu().double(), out64, rtol=TOL[dtype], atol=TOL[dtype],
                                           msg=f"{where}: out vs fp64")
                lo, hi = (0, tokens) if mode == "replicated" else (begin, end)
                torch.testing.assert_close(residual.cpu()[lo:hi].double(), r64[lo:hi], rtol=TOL[dtype],
                                           atol=TOL[dtype], msg=f"{where}: residual vs fp64")
                if mode == "sharded":
                    keep = torch.ones(tokens, dtype=torch.bool)
                    keep[begin:end] = False
                    assert torch.equal(bits(residual.cpu()[keep]), bits(residual0[keep])), f"{where}: foreign rows"
    return True


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_fused_gpu_multimem_where_allowed(ranks, world_size, dtype_name):
    # Runs only on a machine whose environment opts in to NVLink multicast and sets no kill switch
    # (never the lent machines: docs/architecture.md, Safety); this test sets neither.
    import commlib
    allowed, variable, reason = commlib.fused.multicast_allowed()
    if not allowed:
        pytest.skip(f"NVLink multicast not allowed here: {reason}")
    ranks(world_size).run(_multimem_case, dtype_name, [1, 7, 301, 2048], [1024, 8192])
