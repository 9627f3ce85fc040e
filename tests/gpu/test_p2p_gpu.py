"""Point-to-point of CUDA tensors over peer memory (Note [cuda p2p], csrc/cuda/cuda_p2p.hpp): the
direct API's isend / irecv / send / recv / batch_isend_irecv and the "ddacomm" backend's
dist.send / recv / isend / irecv / batch_isend_irecv.

Reference: the deterministic inputs themselves (the receiver rebuilds what the sender sent from the
same seed; every output poisoned first), and, where one GPU per rank is available (marked ``nccl``),
an NCCL group of the same ranks on the same inputs. The counters of the peer-memory path
(``_C.cuda_p2p_counts``, the backend's ``num_fast_calls``) prove that it moved the messages.
Runs with ranks sharing one GPU (COMMLIB_TEST_SHARE_GPUS=1): a check of the protocol, not of speed.
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


def slot_bytes() -> int:
    import os
    return int(os.environ.get("COMMLIB_P2P_SLOT_BYTES", str(1 << 20)))


def message(src, dst, count, dtype, salt=0, device="cuda"):
    """What rank src sends rank dst: fresh, non-zero, deterministic values of every dtype."""
    g = torch.Generator().manual_seed(1000003 * src + 7919 * dst + 104729 * count + 31 * salt)
    if dtype.is_complex:
        x = torch.view_as_complex((torch.rand(count, 2, generator=g, dtype=torch.float64) * 2 - 1).float())
    elif dtype == torch.bool:
        x = torch.rand(count, generator=g) > 0.5
    elif dtype.is_floating_point:
        x = (torch.rand(count, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    else:
        info = torch.iinfo(dtype)
        x = torch.randint(max(info.min, -30000), min(info.max, 30000) + 1, (count,), generator=g, dtype=torch.int64)
        x = x.to(dtype)
    return x.to(device)


def poison(like):
    if like.dtype == torch.bool:
        return torch.zeros_like(like) if like.numel() == 0 else ~like  # every element differs
    if like.dtype.is_complex or like.dtype.is_floating_point:
        return torch.full_like(like, float("nan"))
    return torch.full_like(like, -7)


def same(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.cpu(), want.cpu()), f"{what}: received data differs from what was sent"


def counts(comm):
    from commlib import _C
    return tuple(_C.cuda_p2p_counts(comm.native))


def sizes():
    s = slot_bytes()
    # elements of float32: empty, tiny, odd, one slot exactly, just past it, several chunks (odd)
    return [0, 1, 7, 4097, s // 4, s // 4 + 3, (5 * s) // 4 + 17]


# ---- the direct API ----

def _direct_ping_pong(ctx):
    comm = ctx.new_comm("p2p-direct")
    r = ctx.rank
    sends0, recvs0 = counts(comm) if comm.world_size == 2 else (0, 0)
    num = 0
    for dtype in DTYPES:
        for i, count in enumerate(sizes()):
            if dtype != torch.float32 and count > 5000 and i != len(sizes()) - 1:
                continue  # every dtype: the small sizes and the multi-chunk one
            x = message(0, 1, count, dtype, salt=i)
            if r == 0:
                comm.send(x, 1, tag=i)
                back = poison(x)
                comm.recv(back, 1, tag=i)
                torch.cuda.synchronize()
                same(back, message(1, 0, count, dtype, salt=i), f"pong {dtype} {count}")
            else:
                got = poison(x)
                comm.recv(got, 0, tag=i)
                torch.cuda.synchronize()
                same(got, x, f"ping {dtype} {count}")
                comm.send(message(1, 0, count, dtype, salt=i), 0, tag=i)
            num += 1
    torch.cuda.synchronize()
    sends, recvs = counts(comm)
    assert (sends - sends0, recvs - recvs0) == (num, num), "a message left the peer-memory path"
    comm.close()


def test_direct_ping_pong_every_dtype_and_size(ranks):
    ranks(2).run(_direct_ping_pong)


def _direct_layouts_and_tags(ctx):
    comm = ctx.new_comm("p2p-layout")
    r, peer = ctx.rank, 1 - ctx.rank
    # Non-contiguous source and destination (a transposed view), 2-D shapes.
    base = message(r, peer, 37 * 53, torch.bfloat16).view(37, 53)
    src = base.t()
    want = message(peer, r, 37 * 53, torch.bfloat16).view(37, 53).t()
    out_base = poison(torch.empty(37, 53, dtype=torch.bfloat16, device="cuda"))
    out = out_base.t()
    work = comm.batch_isend_irecv([("send", src, peer, 5), ("recv", out, peer, 5)])
    work.wait()
    torch.cuda.synchronize()
    same(out, want, "non-contiguous exchange")
    # Tags out of order: rank 0 sends tags 1, 2, 3; rank 1 receives 3, 1, 2 (lanes differ).
    msgs = {t: message(0, 1, 1000 + t, torch.float32, salt=t) for t in (1, 2, 3)}
    if r == 0:
        works = [comm.isend(msgs[t], 1, tag=t) for t in (1, 2, 3)]
        for w in works:
            w.wait()
    else:
        outs = {t: poison(msgs[t]) for t in (3, 1, 2)}
        works = [comm.irecv(outs[t], 0, tag=t) for t in (3, 1, 2)]
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        for t in (1, 2, 3):
            same(outs[t], msgs[t], f"tag {t} received out of order")
    torch.cuda.synchronize()
    comm.close()


def test_direct_non_contiguous_and_tags_out_of_order(ranks):
    ranks(2).run(_direct_layouts_and_tags)


def _ring(comm, count, dtype, salt):
    n, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    x = message(r, nxt, count, dtype, salt)
    out = poison(x)
    work = comm.batch_isend_irecv([("send", x, nxt), ("recv", out, prv)])
    work.wait()
    return out, message(prv, r, count, dtype, salt)


def _direct_ring(ctx):
    comm = ctx.new_comm("p2p-ring")
    comm.symmetric_empty((16,), torch.float32)  # GPU state (collective) for worlds above 2
    sends0, recvs0 = counts(comm)
    num = 0
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        for i, count in enumerate([0, 3, 65537, 3 * slot_bytes() // 2 + 5]):
            out, want = _ring(comm, count, dtype, i)
            torch.cuda.synchronize()
            same(out, want, f"ring {dtype} {count}")
            num += 1
    # Several ring steps back to back without host synchronisation (ring attention's pattern).
    n, r = comm.world_size, comm.rank
    kv = message(r, r, 8191, torch.bfloat16, salt=99)
    for step in range(1, 2 * n + 1):
        nxt = poison(kv)
        work = comm.batch_isend_irecv([("send", kv, (r + 1) % n), ("recv", nxt, (r - 1) % n)])
        work.wait()
        kv = nxt
        num += 1
    torch.cuda.synchronize()
    same(kv, message(r, r, 8191, torch.bfloat16, salt=99), "ring of 2n steps: every block back at its owner")
    sends, recvs = counts(comm)
    assert (sends - sends0, recvs - recvs0) == (num, num), "a message left the peer-memory path"
    comm.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_direct_batch_ring_exchange(ranks, world_size):
    ranks(world_size).run(_direct_ring)


def _direct_graph(ctx):
    comm = ctx.new_comm("p2p-graph")
    comm.symmetric_empty((16,), torch.float32)  # GPU state (collective) for worlds above 2
    n, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    count = slot_bytes() // 2 + 3 * 1024 + 1  # two chunks of bf16
    static_in = torch.empty(count, dtype=torch.bfloat16, device="cuda")
    static_out = torch.empty_like(static_in)
    # Warm-up outside capture: sets up the GPU state (collective) and the streams.
    _ring(comm, 5, torch.float32, 0)
    torch.cuda.synchronize()
    sends0, _ = counts(comm)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            work = comm.batch_isend_irecv([("send", static_in * 2, nxt), ("recv", static_out, prv)])
            work.wait()
            doubled = static_out + 1
    torch.cuda.synchronize()
    captured = counts(comm)[0] - sends0
    assert captured == 1, captured
    for step in range(4):
        static_in.copy_(message(r, nxt, count, torch.bfloat16, salt=step))
        static_out.copy_(poison(static_out))
        graph.replay()
        torch.cuda.synchronize()
        want = message(prv, r, count, torch.bfloat16, salt=step) * 2
        same(static_out, want, f"graph replay {step}")
        same(doubled, want + 1, f"graph replay {step}: the work after wait()")
    # Replays moved the data without new host calls; eager calls still work afterwards.
    assert counts(comm)[0] - sends0 == 1
    out, want = _ring(comm, 4099, torch.float16, 7)
    torch.cuda.synchronize()
    same(out, want, "eager after replays")
    del graph
    comm.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_direct_cuda_graph_ring_exchange(ranks, world_size):
    ranks(world_size).run(_direct_graph)


def _direct_errors(ctx, timeout_s):
    import commlib
    import torch.distributed as dist
    r = ctx.rank
    comm = ctx.new_comm("p2p-errors", timeout=timedelta(seconds=timeout_s))
    x = message(0, 1, 100, torch.float32)
    # Bad arguments: a clear error on the calling rank, nothing posted.
    for bad in (-1, 2, r):
        with pytest.raises(ValueError, match="out of range"):
            comm.isend(x, bad)
    with pytest.raises(ValueError, match="any source"):
        comm.irecv(poison(x), None)
    # Size mismatch: the receiver raises "ranks disagree".
    if r == 0:
        comm.send(x, 1, tag=4)
    else:
        wrong = torch.empty(99, dtype=torch.float32, device="cuda")
        work = comm.irecv(wrong, 0, tag=4)
        torch.cuda.synchronize()
        with pytest.raises(dist.DistBackendError, match="ranks disagree"):
            work.wait()
    torch.cuda.synchronize()
    ctx.store.set(f"p2p-errors/mismatch/{r}", b"1")
    ctx.store.wait([f"p2p-errors/mismatch/{1 - r}"])
    comm.close()

    # A peer that never posts the matching call: an error within the timeout, never a hang.
    comm = ctx.new_comm("p2p-missing", timeout=timedelta(seconds=timeout_s))
    comm.symmetric_empty((1,), torch.float32)
    if r == 0:
        got = poison(x)
        t0 = time.monotonic()
        work = comm.irecv(got, 1, tag=0)
        work.wait()
        torch.cuda.synchronize()  # the device wait gives up after the timeout
        elapsed = time.monotonic() - t0
        with pytest.raises(dist.DistBackendError, match="Timed out") as info:
            work.is_completed()
        assert "rank 0 waiting for rank 1" in str(info.value), str(info.value)
        assert elapsed < timeout_s + 60, f"gave up after {elapsed:.1f} s"
        with pytest.raises(dist.DistBackendError, match="Timed out"):
            comm.send(x, 1)
    else:
        # A send larger than the channel's two slots waits for a receiver that never comes.
        big = message(1, 0, 3 * slot_bytes() // 4 + 1, torch.float32)
        work = comm.isend(big, 0, tag=1)
        work.wait()
        torch.cuda.synchronize()
        with pytest.raises(dist.DistBackendError, match="Timed out"):
            work.is_completed()
    ctx.store.set(f"p2p-errors/missing/{r}", b"1")
    ctx.store.wait([f"p2p-errors/missing/{1 - r}"])
    comm.close()
    assert commlib is not None


def test_direct_errors_and_missing_peer(ranks):
    ranks(2, env={"COMMLIB_TIMEOUT_MS": "0"}).run(_direct_errors, 2.0)


def _world1(ctx):
    comm = ctx.new_comm("p2p-world1")
    x = torch.ones(4, device="cuda")
    with pytest.raises(ValueError, match="out of range"):
        comm.isend(x, 0)
    with pytest.raises(ValueError, match="out of range"):
        comm.irecv(x, 0)
    comm.close()


def test_world1_has_no_peer(ranks):
    ranks(1).run(_world1)


# ---- the ddacomm backend ----

def _init_ddacomm(ctx, name):
    import commlib  # noqa: F401  (registers "ddacomm")
    import torch.distributed as dist
    ctx.drop_default_group()
    n = ctx.scratch["p2p-worlds"] = ctx.scratch.get("p2p-worlds", 0) + 1  # fresh keys for each group
    store = dist.PrefixStore(f"p2p-gpu/{name}/{n}", ctx.store)
    dist.init_process_group("ddacomm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=120))
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    assert type(backend).__name__ == "DdaBackend" and backend.has_fast_path
    return backend


def _backend_p2p(ctx):
    import torch.distributed as dist
    backend = _init_ddacomm(ctx, f"backend-{ctx.world_size}")
    n, r = ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    if n > 2:
        t = torch.ones(8, device="cuda")
        dist.all_reduce(t)  # commlib's all-reduce sets up the GPU state collectively
    fast0, fallback0 = backend.num_fast_calls, backend.num_fallback_calls
    num = 0
    for dtype in DTYPES:
        for i, count in enumerate([0, 5, 4097, 3 * slot_bytes() // 8 + 1]):
            x = message(r, nxt, count, dtype, salt=i)
            out = poison(x)
            if r % 2 == 0:
                dist.send(x, dst=nxt, tag=i)
                dist.recv(out, src=prv, tag=i)
            else:
                dist.recv(out, src=prv, tag=i)
                dist.send(x, dst=nxt, tag=i)
            torch.cuda.synchronize()
            same(out, message(prv, r, count, dtype, salt=i), f"send/recv {dtype} {count}")
            num += 2
    # isend / irecv and batch_isend_irecv (ring attention's step), several back to back.
    kv = message(r, r, 3 * slot_bytes() // 4 + 11, torch.bfloat16)
    for step in range(n):
        nxt_kv = poison(kv)
        ops = [dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, nxt_kv, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        kv = nxt_kv
        num += 2
    torch.cuda.synchronize()
    same(kv, message(r, r, 3 * slot_bytes() // 4 + 11, torch.bfloat16), "batch ring of n steps")
    x = message(r, nxt, 1001, torch.float32, salt=3)
    out = poison(x)
    works = [dist.irecv(out, src=prv, tag=9), dist.isend(x, dst=nxt, tag=9)]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    same(out, message(prv, r, 1001, torch.float32, salt=3), "isend/irecv")
    num += 2
    assert works[0].is_completed()
    # A CUDA graph of a ring exchange through torch.distributed.
    static_in = message(r, nxt, 5003, torch.float16)
    static_out = poison(static_in)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            ops = [dist.P2POp(dist.isend, static_in, nxt), dist.P2POp(dist.irecv, static_out, prv)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
    num += 2
    for step in range(3):
        static_in.copy_(message(r, nxt, 5003, torch.float16, salt=step))
        static_out.copy_(poison(static_out))
        graph.replay()
        torch.cuda.synchronize()
        same(static_out, message(prv, r, 5003, torch.float16, salt=step), f"backend graph replay {step}")
    del graph
    assert backend.num_fast_calls - fast0 == num, (backend.num_fast_calls - fast0, num)
    assert backend.num_fallback_calls == fallback0, "a send or receive went to NCCL"
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_backend_send_recv_batch_and_graph(ranks, world_size):
    ranks(world_size).run(_backend_p2p)


def _backend_vs_nccl(ctx):
    import torch.distributed as dist
    _init_ddacomm(ctx, "vs-nccl")
    nccl = dist.new_group(backend="nccl")
    n, r = ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    for dtype in DTYPES:
        for count in (1, 4097, slot_bytes() + 5):
            x = message(r, nxt, count, dtype)
            ours, ref = poison(x), poison(x)
            for group, out in ((None, ours), (nccl, ref)):
                ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, out, prv, group)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            torch.cuda.synchronize()
            same(ours, ref, f"ddacomm vs nccl {dtype} {count}")
    dist.destroy_process_group()


@pytest.mark.nccl
def test_backend_matches_nccl(ranks):
    ranks(2).run(_backend_vs_nccl)
