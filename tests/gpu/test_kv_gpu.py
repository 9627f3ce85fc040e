"""commlib.kv with CUDA caches: the copy kernel and the peer-memory protocol, prefill and decode
processes on one GPU or several (COMMLIB_TEST_SHARE_GPUS=1: sharing one). Reference and scenarios:
tests/kv_reference.py (bitwise, poisoned destinations)."""
from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import torch

from conftest import RankFailure
from kv_reference import barrier, canonical_bytes, case_dict, make_cache, request, run_case

pytestmark = pytest.mark.gpu


def _tag(name):
    return f"gpu-{name}-{uuid.uuid4().hex[:8]}"


def _requests(src_bs, dst_bs, src_pool, dst_pool, big=False):
    """Requests over disjoint, scattered blocks of each pool (permutations), a partial last block,
    one block, none, a layer-wise one, and with `big` one over most of the pools."""
    g = torch.Generator().manual_seed(3)
    src_perm, dst_perm = torch.randperm(src_pool, generator=g).tolist(), torch.randperm(dst_pool, generator=g).tolist()
    reqs, used = [], [0, 0]

    def add(rid, ntok, mode="send"):
        ns, nd = -(-ntok // src_bs), -(-ntok // dst_bs)
        reqs.append(request(rid, ntok, src_perm[used[0]:used[0] + ns], dst_perm[used[1]:used[1] + nd], mode=mode,
                            num_tokens=ntok))
        used[0] += ns
        used[1] += nd

    add("a", 40)
    add("one", src_bs)
    add("empty", 0)
    add("streamed", 2 * src_bs, mode="stream")
    if big:
        add("big", min((src_pool - used[0]) * src_bs, (dst_pool - used[1]) * dst_bs))
    return reqs


def _run_cases(ctx, cases):
    return [run_case(ctx, c) for c in cases]


def _done(results, P, ids):
    for events, _ in results[P:]:
        for rid in ids:
            assert events[rid][0] == "done", events


@pytest.mark.parametrize("world_size", [2])
def test_layouts_dtypes_block_sizes(ranks, world_size):
    cases = [
        case_dict(_tag("nhd"), src_layout="NHD", dst_layout="NHD", heads=8, head_dim=128, src_blocks=1000,
                  dst_blocks=1000, device="cuda", requests=_requests(16, 16, 1000, 1000, big=True)),
        case_dict(_tag("nhd-hnd"), src_layout="NHD", dst_layout="HND", heads=4, head_dim=64, dtype="float8_e4m3fn",
                  src_blocks=1000, dst_blocks=2000, src_bs=16, dst_bs=8, device="cuda",
                  requests=_requests(16, 8, 1000, 2000, big=True)),
        case_dict(_tag("fa-fi"), src_layout="flash_attn", dst_layout="flashinfer_hnd", heads=2, head_dim=40,
                  dtype="float16", src_bs=32, dst_bs=16, src_blocks=16, dst_blocks=32, device="cuda",
                  requests=_requests(32, 16, 16, 32)),
        case_dict(_tag("mla"), src_layout="MLA", dst_layout="MLA", head_dim=576, src_bs=64, dst_bs=16,
                  src_blocks=16, dst_blocks=32, device="cuda", requests=_requests(64, 16, 16, 32)),
    ]
    for results in zip(*ranks(world_size).run(_run_cases, cases)):
        _done(results, 1, ["a", "one", "empty", "streamed"])


@pytest.mark.parametrize("world_size,P", [(3, 1), (3, 2)])
def test_tensor_parallel(ranks, world_size, P):
    D = world_size - P
    case = case_dict(_tag(f"tp{P}{D}"), P=P, D=D, src_layout="flashinfer_nhd", dst_layout="HND", heads=8,
                     head_dim=128, src_bs=16, dst_bs=32, src_blocks=16, dst_blocks=16, device="cuda",
                     requests=_requests(16, 32, 16, 16))
    _done(ranks(world_size).run(run_case, case), P, ["a", "one", "empty", "streamed"])


def _symmetric(ctx, tag):
    """A decode cache in commlib's symmetric memory (a cuMem allocation: exported by POSIX fd)."""
    from commlib import kv
    device = torch.device("cuda", ctx.device)
    shape = [2, 8, 16, 2, 64]  # flash_attn, one tensor per layer
    sym = [ctx.comm.symmetric_empty(shape, torch.bfloat16, device) for _ in range(2)]  # collective
    if ctx.rank == 0:
        agent = kv.KVAgent(ctx.store, f"{tag}-p", "prefill", device=device, timeout=timedelta(seconds=60))
        caches, planes = make_cache("flash_attn", 2, 8, 16, 2, 64, torch.bfloat16, 5, device)
        agent.register(caches, "flash_attn")
        agent.send(f"{tag}-d", "r", [6, 1], [2, 7]).wait()
        ctx.store.set(f"{tag}/src", b"1")
        out = [[canonical_bytes(p, "flash_attn") for p in layer] for layer in planes]
    else:
        agent = kv.KVAgent(ctx.store, f"{tag}-d", "decode", device=device, timeout=timedelta(seconds=60))
        for t in sym:
            t.fill_(-3.0)
        agent.register(sym, "flash_attn")
        agent.wait("r")
        out = [[canonical_bytes(t.select(0, i), "flash_attn") for i in range(2)] for t in sym]
    barrier(ctx, f"{tag}/end")
    agent.close()
    return out


@pytest.mark.parametrize("world_size", [2])
def test_symmetric_memory_destination(ranks, world_size):
    src, dst = ranks(world_size).run(_symmetric, _tag("sym"))
    for layer in range(2):
        for plane in range(2):
            s, d = src[layer][plane], dst[layer][plane]
            assert torch.equal(d[[2, 7]], s[[6, 1]])
            rest = [b for b in range(8) if b not in (2, 7)]
            assert torch.equal(d[rest], torch.full_like(d[rest].view(torch.bfloat16), -3.0).view(torch.uint8))


def _fault_observer(ctx, case, rid):
    out = run_case(ctx, case)
    if ctx.rank == case["P"]:
        events, _ = out
        ctx.store.set(f"{case['tag']}/outcome", f"{events['ok'][0]}|{'|'.join(events[rid])}".encode())
    return out


@pytest.mark.parametrize("world_size", [2])
def test_killed_producer(ranks, world_size):
    reqs = [request("ok", 32, [0, 1], [2, 3]), request("partial", 32, [4, 5], [6, 7], mode="die")]
    case = case_dict(_tag("die"), requests=reqs, timeout_s=20.0, device="cuda")
    pool = ranks(world_size)
    with pytest.raises(RankFailure) as info:
        pool.run(_fault_observer, case, "partial")
    assert sorted(info.value.errors) == [0], info.value.errors
    ok, kind, message = pool.store.get(f"{case['tag']}/outcome").decode().split("|", 2)
    assert ok == "done" and kind == "PeerError", message
    assert "'partial'" in message and "exited before layer 1 landed" in message, message


def test_benchmark_on_cuda():
    """commlib-perf kv_transfer on CUDA, small: the requests land bit-exact (the benchmark checks one
    on fresh data on the decode ranks and exits 1 on any wrong byte), and the GPU-time column comes
    from the requests timed with their stream held (its own column, a positive time; not asserted
    against anything)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    result = subprocess.run([sys.executable, "-m", "commlib.perf", "kv_transfer", "--device", "cuda", "--kv-blocks",
                             "16,200", "--kv-block-bytes", "4K", "--kv-cases", "nhd,tp1:2", "-n", "2", "-w", "1"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()
            if line.split() and line.split()[0] in ("nhd", "tp1:2")]
    assert [(r[0], r[2]) for r in rows] == [("nhd", "16"), ("nhd", "200"), ("tp1:2", "16"), ("tp1:2", "200")], \
        result.stdout
    for cells in rows:
        gpu_us, d2d = float(cells[8]), float(cells[10])
        assert gpu_us > 0 and d2d > 0 and cells[12] == "0", cells
