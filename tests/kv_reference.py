"""Reference for commlib.kv tests (CPU and GPU).

Caches are filled with random bytes (every bit pattern, fp8 NaNs included, so the check is bitwise).
The expected destination is built by indexing: every cache plane is viewed as [B, T, H, D] bytes,
token i of a request is (blocks[i // block_size], i % block_size) on each side, global head g lives
on rank g // (H / TP) of each side (MLA: decode rank d reads prefill rank d % TP_prefill), and
every element not in a destination block position of the request keeps its poisoned value.

``run_case(ctx, case)`` runs one transfer scenario on every rank of a pool: ranks [0, P) are the
prefill instance (TP P), ranks [P, P + D) the decode instance (TP D). Decode ranks assert their
caches against the reference and return what they received; see ``case_dict`` for the fields.
"""
from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn,
          "float32": torch.float32}


def case_dict(tag, P=1, D=1, src_layout="NHD", dst_layout="NHD", src_bs=16, dst_bs=16, heads=4, head_dim=8,
              dtype="bfloat16", num_layers=3, src_blocks=12, dst_blocks=16, device="cpu", requests=None,
              timeout_s=60.0, dst_shared="separate"):
    mla = src_layout == "MLA"
    return dict(tag=tag, P=P, D=D, src_layout=src_layout, dst_layout=dst_layout, src_bs=src_bs, dst_bs=dst_bs,
                heads=1 if mla else heads, head_dim=head_dim, dtype=dtype, num_layers=num_layers,
                src_blocks=src_blocks, dst_blocks=dst_blocks, device=device, mla=mla, timeout_s=timeout_s,
                dst_shared=dst_shared, requests=requests or [])


def request(rid, ntok, src_blocks, dst_blocks, mode="send", layers=None, num_tokens=None):
    """mode: send (all layers at once), stream (begin, then one layer at a time), or a fault for
    the last prefill rank: "die" (sends layer 0, then exits) or "stall" (sends layer 0, sleeps past
    the timeout, sends the rest)."""
    return dict(id=rid, ntok=ntok, src=list(src_blocks), dst=list(dst_blocks), mode=mode, layers=layers,
                num_tokens=num_tokens)


def _axes(layout):
    from commlib import kv
    return kv.LAYOUTS.get(layout, layout)


def _fill(t, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g, dtype=torch.uint8)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))


def make_cache(layout, num_layers, num_blocks, block_size, heads, head_dim, dtype, seed, device, alloc=None):
    """(caches for KVAgent.register, planes[layer][plane] as the tensors the cache views)."""
    axes = _axes(layout)
    dims = {"B": num_blocks, "T": block_size, "H": heads, "D": head_dim, "K": 2}
    shape = [dims[a] for a in axes if a in dims and (a != "H" or "H" in axes)]
    alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))
    caches, planes = [], []
    for layer in range(num_layers):
        if "K" in axes or "H" not in axes:
            t = alloc(shape, dtype)
            _fill(t, seed * 1000 + layer)
            caches.append(t)
            planes.append([t.select(axes.index("K"), i) for i in range(2)] if "K" in axes else [t])
        else:
            pair = (alloc(shape, dtype), alloc(shape, dtype))
            _fill(pair[0], seed * 1000 + layer)
            _fill(pair[1], seed * 1000 + 500 + layer)
            caches.append(pair)
            planes.append(list(pair))
    return caches, planes


def canonical_bytes(plane, layout):
    """A plane as [B, T, H, D * element size] uint8 on the CPU (a copy)."""
    pa = _axes(layout).replace("K", "")
    if "H" not in pa:
        at = pa.index("D")
        plane, pa = plane.unsqueeze(at), pa[:at] + "H" + pa[at:]
    c = plane.permute([pa.index(a) for a in "BTHD"]).contiguous().cpu()
    return c.view(torch.uint8)


def expected_planes(case, d_rank, before, src_planes_by_rank, req):
    """The decode rank's planes (canonical bytes) after `req`, from its poisoned `before`."""
    exp = [[p.clone() for p in layer] for layer in before]
    ntok = req["num_tokens"] if req["num_tokens"] is not None else req["ntok"]
    tok = torch.arange(ntok)
    sb, st = torch.tensor(req["src"], dtype=torch.long)[tok // case["src_bs"]], tok % case["src_bs"]
    db, dt = torch.tensor(req["dst"], dtype=torch.long)[tok // case["dst_bs"]], tok % case["dst_bs"]
    layers = req["layers"] if req["layers"] is not None else range(case["num_layers"])
    P, D, H = case["P"], case["D"], case["heads"]
    for layer in layers:
        for plane in range(len(exp[layer])):
            if case["mla"]:
                exp[layer][plane][db, dt] = src_planes_by_rank[d_rank % P][layer][plane][sb, st]
                continue
            hd, hp = H // D, H // P
            for h in range(hd):
                g = d_rank * hd + h
                exp[layer][plane][db, dt, h] = src_planes_by_rank[g // hp][layer][plane][sb, st, g % hp]
    return exp


def barrier(ctx, key, expected=None):
    """Every rank (or `expected` of them) reached `key`: over the store, so it survives a dead rank."""
    ctx.store.add(key, 1)
    deadline = time.monotonic() + 120
    while int(ctx.store.add(key, 0)) < (expected or ctx.world_size):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {key}")
        time.sleep(0.005)


def _device(ctx, case):
    return torch.device("cuda", ctx.device) if case["device"] == "cuda" else torch.device("cpu")


def _src_planes(case, p_rank):
    """Prefill rank p's planes, regenerated (canonical bytes) for the reference."""
    _, planes = make_cache(case["src_layout"], case["num_layers"], case["src_blocks"], case["src_bs"],
                           case["heads"] // case["P"], case["head_dim"], DTYPES[case["dtype"]], 17 + p_rank, "cpu")
    return [[canonical_bytes(p, case["src_layout"]) for p in layer] for layer in planes]


def run_case(ctx, case):
    from commlib import kv
    P, D = case["P"], case["D"]
    prefill = ctx.rank < P
    tp_rank = ctx.rank if prefill else ctx.rank - P
    device = _device(ctx, case)
    dtype = DTYPES[case["dtype"]]
    timeout = timedelta(seconds=case["timeout_s"])
    pre, dec = f"{case['tag']}-prefill", f"{case['tag']}-decode"
    if prefill:
        agent = kv.KVAgent(ctx.store, pre, "prefill", tp_rank, P, device=device, timeout=timeout)
        caches, _ = make_cache(case["src_layout"], case["num_layers"], case["src_blocks"], case["src_bs"],
                               case["heads"] // P, case["head_dim"], dtype, 17 + tp_rank, device)
        agent.register(caches, case["src_layout"])
        agent.connect(dec)
        last = tp_rank == P - 1
        for req in case["requests"]:
            mode = req["mode"] if last or req["mode"] in ("send", "stream") else "send"
            if mode == "send":
                agent.send(dec, req["id"], torch.tensor(req["src"], dtype=torch.int32), req["dst"],
                           layers=req["layers"], num_tokens=req["num_tokens"])
                continue
            x = agent.begin(dec, req["id"], req["src"], req["dst"], layers=req["layers"], num_tokens=req["num_tokens"])
            for i, layer in enumerate(x.layers):
                if i == 1 and mode == "die":
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    os.kill(os.getpid(), signal.SIGKILL)
                if i == 1 and mode == "stall":
                    time.sleep(case["timeout_s"] * 2.5)
                x.send_layer(layer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        barrier(ctx, f"{case['tag']}/done")
        agent.close()
        return None
    agent = kv.KVAgent(ctx.store, dec, "decode", tp_rank, D, device=device, timeout=timeout)
    alloc = None
    if device.type == "cpu":
        alloc = kv.host_empty
        if case["dst_shared"] == "one":  # every plane in one memfd: one region for all
            axes = _axes(case["dst_layout"])
            dims = {"B": case["dst_blocks"], "T": case["dst_bs"], "H": 1 if case["mla"] else case["heads"] // D,
                    "D": case["head_dim"], "K": 2}
            per = 1
            for a in axes:
                per *= dims[a]
            pool = kv.host_empty([per * 2 * case["num_layers"]], dtype)
            used = [0]

            def alloc(shape, dt, pool=pool, used=used):
                n = 1
                for s in shape:
                    n *= s
                t = pool[used[0]:used[0] + n].view(shape)
                used[0] += n
                return t
    caches, planes = make_cache(case["dst_layout"], case["num_layers"], case["dst_blocks"], case["dst_bs"],
                                1 if case["mla"] else case["heads"] // D, case["head_dim"], dtype, 900 + tp_rank,
                                device, alloc)
    agent.register(caches, case["dst_layout"])
    state = [[canonical_bytes(p, case["dst_layout"]) for p in layer] for layer in planes]
    src = {p: _src_planes(case, p) for p in range(P)}
    events = {}
    for req in case["requests"]:
        if req["mode"] == "stream" and req["layers"] is None:
            # Layer-wise: a layer becomes visible on its own, before the request is reported.
            agent.wait_layer(req["id"], 0, timeout=timedelta(seconds=120))
        try:
            events[req["id"]] = agent.wait(req["id"], timeout=timedelta(seconds=120))
        except Exception as e:  # noqa: BLE001 - faults are checked by the caller
            events[req["id"]] = e
    # Every request has landed (or failed): the cache must be the poisoned one with the done
    # requests applied in order; a failed request's destination blocks are not compared.
    got = [[canonical_bytes(p, case["dst_layout"]) for p in layer] for layer in planes]
    for req in case["requests"]:
        if isinstance(events[req["id"]], Exception):
            for layer in range(case["num_layers"]):
                for plane in range(len(got[layer])):
                    state[layer][plane][req["dst"]] = got[layer][plane][req["dst"]]
        else:
            state = expected_planes(case, tp_rank, state, src, req)
    for layer in range(case["num_layers"]):
        for plane in range(len(got[layer])):
            bad = int((got[layer][plane] != state[layer][plane]).sum())
            assert bad == 0, (f"layer {layer} plane {plane}: {bad} bytes differ from the reference "
                              f"({case['src_layout']} -> {case['dst_layout']}, TP {P}:{D})")
    remaining = agent.poll()
    dies = any(r["mode"] == "die" for r in case["requests"])
    barrier(ctx, f"{case['tag']}/done", ctx.world_size - 1 if dies else None)
    agent.close()
    return {rid: (type(e).__name__, str(e)) if isinstance(e, Exception) else (e.state, e.layers_done)
            for rid, e in events.items()}, [(e.request_id, e.kind, e.state) for e in remaining]


def two_requests(src_bs, dst_bs, ntok_a=40, ntok_b=23, b_mode="send"):
    """Two requests with scattered, out-of-order blocks on both sides and a partial last block
    (request "b" sent as ``b_mode``)."""
    def blocks(n, bs, order):
        return [order[i] for i in range(-(-n // bs))]
    a_src, b_src = blocks(ntok_a, src_bs, [7, 2, 9, 4, 11, 0]), blocks(ntok_b, src_bs, [5, 10, 1, 3])
    a_dst, b_dst = blocks(ntok_a, dst_bs, [3, 14, 1, 8, 12, 6]), blocks(ntok_b, dst_bs, [15, 0, 9, 10])
    return [request("a", ntok_a, a_src, a_dst, num_tokens=ntok_a),
            request("b", ntok_b, b_src, b_dst, mode=b_mode, num_tokens=ntok_b)]


def layerwise(ctx, tag, layout="NHD"):
    """Layer-wise streaming between rank 0 (prefill) and rank 1 (decode): layer 0 is usable on the
    decode side before the prefill side sends layer 1. Prefill returns (its send events, done, the
    transport it used); decode (layer 0 / 1 ready and poll() while only layer 0 was sent, (final
    state, layers done, the blocks bit-exact)). ``layout``'s planes must have the block axis first."""
    from commlib import kv
    pre, dec = f"{tag}-p", f"{tag}-d"
    if ctx.rank == 0:
        agent = kv.KVAgent(ctx.store, pre, "prefill", timeout=timedelta(seconds=30))
        caches, _ = make_cache(layout, 3, 8, 16, 2, 8, torch.bfloat16, 17, "cpu")
        agent.register(caches, layout)
        x = agent.begin(dec, "r", [1, 2], [5, 6])
        x.send_layer(0)
        ctx.store.get(f"{tag}/layer0-checked")
        x.send_layers([1, 2])
        x.wait()
        sent = agent.poll()
        through = agent.transport(dec)
        barrier(ctx, f"{tag}/end")
        agent.close()
        return [(e.request_id, e.kind, e.state) for e in sent], x.done(), through
    agent = kv.KVAgent(ctx.store, dec, "decode", timeout=timedelta(seconds=30))
    caches, planes = make_cache(layout, 3, 8, 16, 2, 8, torch.bfloat16, 900, "cpu", kv.host_empty)
    agent.register(caches, layout)
    agent.wait_layer("r", 0)
    seen = (agent.layer_ready("r", 0), agent.layer_ready("r", 1), agent.poll())
    ctx.store.set(f"{tag}/layer0-checked", b"1")
    event = agent.wait("r")
    src, src_planes = make_cache(layout, 3, 8, 16, 2, 8, torch.bfloat16, 17, "cpu")
    exact = all(torch.equal(planes[l][p][[5, 6]].view(torch.uint8), src_planes[l][p][[1, 2]].view(torch.uint8))
                for l in range(3) for p in range(2))
    barrier(ctx, f"{tag}/end")
    agent.close()
    return seen, (event.state, event.layers_done, exact)


# Bad requests for an agent with 2 layers of 8 blocks of 16 tokens sending to 12 destination blocks,
# and what the error says (None: a TypeError whose text is not checked). Every path of KVAgent.send
# (one host, NIXL) raises these before anything moves (Note [kv request checks]).
BAD_REQUESTS = [
    (dict(src_blocks=[8], dst_blocks=[0]), "source block id 8 (position 0) out of range; valid: 0..7"),
    (dict(src_blocks=[-1], dst_blocks=[0]), "source block id -1"),
    (dict(src_blocks=[0], dst_blocks=[12]), "destination block id 12 (position 0) out of range; valid: 0..11"),
    (dict(src_blocks=[0, 1], dst_blocks=[3, 3]), "destination block 3 appears twice (positions 0 and 1)"),
    (dict(src_blocks=[0, 1], dst_blocks=[3]), "needs 2 source blocks of 16 tokens and 2 destination blocks"),
    (dict(src_blocks=[0], dst_blocks=[3], num_tokens=17), "of 17 tokens needs 2 source blocks"),
    (dict(src_blocks=[0], dst_blocks=[3], layers=[2]), "layer 2 out of range; valid: 0..1"),
    (dict(src_blocks=[0], dst_blocks=[3], layers=[1, 1]), "layer 1 listed twice"),
    (dict(src_blocks=[0.5], dst_blocks=[3]), None),
]


def bad_request_errors(agent, peer) -> list:
    """What went wrong sending BAD_REQUESTS from ``agent`` to ``peer`` (empty: each raised as it should)."""
    errors = []
    for kwargs, text in BAD_REQUESTS:
        try:
            agent.send(peer, "bad", **kwargs)
            errors.append(f"no error for {kwargs}")
        except ValueError as e:
            if text is None or text not in str(e):
                errors.append(f"{kwargs}: {e}")
        except TypeError as e:
            if text is not None:
                errors.append(f"{kwargs}: {e}")
    return errors

