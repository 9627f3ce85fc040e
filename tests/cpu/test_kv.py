"""commlib.kv over shared memory (CPU caches): a prefill instance pushes requests into a decode
instance's paged cache, 2-5 processes. Reference: tests/kv_reference.py (indexing, bitwise, every
untouched byte of the poisoned destination checked too)."""
from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import RankFailure
from kv_reference import (bad_request_errors, barrier, case_dict, layerwise, make_cache, request, run_case,
                          two_requests)

NON_MLA = ("NHD", "HND", "flash_attn", "flashinfer_nhd", "flashinfer_hnd")
DTYPE_CYCLE = ("bfloat16", "float16", "float8_e4m3fn")


def _tag(name):
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _run_cases(ctx, cases):
    return [run_case(ctx, c) for c in cases]


def _two_requests(src_bs, dst_bs, ntok_a=40, ntok_b=23):
    return two_requests(src_bs, dst_bs, ntok_a, ntok_b)


def _check_done(results, world, P, ids=("a", "b")):
    for rank in range(P, world):
        events, _ = results[rank]
        for rid in ids:
            assert events[rid][0] == "done", (rank, rid, events[rid])


def test_every_layout_pair(ranks):
    """Every layout pair (TP 1:1), dtypes cycling through bf16 / fp16 / fp8, one cache in one memfd
    for every other pair."""
    cases = []
    for i, (src, dst) in enumerate([(s, d) for s in NON_MLA for d in NON_MLA]):
        cases.append(case_dict(_tag(f"pair{i}"), src_layout=src, dst_layout=dst, dtype=DTYPE_CYCLE[i % 3],
                               requests=_two_requests(16, 16), dst_shared="one" if i % 2 else "separate"))
    cases.append(case_dict(_tag("mla"), src_layout="MLA", dst_layout="MLA", head_dim=24, src_bs=16, dst_bs=32,
                           requests=_two_requests(16, 32)))
    for results in zip(*ranks(2).run(_run_cases, cases)):
        _check_done(results, 2, 1)


@pytest.mark.parametrize("P,D", [(1, 2), (1, 4), (2, 1), (4, 1), (2, 2)])
def test_tensor_parallel_ratios(ranks, P, D):
    """Heterogeneous TP both ways, with a layout and a block-size change fused in."""
    cases = [case_dict(_tag(f"tp{P}{D}"), P=P, D=D, src_layout="flash_attn", dst_layout="HND", src_bs=16, dst_bs=32,
                       heads=8, dtype="bfloat16", requests=_two_requests(16, 32)),
             case_dict(_tag(f"tp{P}{D}b"), P=P, D=D, src_layout="flashinfer_hnd", dst_layout="NHD", src_bs=32,
                       dst_bs=16, heads=4, dtype="float8_e4m3fn", head_dim=16, requests=_two_requests(32, 16))]
    for results in zip(*ranks(P + D).run(_run_cases, cases)):
        _check_done(results, P + D, P)


@pytest.mark.parametrize("P,D", [(1, 2), (2, 1), (3, 2)])
def test_mla_replicated_latent(ranks, P, D):
    """MLA: every rank holds the whole latent; decode rank d is served by prefill rank d mod P."""
    case = case_dict(_tag(f"mla{P}{D}"), P=P, D=D, src_layout="MLA", dst_layout="MLA", head_dim=36, src_bs=64,
                     dst_bs=16, requests=_two_requests(64, 16, 70, 16))
    results = ranks(P + D).run(run_case, case)
    _check_done(results, P + D, P)


@pytest.mark.parametrize("heads", [8, 16])
def test_tp_routes_against_head_sets(heads):
    # The one TP mapping of both paths (kv_routes, Note [kv tensor parallelism]) against sets of
    # global heads: every destination a sending rank meets, the shared heads as offsets into each
    # side's range, and that destination's senders (consecutive ranks, this one among them).
    from commlib import _C
    for tp in (1, 2, 4, 8):
        for tp_d in (1, 2, 4, 8):
            held = lambda r, t: set(range(r * heads // t, (r + 1) * heads // t))  # noqa: E731
            for rank in range(tp):
                routes = _C.kv_routes(heads, False, rank, tp, tp_d)
                want = [d for d in range(tp_d) if held(rank, tp) & held(d, tp_d)]
                assert [r["rank"] for r in routes] == want, (tp, tp_d, rank)
                for r in routes:
                    common = sorted(held(rank, tp) & held(r["rank"], tp_d))
                    assert r["heads"] == len(common)
                    assert r["src_head"] == common[0] - rank * heads // tp
                    assert r["dst_head"] == common[0] - r["rank"] * heads // tp_d
                    senders = [s for s in range(tp) if held(s, tp) & held(r["rank"], tp_d)]
                    assert senders == list(range(r["first_sender"], r["first_sender"] + r["num_contributors"]))
                    assert senders[r["contributor"]] == rank
            for rank in range(tp):  # MLA: decode rank d is served by prefill rank d mod tp alone
                routes = _C.kv_routes(1, True, rank, tp, tp_d)
                assert [r["rank"] for r in routes] == [d for d in range(tp_d) if d % tp == rank]
                assert all((r["heads"], r["first_sender"], r["num_contributors"]) == (1, rank, 1) for r in routes)


@pytest.mark.parametrize("src_bs,dst_bs", [(16, 32), (32, 16), (64, 16), (16, 64)])
def test_block_size_ratios(ranks, src_bs, dst_bs):
    case = case_dict(_tag(f"bs{src_bs}-{dst_bs}"), src_layout="NHD", dst_layout="NHD", src_bs=src_bs, dst_bs=dst_bs,
                     dtype="float16", requests=_two_requests(src_bs, dst_bs, 45, 64))
    results = ranks(2).run(run_case, case)
    _check_done(results, 2, 1)


def test_empty_single_block_and_layer_subsets(ranks):
    reqs = [request("empty", 0, [], [], num_tokens=0),
            request("one", 16, [3], [9]),
            request("one-token", 1, [4], [2], num_tokens=1),
            request("some-layers", 32, [0, 1], [4, 5], layers=[0, 2]),
            request("streamed", 32, [6, 8], [12, 13], mode="stream")]
    case = case_dict(_tag("small"), src_layout="HND", dst_layout="flash_attn", requests=reqs)
    results = ranks(2).run(run_case, case)
    _check_done(results, 2, 1, ids=[r["id"] for r in reqs])
    events, _ = results[1]
    assert events["empty"][1] == [0, 1, 2] and events["some-layers"][1] == [0, 2]


def test_layerwise_streaming(ranks):
    (sent, done, through), (seen, final) = ranks(2).run(layerwise, _tag("lw"), "NHD")
    assert seen == (True, False, [])  # layer 0 landed, layer 1 not, the request not finished
    assert final == ("done", [0, 1, 2], True)
    assert sent == [("r", "send", "done")] and done and through.startswith("local: shared memory"), through


def _out_of_order(ctx, tag):
    """Requests finish in another order than they started; poll reports each once."""
    from commlib import kv
    pre, dec = f"{tag}-p", f"{tag}-d"
    if ctx.rank == 0:
        agent = kv.KVAgent(ctx.store, pre, "prefill", timeout=timedelta(seconds=30))
        caches, _ = make_cache("NHD", 2, 8, 16, 2, 8, torch.bfloat16, 17, "cpu")
        agent.register(caches, "NHD")
        first = agent.begin(dec, "first", [0], [0])
        first.send_layer(0)
        agent.send(dec, "second", [1], [1])
        agent.send(dec, "third", [2], [2])
        ctx.store.get(f"{tag}/polled")
        first.send_layer(1)
        barrier(ctx, f"{tag}/end")
        agent.close()
        return None
    agent = kv.KVAgent(ctx.store, dec, "decode", timeout=timedelta(seconds=30))
    caches, _ = make_cache("NHD", 2, 8, 16, 2, 8, torch.bfloat16, 900, "cpu", kv.host_empty)
    agent.register(caches, "NHD")
    agent.wait("third")
    order = []
    deadline = time.monotonic() + 30
    while "second" not in order and time.monotonic() < deadline:
        order += [e.request_id for e in agent.poll()]
    ctx.store.set(f"{tag}/polled", b"1")
    while "first" not in order and time.monotonic() < deadline:
        order += [e.request_id for e in agent.poll()]
    barrier(ctx, f"{tag}/end")
    agent.close()
    return order


def test_out_of_order_completion(ranks):
    _, order = ranks(2).run(_out_of_order, _tag("ooo"))
    assert order == ["second", "first"]  # "third" was reported by wait, never again by poll


def _fault_observer(ctx, case, rid):
    """run_case, with the decode rank's outcome of `rid` also left in the store (a killed rank's
    pool.run reports only the failure)."""
    out = run_case(ctx, case)
    if ctx.rank == case["P"]:
        events, _ = out
        kind, message = events[rid]
        ctx.store.set(f"{case['tag']}/outcome", f"{events['ok'][0]}|{kind}|{message}".encode())
    return out


def test_killed_producer(ranks):
    """The prefill rank exits after layer 0 of a request: the decode rank gets PeerError naming the
    request, the peer and layer 1; the request before it landed intact (checked bitwise)."""
    reqs = [request("ok", 32, [0, 1], [2, 3]), request("partial", 32, [4, 5], [6, 7], mode="die")]
    case = case_dict(_tag("die"), requests=reqs, timeout_s=20.0)
    pool = ranks(2)
    with pytest.raises(RankFailure) as info:
        pool.run(_fault_observer, case, "partial")
    assert sorted(info.value.errors) == [0], info.value.errors  # only the killed rank failed
    ok, kind, message = pool.store.get(f"{case['tag']}/outcome").decode().split("|", 2)
    assert ok == "done" and kind == "PeerError", message
    for part in ("'partial'", "instance '", "rank 0 (pid", "exited before layer 1 landed", "layers landed: 0 of 3",
                 "2 destination blocks hold partial data"):
        assert part in message, message


def test_slow_producer(ranks):
    """The prefill rank stops for 2.5x the timeout after layer 0: CommTimeoutError naming the
    request, peer and layer; the late layers then land into records the receiver kept, and a
    request after it works."""
    reqs = [request("ok", 32, [0, 1], [2, 3]), request("partial", 32, [4, 5], [6, 7], mode="stall"),
            request("after", 16, [8], [9])]
    case = case_dict(_tag("stall"), requests=reqs, timeout_s=1.0)
    results = ranks(2).run(_fault_observer, case, "partial")
    events, remaining = results[1]
    assert events["ok"][0] == "done" and events["after"][0] == "done", events
    kind, message = events["partial"]
    assert kind == "CommTimeoutError", message
    for part in ("'partial'", "rank 0 (pid", "Timed out after 1000 ms", "layer 1 has not landed",
                 "layers landed: 0 of 3"):
        assert part in message, message
    assert remaining == []  # the timed-out request is reported once, not again when it completes


def _bad_input(ctx, tag):
    """Every bad argument raises ValueError / TypeError on the sending rank before anything is
    written; the agents stay usable (a good request after them lands)."""
    from commlib import kv
    pre, dec = f"{tag}-p", f"{tag}-d"
    errors = []
    if ctx.rank == 0:
        agent = kv.KVAgent(ctx.store, pre, "prefill", timeout=timedelta(seconds=30))
        caches, _ = make_cache("NHD", 2, 8, 16, 2, 8, torch.bfloat16, 17, "cpu")
        agent.register(caches, "NHD")
        errors += bad_request_errors(agent, dec)
        try:
            agent.send(dec, "x" * 200, [0], [3])
            errors.append("no error for a long request id")
        except ValueError:
            pass
        try:
            agent.send(dec, "cuda-ids", torch.tensor([0]).to("meta"), [3])
            errors.append("no error for ids on the meta device")
        except TypeError:
            pass
        x = agent.begin(dec, "good", [0], [3])
        for layer, text in ((5, "out of range"), (0, None)):
            try:
                x.send_layer(layer)
                if text:
                    errors.append(f"no error for layer {layer}")
            except ValueError as e:
                if not text or text not in str(e):
                    errors.append(str(e))
        try:
            x.send_layer(0)
            errors.append("no error for a layer sent twice")
        except ValueError as e:
            assert "sent already" in str(e), e
        x.send_layer(1)
        barrier(ctx, f"{tag}/end")
        agent.close()
        return errors
    agent = kv.KVAgent(ctx.store, dec, "decode", timeout=timedelta(seconds=30))
    caches, planes = make_cache("NHD", 2, 12, 16, 2, 8, torch.bfloat16, 900, "cpu", kv.host_empty)
    before = [[p.clone() for p in layer] for layer in planes]
    agent.register(caches, "NHD")
    event = agent.wait("good")
    changed = [(lay, pl) for lay in range(2) for pl in range(2)
               if not torch.equal(planes[lay][pl].view(torch.uint8)[torch.arange(12) != 3],
                                  before[lay][pl].view(torch.uint8)[torch.arange(12) != 3])]
    assert changed == [], f"blocks other than 3 were written by failed sends: {changed}"
    assert agent.poll() == []  # no failed send announced anything
    barrier(ctx, f"{tag}/end")
    agent.close()
    return event.state


def test_bad_input_before_anything_moves(ranks):
    errors, state = ranks(2).run(_bad_input, _tag("bad"))
    assert errors == [] and state == "done"


def _incompatible(ctx, tag, prefill_kw, decode_kw, text, hosts):
    old_host = os.environ.get("COMMLIB_TEST_HOST_ID")
    if hosts == "two":  # the NIXL path's connect: the same checks (Note [kv peer checks])
        os.environ["COMMLIB_TEST_HOST_ID"] = f"host-{ctx.rank}"
    try:
        return _incompatible_on_host(ctx, tag, prefill_kw, decode_kw, text)
    finally:
        if old_host is None:
            os.environ.pop("COMMLIB_TEST_HOST_ID", None)
        else:
            os.environ["COMMLIB_TEST_HOST_ID"] = old_host


def _incompatible_on_host(ctx, tag, prefill_kw, decode_kw, text):
    from commlib import kv
    pre, dec = f"{tag}-p", f"{tag}-d"
    kw = prefill_kw if ctx.rank == 0 else decode_kw
    shape = dict(layout="NHD", num_layers=2, num_blocks=8, block_size=16, heads=2, head_dim=8, dtype=torch.bfloat16)
    shape.update(kw)
    agent = kv.KVAgent(ctx.store, pre if ctx.rank == 0 else dec, "prefill" if ctx.rank == 0 else "decode",
                       timeout=timedelta(seconds=30))
    caches, _ = make_cache(shape["layout"], shape["num_layers"], shape["num_blocks"], shape["block_size"],
                           shape["heads"], shape["head_dim"], shape["dtype"], 5, "cpu",
                           kv.host_empty if ctx.rank == 1 else None)
    agent.register(caches, shape["layout"])
    result = None
    if ctx.rank == 0:
        try:
            agent.connect(dec)
            result = "no error"
        except ValueError as e:
            result = None if text in str(e) else str(e)
    barrier(ctx, f"{tag}/end")
    agent.close()
    return result


@pytest.mark.parametrize("prefill_kw,decode_kw,text", [
    (dict(dtype=torch.float16), {}, "dtypes differ"),
    (dict(head_dim=16), {}, "head_dim 16 vs 8"),
    (dict(num_layers=3), {}, "3 layers vs 2"),
    (dict(heads=4), {}, "global KV heads differ: 4 x TP 1 = 4 vs 2 x TP 1 = 2"),
    (dict(layout="MLA", heads=1), {}, "one side is an MLA latent cache"),
])
@pytest.mark.parametrize("hosts", ["one", "two"])
def test_caches_that_cannot_be_mapped(ranks, prefill_kw, decode_kw, text, hosts):
    """Caches that cannot be mapped onto each other: ValueError at connect, naming both sides, on one
    host and across two (NIXL's path). (Heads that do not divide by the other side's TP show as
    different global head counts: each side's count is its rank's heads x its TP.)"""
    assert ranks(2).run(_incompatible, _tag("map"), prefill_kw, decode_kw, text, hosts)[0] is None


def test_register_and_constructor_errors():
    from commlib import kv
    store = dist.HashStore()
    with pytest.raises(ValueError, match="role 'reader' not supported; supported: prefill, decode, both"):
        kv.KVAgent(store, "x", "reader")
    with pytest.raises(ValueError, match="tp_rank 2 out of range for tp_size 2"):
        kv.KVAgent(store, "x", "decode", 2, 2)
    with pytest.raises(ValueError, match="instance 'a/b' must be"):
        kv.KVAgent(store, "a/b", "decode")
    agent = kv.KVAgent(store, "x", "decode")
    plain = [torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match="must lie in memory from commlib.kv.host_empty"):
        agent.register([(plain[0], plain[1])], "NHD")
    with pytest.raises(ValueError, match="layout 'NDH' not supported"):
        agent.register([(plain[0], plain[1])], "NDH")
    with pytest.raises(ValueError, match=r"needs a \(k, v\) pair"):
        agent.register([plain[0]], "NHD")
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        t = kv.host_empty([4, 16, 8, 2], torch.bfloat16).transpose(2, 3)
        agent.register([(t, t)], "NHD")
    with pytest.raises(ValueError, match=r"the K axis \(dim 0\) has size 3; expected 2"):
        agent.register([kv.host_empty([3, 4, 16, 2, 8])], "flash_attn")
    with pytest.raises(ValueError, match="does not receive"):
        agent.wait("nothing", timeout=timedelta(0))
    ok = kv.host_empty([2, 4, 16, 2, 8], torch.bfloat16)
    agent.register([ok], "flash_attn")
    with pytest.raises(ValueError, match="registered its cache already"):
        agent.register([ok], "flash_attn")
    with pytest.raises(ValueError, match="only prefill or both may send"):
        agent.connect("elsewhere")
    with pytest.raises(__import__("commlib").CommTimeoutError, match="nothing of KV request 'r' arrived"):
        agent.wait("r", timeout=timedelta(milliseconds=50))
    agent.close()
    with pytest.raises(ValueError, match="is closed"):
        agent.poll()


def test_no_shared_memory_names_left():
    """CPU caches and notification segments are memfds: nothing appears in /dev/shm."""
    from commlib import kv
    before = set(os.listdir("/dev/shm"))
    agent = kv.KVAgent(dist.HashStore(), "shm", "both")
    agent.register([kv.host_empty([2, 4, 16, 2, 8])], "flash_attn")
    assert set(os.listdir("/dev/shm")) == before
    agent.close()


def _nixl_importable() -> bool:
    import importlib.util
    return any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl"))


@pytest.mark.skipif(not _nixl_importable(), reason="NIXL not installed (pip install nixl-cu13)")
def test_benchmark_moves_the_same_requests_through_nixl():
    """commlib-perf kv_transfer's NIXL columns: the same requests as commlib's, posted through NIXL
    (UCX, DRAM) with one descriptor per contiguous run, and through commlib.kv over NIXL (two
    hosts named), land bit-exact (the benchmark checks a request on fresh data on the decode ranks
    and exits 1 on any wrong byte)."""
    import subprocess
    import sys
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    result = subprocess.run([sys.executable, "-m", "commlib.perf", "kv_transfer", "--device", "cpu", "--kv-blocks", "16",
                             "--kv-block-bytes", "4K", "--kv-cases", "nhd,nhd>hnd,tp1:2,tp2:1,llama70b", "-n", "2",
                             "-w", "1"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    layerwise = lines.index(next(l for l in lines if l.startswith("# c/NIXL layer by layer")))
    rows = {line.split()[0]: line.split() for line in lines[:layerwise]
            if line.split() and line.split()[0] in ("nhd", "nhd>hnd", "tp1:2", "tp2:1", "llama70b")}
    assert set(rows) == {"nhd", "nhd>hnd", "tp1:2", "tp2:1", "llama70b"}, result.stdout
    # the 80-layer request also sent layer by layer during a stand-in compute: compute, alone, both, exposed
    cells = lines[layerwise + 2].split()
    compute, alone, both, exposed = map(float, cells[4:8])
    assert cells[:4] == ["llama70b", "4K", "118", "80"] and min(compute, alone, both) > 0, cells
    assert abs(exposed - (both - compute)) < 0.011, cells  # the table's own arithmetic (no timing claim)
    for case, cells in rows.items():
        assert cells[-2] == "0" and cells[12] == "0" and cells[15] == "0", (case, cells)  # NIXL's, commlib's, c/NIXL's
        descs = int(cells[-3])
        # whole blocks when the layouts match (16 blocks x K, V, or 80 layers x 118 x K, V; neighbours in
        # the random block order merge); head rows otherwise
        whole = {"nhd": 32, "llama70b": 80 * 118 * 2}
        assert (1 <= descs <= whole[case]) if case in whole else descs > 32 * 16, (case, descs)


def test_benchmark_out_rewrites_its_device_section(tmp_path):
    """commlib-perf kv_transfer --out rewrites the section of its device and keeps the others (the
    CUDA table and the CPU one share bench/results/kv_transfer.md)."""
    import subprocess
    import sys
    out = tmp_path / "kv_transfer.md"
    out.write_text("# kv_transfer\n\n## CUDA: commlib-perf kv_transfer\n\ncuda rows, kept\n\n"
                   "## CPU: commlib-perf kv_transfer\n\nan older CPU table\n")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    for _ in range(2):  # the second run replaces the first one's section
        result = subprocess.run([sys.executable, "-m", "commlib.perf", "kv_transfer", "--device", "cpu", "--kv-blocks",
                                 "4", "--kv-block-bytes", "4K", "--kv-cases", "nhd", "-n", "1", "-w", "0", "--out",
                                 str(out)], env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    assert "## CUDA: commlib-perf kv_transfer\n\ncuda rows, kept\n\n## CPU: commlib-perf kv_transfer\n" in text, text
    assert "an older CPU table" not in text and text.count("## CPU: commlib-perf kv_transfer") == 1, text
    assert "- command: `commlib-perf kv_transfer --device cpu" in text and "- commit: " in text, text
    assert [line.split()[0] for line in text.splitlines() if line.startswith("      nhd")] == ["nhd"], text
