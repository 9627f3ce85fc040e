"""commlib.cp on CUDA: the fused merge kernel against an fp64 merge; ring attention at world 1 and
over the copy-engine ring (ranks on their own GPUs, or sharing one with COMMLIB_TEST_SHARE_GPUS=1),
against the fp64 reference of tests/cpu/test_cp.py; CUDA-graph capture of decode; a deliberately
slow consumer; the ring's automatic watchdog against a stuck peer."""
from __future__ import annotations

import contextlib
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cpu"))
from test_cp import LAG_PATTERNS, _make_case, merge_case, merge_lag_matches_eager, merge_reference, reference, tol  # noqa: E402,E501

from commlib import cp  # noqa: E402

pytestmark = pytest.mark.gpu

# ---------------------------------------------------------------------------------------------
# The fused merge kernel (single process)
# ---------------------------------------------------------------------------------------------

F32_EPS = torch.finfo(torch.float32).eps


def _merge_errors(out, lse, ref, ref_lse):
    """(max |out - ref| / (1 + |ref|), max |lse - ref_lse| / (1 + |ref_lse|), finite pattern equal)."""
    out, lse = out.double().cpu(), lse.double().cpu()
    finite = torch.isfinite(ref_lse)
    e_out = ((out - ref).abs() / (1 + ref.abs())).max().item() if out.numel() else 0.0
    e_lse = ((lse[finite] - ref_lse[finite]).abs() / (1 + ref_lse[finite].abs())).max().item() if finite.any() else 0.0
    return e_out, e_lse, torch.equal(finite, torch.isfinite(lse)) and bool((lse[~finite] == float("-inf")).all())


@pytest.mark.parametrize("world_size", [1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_states,t,h,d", [(1, 7, 4, 64), (2, 301, 8, 128), (3, 64, 2, 64), (8, 5, 3, 128),
                                               (11, 9, 2, 64), (2, 13, 4, 33), (3, 6, 2, 1), (2, 0, 4, 128),
                                               (2, 17, 1, 256)])
def test_merge_kernel_matches_fp64(world_size, dtype, num_states, t, h, d):
    """torch.ops.commlib.merge_attention_states against the fp64 merge of the same (rounded) inputs:
    fp32 output within fp32 rounding, the dtype's output within its rounding; -inf rows, a token no
    partial saw (out 0, LSE -inf), NaN in empty partials never read, odd head_dim (element path)."""
    outs, lses = merge_case(num_states, t, h, d, dtype, device="cuda", seed=7 * num_states + t + d)
    ref, ref_lse = merge_reference([o.cpu() for o in outs], [x.cpu() for x in lses])
    out32, lse32 = cp.merge_attention_states(outs, lses, out_dtype=torch.float32)
    e_out, e_lse, same_inf = _merge_errors(out32, lse32, ref, ref_lse)
    assert same_inf and e_out <= 8 * num_states * F32_EPS and e_lse <= 4 * F32_EPS, (e_out, e_lse)
    out, lse = cp.merge_attention_states(outs, lses)
    assert out.dtype == dtype and out.shape == (t, h, d)
    e_out, _, _ = _merge_errors(out, lse, ref, ref_lse)
    assert e_out <= torch.finfo(dtype).eps + 8 * num_states * F32_EPS, e_out
    if t > 1:
        assert (out32[1] == 0).all() and (lse32[:, 1] == float("-inf")).all()
    # The same arithmetic on CPU agrees to fp32 rounding (not bitwise: fma, expf).
    out_cpu, _ = cp.merge_attention_states([o.cpu() for o in outs], [x.cpu() for x in lses], out_dtype=torch.float32)
    assert ((out_cpu.double() - out32.double().cpu()).abs() / (1 + ref.abs())).max().item() <= \
        16 * num_states * F32_EPS if t else True
    if t:  # a NaN LSE poisons its row
        lses[0][0, 0] = float("nan")
        out_nan, lse_nan = cp.merge_attention_states(outs, lses, out_dtype=torch.float32)
        assert torch.isnan(out_nan[0, 0]).all() and torch.isnan(lse_nan[0, 0])
        assert torch.equal(out_nan[1:], out32[1:])


@pytest.mark.parametrize("world_size", [1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pattern", LAG_PATTERNS)
def test_state_merge_lag_keeps_bits(world_size, dtype, pattern):
    """The ring state's last owned partial merged straight into the result's dtype (out of place for
    every row, in place into the adopted partial for half of them: Note [merge lag]) gives the bits
    of the fp32 accumulator path."""
    merge_lag_matches_eager(pattern, dtype, "cuda")


@pytest.mark.parametrize("world_size", [1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 64, 5])
def test_merge_kernel_in_place(world_size, dtype, d):
    """merge_attention_states_ into an fp32 accumulator at a permuted subset of rows (the ring's
    merge-on-arrival), with strided LSE views as the ring's packed partials have; rows not named
    are left untouched; an unaligned partial (element path) gives the same result."""
    g = torch.Generator().manual_seed(d)
    rows_total, t, h = 50, 23, 4
    acc = torch.randn(rows_total, h, d, generator=g).cuda()
    acc_lse = (torch.randn(h, rows_total, generator=g) * 3).cuda()
    acc_lse[:, :5] = float("-inf")
    acc[:5] = float("nan")  # an empty accumulator row is not read
    rows = torch.randperm(rows_total, generator=g)[:t].cuda()
    outs, lses = merge_case(2, t, h, d, dtype, device="cuda", seed=d + 1)
    wide = torch.full((h, t + 9), 1.0, device="cuda")
    wide[:, :t] = lses[1]
    lses[1] = wide[:, :t]  # stride (t + 9, 1)
    ref, ref_lse = merge_reference([acc[rows].cpu()] + [o.cpu() for o in outs],
                                   [acc_lse[:, rows].cpu()] + [x.cpu() for x in lses])
    before, before_lse = acc.clone(), acc_lse.clone()
    torch.ops.commlib.merge_attention_states_(acc, acc_lse, outs, lses, rows)
    e_out, e_lse, same_inf = _merge_errors(acc[rows], acc_lse[:, rows], ref, ref_lse)
    assert same_inf and e_out <= 24 * F32_EPS and e_lse <= 4 * F32_EPS, (e_out, e_lse)
    other = torch.ones(rows_total, dtype=torch.bool)
    other[rows.cpu()] = False
    assert torch.equal(acc[other.cuda()].nan_to_num(7.0), before[other.cuda()].nan_to_num(7.0))
    assert torch.equal(acc_lse[:, other.cuda()], before_lse[:, other.cuda()])
    # Unaligned: the partials start one element into a buffer.
    buf = torch.empty(t * h * d + 1, dtype=dtype, device="cuda")
    shifted = buf[1:].view(t, h, d)
    shifted.copy_(outs[0])
    a1, l1 = before.clone(), before_lse.clone()
    torch.ops.commlib.merge_attention_states_(a1, l1, [shifted, outs[1]], lses, rows)
    e1, _, _ = _merge_errors(a1[rows], l1[:, rows], ref, ref_lse)
    assert e1 <= 24 * F32_EPS, e1


@pytest.mark.parametrize("world_size", [1])
def test_merge_kernel_bad_input(world_size):
    assert cp.merge._merge_kernel(torch.empty(1, device="cuda")), "this CUDA build has the fused merge"
    o = torch.randn(4, 2, 64, device="cuda")
    lse = torch.randn(2, 4, device="cuda")
    with pytest.raises(TypeError, match="merge_attention_states: outs\\[0\\] has dtype torch.int32"):
        cp.merge_attention_states([o.int()], [lse])
    with pytest.raises(ValueError, match="expected \\[heads, tokens\\]"):
        cp.merge_attention_states([o], [lse.t()])
    with pytest.raises(TypeError, match="supported: float32, float16, bfloat16"):
        torch.ops.commlib.merge_attention_states([o.double()], [lse])
    with pytest.raises(ValueError, match="rows must be a contiguous"):
        torch.ops.commlib.merge_attention_states_(o, lse, [o], [lse], torch.arange(3, device="cuda"))
    out, _ = cp.merge_attention_states([o, o], [lse, lse])  # still usable
    assert torch.allclose(out, o, atol=1e-6)
    # Schemas (mutation annotations) and Meta kernels agree with the CUDA kernels.
    tests = ("test_schema", "test_faketensor")
    ops = torch.ops.commlib
    torch.library.opcheck(ops.merge_attention_states.default, ([o, o * 2], [lse, lse - 1], torch.bfloat16),
                          test_utils=tests)
    torch.library.opcheck(ops.merge_attention_states_.default, (o.clone(), lse.clone(), [o * 2], [lse - 1], None),
                          test_utils=tests)
    for op in (ops.merge_attention_states, ops.merge_attention_states_):
        assert torch.Tag.pt2_compliant_tag in op.default.tags, op


# ---------------------------------------------------------------------------------------------
# The attention backends (Note [cp attention backend])
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens_q,lens_k,causal,hkv", [([256], [256], True, 2), ([96, 96, 96], [160, 160, 160], False, 8),
                                                      ([200], [77], False, 1), ([64, 64], [64, 64], True, 4)])
def test_attention_backends_match_fp64(world_size, dtype, lens_q, lens_k, causal, hkv):
    """Shapes cuDNN takes: every backend against fp64 (out and LSE), auto picks cuDNN on sm90+."""
    g = torch.Generator().manual_seed(sum(lens_q) + hkv)
    h, d = 8, 128
    q = torch.randn(sum(lens_q), h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    qs, ks, vs = (x.to("cuda", dtype) for x in (q, k, v))
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    assert cp.attention._cudnn_fits(qs, ks, cu_q, max(lens_q), max(lens_k), causal) == len(lens_q)
    # The reference on the same rounded inputs: bottom-right causal of a square call is plain causal;
    # non-causal, every key is passed as cache (all visible).
    qr, kr, vr = (x.double().cpu() for x in (qs, ks, vs))
    ref, ref_lse = reference(qr, kr, vr, lens_q, [kr[0:0]] * len(lens_q), [vr[0:0]] * len(lens_q), causal,
                             0.125) if causal else reference(qr, kr[:0], vr[:0], lens_q, list(kr.split(lens_k)),
                                                             list(vr.split(lens_k)), False, 0.125)
    outs = {}
    for backend in ("cudnn", "flash", "efficient", "auto"):
        out, lse = cp.default_attention(qs, ks, vs, cu_q, cu_k, max(lens_q), max(lens_k), causal, 0.125,
                                        backend=backend)
        assert out.shape == qs.shape and out.dtype == dtype and lse.shape == (h, qs.shape[0])
        e_out = (out.double().cpu() - ref).abs().max().item()
        e_lse = (lse.double().cpu() - ref_lse).abs().max().item()
        assert e_out <= tol(dtype) and e_lse <= 1e-3, (backend, e_out, e_lse)
        outs[backend] = (out, lse)
    if torch.cuda.get_device_capability() >= (9, 0):  # auto ran cuDNN: its very bits
        assert torch.equal(outs["auto"][0], outs["cudnn"][0]) and torch.equal(outs["auto"][1], outs["cudnn"][1])


# ---------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------

GPU_CASES = [
    # name, lens, cache lens, h, hkv, d, dtype, causal, layout
    ("causal varlen gqa8 d128 bf16", [300, 17, 1, 64], None, 16, 2, 128, torch.bfloat16, True, "balanced"),
    ("causal gqa4 d64 fp16", [129, 5], None, 8, 2, 64, torch.float16, True, "balanced"),
    ("noncausal gqa1 d128 bf16", [77, 1], None, 4, 4, 128, torch.bfloat16, False, "balanced"),
    ("causal fp32 (efficient attention)", [50, 3], None, 4, 1, 64, torch.float32, True, "balanced"),
    ("partial prefill gqa8 bf16", [40, 9, 1], [200, 31, 5], 16, 2, 128, torch.bfloat16, True, "balanced"),
    ("decode gqa8 bf16", [1] * 6, [90, 31, 5, 1, 64, 7], 16, 2, 128, torch.bfloat16, True, "round_robin"),
]
MODES = [("pass_kv", "stream"), ("pass_q", "stream"), ("pass_q", "all_to_all"), ("auto", "stream")]


def _inputs(ci, case, rank, n, device):
    name, lens, cache_lens, h, hkv, d, dtype, causal, layout = case
    q, k, v, ck, cv, split = _make_case(500 + ci, lens, cache_lens or [0] * len(lens), h, hkv, d, dtype, n)
    cu = [0]
    for x in lens:
        cu.append(cu[-1] + x)
    sh = cp.shard(cu, n, rank, layout=layout)
    kv_cache = None
    if cache_lens is not None:
        rows_k, rows_v = [], []
        for b in range(len(lens)):
            off = sum(split[r][b] for r in range(rank))
            rows_k.append(ck[b][off:off + split[rank][b]])
            rows_v.append(cv[b][off:off + split[rank][b]])
        kv_cache = (torch.cat(rows_k).to(device), torch.cat(rows_v).to(device), split[rank])
    ref, _ = reference(q, k, v, lens, ck, cv, causal, 1.0 / math.sqrt(d))
    return (q[sh.index].to(device), k[sh.index].to(device), v[sh.index].to(device), cu, kv_cache,
            ref[sh.index], causal, layout, dtype)


def _gpu_cases(ctx):
    device = torch.device("cuda", torch.cuda.current_device())
    comm = ctx.comm
    results = []
    for ci, case in enumerate(GPU_CASES):
        q, k, v, cu, kv_cache, ref, causal, layout, dtype = _inputs(ci, case, ctx.rank, ctx.world_size, device)
        for mode, ret in MODES:
            with _naming(f"{case[0]} {mode}/{ret}"):
                out = cp.ring_attention(comm, q, k, v, cu_seqlens_q=cu, causal=causal, kv_cache=kv_cache, mode=mode,
                                        layout=layout, pass_q_return=ret)
                torch.cuda.synchronize()
            err = (out.double().cpu() - ref).abs().max().item() if out.numel() else 0.0
            results.append((f"{case[0]} {mode}/{ret}", err, tol(dtype)))
        if ci == 0 and ctx.world_size > 1:  # the all_to_all_v ring step on CUDA (the fallback transport)
            for mode in ("pass_kv", "pass_q"):
                with _naming(f"{case[0]} {mode} CommTransport"):
                    out = cp.ring_attention(comm, q, k, v, cu_seqlens_q=cu, causal=causal, mode=mode,
                                            transport=cp.CommTransport(comm))
                    torch.cuda.synchronize()
                results.append((f"{case[0]} {mode} CommTransport", (out.double().cpu() - ref).abs().max().item(),
                                tol(dtype)))
    return results


@contextlib.contextmanager
def _naming(label: str):
    """A failure inside (a device fault surfaces at the synchronize) names the case it came from."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised with the case's name
        raise RuntimeError(f"{label}: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("world_size", [1, 2])
def test_ring_attention_gpu(ranks, world_size):
    per_rank = ranks(world_size).run(_gpu_cases, timeout=900)
    bad = [(r, label, e, t) for r, res in enumerate(per_rank) for label, e, t in res if not e <= t]
    assert not bad, "\n".join(f"rank {r}: {label}: error {e:.3g} > {t:.3g}" for r, label, e, t in bad[:20])


def _slow_consumer(ctx, rounds):
    """Rank 1's attention sleeps on its stream before every block, so its slots are released late;
    a sender that overwrote a slot early, or a lost block, shows up as a wrong output."""
    device = torch.device("cuda", torch.cuda.current_device())
    case = ("causal varlen", [96, 33, 1, 8], [24, 0, 3, 5], 8, 2, 64, torch.bfloat16, True, "balanced")

    def slow_attention(*args):
        if ctx.rank == 1:
            torch.cuda._sleep(2_000_000)
        return cp.default_attention(*args)

    worst = []
    for r in range(rounds):
        q, k, v, cu, kv_cache, ref, causal, layout, dtype = _inputs(900 + r, case, ctx.rank, ctx.world_size, device)
        for mode in ("pass_kv", "pass_q"):
            out = cp.ring_attention(ctx.comm, q, k, v, cu_seqlens_q=cu, causal=causal, kv_cache=kv_cache, mode=mode,
                                    attn_fn=slow_attention)
            out2 = cp.ring_attention(ctx.comm, q, k, v, cu_seqlens_q=cu, causal=causal, kv_cache=kv_cache, mode=mode,
                                     attn_fn=slow_attention)
            torch.cuda.synchronize()
            worst.append(max((out.double().cpu() - ref).abs().max().item(),
                             (out2.double().cpu() - ref).abs().max().item()))
    return max(worst), tol(torch.bfloat16)


@pytest.mark.parametrize("world_size", [2])
def test_copy_engine_ring_slow_consumer(ranks, world_size):
    for rank, (err, t) in enumerate(ranks(world_size).run(_slow_consumer, 3, timeout=900)):
        assert err <= t, f"rank {rank}: error {err:.3g} > {t:.3g}"


def _decode_graph(ctx):
    """Decode captured once into a CUDA graph and replayed on new queries of the same shapes."""
    device = torch.device("cuda", torch.cuda.current_device())
    case = GPU_CASES[-1]
    q, k, v, cu, kv_cache, ref, causal, layout, dtype = _inputs(len(GPU_CASES) - 1, case, ctx.rank,
                                                                ctx.world_size, device)

    def step():
        return cp.ring_attention(ctx.comm, q, k, v, cu_seqlens_q=cu, kv_cache=kv_cache, mode="pass_q",
                                 layout=layout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: plans, slots, attention workspaces
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # The ring watchdog's thread polls an unfinished event during the capture (it must not
    # invalidate the capture: Note [cp ring watchdog], relaxed capture mode).
    import time

    class Watched:  # the watchdog's view of a transport: its events are queried until done
        failure, rank = None, ctx.rank

        def _call_done(self, trace):
            return all(ev.query() for ev, _ in trace)

        def _on_timeout(self, trace, recv_slots, elapsed):
            self.failure = "timed out"

    watched = Watched()
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(2_000_000_000)
    pending = torch.cuda.Event()
    pending.record(busy)
    cp.symmetric._watchdog().watch(watched, [(pending, "a test event")], time.monotonic() + 1e9, [])
    time.sleep(0.05)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    errs = []
    for r in range(3):
        qn, kn, vn, _, _, _, _, _, _ = _inputs(700 + r, case, ctx.rank, ctx.world_size, device)
        q.copy_(qn)
        k.copy_(kn)
        v.copy_(vn)
        # The new queries meet the same cache: recompute the reference with the case's cache.
        name, lens, cache_lens, h, hkv, d, dt, causal_, _ = case
        _, _, _, ck, cv, _ = _make_case(len(GPU_CASES) - 1 + 500, lens, cache_lens, h, hkv, d, dt, ctx.world_size)
        qa, ka, va, _, _, _ = _make_case(700 + r + 500, lens, cache_lens, h, hkv, d, dt, ctx.world_size)
        full, _ = reference(qa, ka, va, lens, ck, cv, causal_, 1.0 / math.sqrt(d))
        sh = cp.shard(cu, ctx.world_size, ctx.rank, layout=layout)
        out.fill_(float("nan"))  # poison: every element must be rewritten by the replay
        graph.replay()
        torch.cuda.synchronize()
        errs.append((out.double().cpu() - full[sh.index]).abs().max().item() if out.numel() else 0.0)
    return max(errs), tol(dtype)


@pytest.mark.parametrize("world_size", [1, 2])
def test_decode_cuda_graph(ranks, world_size):
    for rank, (err, t) in enumerate(ranks(world_size).run(_decode_graph, timeout=900)):
        assert err <= t, f"rank {rank}: error {err:.3g} > {t:.3g}"


def _stuck_peer(ctx, sleep_s):
    """Rank 1's host stops for ``sleep_s`` in the middle of a pass-Q call (after posting its Q,
    before its partial), so rank 0's stream waits on a flag nobody writes for longer than the
    communicator's timeout (3 s). The watchdog must unblock rank 0 (its synchronize returns; the
    rows that needed rank 1's partial are NaN) and the next call must raise CommTimeoutError on
    every rank, naming rank 1 and the slot on rank 0."""
    import time
    from datetime import timedelta

    import commlib
    device = torch.device("cuda", torch.cuda.current_device())
    case = ("causal", [64, 9], None, 8, 2, 64, torch.bfloat16, True, "balanced")
    q, k, v, cu, _, ref, _, _, dtype = _inputs(950, case, ctx.rank, ctx.world_size, device)
    # CUDA, the attention kernels and the GPU state of a communicator are set up under the default
    # (long) timeout first, so the 3 s communicator below times only the ring.
    cp.ring_attention(ctx.comm, q, k, v, cu_seqlens_q=cu, mode="pass_q")
    torch.cuda.synchronize()
    # COMMLIB_TIMEOUT_MS (a runner's setting) would outrank the 3 s below and outlast the stall.
    runner_timeout = os.environ.pop("COMMLIB_TIMEOUT_MS", None)
    comm = ctx.new_comm("cp-watchdog", timeout=timedelta(seconds=3))
    if runner_timeout is not None:
        os.environ["COMMLIB_TIMEOUT_MS"] = runner_timeout
    stalled = []

    def stuck_attention(*args):
        if ctx.rank == 1 and not stalled:
            stalled.append(True)
            time.sleep(sleep_s)
        return cp.default_attention(*args)

    out = cp.ring_attention(comm, q, k, v, cu_seqlens_q=cu, mode="pass_q", attn_fn=cp.default_attention)
    torch.cuda.synchronize()
    warm_err = (out.double().cpu() - ref).abs().max().item()
    out = cp.ring_attention(comm, q, k, v, cu_seqlens_q=cu, mode="pass_q", attn_fn=stuck_attention)
    torch.cuda.synchronize()  # rank 0: returns because the watchdog unblocked the stream
    has_nan = bool(torch.isnan(out.float()).any())
    # Both ranks reach the next call together (the store, not the communicator, lines them up).
    ctx.store.set(f"cp-watchdog-{ctx.rank}", "1")
    ctx.store.wait([f"cp-watchdog-{r}" for r in range(ctx.world_size)], timedelta(seconds=120))
    try:
        cp.ring_attention(comm, q, k, v, cu_seqlens_q=cu, mode="pass_q", attn_fn=cp.default_attention)
        raised = None
    except commlib.CommTimeoutError as e:
        raised = str(e)
    torch.cuda.synchronize()
    return warm_err, tol(dtype), has_nan, raised


@pytest.mark.parametrize("world_size", [2])
def test_copy_engine_ring_watchdog(ranks, world_size):
    results = ranks(world_size).run(_stuck_peer, 7.0, timeout=300)
    (err0, t0, nan0, raised0), (err1, t1, _, raised1) = results
    assert err0 <= t0 and err1 <= t1, "the warm-up call is correct"
    assert nan0, "rank 0's stuck call was unblocked with NaN rows, not a stale result"
    assert raised0 is not None and "rank 0" in raised0 and "from rank 1" in raised0 and "did not complete" in raised0, \
        raised0
    assert raised1 is not None and "rank 0's copy-engine ring timed out" in raised1, raised1


def _comm_transport_at_8k(ctx):
    """pass_q over CommTransport at 8K tokens, 16 / 4 heads of 128 (a step of 33.8 MB: more than the
    communicator's workspace half, which the all_to_all_v step was once limited to), against a
    causal SDPA of the whole sequence in fp32 on this GPU."""
    device = torch.device("cuda", torch.cuda.current_device())
    tokens, h, hkv, d = 8192, 16, 4, 128
    g = torch.Generator(device=device).manual_seed(8192)
    q = torch.randn(tokens, h, d, generator=g, device=device).to(torch.bfloat16)
    k = torch.randn(tokens, hkv, d, generator=g, device=device).to(torch.bfloat16)
    v = torch.randn(tokens, hkv, d, generator=g, device=device).to(torch.bfloat16)
    cu = [0, tokens]
    sh = cp.shard(cu, ctx.world_size, ctx.rank)
    index = sh.index.to(device)
    out = cp.ring_attention(ctx.comm, q[index], k[index], v[index], cu_seqlens_q=cu, causal=True, mode="pass_q",
                            transport=cp.CommTransport(ctx.comm))
    torch.cuda.synchronize()
    rep = h // hkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().repeat_interleave(rep, 1).transpose(0, 1)[None],
        v.float().repeat_interleave(rep, 1).transpose(0, 1)[None], is_causal=True)[0].transpose(0, 1)
    err = (out.float() - ref[index]).abs().max().item()
    assert err <= tol(torch.bfloat16), f"pass_q CommTransport at 8K tokens: error {err:.3g}"
    return True


@pytest.mark.parametrize("world_size", [2])
def test_comm_transport_pass_q_at_8k_tokens(ranks, world_size):
    assert all(ranks(world_size).run(_comm_transport_at_8k, timeout=900))
