"""commlib.cp on CUDA: ring attention at world 1 and over the copy-engine ring (ranks on their own
GPUs, or sharing one with COMMLIB_TEST_SHARE_GPUS=1), against the fp64 reference of
tests/cpu/test_cp.py; CUDA-graph capture of decode; a deliberately slow consumer."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cpu"))
from test_cp import _make_case, reference, tol  # noqa: E402

from commlib import cp  # noqa: E402

pytestmark = pytest.mark.gpu

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
            out = cp.ring_attention(comm, q, k, v, cu_seqlens_q=cu, causal=causal, kv_cache=kv_cache, mode=mode,
                                    layout=layout, pass_q_return=ret)
            torch.cuda.synchronize()
            err = (out.double().cpu() - ref).abs().max().item() if out.numel() else 0.0
            results.append((f"{case[0]} {mode}/{ret}", err, tol(dtype)))
        if ci == 0 and ctx.world_size > 1:  # the all_to_all_v ring step on CUDA (the fallback transport)
            for mode in ("pass_kv", "pass_q"):
                out = cp.ring_attention(comm, q, k, v, cu_seqlens_q=cu, causal=causal, mode=mode,
                                        transport=cp.CommTransport(comm))
                torch.cuda.synchronize()
                results.append((f"{case[0]} {mode} CommTransport", (out.double().cpu() - ref).abs().max().item(),
                                tol(dtype)))
    return results


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
