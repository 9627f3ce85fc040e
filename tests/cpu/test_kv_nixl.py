"""commlib.kv across hosts, through NIXL (Note [kv over nixl]): the prefill and decode processes run
on one machine but name different hosts (COMMLIB_TEST_HOST_ID), so every destination is "remote"
and the request goes through NIXL / UCX. Bitwise against tests/kv_reference.py (indexing), the
destination poisoned and checked outside the request's blocks too. test_cross_host_cuda_caches (marked gpu)
runs the same between CUDA caches."""
from __future__ import annotations

import gc
import importlib.util
import os
import signal
import time
import uuid
from datetime import timedelta

import pytest
import torch

from kv_reference import (bad_request_errors, barrier, canonical_bytes, case_dict, layerwise, make_cache, request,
                          run_case, two_requests)

pytestmark = pytest.mark.skipif(not any(importlib.util.find_spec(m) for m in ("nixl_cu13", "nixl")),
                                reason="NIXL not installed (pip install nixl-cu13)")
HOST = "COMMLIB_TEST_HOST_ID"


def _tag(name):
    return f"{name}-{uuid.uuid4().hex[:8]}"


class _OnHost:
    """This rank names host `name` while the block runs; KVAgent.connect records the transport."""

    def __init__(self, name):
        self.name, self.transports = name, []

    def __enter__(self):
        from commlib import kv
        self.old_host, self.old_connect = os.environ.get(HOST), kv.KVAgent.connect
        os.environ[HOST] = self.name
        transports, connect = self.transports, self.old_connect

        def recording(agent, peer):
            out = connect(agent, peer)
            transports.append(agent.transport(peer))
            return out
        kv.KVAgent.connect = recording
        return self

    def __exit__(self, *exc):
        from commlib import kv
        kv.KVAgent.connect = self.old_connect
        if self.old_host is None:
            os.environ.pop(HOST, None)
        else:
            os.environ[HOST] = self.old_host


def _host(ctx, P):
    return f"host-{'prefill' if ctx.rank < P else 'decode'}-{ctx.rank}"


def _agent(ctx, instance, role, timeout_s=30.0, layout="NHD", layers=3):
    """A KV agent of `role` with a registered CPU cache of `layers` layers x 8 blocks of 16 tokens x
    2 heads of 8 (bf16; prefill: seed 17's data, decode: seed 900's in host_empty memory); returns it
    and the cache's planes."""
    from commlib import kv
    agent = kv.KVAgent(ctx.store, instance, role, timeout=timedelta(seconds=timeout_s))
    prefill = role == "prefill"
    caches, planes = make_cache(layout, layers, 8, 16, 2, 8, torch.bfloat16, 17 if prefill else 900, "cpu",
                                None if prefill else kv.host_empty)
    agent.register(caches, layout)
    return agent, planes


def _cross_host_case(ctx, case, prep_limit=None, stage=True):
    """run_case with the ranks on two hosts; prep_limit: kv_nixl.PREP_LIMIT for the run (0: no
    prepared lists, explicit descriptors for every request); stage: kv_nixl.STAGE."""
    from commlib import kv_nixl
    limit, staging = kv_nixl.PREP_LIMIT, kv_nixl.STAGE
    kv_nixl.PREP_LIMIT = limit if prep_limit is None else prep_limit
    kv_nixl.STAGE = stage
    try:
        with _OnHost(_host(ctx, case["P"])) as h:
            return run_case(ctx, case), h.transports
    finally:
        kv_nixl.PREP_LIMIT, kv_nixl.STAGE = limit, staging


def _two_requests(src_bs, dst_bs, ntok_a=40, ntok_b=23):
    return two_requests(src_bs, dst_bs, ntok_a, ntok_b, b_mode="stream")


def _check(results, P, ids, how=None):
    """Every request done on every decode rank; the prefill ranks went through NIXL (`how`: the way
    their descriptors were made, as transport() says)."""
    for rank, (out, transports) in enumerate(results):
        if rank < P:
            assert transports and all(t.startswith("NIXL/UCX") for t in transports), transports
            assert how is None or all(f"; {how}" in t for t in transports), (how, transports)
            continue
        events, remaining = out
        for rid in ids:
            assert events[rid][0] == "done", (rank, rid, events[rid])
        assert remaining == [], remaining


@pytest.mark.parametrize("P,D,src,dst,src_bs,dst_bs,dtype,stage,how", [
    (1, 1, "NHD", "HND", 16, 32, "bfloat16", True, "staged"),       # layout and block size: rows gathered
    (1, 1, "NHD", "HND", 16, 32, "bfloat16", False, "direct: 64"),  # the same, one head row per descriptor
    (1, 2, "flash_attn", "HND", 16, 32, "float16", True, "staged"),  # TP 1 -> 2
    (2, 1, "HND", "flash_attn", 32, 16, "float8_e4m3fn", True, "staged"),  # TP 2 -> 1
    (2, 1, "NHD", "NHD", 16, 16, "float16", True, "direct: 16"),   # TP 2 -> 1: a half token row per run
    (1, 1, "flash_attn", "flash_attn", 16, 16, "bfloat16", True, "direct: 1"),  # same layout: one run per block
])
def test_cross_host_transforms(ranks, P, D, src, dst, src_bs, dst_bs, dtype, stage, how):
    case = case_dict(_tag(f"nx{P}{D}"), P=P, D=D, src_layout=src, dst_layout=dst, src_bs=src_bs, dst_bs=dst_bs,
                     heads=4, dtype=dtype, requests=_two_requests(src_bs, dst_bs))
    _check(ranks(P + D).run(_cross_host_case, case, None, stage), P, ("a", "b"), how)


@pytest.mark.gpu
@pytest.mark.parametrize("P,D,src,dst,src_bs,dst_bs,stage,how", [
    (1, 1, "NHD", "NHD", 16, 16, True, "direct: 1"),       # one run per block, VRAM to VRAM
    (1, 1, "NHD", "HND", 16, 32, True, "staged"),          # gathered on the caller's stream
    (1, 1, "NHD", "HND", 16, 32, False, "direct: 64"),     # one head row per descriptor
    (1, 2, "flash_attn", "HND", 16, 32, True, "staged"),   # TP 1 -> 2
    (2, 1, "NHD", "NHD", 16, 16, True, "direct: 16"),      # TP 2 -> 1
])
def test_cross_host_cuda_caches(ranks, P, D, src, dst, src_bs, dst_bs, stage, how):
    """The same requests between CUDA caches (NIXL VRAM registrations; ranks may share one GPU)."""
    case = case_dict(_tag(f"nxg{P}{D}"), P=P, D=D, src_layout=src, dst_layout=dst, src_bs=src_bs, dst_bs=dst_bs,
                     heads=4, dtype="bfloat16", device="cuda", requests=_two_requests(src_bs, dst_bs))
    _check(ranks(P + D).run(_cross_host_case, case, None, stage), P, ("a", "b"), how)


def test_cross_host_without_prepared_lists(ranks):
    """A cache whose descriptor lists would be too large to prepare: explicit descriptors per request."""
    case = case_dict(_tag("nxexp"), P=1, D=2, src_layout="NHD", dst_layout="flashinfer_hnd", src_bs=16, dst_bs=32,
                     heads=4, dtype="bfloat16", requests=_two_requests(16, 32))
    _check(ranks(3).run(_cross_host_case, case, 0), 1, ("a", "b"), "explicit descriptors per request")


def test_cross_host_mla_replicated(ranks):
    """MLA over NIXL, TP 1 -> 2: both decode ranks get the whole latent from the one prefill rank."""
    case = case_dict(_tag("nxmla"), P=1, D=2, src_layout="MLA", dst_layout="MLA", head_dim=36, src_bs=64, dst_bs=16,
                     requests=_two_requests(64, 16, 70, 16))
    _check(ranks(3).run(_cross_host_case, case), 1, ("a", "b"))


def test_cross_host_empty_single_block_and_layer_subsets(ranks):
    reqs = [request("empty", 0, [], [], num_tokens=0),
            request("one", 16, [3], [9]),
            request("one-token", 1, [4], [2], num_tokens=1),
            request("some-layers", 32, [0, 1], [4, 5], layers=[0, 2])]
    case = case_dict(_tag("nxsmall"), src_layout="NHD", dst_layout="NHD", requests=reqs)
    results = ranks(2).run(_cross_host_case, case)
    _check(results, 1, [r["id"] for r in reqs])
    (events, _), _ = results[1]
    assert events["empty"][1] == [0, 1, 2] and events["some-layers"][1] == [0, 2]


def _layerwise(ctx, tag):
    with _OnHost(_host(ctx, 1)):
        return layerwise(ctx, tag)


def test_cross_host_layerwise_streaming(ranks):
    (sent, done, through), (seen, final) = ranks(2).run(_layerwise, _tag("nxlw"))
    assert seen == (True, False, [])  # layer 0 landed, layer 1 not, the request not finished
    assert final == ("done", [0, 1, 2], True)
    assert sent == [("r", "send", "done")] and done and through.startswith("NIXL/UCX"), through


def _unattended(ctx, tag, dst_layout):
    """Rank 0 posts three layers back to back (a staged post waits for the last one's transfers)
    and then makes no call into commlib until rank 1 saw the request land: the sending agent's own
    thread must post and drive the transfers (Note [kv over nixl])."""
    pre, dec = f"{tag}-p", f"{tag}-d"
    with _OnHost(_host(ctx, 1)):
        if ctx.rank == 0:
            agent, _ = _agent(ctx, pre, "prefill")
            x = agent.begin(dec, "r", [3, 1, 6], [2, 7, 4])
            for layer in range(3):
                x.send_layer(layer)
            ctx.store.get(f"{tag}/landed")
            done, through = x.done(), agent.transport(dec)
            sent = [(e.request_id, e.kind, e.state) for e in agent.poll()]
            barrier(ctx, f"{tag}/end")
            # Dropped without close(): the agent is collected and its sending thread ends.
            thread = agent._sending.thread
            del x, agent
            gc.collect()
            thread.join(timeout=10)
            return done, sent, through, thread.is_alive()
        agent, planes = _agent(ctx, dec, "decode", layout=dst_layout)
        event = agent.wait("r")
        ctx.store.set(f"{tag}/landed", b"1")
        _, src_planes = make_cache("NHD", 3, 8, 16, 2, 8, torch.bfloat16, 17, "cpu")
        exact = all(torch.equal(canonical_bytes(planes[l][p], dst_layout)[[2, 7, 4]],
                                canonical_bytes(src_planes[l][p], "NHD")[[3, 1, 6]])
                    for l in range(3) for p in range(2))
        barrier(ctx, f"{tag}/end")
        agent.close()
        return event.state, event.layers_done, exact


@pytest.mark.parametrize("dst_layout,how", [("NHD", "direct"), ("HND", "staged")])
def test_cross_host_sends_progress_without_the_caller(ranks, dst_layout, how):
    (done, sent, through, alive), (state, layers, exact) = ranks(2).run(_unattended, _tag("nxbg"), dst_layout)
    assert (state, layers, exact) == ("done", [0, 1, 2], True)
    assert done and sent == [("r", "send", "done")] and f"; {how}" in through, through
    assert not alive  # the sending thread of an agent dropped without close()


def _stuck_staged(ctx, tag):
    """A staged transfer that NIXL never reports done (its state forced to PROC on the sender)
    fails its request after the sender's timeout; the next staged request to the same peer gathers
    into a new staging buffer and lands (the stuck transfer keeps the old one until close)."""
    pre, dec = f"{tag}-p", f"{tag}-d"
    shape = ("NHD", 3, 8, 16, 2, 8, torch.bfloat16)
    with _OnHost(_host(ctx, 1)):
        if ctx.rank == 0:
            agent, _ = _agent(ctx, pre, "prefill", 1.5)
            x = agent.begin(dec, "stuck", [3, 1, 6], [2, 7, 4])
            nixl, stuck, record = agent.nixl_agent(), [], [True]
            transfer, state = nixl.transfer, nixl.check_xfer_state
            nixl.transfer = lambda h, *a: (stuck.append(h) if record[0] else None, transfer(h, *a))[1]
            nixl.check_xfer_state = lambda h: "PROC" if any(h is s for s in stuck) else state(h)
            x.send_layer(0)
            try:
                x.wait(timedelta(seconds=10))
                first = "done"
            except Exception as e:  # noqa: BLE001 - checked by the caller
                first = f"{type(e).__name__}: {e}"
            record[0] = False
            y = agent.send(dec, "next", [0, 5], [1, 3])  # staged too: waits for no stuck transfer
            y.wait(timedelta(seconds=10))
            orphans = len(agent._remote[dec].orphans)
            barrier(ctx, f"{tag}/end")
            agent.close()
            return first, bool(stuck), orphans
        agent, planes = _agent(ctx, dec, "decode", layout="HND")
        event = agent.wait("next")
        _, src_planes = make_cache(*shape, 17, "cpu")
        exact = all(torch.equal(canonical_bytes(planes[l][p], "HND")[[1, 3]],
                                canonical_bytes(src_planes[l][p], "NHD")[[0, 5]])
                    for l in range(3) for p in range(2))
        try:
            agent.wait("stuck")
            stuck = "done"
        except Exception as e:  # noqa: BLE001 - checked by the caller
            stuck = f"{type(e).__name__}: {e}"
        barrier(ctx, f"{tag}/end")
        agent.close()
        return event.state, exact, stuck


def test_cross_host_stuck_staged_transfer(ranks):
    (first, recorded, orphans), (state, exact, stuck) = ranks(2).run(_stuck_staged, _tag("nxstuck"))
    assert recorded and first.startswith("CommError") and "did not complete within 1500 ms" in first, first
    assert (state, exact, orphans) == ("done", True, 1)
    assert stuck.startswith("CommError") and "failed at the sender" in stuck, stuck


def _killed(ctx, tag, timeout_s):
    """The prefill rank sends layer 0 of a request, then is killed (SIGKILL)."""
    pre, dec = f"{tag}-p", f"{tag}-d"
    with _OnHost(_host(ctx, 1)):
        if ctx.rank == 0:
            agent, _ = _agent(ctx, pre, "prefill", timeout_s)
            agent.send(dec, "ok", [0], [1]).wait()
            x = agent.begin(dec, "partial", [4, 5], [6, 7])
            x.send_layer(0)
            ctx.store.get(f"{tag}/ok-seen")
            os.kill(os.getpid(), signal.SIGKILL)
        agent, _ = _agent(ctx, dec, "decode", timeout_s)
        ok = agent.wait("ok").state
        agent.wait_layer("partial", 0)
        ctx.store.set(f"{tag}/ok-seen", b"1")
        try:  # the request's own failure, not this call's timeout, must end the wait
            agent.wait("partial", timeout=timedelta(seconds=2 * timeout_s))
            outcome = ("done", "")
        except Exception as e:  # noqa: BLE001 - checked by the caller
            outcome = (type(e).__name__, str(e))
        after = agent.poll()
        ctx.store.set(f"{tag}/outcome", repr((ok, outcome, after)).encode())
        agent.close()
        return ok, outcome, after


@pytest.mark.parametrize("timeout_s,kind,says", [
    (2.0, "CommTimeoutError", "without progress"),  # the agent's timeout comes first
    (60.0, "PeerError", "the sender stopped: its heartbeat"),  # the heartbeat, long before the timeout
])
def test_cross_host_killed_producer(ranks, timeout_s, kind, says):
    from conftest import RankFailure
    tag = _tag("nxdie")
    pool = ranks(2)
    with pytest.raises(RankFailure) as info:
        pool.run(_killed, tag, timeout_s)
    assert sorted(info.value.errors) == [0], info.value.errors  # only the killed rank failed
    ok, (got, message), after = eval(pool.store.get(f"{tag}/outcome").decode())  # noqa: S307 - our own repr
    assert ok == "done" and got == kind, message
    for part in ("'partial'", "instance '", "rank 0 (pid", says, "layer 1 has not landed",
                 "layers landed: 0 of 3", "2 destination blocks hold partial data"):
        assert part in message, message
    assert after == []  # reported once, by wait


def _slow(ctx, tag, pause_s):
    """The prefill rank sends layer 0, computes (sleeps) for longer than a stopped sender's
    heartbeat limit, then sends the rest: a slow producer is not a dead one."""
    pre, dec = f"{tag}-p", f"{tag}-d"
    with _OnHost(_host(ctx, 1)):
        if ctx.rank == 0:
            agent, _ = _agent(ctx, pre, "prefill", 60.0)
            x = agent.begin(dec, "slow", [4, 5], [6, 7])
            x.send_layer(0)
            ctx.store.get(f"{tag}/first")  # layer 0 landed: the request stalls from here
            time.sleep(pause_s)
            x.send_layers([1, 2])
            x.wait()
            barrier(ctx, f"{tag}/end")
            agent.close()
            return True
        agent, _ = _agent(ctx, dec, "decode", 60.0)
        agent.wait_layer("slow", 0)
        ctx.store.set(f"{tag}/first", b"1")
        event = agent.wait("slow")
        barrier(ctx, f"{tag}/end")
        agent.close()
        return event.state, event.layers_done


def test_cross_host_slow_producer_is_not_dead(ranks):
    from commlib.kv_nixl import BEAT_S, DEAD_S
    _, (state, layers) = ranks(2).run(_slow, _tag("nxslow"), 2 * BEAT_S + DEAD_S + 1.0)
    assert (state, layers) == ("done", [0, 1, 2])


def _cycles(ctx, tag, count):
    """`count` prefill / decode agent pairs naming two hosts, each moving a few requests through NIXL
    and then closed (even cycles) or dropped without close (odd ones); returns the open file
    descriptors and commlib's threads after the first two cycles and after all."""
    import gc
    import threading

    def state():
        gc.collect()
        for t in threading.enumerate():  # an idle sending thread ends within SendProgress._IDLE_S
            if t.name.startswith("commlib-kv"):
                t.join(timeout=5)
        return len(os.listdir("/proc/self/fd")), sorted(t.name for t in threading.enumerate()
                                                         if t.name.startswith("commlib"))

    before = None
    for i in range(count):
        with _OnHost("host-d"):
            dec, _ = _agent(ctx, f"{tag}-d{i}", "decode", layers=2)
        with _OnHost("host-p"):
            pre, _ = _agent(ctx, f"{tag}-p{i}", "prefill", layers=2)
            for r in range(3):
                x = pre.send(f"{tag}-d{i}", f"r{r}", [r, r + 3], [r + 4, 7 - r])
                dec.wait(f"r{r}")
                x.wait()
        if i % 2 == 0:
            pre.close()
            dec.close()
        del pre, dec, x
        if i == 1:
            before = state()
    return before, state()


def test_cross_host_agents_release_threads_and_fds(ranks):
    (fds0, threads0), (fds1, threads1) = ranks(1).run(_cycles, _tag("nxleak"), 8)[0]
    assert (fds1, threads1) == (fds0, threads0) and threads1 == [], (fds0, threads0, fds1, threads1)


def _refusals(ctx, tag):
    """Bad input errors (the local path's messages) before anything moves, and require_rdma."""
    from commlib import kv
    from commlib.kv_nixl import rdma_devices
    pre, dec = f"{tag}-p", f"{tag}-d"
    errors = []
    with _OnHost(_host(ctx, 1)):
        if ctx.rank == 0:
            agent = kv.KVAgent(ctx.store, pre, "prefill", timeout=timedelta(seconds=30))
            caches, _ = make_cache("NHD", 2, 8, 16, 2, 8, torch.bfloat16, 17, "cpu")
            agent.register(caches, "NHD")
            errors += bad_request_errors(agent, dec)
            x = agent.begin(dec, "good", [0], [3])
            x.send_layer(0)
            for layer, text in ((0, "sent already"), (5, "out of range")):
                try:
                    x.send_layer(layer)
                    errors.append(f"no error for layer {layer}")
                except ValueError as e:
                    if text not in str(e):
                        errors.append(str(e))
            x.send_layer(1)
            x.wait()
            strict = kv.KVAgent(ctx.store, pre + "-rdma", "prefill", timeout=timedelta(seconds=30), require_rdma=True)
            strict.register(caches, "NHD")
            try:
                strict.connect(dec)
                refused = "connected" if rdma_devices() else "no error without RDMA ports"
            except ValueError as e:
                refused = None if "require_rdma" in str(e) and "TCP" in str(e) else str(e)
            strict.close()
            barrier(ctx, f"{tag}/end")
            agent.close()
            return errors, refused
        agent = kv.KVAgent(ctx.store, dec, "decode", timeout=timedelta(seconds=30))
        caches, planes = make_cache("NHD", 2, 12, 16, 2, 8, torch.bfloat16, 900, "cpu", kv.host_empty)
        before = [[p.clone() for p in layer] for layer in planes]
        agent.register(caches, "NHD")
        event = agent.wait("good")
        others = torch.arange(12) != 3
        changed = [(l, p) for l in range(2) for p in range(2)
                   if not torch.equal(planes[l][p].view(torch.uint8)[others], before[l][p].view(torch.uint8)[others])]
        leftover = agent.poll()
        barrier(ctx, f"{tag}/end")
        agent.close()
        return event.state, changed, leftover


def test_cross_host_bad_input_and_require_rdma(ranks):
    (errors, refused), (state, changed, leftover) = ranks(2).run(_refusals, _tag("nxbad"))
    assert errors == [] and state == "done"
    assert changed == [] and leftover == []  # no failed send wrote or announced anything
    assert refused in (None, "connected"), refused
