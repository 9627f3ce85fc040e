"""commlib.cp: sharding, the merge of attention states, the selection rule, and ring attention on
CPU against a single-process fp64 full-attention reference on the unsharded input."""
from __future__ import annotations

import math

import pytest
import torch

from commlib import cp

# Output tolerance in units of the dtype's epsilon: the partial outputs are rounded to the dtype
# once per block call and the final output once more, each error at most eps/2 relative of values
# of order 1; the attention kernels accumulate in fp32 (low-precision P@V adds a few eps).
TOL_EPS = {torch.float32: 64, torch.float16: 8, torch.bfloat16: 8, torch.float64: 1e6}


def tol(dtype):
    return TOL_EPS[dtype] * torch.finfo(dtype).eps


def reference(q, k, v, lens, cache_k, cache_v, causal, scale):
    """fp64 attention per sequence: sequence b's queries q[b] [L, H, D] against its cached keys
    (all visible) and its new keys (position p sees new keys <= p when causal). Returns (out, lse)
    packed like q, lse [H, T]."""
    outs, lses, start = [], [], 0
    h = q.shape[1]
    for b, length in enumerate(lens):
        qb = q[start:start + length].double()
        kb = torch.cat([cache_k[b].double(), k[start:start + length].double()])
        vb = torch.cat([cache_v[b].double(), v[start:start + length].double()])
        rep = h // kb.shape[1]
        kb, vb = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        if causal:
            p = cache_k[b].shape[0]
            allowed = torch.ones(length, kb.shape[0], dtype=torch.bool).tril(p)
            s = s.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, -1)
        if length:
            outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vb))
        else:
            outs.append(qb.new_zeros(0, h, vb.shape[-1]))
        lses.append(lse)
        start += length
    return torch.cat(outs), torch.cat(lses, dim=1)


# ---------------------------------------------------------------------------------------------
# Single process
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_shard_unshard_round_trip(world_size, layout):
    lens = [0, 1, 2, 3, 2 * world_size - 1, 2 * world_size, 37, 1]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = torch.randn(cu[-1], 3)
    shards = [cp.shard(cu, world_size, r, layout=layout) for r in range(world_size)]
    every = torch.cat([s.index for s in shards]).sort().values
    assert torch.equal(every, torch.arange(cu[-1])), "every token on exactly one rank"
    for s in shards:
        assert s.cu_seqlens[-1] == s.index.numel() and len(s.cu_seqlens) == len(lens) + 1
    back = cp.unshard([x[s.index] for s in shards], cu, layout=layout)
    assert torch.equal(back, x)


def test_shard_balanced_chunks():
    # One sequence of 16 tokens, 2 ranks: chunks of 4; rank 0 holds chunks 0 and 3.
    s0 = cp.shard([0, 16], 2, 0)
    assert s0.index.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    s1 = cp.shard([0, 16], 2, 1)
    assert s1.index.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # round robin: sequence b on rank b mod N.
    rr = cp.shard([0, 1, 2, 3], 2, 1, layout="round_robin")
    assert rr.index.tolist() == [1] and rr.cu_seqlens.tolist() == [0, 0, 1, 1]


def test_shard_bad_input():
    with pytest.raises(ValueError, match="shard: layout 'zigzag' not supported; supported: balanced, round_robin"):
        cp.shard([0, 4], 2, 0, layout="zigzag")
    with pytest.raises(ValueError, match=r"shard: rank must be in \[0, 2\), got 2"):
        cp.shard([0, 4], 2, 2)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, be non-decreasing"):
        cp.shard([0, 4, 3], 2, 0)
    with pytest.raises(ValueError, match="unshard: shards\\[1\\] has 3 rows but rank 1 of 2 holds 2"):
        cp.unshard([torch.zeros(2), torch.zeros(3)], [0, 4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_attention_states(dtype):
    torch.manual_seed(1)
    t, h, d = 13, 4, 16
    q = torch.randn(t, h, d, dtype=torch.float64)
    keys = [torch.randn(n, h, d, dtype=torch.float64) * 3 for n in (5, 1, 9)]
    vals = [torch.randn(n, h, d, dtype=torch.float64) for n in (5, 1, 9)]
    outs, lses = [], []
    for kk, vv in zip(keys, vals):
        s = torch.einsum("qhd,khd->hqk", q, kk)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv).to(dtype))
        lses.append(torch.logsumexp(s, -1).float())
    # A state that saw no key (lse -inf) contributes nothing.
    outs.append(torch.full((t, h, d), float("nan")).nan_to_num(7.0).to(dtype))
    lses.append(torch.full((h, t), float("-inf")))
    s_all = torch.einsum("qhd,khd->hqk", q, torch.cat(keys))
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(s_all, -1), torch.cat(vals))
    out, lse = cp.merge_attention_states(outs, lses)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert (out.double() - ref).abs().max() <= tol(dtype) * 4
    assert (lse.double() - torch.logsumexp(s_all, -1)).abs().max() <= 1e-5
    # Large LSE magnitudes stay finite (max-subtracted).
    o2, l2 = cp.merge_attention_states([outs[0], outs[0]], [lses[0] + 1e4, lses[0] + 1e4])
    assert torch.isfinite(o2.float()).all() and (l2 - (lses[0] + 1e4 + math.log(2))).abs().max() < 1e-2
    with pytest.raises(ValueError, match=r"lses\[0\] has shape \(13, 4\); expected \[heads, tokens\] = \(4, 13\)"):
        cp.merge_attention_states([outs[0]], [lses[0].t()])
    with pytest.raises(TypeError, match=r"merge_attention_states: outs\[1\] has dtype torch.int32; supported: float32"):
        cp.merge_attention_states([outs[0], outs[0].int()], [lses[0], lses[0]])
    with pytest.raises(TypeError, match=r"merge_attention_states: out_dtype torch.int8 not supported"):
        cp.merge_attention_states([outs[0]], [lses[0]], out_dtype=torch.int8)


def merge_reference(outs, lses):
    """fp64 merge of partial states (the inputs as given, upcast): out [T, H, D], lse [H, T]; a
    token with no finite LSE gets out 0 and LSE -inf; an empty state's out is ignored."""
    lse = torch.stack([x.double() for x in lses])                        # [S, H, T]
    m = lse.max(0).values
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)                                          # 0 for empty states
    total = w.sum(0)
    f = torch.where(total > 0, w / total, torch.zeros_like(w))           # [S, H, T]
    o = torch.stack([x.double() for x in outs])                          # [S, T, H, D]
    o = torch.where(f.permute(0, 2, 1).unsqueeze(-1) > 0, o, torch.zeros_like(o))
    out = (o * f.permute(0, 2, 1).unsqueeze(-1)).sum(0)
    return out, torch.where(total > 0, m_safe + torch.log(total), torch.full_like(total, float("-inf")))


def merge_case(num_states, t, h, d, dtype, device="cpu", seed=0):
    """Random partial states with a spread of LSE magnitudes, empty partials (-inf, their out
    poisoned with NaN) and one token (if t > 1) that no partial saw."""
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(t, h, d, generator=g).to(dtype) for _ in range(num_states)]
    lses = [(torch.randn(h, t, generator=g) * 4 + 20 * s) for s in range(num_states)]
    for s in range(num_states):
        empty = torch.rand(h, t, generator=g) < 0.2
        lses[s][empty] = float("-inf")
        outs[s][empty.t()] = float("nan")
    if t > 1:
        for s in range(num_states):
            lses[s][:, 1] = float("-inf")
    return [o.to(device) for o in outs], [x.to(device) for x in lses]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_states,t,d", [(1, 5, 64), (2, 37, 128), (3, 0, 64), (9, 6, 33)])
def test_merge_attention_states_cpu_reference(dtype, num_states, t, d):
    outs, lses = merge_case(num_states, t, 3, d, dtype, seed=num_states * 100 + t)
    ref, ref_lse = merge_reference(outs, lses)
    out, lse = cp.merge_attention_states(outs, lses, out_dtype=torch.float32)
    assert out.shape == (t, 3, d) and lse.shape == (3, t)
    assert torch.isfinite(out).all(), "an empty partial's NaN out must not leak"
    assert (out.double() - ref).abs().max().item() <= 64 * torch.finfo(torch.float32).eps if t else True
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    if t > 1:
        assert (out[1] == 0).all() and (lse[:, 1] == float("-inf")).all()
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= 1e-5 if finite.any() else True
    if t:  # a NaN LSE (a poisoned partial) makes its row NaN instead of being merged away
        lses[0][0, 0] = float("nan")
        out, lse = cp.merge_attention_states(outs, lses, out_dtype=torch.float32)
        assert torch.isnan(out[0, 0]).all() and torch.isnan(lse[0, 0])
        assert torch.isfinite(out[0, 1:]).all() and torch.isfinite(out[2:]).all()


# Merge patterns of a ring's running state: per partial, None (every row) or "half" (a permuted
# half of the rows, as the balanced layout's "second chunk" calls give).
LAG_PATTERNS = [(None, None), (None, "half"), (None, "half", None), (None, None, "half", "half"), ("half", None),
                ("half", None, "half"), (None,)]


def merge_lag_matches_eager(pattern, dtype, device):
    """ring attention's state with its owned partials merged one merge late (Note [merge lag]) gives
    the bits of the same partials merged as they come (an adopted partial's empty rows stay as the
    attention call left them, on both paths)."""
    from commlib.cp.merge import _State
    t, h, d = 37, 3, 64
    outs, lses = merge_case(len(pattern), t, h, d, dtype, device=device, seed=len(pattern) * 7 + t)
    g = torch.Generator().manual_seed(11)
    half = torch.randperm(t, generator=g)[:t // 2].to(device)
    results = []
    for owned in (False, True):
        state = _State(t, h, d, device)
        for s, sel in enumerate(pattern):
            rows = None if sel is None else half
            o, lse = outs[s].clone(), lses[s].clone()
            if rows is not None:
                o, lse = o[rows], lse[:, rows].contiguous()
            # The first partial is always the attention call's own (adopted when it covers every row).
            state.merge(rows, o, lse, owned=owned or s == 0)
        results.append(state.result(dtype))
    (eager, eager_lse), (lagged, lagged_lse) = results
    assert lagged.dtype == dtype and lagged.shape == (t, h, d)
    # Bit for bit, a NaN's payload aside: the poisoned empty rows of the adopted partial that no later
    # partial covers stay as they are on the lagged path, while the eager one converts them to fp32
    # and back, which on CUDA gives the canonical NaN.
    nan = torch.isnan(lagged)
    assert torch.equal(nan, torch.isnan(eager)), "NaN rows differ"
    assert torch.equal(lagged[~nan].view(torch.uint8), eager[~nan].view(torch.uint8)), \
        (lagged[~nan] - eager[~nan]).abs().max()
    assert torch.equal(lagged_lse, eager_lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pattern", LAG_PATTERNS)
def test_state_merge_lag_keeps_bits(pattern, dtype):
    merge_lag_matches_eager(pattern, dtype, "cpu")


def test_select_mode():
    args = dict(world_size=2, num_q_heads=64, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                bw=3.5e11, flops=4.5e14)
    assert cp.select_mode(128 * 1024, 0, **args) == "pass_kv"         # full prefill
    assert cp.select_mode(1, 100_000, **args) == "pass_q"             # decode
    assert cp.select_mode(200, 100_000, **args) == "pass_q"           # 0.2% new tokens
    # Hidden transfer: T >= N*C*NKV*e / (2*NH*BW) = 2*4.5e14*8*2/(2*64*3.5e11) ~ 321.
    assert cp.select_mode(400, 10_000_000, **args) == "pass_kv"
    assert cp.select_mode(300, 10_000_000, **args) == "pass_q"
    # MHA with a large new fraction (the second condition).
    mha = dict(args, num_kv_heads=64, flops=1e30)
    assert cp.select_mode(900, 100, **mha) == "pass_q"  # 2*NKV/NH = 2 > 0.9
    with pytest.raises(ValueError, match="select_mode: num_q_heads 6 is not a multiple of num_kv_heads 4"):
        cp.select_mode(1, 1, 2, 6, 4, 64, torch.bfloat16)
    with pytest.raises(TypeError, match="select_mode: dtype torch.int32 not supported"):
        cp.select_mode(1, 1, 2, 8, 4, 64, torch.int32)


def test_default_attention_cpu_matches_reference():
    torch.manual_seed(2)
    lens_q, lens_k = [3, 1, 6], [5, 1, 6]
    h, hkv, d = 8, 2, 32
    q = torch.randn(sum(lens_q), h, d, dtype=torch.float64)
    k = torch.randn(sum(lens_k), hkv, d, dtype=torch.float64)
    v = torch.randn(sum(lens_k), hkv, d, dtype=torch.float64)
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    out, lse = cp.default_attention(q, k, v, cu_q, cu_k, 6, 6, True, 0.3)
    # bottom-right causal = the reference's cache (the first Lk - Lq keys) + causal new keys
    cache_k = [k[0:2], k[5:5], k[6:6]]
    cache_v = [v[0:2], v[5:5], v[6:6]]
    new_idx = torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    ref, ref_lse = reference(q, k[new_idx], v[new_idx], lens_q, cache_k, cache_v, True, 0.3)
    assert (out - ref).abs().max() < 1e-10 and (lse.double() - ref_lse).abs().max() < 1e-5


def test_cudnn_fit_rule():
    """Note [cp attention backend]: cuDNN only for a dense batch it computes exactly."""
    fits = cp.attention._cudnn_fits

    def call(lens_q, lens_k, causal, dtype=torch.bfloat16, d=128):
        q = torch.empty(sum(lens_q), 8, d, dtype=dtype)
        k = torch.empty(sum(lens_k), 2, d, dtype=dtype)
        cu = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
        return fits(q, k, cu, max(lens_q), max(lens_k), causal)

    assert call([64], [64], True) == 1                    # causal square
    assert call([32, 32, 32], [64, 64, 64], False) == 3  # equal sequences, rectangular, non-causal
    assert call([32], [64], True) == 0                    # rectangular causal: cuDNN's mask is top-left
    assert call([40, 24], [64, 64], False) == 0           # unequal query counts (Tq != B * max_q)
    assert call([32, 32], [64, 63], False) == 0           # unequal key counts
    assert call([64], [64], True, dtype=torch.float32) == 0
    assert call([64], [64], True, d=256) == 0 and call([64], [64], True, d=60) == 0


def test_default_attention_backend_argument():
    q = torch.randn(4, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="default_attention: backend 'fast' not supported; supported: auto, cudnn, "
                                         "flash, efficient"):
        cp.default_attention(q, q, q, cu, cu, 4, 4, True, 0.3, backend="fast")
    # On the CPU every backend name runs the CPU path: each against the fp64 reference.
    want = reference(q, q, q, [4], [q[:0]], [q[:0]], True, 0.3)
    for backend in ("auto", "cudnn", "flash", "efficient"):
        out, lse = cp.default_attention(q, q, q, cu, cu, 4, 4, True, 0.3, backend=backend)
        torch.testing.assert_close(out.double(), want[0], msg=backend)
        torch.testing.assert_close(lse.double(), want[1], msg=backend)


# ---------------------------------------------------------------------------------------------
# Ring attention, multi-process
# ---------------------------------------------------------------------------------------------

def _make_case(seed, lens, cache_lens, h, hkv, d, dtype, world_size):
    """Global data, identical on every rank: new q/k/v packed per sequence, and each sequence's
    cache split over the ranks (cache_split[r][b] rows of sequence b on rank r)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    cache_k = [torch.randn(p, hkv, d, generator=g).to(dtype) for p in cache_lens]
    cache_v = [torch.randn(p, hkv, d, generator=g).to(dtype) for p in cache_lens]
    split = [[0] * len(lens) for _ in range(world_size)]
    for b, p in enumerate(cache_lens):
        cuts = sorted(torch.randint(0, p + 1, (world_size - 1,), generator=g).tolist())
        bounds = [0] + cuts + [p]
        for r in range(world_size):
            split[r][b] = bounds[r + 1] - bounds[r]
    return q, k, v, cache_k, cache_v, split


CASES = [
    # name, lens, cache lens (None: no cache), h, hkv, d, dtype, causal, layout
    ("causal varlen gqa4 d64 fp32", [37, 5, 1, 16, 3], None, 8, 2, 64, torch.float32, True, "balanced"),
    ("noncausal varlen mha d64 fp32", [21, 1, 9], None, 4, 4, 64, torch.float32, False, "balanced"),
    ("causal gqa8 d128 bf16", [40, 7], None, 8, 1, 128, torch.bfloat16, True, "balanced"),
    ("causal gqa4 d128 fp16", [33, 2, 1], None, 8, 2, 128, torch.float16, True, "balanced"),
    ("partial prefill gqa4 fp32", [12, 3, 1], [20, 7, 0], 8, 2, 64, torch.float32, True, "balanced"),
    ("partial prefill noncausal bf16", [9, 4], [11, 5], 4, 1, 64, torch.bfloat16, False, "balanced"),
    ("decode gqa4 fp32", [1, 1, 1, 1, 1], [9, 17, 1, 4, 30], 8, 2, 64, torch.float32, True, "round_robin"),
    ("decode gqa8 bf16", [1, 1, 1], [33, 6, 12], 8, 1, 128, torch.bfloat16, True, "round_robin"),
]
MODES_TRANSPORTS = [("pass_kv", "stream", "comm"), ("pass_q", "stream", "comm"), ("pass_q", "all_to_all", "comm"),
                    ("auto", "stream", "comm"), ("pass_kv", "stream", "gloo"), ("pass_q", "stream", "gloo"),
                    ("pass_q", "all_to_all", "gloo")]


def _ring_cases(ctx):
    """Every case x mode x transport on this rank; returns [(label, max error, tolerance)] plus
    the pass-KV vs pass-Q difference of the fp32 runs."""
    rank, n = ctx.rank, ctx.world_size
    gloo = ctx.gloo()
    results = []
    for ci, (name, lens, cache_lens, h, hkv, d, dtype, causal, layout) in enumerate(CASES):
        q, k, v, ck, cv, split = _make_case(100 + ci, lens, cache_lens or [0] * len(lens), h, hkv, d, dtype, n)
        cu = [0]
        for x in lens:
            cu.append(cu[-1] + x)
        sh = cp.shard(cu, n, rank, layout=layout)
        scale = 1.0 / math.sqrt(d) if ci % 2 == 0 else 0.7 / math.sqrt(d)
        ref, ref_lse = reference(q, k, v, lens, ck, cv, causal, scale)
        kv_cache, cu_kv = None, None
        if cache_lens is not None:
            rows_k, rows_v = [], []
            for b in range(len(lens)):
                off = sum(split[r][b] for r in range(rank))
                rows_k.append(ck[b][off:off + split[rank][b]])
                rows_v.append(cv[b][off:off + split[rank][b]])
            kv_cache = (torch.cat(rows_k), torch.cat(rows_v), split[rank])
            cu_kv = [0]
            for b in range(len(lens)):
                cu_kv.append(cu_kv[-1] + lens[b] + cache_lens[b])
        outs = {}
        for mode, ret, via in MODES_TRANSPORTS:
            comm = ctx.comm if via == "comm" else gloo
            out, lse = cp.ring_attention(comm, q[sh.index], k[sh.index], v[sh.index], cu_seqlens_q=cu,
                                         cu_seqlens_kv=cu_kv, causal=causal, kv_cache=kv_cache, mode=mode,
                                         scale=scale, layout=layout, pass_q_return=ret, return_lse=True)
            assert out.dtype == dtype and out.shape == q[sh.index].shape
            err = (out.double() - ref[sh.index]).abs().max().item() if out.numel() else 0.0
            lse_err = (lse.double() - ref_lse[:, sh.index]).abs().max().item() if out.numel() else 0.0
            label = f"{name} {mode}/{ret}/{via}"
            results.append((label, err, tol(dtype)))
            results.append((label + " lse", lse_err, 1e-4))
            outs[(mode, ret, via)] = out
        # pass-KV and pass-Q compute the same block calls and merge in another order.
        a, b = outs[("pass_kv", "stream", "comm")], outs[("pass_q", "stream", "comm")]
        if a.numel():
            agree = 8 * torch.finfo(torch.float32).eps if dtype == torch.float32 else torch.finfo(dtype).eps * 2
            diff = ((a.double() - b.double()).abs() / (1 + b.double().abs())).max().item()
            results.append((f"{name} pass_kv vs pass_q", diff, agree))
    return results


def _ring_errors(ctx):
    """Bad input raises on every rank, and the communicator stays usable."""
    rank, n = ctx.rank, ctx.world_size
    cu = [0, 8 * n]
    sh = cp.shard(cu, n, rank)
    q = torch.randn(sh.index.numel(), 4, 16)
    k = torch.randn(sh.index.numel(), 2, 16)
    msgs = []

    def expect(exc, fn):
        try:
            fn()
        except exc as e:  # noqa: PERF203
            msgs.append(str(e))
            return
        raise AssertionError("no error raised")

    expect(ValueError, lambda: cp.ring_attention(ctx.comm, q, k, k, cu_seqlens_q=cu, mode="pass_x"))
    expect(ValueError, lambda: cp.ring_attention(ctx.comm, q, k[:, :1].expand(-1, 3, -1), k[:, :1].expand(-1, 3, -1),
                                                 cu_seqlens_q=cu))
    expect(TypeError, lambda: cp.ring_attention(ctx.comm, q.int(), k, k, cu_seqlens_q=cu))
    expect(ValueError, lambda: cp.ring_attention(ctx.comm, q[1:], k[1:], k[1:], cu_seqlens_q=cu))
    # Ranks disagreeing: modes, then sequence layouts.
    expect(ValueError, lambda: cp.ring_attention(ctx.comm, q, k, k, cu_seqlens_q=cu,
                                                 mode="pass_kv" if rank == 0 else "pass_q"))
    cu_bad = [0, 8 * n] if rank == 0 else [0, 4 * n, 8 * n]
    sh_bad = cp.shard(cu_bad, n, rank)
    expect(ValueError, lambda: cp.ring_attention(ctx.comm, q[:sh_bad.index.numel()], k[:sh_bad.index.numel()],
                                                 k[:sh_bad.index.numel()], cu_seqlens_q=cu_bad))
    # A bad argument on one rank only: that rank raises its own error, every other rank names it.
    expect(ValueError, lambda: cp.ring_attention(ctx.comm, q, k, k, cu_seqlens_q=cu,
                                                 mode="pass_x" if rank == 1 else "pass_kv"))
    expect(ValueError, lambda: cp.ring_attention(ctx.comm, q[1:] if rank == 0 else q, k[1:] if rank == 0 else k,
                                                 k[1:] if rank == 0 else k, cu_seqlens_q=cu))
    expect(TypeError, lambda: cp.ring_attention(ctx.comm, q.int() if rank == n - 1 else q, k, k, cu_seqlens_q=cu))
    # The same over a torch.distributed group (gloo).
    expect(ValueError, lambda: cp.ring_attention(ctx.gloo(), q, k, k, cu_seqlens_q=cu,
                                                 layout="zigzag" if rank == 0 else "balanced"))
    out_g = cp.ring_attention(ctx.gloo(), q, k, k, cu_seqlens_q=cu)
    assert torch.isfinite(out_g).all()
    # Still usable.
    out = cp.ring_attention(ctx.comm, q, k, k, cu_seqlens_q=cu)
    assert torch.isfinite(out).all()
    return msgs


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_attention(ranks, world_size):
    pool = ranks(world_size)
    per_rank = pool.run(_ring_cases, timeout=900)
    bad = [(r, label, err, t) for r, res in enumerate(per_rank) for label, err, t in res if not err <= t]
    assert not bad, "\n".join(f"rank {r}: {label}: error {err:.3g} > {t:.3g}" for r, label, err, t in bad[:20])
    assert len(per_rank[0]) >= len(CASES) * len(MODES_TRANSPORTS) * 2


@pytest.mark.parametrize("world_size", [3])
def test_ring_attention_errors(ranks, world_size):
    msgs = ranks(world_size).run(_ring_errors)
    for m in msgs:
        assert "mode 'pass_x' not supported; supported: auto, pass_kv, pass_q" in m[0]
        assert "num_q_heads 4 is not a multiple of num_kv_heads 3" in m[1]
        assert "q has dtype torch.int32; supported: float32, float16, bfloat16, float64" in m[2]
        assert "q has" in m[3] and "pass this rank's shard" in m[3]
        assert "ranks disagree on mode: rank 0: pass_kv, rank 1: pass_q" in m[4]
        assert "ranks disagree on batch size" in m[5]
    n = world_size
    for rank, m in enumerate(msgs):
        if rank == 1:
            assert "ring_attention: mode 'pass_x' not supported; supported: auto, pass_kv, pass_q" in m[6]
        else:
            assert "ring_attention: rank 1 rejected its argument mode" in m[6] and "every rank raises" in m[6]
        assert ("pass this rank's shard" in m[7]) if rank == 0 else ("rank 0 rejected its argument q" in m[7])
        assert ("q has dtype torch.int32" in m[8]) if rank == n - 1 else (f"rank {n - 1} rejected its argument q" in m[8])
        assert ("layout 'zigzag' not supported; supported: balanced, round_robin" in m[9]) if rank == 0 else \
            ("rank 0 rejected its argument layout" in m[9])
        assert "valid num_kv_heads: 1, 2, 4" in m[1]


def _ring_errors_one_rank(ctx):
    """World 1 exchanges no header (Note [agreed arguments]): its own errors, then a good call, which
    matches the attention it stands for."""
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="ring_attention: mode 'pass_x' not supported; supported: auto, pass_kv"):
        cp.ring_attention(ctx.comm, q, k, v, cu_seqlens_q=[0, 8], mode="pass_x")
    with pytest.raises(TypeError, match="q has dtype torch.int32; supported: float32"):
        cp.ring_attention(ctx.comm, q.int(), k, v, cu_seqlens_q=[0, 8])
    with pytest.raises(ValueError, match="pass this rank's shard"):
        cp.ring_attention(ctx.comm, q[1:], k[1:], v[1:], cu_seqlens_q=[0, 8])
    out = cp.ring_attention(ctx.comm, q, k, v, cu_seqlens_q=[0, 8])
    cu = torch.tensor([0, 8], dtype=torch.int32)
    want, _ = cp.default_attention(q, k, v, cu, cu, 8, 8, True, 16 ** -0.5)
    return torch.equal(out, want)


def test_ring_attention_errors_one_rank(ranks):
    assert ranks(1).run(_ring_errors_one_rank) == [True]


def test_ring_watchdog_thread():
    """The watchdog thread (Note [cp ring watchdog]) on stand-in events: a call whose events are
    done is dropped without action; a call past its deadline gets _on_timeout with the first
    pending wait and its receive slots; a transport whose check raises is marked failed."""
    import time

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    class Transport:
        rank = 0

        def __init__(self, broken=False):
            self.failure, self.fired, self.broken = None, [], broken

        def _call_done(self, trace):
            if self.broken:
                raise RuntimeError("context lost")
            return all(ev.query() for ev, _ in trace)

        def _on_timeout(self, trace, recv_slots, elapsed):
            self.fired.append((next(w for ev, w in trace if not ev.query()), recv_slots))
            self.failure = "timed out"

    wd = cp.symmetric._watchdog()
    ok, stuck, late, broken = Transport(), Transport(), Transport(), Transport(broken=True)
    now = time.monotonic()
    wd.watch(ok, [(Event(True), "slot kv1 from rank 1")], now + 0.05, ["kv1"])
    wd.watch(stuck, [(Event(True), "slot q1 from rank 2"), (Event(False), "slot p1 from rank 2")], now + 0.05,
             ["q1", "p1"])
    far = [(Event(False), "slot kv0 from rank 3")]
    wd.watch(late, far, now + 3600, ["kv0"])
    wd.watch(broken, [(Event(False), "x")], now + 3600, [])
    end = time.monotonic() + 60
    while (not stuck.fired or broken.failure is None) and time.monotonic() < end:
        time.sleep(0.01)
    assert stuck.fired == [("slot p1 from rank 2", ("q1", "p1"))] and stuck.failure == "timed out"
    assert "the ring watchdog failed: context lost" in broken.failure
    far[0][0].done = True  # the long call completes: dropped without action
    while wd.pending() and time.monotonic() < end:
        time.sleep(0.01)
    assert wd.pending() == 0
    assert ok.fired == [] and ok.failure is None and late.fired == [] and late.failure is None


def test_tuned_constants_reach_select_mode(tmp_path, monkeypatch):
    from commlib.perf import tune
    path = tmp_path / "tune.txt"
    monkeypatch.setenv("COMMLIB_TUNE_FILE", str(path))
    entry = tune.tune_cp("cpu", 2)
    assert entry["bw_bytes_per_s"] > 0 and entry["attn_flops_per_s"] > 0
    assert cp.machine_constants("cpu", 2) == (entry["bw_bytes_per_s"], entry["attn_flops_per_s"])
    # A machine whose link is slow against its compute: pass-Q at 1% new tokens; fast: pass-KV.
    data = tune.read_file()
    for bw, want in ((1e3, "pass_q"), (1e20, "pass_kv")):
        data["cp"][0].update(bw_bytes_per_s=bw, attn_flops_per_s=1e12)
        tune.write_file(data)
        cp.select._tuned.clear()
        assert cp.select_mode(1000, 99_000, 2, 8, 2, 64, torch.float32, device_type="cpu") == want
    cp.select._tuned.clear()


def test_perf_ring_attention_rows():
    """commlib-perf ring_attention on 2 CPU processes: the CLI checks each result against the
    1-process attention on the whole sequence; a planted wrong element must be reported."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, "-m", "commlib.perf", "ring_attention", "-np", "2", "--seqlens", "33", "--cp-mode",
            "pass_q", "--backend", "ddacomm", "gloo", "-n", "1", "-w", "1", "-d", "float"]
    ok = subprocess.run(args, capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    rows = [line.split() for line in ok.stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert {r[0] for r in rows} == {"ddacomm", "gloo"}, ok.stdout
    assert "Out of bounds values : 0 OK" in ok.stdout
    bad = subprocess.run(args + ["--corrupt-rank", "1"], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert bad.returncode != 0 and "Out of bounds values : 0 OK" not in bad.stdout, bad.stdout


def _bench_rows(ctx):
    from commlib.perf import ops_cp
    dev, shape = torch.device("cpu"), (4, 2, 16)
    cases = ops_cp._grid_cases("cpu", ctx.world_size, cached=[40], fractions=(0.05,), decode_batches=(3,))
    grid = ops_cp.grid_rows(ctx.comm, dev, torch.float32, 1, shape=shape, cases=cases)
    scaling = ops_cp.scaling_rows(ctx.comm, [24], ["pass_kv", "pass_q"], dev, torch.float32, 1, shape=shape)
    return grid, scaling


@pytest.mark.parametrize("world_size", [2])
def test_perf_grid_and_scaling_rows(ranks, world_size):
    """ops_cp's (T, P) grid and scaling rows on 2 CPU processes: one row per case, every mode
    timed, the pick is select_mode's (pass-Q for decode), hit means the pick's time is the best."""
    from commlib.perf import ops_cp
    grid, scaling = ranks(world_size).run(_bench_rows)[0]
    assert [r["kind"] for r in grid] == ["prefill", "decode"]
    for r in grid:
        times = {m: r[f"{m}_ms"] for m in ops_cp.GRID_MODES}
        assert all(t > 0 for t in times.values()) and r["fastest"] == min(times, key=times.get)
        want = "pass_q" if r["kind"] == "decode" else cp.select_mode(r["T"], r["P"], world_size, 4, 2, 16,
                                                                     torch.float32, device_type="cpu")
        assert r["pick"] == want
        pick_ms = min(t for m, t in times.items() if ops_cp.CP_MODES[m][0] == want)
        assert r["hit"] == (pick_ms <= times[r["fastest"]])
    assert [(r["seqlen"], r["mode"]) for r in scaling] == [(24, "pass_kv"), (24, "pass_q")]
    assert all(r["time_ms"] > 0 and r["efficiency"] > 0 for r in scaling)


@pytest.mark.parametrize("n", [2, 4])
def test_block_pairs_read_views_of_one_range(n):
    """A block pair whose query or key rows are one range (one sequence) hands the attention call a
    view of the block, not a gathered copy, and gives the same bits as the gathered rows."""
    import dataclasses
    length, h, hkv, d = 16 * n, 4, 2, 16
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(length, x, d, generator=g) for x in (h, hkv, hkv))
    plan = cp.plan._plan([length], [[0]] * n, n, "balanced", True, torch.device("cpu"))
    shards = [cp.shard([0, length], n, r) for r in range(n)]
    blocks = [(q[s.index], k[s.index], v[s.index]) for s in shards]
    seen = []

    def attn(qc, kc, vc, *args):
        seen.append((qc.data_ptr(), kc.data_ptr()))
        return cp.default_attention(qc, kc, vc, *args)

    for j in range(n):
        for i in range(n):
            if i == j:
                continue
            (call,) = plan.calls(j, i)
            assert (call.q_rows is None) != (call.k_rows is None)  # one side whole, the other one range
            qb, kb, vb = blocks[j][0], blocks[i][1], blocks[i][2]
            views, gathered = cp.merge._State(qb.shape[0], h, d, qb.device), cp.merge._State(qb.shape[0], h, d,
                                                                                          qb.device)
            seen.clear()
            cp.plan._block_attention(plan, j, i, qb, kb, vb, attn, d ** -0.5, views)
            rows, span = (call.q_rows, call.q_span) if call.q_rows is not None else (call.k_rows, call.k_span)
            block = qb if call.q_rows is not None else kb
            want_ptr = block.data_ptr() + span[0] * block.stride(0) * block.element_size()
            assert want_ptr in seen[0], (j, i, span)
            plan._calls[(j, i)] = [dataclasses.replace(call, q_span=None, k_span=None)]
            try:
                cp.plan._block_attention(plan, j, i, qb, kb, vb, attn, d ** -0.5, gathered)
            finally:
                plan._calls[(j, i)] = [call]
            assert want_ptr not in seen[1]  # the gathered copy
            for a, b in zip(views.partial(), gathered.partial()):
                assert torch.equal(a, b), (j, i)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_emulated_ring_is_the_ring(n):
    """ops_cp --emulate runs each rank's real ring steps on one device: rank r's result after its N
    steps is the fp64 causal attention of r's query rows over the whole sequence, for every rank."""
    from commlib.perf import ops_cp
    length, (h, hkv, d) = 8 * n + 5, (4, 2, 16)
    q, k, v = ops_cp._sequence(length, h, hkv, d, torch.float32, 3)
    dev = torch.device("cpu")
    plan = cp.plan._plan([length], [[0]] * n, n, "balanced", True, dev)
    shards = [cp.shard([0, length], n, r) for r in range(n)]
    blocks = [(q[s.index], k[s.index], v[s.index]) for s in shards]
    want, want_lse = reference(q, k, v, [length], [k[:0]], [v[:0]], True, d ** -0.5)
    marks = []
    for r in range(n):
        out, lse = ops_cp.emulated_ring(plan, blocks, r, lambda: marks.append(r))
        assert torch.allclose(out.double(), want[shards[r].index], atol=tol(torch.float32)), r
        assert torch.allclose(lse.double(), want_lse[:, shards[r].index], atol=tol(torch.float32)), r
    assert marks == [r for r in range(n) for _ in range(n)]  # one mark per step
    rows = ops_cp.emulated_step_rows([length], [n], dev, torch.float32, 1, shape=(h, hkv, d))
    assert [r["step"] for r in rows] == list(range(n)) and all(r["attn_ms"] > 0 and r["attn_only_ms"] > 0
                                                               for r in rows)


def test_perf_ops_cp_cli_world1(tmp_path):
    """python -m commlib.perf.ops_cp at world 1 on CPU with the grid, the PyTorch baseline and the
    emulated steps: the tables print and --out writes them under the run's commit and command; the
    baseline reports why it does not run where it does not (CPU SDPA has no CP)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "commlib.perf.ops_cp", "--device", "cpu", "--seqlens", "48", "--modes",
                        "pass_kv", "--iters", "1", "--torch-cp", "--grid", "--grid-cached", "64", "--merge", "16",
                        "--emulate", "2", "--out", str(tmp_path / "cp.md")],
                       capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    written = (tmp_path / "cp.md").read_text()
    assert "- command: `python -m commlib.perf.ops_cp --device cpu" in written and "- commit: " in written, written
    assert "# per seqlen and N: the steps' sum against the ideal" in written, written
    assert "pass_kv" in r.stdout and "torch_cp" in r.stdout, r.stdout
    assert "select_mode picked the fastest mode in" in r.stdout and "(T, P) grid" in r.stdout, r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("  ") and line.split()[0] in
            ("prefill", "decode")]
    assert len(rows) == 7, r.stdout  # 4 fractions + 3 decode batch sizes
    assert "merge_attention_states, 2 partials" in r.stdout, r.stdout
