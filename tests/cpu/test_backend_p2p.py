"""Point-to-point on CPU tensors through commlib's shared memory (Note [host p2p]): the ddacomm
backend's send / recv / isend / irecv / batch_isend_irecv / any-source recv, and the direct API's.

Reference: gloo on the same ranks with the same inputs, and the deterministic inputs themselves
(every output poisoned first). Call counters prove that commlib's path moved the messages.
"""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from test_backend import ALL_DTYPES, any_values, backend_of, ddacomm_world, poison

MiB = 1 << 20


def message(src, dst, count, dtype, salt=0):
    if dtype.is_complex:
        real = any_values(1000 * src + dst, 2 * count, torch.float32, salt=salt)
        return torch.view_as_complex(real.reshape(count, 2))
    return any_values(1000 * src + dst, count, dtype, salt=salt)


def _p2p(ctx):
    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    with ddacomm_world(ctx) as (world, gloo):
        backend = backend_of(world)
        fast0, fallback0, num_fast = backend.num_fast_calls, backend.num_fallback_calls, 0

        # Ping-pong between ranks 0 and 1, every size class: empty, tiny, one slot, beyond the ring.
        for i, count in enumerate([0, 1, 1000, (256 << 10) // 4 + 3, 3 * MiB // 4 + 5]):
            if r in (0, 1):
                x = message(0, 1, count, torch.float32, salt=i)
                if r == 0:
                    dist.send(x, dst=1, tag=i)
                    back = poison(x)
                    dist.recv(back, src=1, tag=i)
                    assert torch.equal(back, x * 2), f"ping-pong count={count}"
                else:
                    got = poison(x)
                    dist.recv(got, src=0, tag=i)
                    assert torch.equal(got, x), f"ping count={count}"
                    dist.send(got * 2, dst=0, tag=i)
                num_fast += 2

        # A ring of every dtype, blocking calls (even ranks send first), against gloo's ring.
        for dtype in ALL_DTYPES + [torch.complex64]:
            x = message(r, nxt, 1237, dtype)
            ours, ref = poison(x), poison(x)
            for group, out in ((None, ours), (gloo, ref)):
                if r % 2 == 0:
                    dist.send(x, dst=nxt, group=group)
                    dist.recv(out, src=prv, group=group)
                else:
                    dist.recv(out, src=prv, group=group)
                    dist.send(x, dst=nxt, group=group)
            num_fast += 2
            expected = message(prv, r, 1237, dtype)
            assert torch.equal(ours.view(torch.uint8), expected.view(torch.uint8)), f"ring {dtype}"
            assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8)), f"ring {dtype} vs gloo"

        # batch_isend_irecv: every rank sends 5 MiB to the next and receives from the previous at once
        # (larger than the ring, so the two directions must progress together).
        x = message(r, nxt, 5 * MiB // 8 + 3, torch.float64, salt=7)
        got = poison(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, tag=3), dist.P2POp(dist.irecv, got, prv, tag=3)])
        for w in works:
            w.wait()
        num_fast += 2
        assert torch.equal(got, message(prv, r, 5 * MiB // 8 + 3, torch.float64, salt=7)), "batch ring"

        # Blocking sends of large messages towards each other first: arriving data is drained, no deadlock.
        if r in (0, 1):
            peer = 1 - r
            x = message(r, peer, 3 * MiB // 4 + 1, torch.int32, salt=8)
            got = poison(x)
            dist.send(x, dst=peer, tag=9)
            dist.recv(got, src=peer, tag=9)
            num_fast += 2
            assert torch.equal(got, message(peer, r, 3 * MiB // 4 + 1, torch.int32, salt=8)), "send-send-recv-recv"

        # Out-of-order tags: sent as 11, 12, 13; received as 13, 11, 12 (one of them beyond the ring).
        counts = {11: 17, 12: 3 * MiB // 4, 13: 0}
        if r == 0:
            works = [dist.isend(message(0, 1, c, torch.float32, salt=t), dst=1, tag=t) for t, c in counts.items()]
            for w in works:
                w.wait()
            num_fast += 3
        elif r == 1:
            for t in (13, 11, 12):
                got = poison(torch.empty(counts[t]))
                dist.recv(got, src=0, tag=t)
                num_fast += 1
                assert torch.equal(got, message(0, 1, counts[t], torch.float32, salt=t)), f"tag {t}"

        # Non-contiguous source and destination.
        base = message(r, nxt, 64 * 9, torch.bfloat16, salt=10).reshape(64, 9)
        got = poison(torch.empty(9, 64, dtype=torch.bfloat16)).t()
        reqs = [dist.isend(base[:, ::2], dst=nxt, tag=4), dist.irecv(got[:, ::2], src=prv, tag=4)]
        for w in reqs:
            w.wait()
        num_fast += 2
        assert torch.equal(got[:, ::2], message(prv, r, 64 * 9, torch.bfloat16, salt=10).reshape(64, 9)[:, ::2])
        assert torch.isnan(got[:, 1::2].float()).all(), "recv wrote outside its view"

        # Any-source receive: rank 0 takes one message from each other rank, in whatever order.
        if r == 0:
            seen = set()
            for _ in range(n - 1):
                got = poison(torch.empty(77, dtype=torch.int64))
                src = dist.recv(got, tag=5)
                assert torch.equal(got, message(src, 0, 77, torch.int64, salt=5)), f"any-source from {src}"
                seen.add(src)
            assert seen == set(range(1, n))
            num_fast += n - 1
        else:
            dist.send(message(r, 0, 77, torch.int64, salt=5), dst=0, tag=5)
            num_fast += 1

        # A receive that expects another size (or dtype): "ranks disagree" on the receiver, pair usable.
        if r in (0, 1):
            if r == 0:
                dist.send(torch.ones(10), dst=1, tag=6)
                dist.send(torch.ones(10), dst=1, tag=6)
                dist.send(torch.full((4,), 2.0), dst=1, tag=6)
            else:
                with pytest.raises(dist.DistBackendError, match="ranks disagree: rank 0 sent 40 bytes"):
                    dist.recv(torch.empty(11), src=0, tag=6)
                with pytest.raises(dist.DistBackendError, match="ranks disagree"):
                    dist.recv(torch.empty(10, dtype=torch.int32), src=0, tag=6)
                got = torch.empty(4)
                dist.recv(got, src=0, tag=6)
                assert got.tolist() == [2.0] * 4
            num_fast += 3

        assert backend.num_fast_calls == fast0 + num_fast, "a send or receive left commlib's path"
        assert backend.num_fallback_calls == fallback0

        # The direct API: a ring step posted together and overlapped with compute.
        comm = ctx.comm
        kv = message(r, nxt, 4099, torch.float16, salt=11)
        kv_next = poison(kv)
        work = comm.batch_isend_irecv([("send", kv, nxt), ("recv", kv_next, prv)])
        busy = torch.randn(64, 64) @ torch.randn(64, 64)  # compute while the messages move
        work.wait()
        assert busy.shape == (64, 64)
        assert torch.equal(kv_next, message(prv, r, 4099, torch.float16, salt=11)), "direct batch ring"
        if r in (0, 1):
            x = message(r, 1 - r, 33, torch.int8, salt=12)
            got = poison(x)
            if r == 0:
                comm.send(x, 1, tag=2)
                assert comm.recv(got, None, tag=2) == 1
            else:
                assert comm.recv(got, 0, tag=2) == 0
                comm.send(x, 0, tag=2)
            assert torch.equal(got, message(1 - r, r, 33, torch.int8, salt=12)), "direct send/recv"
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_p2p_on_shared_memory_matches_gloo(ranks, world_size):
    ranks(world_size).run(_p2p)


def _p2p_timeouts(ctx):
    """A 1 s group: a receive whose sender never sends, a send beyond the ring whose receiver never
    receives; both raise "Timed out" on the waiting rank, naming rank, peer and phase."""
    import torch.distributed as dist
    n = ctx.scratch["p2p_timeouts"] = ctx.scratch.get("p2p_timeouts", 0) + 1
    with ddacomm_world(ctx) as (world, gloo):
        dist.barrier()
        group = dist.new_group(backend="ddacomm", timeout=timedelta(seconds=1))
        for phase, call in (("recv", lambda: dist.recv(torch.empty(5), src=1, group=group)),
                            ("send", lambda: dist.send(torch.ones(MiB), dst=1, group=group))):
            key = f"p2p-timeouts/{n}/{phase}"
            if ctx.rank == 1:
                ctx.store.wait([key])
                continue
            try:
                with pytest.raises(dist.DistBackendError, match="Timed out") as info:
                    call()
            finally:
                ctx.store.set(key, b"1")
            text = str(info.value)
            for part in (phase, "rank 0", "rank 1", f"phase '{phase}'"):
                assert part in text, text
    return True


def test_p2p_timeouts(ranks):
    ranks(2).run(_p2p_timeouts)


def _set_timeout(ctx):
    """ProcessGroup.set_timeout (torch.distributed.set_timeout; _set_default_timeout in older torch)
    on a ddacomm group bounds commlib's waits from then on: a group created with 300 s and set to 1 s
    raises "Timed out" for a receive and a barrier whose peer never comes, not after 300 s."""
    import time

    import torch.distributed as dist
    n = ctx.scratch["set_timeout"] = ctx.scratch.get("set_timeout", 0) + 1
    with ddacomm_world(ctx) as (world, gloo):
        group = dist.new_group(backend="ddacomm", timeout=timedelta(seconds=300))
        dist.barrier(group=group)  # the shared memory is set up under the old timeout
        dist.send(torch.ones(3), dst=1 - ctx.rank, group=group)  # and the pair's channel
        dist.recv(torch.empty(3), src=1 - ctx.rank, group=group)
        if hasattr(group, "set_timeout"):
            group.set_timeout(timedelta(seconds=1))
        else:
            group._set_default_timeout(timedelta(seconds=1))
        for phase, call in (("recv", lambda: dist.recv(torch.empty(5), src=1, group=group)),
                            ("barrier", lambda: dist.barrier(group=group))):
            key = f"set-timeout/{n}/{phase}"
            if ctx.rank == 1:
                ctx.store.wait([key])
                continue
            t0 = time.monotonic()
            try:
                with pytest.raises(dist.DistBackendError, match="Timed out") as info:
                    call()
            finally:
                ctx.store.set(key, b"1")
            assert time.monotonic() - t0 < 100, "the wait was bounded by the creation timeout, not the new one"
            assert "rank 1" in str(info.value), str(info.value)
    return True


def test_set_timeout_bounds_later_waits(ranks):
    ranks(2, env={"COMMLIB_TIMEOUT_MS": "0"}).run(_set_timeout)


def _dead_peer(ctx):
    import time

    import torch.distributed as dist
    with ddacomm_world(ctx) as (world, gloo):
        dist.send(torch.ones(3), dst=1 - ctx.rank)  # the pair's channel is up
        dist.recv(torch.empty(3), src=1 - ctx.rank)
        if ctx.rank == 1:
            time.sleep(0.5)
            os._exit(0)
        with pytest.raises(dist.DistBackendError, match="rank 1 .* has exited"):
            dist.recv(torch.empty(3), src=1)
    return "saw the exit"


def test_p2p_dead_peer_raises(ranks):
    from conftest import RankFailure
    pool = ranks(2, env={"P2P_DEAD_PEER_POOL": "1"})  # a pool of its own: rank 1 exits
    with pytest.raises(RankFailure) as info:
        pool.run(_dead_peer, timeout=120)
    assert set(info.value.errors) == {1}, info.value.errors  # rank 0 answered: it saw the exit


def _direct_cuda(ctx):
    n, r = ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    dev = torch.device("cuda", ctx.device)
    comm = ctx.comm
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        kv = message(r, nxt, 4099, dtype, salt=13).to(dev)
        kv_next = poison(kv)
        work = comm.batch_isend_irecv([("send", kv, nxt), ("recv", kv_next, prv)])
        work.wait()
        assert kv_next.device == dev
        assert torch.equal(kv_next.cpu(), message(prv, r, 4099, dtype, salt=13)), f"cuda ring {dtype}"
    return True


@pytest.mark.gpu
def test_direct_api_p2p_of_cuda_tensors(ranks):
    """The direct API's ring step on CUDA tensors (peer memory at two ranks), against the inputs."""
    ranks(2).run(_direct_cuda)


def _ring_first_message(ctx, repeats):
    # The group's first message, a ring (rank r sends to r + 1, then receives from r - 1), in a fresh
    # group each time. Reference: the sender's rank.
    import torch.distributed as dist
    n, r = ctx.world_size, ctx.rank
    for _ in range(repeats):
        with ddacomm_world(ctx) as (world, _gloo):
            got = torch.tensor(-1.0)
            dist.send(torch.tensor(float(r)), (r + 1) % n, group=world)
            dist.recv(got, (r - 1) % n, group=world)
            assert got.item() == (r - 1) % n
    return True


@pytest.mark.xfail(reason="the receiver's open of the pair's segment can race its creation: 'recv: rank 1 could "
                          "not open /commlib-p2p-...: No such file or directory' (found by test_fuzz_backend.py)",
                   strict=False)
@pytest.mark.parametrize("world_size", [3, 4])
def test_ring_as_first_message_of_a_fresh_group(ranks, world_size):
    ranks(world_size).run(_ring_first_message, 5)
