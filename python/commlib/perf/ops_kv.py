"""commlib-perf operation ``kv_transfer``: a prefill instance pushes one request's KV blocks into a
decode instance's paged cache (commlib.kv), timed from the sending side. A table of its own:

    commlib-perf kv_transfer --device cuda --kv-blocks 128,1000,20000 --kv-block-bytes 4K,16K --out bench/results/kv_transfer.md

Three processes share the machine (one GPU: every process on it; the prefill and decode pools are
then on the same GPU): per case, ranks [0, P) are the prefill instance and [P, P + D) the decode
instance, the rest idle. Rows: case (layout / TP / block size) x block bytes (one K or V block of one
layer on a prefill rank) x blocks per request (scattered ids, a random permutation on each side).
A request moves blocks x 2 planes (K, V) x layers.

Columns, on prefill rank 0, medians over ``-n`` requests after ``-w`` warm-up ones:
* post: host time of ``agent.send`` (checks, block-id staging, record writes, the launch);
* complete: from the start of ``send`` until the sender sees every layer's flag (host polling);
* GPU: CUDA-event time of the request's stream work (block-id upload + copy kernel), timed on
  ``-n`` more requests whose stream a spin kernel holds until the host has issued them, so it is
  the GPU's work alone (timed from before ``send``, a 1,000-block request would count its post,
  about as long as its copy, as GPU time);
* GB/s: request bytes / GPU time (CPU: / completion time); D2D: the same bytes as one contiguous ``cudaMemcpyAsync``
  device-to-device on this GPU (timed the same way), and the ratio (the issue's target: >= 70 % at 16 KiB blocks, >= 50 %
  at 4 KiB, transforms included);
* wrong: bytes of one more request on fresh data that differ from the reference (indexing), read
  on the decode ranks;
* NIXL (when ``nixl_cu13`` or ``nixl`` imports: ``pip install nixl-cu13``): the same request through NIXL in the
  same run, as an engine without commlib moves it: one NIXL agent per rank (UCX backend with NIXL's
  progress thread, made by commlib.kv_nixl.make_agent) with the caches registered, the request's
  descriptors (one per run of bytes contiguous on both sides:
  a whole block when the layouts match, a head_dim row when they do not) posted as one WRITE per
  decode rank; post = host time to build the descriptor lists and post them, complete = until
  NIXL reports the transfer done, then the count of descriptors and the wrong bytes of a checked
  request on fresh data. Above NIXL_ONE_REQUEST_DESCS descriptors (a head_dim row each when the
  layouts differ: a million at 20,000 blocks) NIXL takes seconds per request, and the column
  times one request without warm-up (marked ``1``).
* c/NIXL (when NIXL imports): commlib.kv itself through NIXL (Note [kv over nixl]): the same
  requests through a second pair of agents whose processes name two hosts; post: the caller's time
  in ``send`` (the transfers are handed to the sending agent's thread), complete: until ``done()``;
  wrong bytes of a checked request (on CUDA: VRAM to VRAM, as the NIXL column). For a request of
  several layers a second table: the compute of a prefill (a 384 x 384 fp32 matmul per layer on
  the CPU, on either device: it stands for work that keeps the calling thread busy) alone, the request sent alone, and the compute with
  each layer sent as it is done (until ``done()``): exposed = both - compute.
``llama70b`` is the anchor shape of the issue: 80 layers x 118 blocks x K, V = 18,880 block
descriptors of 4 KiB (Llama-3-70B at TP 8: one KV head of 128 dims, 16 tokens, bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import List, Optional

import torch

from . import harness, registry
from .report import machine_description, now_utc, software_description, source_commit, write_section
from .rows import _int_list

NAME = "kv_transfer"
# name: (P, D, src layout, dst layout, dst block size / src block size, layers)
CASES = {
    "nhd": (1, 1, "NHD", "NHD", 1, 1),
    "nhd>hnd": (1, 1, "NHD", "HND", 1, 1),
    "bs16>32": (1, 1, "flash_attn", "flash_attn", 2, 1),
    "tp1:2": (1, 2, "flash_attn", "HND", 1, 1),
    "tp2:1": (2, 1, "HND", "flash_attn", 1, 1),
    "llama70b": (1, 1, "flash_attn", "flash_attn", 1, 80),
}
HEAD_DIM = 128
NIXL_ONE_REQUEST_DESCS = 200_000  # above: the NIXL column times one request (it takes seconds)
GPU_HOLD_CYCLES = 4_000_000  # a spin of about 2 ms holds the stream while the host issues a request


def _sizes(text: str) -> List[int]:
    from .__main__ import parse_size
    return [parse_size(v) for v in text.replace(",", " ").split()]


def _add(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--kv-blocks", dest="kv_blocks", type=_int_list, default=None, metavar="N1,N2",
                       help=f"{NAME}: blocks per request (default 128,1000,4000,20000 on GPU, 16,128 on CPU)")
    group.add_argument("--kv-block-bytes", dest="kv_block_bytes", type=_sizes, default=None, metavar="B1,B2",
                       help=f"{NAME}: bytes of one K or V block of one layer (default 4K,16K)")
    group.add_argument("--kv-ctas", dest="kv_ctas", type=_int_list, default=None, metavar="N1,N2",
                       help=f"{NAME}: copy-kernel CTA budgets to time side by side (default: COMMLIB_KV_CTAS)")
    group.add_argument("--kv-cases", dest="kv_cases", default=",".join(CASES), metavar="C1,C2",
                       help=f"{NAME}: layout / TP cases, of {', '.join(CASES)} (default all)")


def _validate(opts) -> Optional[str]:
    for c in opts.kv_cases.split(","):
        if c not in CASES:
            return f"--kv-cases {c} not known; known: {', '.join(CASES)}"
    return None


registry.register_options(NAME, _add, _validate)


def _shape(block_bytes: int, P: int, D: int, layers: int, cpu: bool):
    """(block size, heads on a prefill rank, global heads, head_dim) for `block_bytes` bf16 blocks."""
    head_dim = 16 if cpu else HEAD_DIM
    row = head_dim * 2
    need = max(1, D // P)  # a prefill rank's heads must split over the decode ranks it serves
    bs = 16
    while bs > 1 and block_bytes // (bs * row) < need:
        bs //= 2
    heads = max(need, block_bytes // (bs * row))
    return bs, heads, heads * P, head_dim


def _fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator(device=t.device).manual_seed(seed)
    flat = t.view(-1).view(torch.int16)
    flat.copy_(torch.randint(-32768, 32767, flat.shape, generator=g, device=t.device, dtype=torch.int16))


def _fill_cache(caches, seed: int) -> None:
    tensors = [t for c in caches for t in (c if isinstance(c, tuple) else (c,))]
    for i, t in enumerate(tensors):
        _fill(t, seed * 1000 + i)


def _cache(layout: str, layers: int, blocks: int, bs: int, heads: int, head_dim: int, device, alloc):
    from .. import kv
    axes = kv.LAYOUTS[layout]
    dims = {"B": blocks, "T": bs, "H": heads, "D": head_dim, "K": 2}
    shape = [dims[a] for a in axes]
    if "K" in axes:
        caches = [alloc(shape) for _ in range(layers)]
        planes = [[c.select(axes.index("K"), i) for i in range(2)] for c in caches]
    else:
        caches = [(alloc(shape), alloc(shape)) for _ in range(layers)]
        planes = [list(c) for c in caches]
    pa = axes.replace("K", "")
    canon = [[p.permute([pa.index(a) for a in "BTHD"]) for p in layer] for layer in planes]
    return caches, canon


def _row_worker(rank: int, world_size: int, store, opts, rows, run_id: str) -> List[dict]:
    from .. import kv
    cpu = opts.device == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(device)
    results = []
    for r, (case, block_bytes, blocks, ctas) in enumerate(rows):
        P, D, src_layout, dst_layout, bs_ratio, layers = CASES[case]
        bs, heads_p, heads, head_dim = _shape(block_bytes, P, D, layers, cpu)
        tag = f"kvperf-{run_id}-{r}"
        dst_bs = bs * bs_ratio
        dst_blocks = -(-blocks * bs // dst_bs)
        role = "prefill" if rank < P else "decode" if rank < P + D else None
        result = None
        if role is not None:
            tp_rank = rank if role == "prefill" else rank - P
            tp = P if role == "prefill" else D
            agent = kv.KVAgent(store, f"{tag}-{role}", role, tp_rank, tp, device=device, timeout=timedelta(seconds=60),
                               num_ctas=ctas)
            if role == "prefill":
                caches, canon = _cache(src_layout, layers, blocks, bs, heads_p, head_dim, device,
                                       lambda s: torch.empty(s, dtype=torch.bfloat16, device=device))
            else:
                caches, canon = _cache(dst_layout, layers, dst_blocks, dst_bs, heads // D, head_dim, device,
                                       (lambda s: kv.host_empty(s, torch.bfloat16)) if cpu else
                                       (lambda s: torch.empty(s, dtype=torch.bfloat16, device=device)))
            _fill_cache(caches, 100 + rank)
            agent.register(caches, src_layout if role == "prefill" else dst_layout)
            g = torch.Generator().manual_seed(r)
            src_ids = torch.randperm(blocks, generator=g).to(torch.int32)
            dst_ids = torch.randperm(dst_blocks, generator=g).to(torch.int32)
            if role == "prefill":
                result = _send_rows(agent, f"{tag}-decode", src_ids, dst_ids, opts, rank, device, caches, canon, store,
                                    tag, D)
            else:
                result = _receive(agent, store, tag, src_ids, dst_ids, canon, rank - P, P, D, bs, dst_bs, heads,
                                  head_dim, layers, src_layout, blocks, device, opts)
            if _nixl_api() is not None:  # the same request through NIXL, in the same run
                if role == "prefill":
                    result.update(_nixl_sender(caches, canon, src_ids, dst_ids, store, tag, rank, P, D, bs, dst_bs,
                                               blocks, heads, head_dim, opts, device))
                else:
                    _nixl_receiver(caches, canon, store, tag, rank - P, P, lambda: _wrong_bytes(
                        canon, src_ids, dst_ids, rank - P, P, D, bs, dst_bs, heads, head_dim, layers, src_layout,
                        blocks, device, seed=9))
            store.add(f"{tag}/finished", 1)
            while int(store.add(f"{tag}/finished", 0)) < P + D:
                time.sleep(0.001)
            agent.close()
            if _nixl_api() is not None:  # commlib.kv itself over NIXL: the instances name two hosts
                layout = src_layout if role == "prefill" else dst_layout
                out = _over_nixl(store, f"{tag}-x", role, tp_rank, tp, P + D, device, caches, layout, lambda a, t: (
                    dict(_send_rows(a, f"{t}-decode", src_ids, dst_ids, opts, rank, device, caches, canon, store, t,
                                    D, gpu_requests=False),
                         **(_layerwise(a, f"{t}-decode", src_ids, dst_ids, layers, opts) if layers > 1 else {}))
                    if role == "prefill" else
                    _receive(a, store, t, src_ids, dst_ids, canon, rank - P, P, D, bs, dst_bs, heads, head_dim, layers,
                             src_layout, blocks, device, opts, gpu_requests=False)))
                if role == "prefill":
                    result.update(cx_post_us=out["post_us"], cx_complete_us=out["complete_us"],
                                  cx_wrong=out.get("wrong", 0),
                                  **{k: v for k, v in out.items() if k.startswith("lw_")})
        if rank == 0:
            result.update(case=case, block_bytes=block_bytes, blocks=blocks, layers=layers, ctas=ctas,
                          bytes=blocks * block_bytes * 2 * layers)
            results.append(result)
            # Each row as it is measured (the table follows at the end): a run cut short keeps what it measured.
            print("# measured:" + _table([result], cpu)[1], flush=True)
        store.add(f"{tag}/row", 1)
        while int(store.add(f"{tag}/row", 0)) < world_size:
            time.sleep(0.001)
    return results


def _layerwise(agent, peer, src_ids, dst_ids, layers, opts) -> dict:
    """A multi-layer request sent layer by layer while the caller computes (a 384 x 384 fp32 matmul
    per layer, one thread, standing in for the layer's prefill compute): medians (ms) of the compute
    alone, the request sent alone, and the compute with each layer sent as it is done, until done();
    exposed = the last minus the compute (Note [kv over nixl]: the transfers move meanwhile)."""
    m = torch.randn(384, 384)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = {"lw_compute_ms": [], "lw_alone_ms": [], "lw_overlap_ms": []}
    try:
        for i in range(opts.warmup + opts.iters):
            t0 = time.perf_counter()
            for _ in range(layers):
                torch.mm(m, m)
            t1 = time.perf_counter()
            agent.send(peer, f"lw-a{i}", src_ids, dst_ids).wait()
            t2 = time.perf_counter()
            x = agent.begin(peer, f"lw-o{i}", src_ids, dst_ids)
            for layer in range(layers):
                torch.mm(m, m)
                x.send_layer(layer)
            x.wait()
            t3 = time.perf_counter()
            agent.poll()
            if i >= opts.warmup:
                for key, t in (("lw_compute_ms", t1 - t0), ("lw_alone_ms", t2 - t1), ("lw_overlap_ms", t3 - t2)):
                    times[key].append(t * 1e3)
    finally:
        torch.set_num_threads(threads)
    return {k: statistics.median(v) for k, v in times.items()}


def _over_nixl(store, tag, role, tp_rank, tp, ranks, device, caches, layout, run):
    """`run(agent, tag)` with a second pair of commlib.kv agents over the same caches, the prefill and
    decode processes naming two hosts (COMMLIB_TEST_HOST_ID), so commlib.kv moves the requests
    through NIXL (Note [kv over nixl])."""
    from .. import kv
    old = os.environ.get("COMMLIB_TEST_HOST_ID")
    os.environ["COMMLIB_TEST_HOST_ID"] = f"{tag}-{role}-host"
    try:
        agent = kv.KVAgent(store, f"{tag}-{role}", role, tp_rank, tp, device=device, timeout=timedelta(seconds=60))
        agent.register(caches, layout)
        out = run(agent, tag)
        store.add(f"{tag}/finished", 1)
        while int(store.add(f"{tag}/finished", 0)) < ranks:
            time.sleep(0.001)
        agent.close()
        return out
    finally:
        if old is None:
            os.environ.pop("COMMLIB_TEST_HOST_ID", None)
        else:
            os.environ["COMMLIB_TEST_HOST_ID"] = old


def _gpu_time_us(device, enqueue) -> tuple:
    """(CUDA-event time in us, result) of the stream work ``enqueue()`` issues, the stream held by a spin
    kernel (GPU_HOLD_CYCLES) until the host has issued it all: the GPU's work alone, not the host's
    time to issue it (a 1,000-block request's post takes about as long as its copy)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(GPU_HOLD_CYCLES)
    start.record()
    out = enqueue()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3, out


def _send_rows(agent, peer, src_ids, dst_ids, opts, rank, device, caches, canon, store, tag, D,
               gpu_requests: bool = True) -> dict:
    """Prefill rank: the timed requests (post and completion, host clocks), then on CUDA with
    ``gpu_requests`` as many again timed on the GPU alone (``_gpu_time_us``; the decode side waits
    for those too), then a checked request on fresh data."""
    cuda = device.type == "cuda"
    posts, completes, gpu = [], [], []
    agent.connect(peer)
    for i in range(opts.warmup + opts.iters):
        t0 = time.perf_counter()
        x = agent.send(peer, f"r{i}", src_ids, dst_ids)
        t1 = time.perf_counter()
        while not x.done():
            pass
        t2 = time.perf_counter()
        if i >= opts.warmup:
            posts.append((t1 - t0) * 1e6)
            completes.append((t2 - t0) * 1e6)
    for i in range(opts.iters if cuda and gpu_requests else 0):
        us, x = _gpu_time_us(device, lambda: agent.send(peer, f"g{i}", src_ids, dst_ids))
        x.wait()
        gpu.append(us)
    # The check: fresh source data, one more request, compared on the decode ranks.
    _fill_cache(caches, 7 + rank)
    agent.send(peer, "check", src_ids, dst_ids).wait()
    store.set(f"{tag}/sent-check/{rank}", b"1")
    out = {"post_us": statistics.median(posts), "complete_us": statistics.median(completes),
           "gpu_us": statistics.median(gpu) if gpu else float("nan")}
    if rank == 0:
        out["d2d_us"] = _d2d_us(canon, src_ids, opts, device) if cuda else float("nan")
        out["wrong"] = sum(int(store.get(f"{tag}/wrong/{d}")) for d in range(D))
    return out


def _d2d_us(canon, src_ids, opts, device) -> float:
    """A contiguous device-to-device copy of the request's bytes on this GPU (the rate to compare)."""
    nbytes = sum(p[src_ids.long()].numel() * p.element_size() for layer in canon for p in layer)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = [_gpu_time_us(device, lambda: b.copy_(a))[0] for _ in range(opts.warmup + opts.iters)]
    return statistics.median(times[opts.warmup:])


def _receive(agent, store, tag, src_ids, dst_ids, canon, d_rank, P, D, bs, dst_bs, heads, head_dim, layers,
             src_layout, blocks, device, opts, gpu_requests: bool = True) -> Optional[dict]:
    """Decode rank: keeps reporting requests (freeing their records), then checks the last one."""
    names = [f"r{i}" for i in range(opts.warmup + opts.iters)]
    names += [f"g{i}" for i in range(opts.iters if device.type == "cuda" and gpu_requests else 0)]
    for name in names:
        agent.wait(name)
    agent.wait("check")
    wrong = _wrong_bytes(canon, src_ids, dst_ids, d_rank, P, D, bs, dst_bs, heads, head_dim, layers, src_layout,
                         blocks, device, seed=7)
    store.set(f"{tag}/wrong/{d_rank}", str(wrong).encode())
    return None


def _wrong_bytes(canon, src_ids, dst_ids, d_rank, P, D, bs, dst_bs, heads, head_dim, layers, src_layout, blocks,
                 device, seed: int) -> int:
    """Bytes of this decode rank's cache that differ from the prefill ranks' data (filled with
    `seed` + prefill rank), regenerated here and indexed into place."""
    wrong = 0
    tok = torch.arange(blocks * bs, device=device)
    sb, st = src_ids.to(device).long()[tok // bs], tok % bs
    db, dt = dst_ids.to(device).long()[tok // dst_bs], tok % dst_bs
    hd, hp = heads // D, heads // P
    for p in range(P):  # the prefill ranks' fresh data, regenerated (the same generator and seeds)
        src_caches, src_canon = _cache(src_layout, layers, blocks, bs, hp, head_dim, device,
                                       lambda s: torch.empty(s, dtype=torch.bfloat16, device=device))
        _fill_cache(src_caches, seed + p)
        for layer in range(layers):
            for plane in range(2):
                for h in range(hd):
                    g = d_rank * hd + h
                    if g // hp != p:
                        continue
                    got = canon[layer][plane][db, dt, h].view(torch.int16)
                    want = src_canon[layer][plane][sb, st, g % hp].view(torch.int16)
                    wrong += int((got != want).sum()) * 2
    return wrong


# ---- the same request through NIXL (when it imports) ----

def _nixl_api():
    """NIXL's agent classes, or None without NIXL (the product's helper: commlib.kv_nixl)."""
    from ..kv_nixl import nixl_api
    return nixl_api()


def _nixl_agent(name: str, caches):
    """A NIXL agent (UCX) with the caches registered, made the way commlib.kv makes its own."""
    from ..kv_nixl import make_agent
    return make_agent(name, tensors=[t for c in caches for t in (c if isinstance(c, tuple) else (c,))],
                      progress_thread=True)


def _plane_geometry(canon) -> list:
    """[layer][plane] -> (address, block, token, head strides in bytes) of the canonical BTHD views."""
    return [[(p.data_ptr(), *(st * p.element_size() for st in p.stride()[:3])) for p in layer] for layer in canon]


def _nixl_runs(src_geo, dst_geo, src_ids, dst_ids, bs, dst_bs, blocks, heads_src, src_first, dst_first, num_heads,
               head_dim):
    """(source addresses, destination addresses, lengths) of the runs a request moves: one head_dim row
    per (layer, plane, token, head), merged where consecutive rows are contiguous on both sides."""
    import numpy as np
    tok = torch.arange(blocks * bs)
    sb, st = src_ids.long()[tok // bs], tok % bs
    db, dt = dst_ids.long()[tok // dst_bs], tok % dst_bs
    row = head_dim * 2
    srcs, dsts = [], []
    for layer in range(len(src_geo)):
        for plane in range(2):
            s0, sB, sT, sH = src_geo[layer][plane]
            d0, dB, dT, dH = dst_geo[layer][plane]
            for h in range(num_heads):
                srcs.append(s0 + sb * sB + st * sT + (src_first + h) * sH)
                dsts.append(d0 + db * dB + dt * dT + (dst_first + h) * dH)
    src, dst = torch.cat(srcs), torch.cat(dsts)
    order = torch.argsort(src)
    src, dst = src[order], dst[order]
    starts = torch.ones_like(src, dtype=torch.bool)
    starts[1:] = (src[1:] != src[:-1] + row) | (dst[1:] != dst[:-1] + row)
    run = torch.cumsum(starts.long(), 0) - 1
    lengths = torch.zeros(int(run[-1]) + 1, dtype=torch.long).index_add_(0, run, torch.full_like(run, row))
    return src[starts].numpy().astype(np.uint64), dst[starts].numpy().astype(np.uint64), lengths.numpy()


def _nixl_sender(caches, canon, src_ids, dst_ids, store, tag, p, P, D, bs, dst_bs, blocks, heads, head_dim, opts,
                 device) -> dict:
    """Prefill rank p: the timed requests through NIXL, then a checked one on fresh data."""
    import numpy as np
    agent = _nixl_agent(f"{tag}-nixl-p{p}", caches)
    mem = "DRAM" if device.type == "cpu" else "VRAM"
    dev = 0 if device.type == "cpu" else device.index
    hp, hd = heads // P, heads // D
    posts = []  # per decode rank this prefill rank feeds: (remote name, local array, remote array)
    for d in range(D):
        first, last = max(p * hp, d * hd), min((p + 1) * hp, (d + 1) * hd)
        if first >= last:
            continue
        name = agent.add_remote_agent(store.get(f"{tag}/nixl/meta/{d}"))
        dst_geo = json.loads(store.get(f"{tag}/nixl/geo/{d}"))
        src, dst, lengths = _nixl_runs(_plane_geometry(canon), dst_geo, src_ids, dst_ids, bs, dst_bs, blocks, hp,
                                       first - p * hp, first - d * hd, last - first, head_dim)
        devs = np.full_like(lengths, dev, dtype=np.uint64)
        posts.append((name, np.stack([src, lengths.astype(np.uint64), devs], 1),
                      np.stack([dst, lengths.astype(np.uint64), devs], 1)))

    def request(note: bytes):
        handles = []
        t0 = time.perf_counter()
        for name, local, remote in posts:
            h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem),
                                      name, note)
            if agent.transfer(h) == "ERR":
                raise RuntimeError(f"{NAME}: NIXL transfer to {name} failed")
            handles.append(h)
        t1 = time.perf_counter()
        deadline = t1 + 60.0
        for h in handles:
            while (state := agent.check_xfer_state(h)) not in ("DONE", "ERR"):
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{NAME}: a NIXL transfer of request {note.decode()} not done after 60 s")
            if state == "ERR":
                raise RuntimeError(f"{NAME}: NIXL transfer of request {note.decode()} failed")
            agent.release_xfer_handle(h)
        return (t1 - t0) * 1e6, (time.perf_counter() - t0) * 1e6

    descs = sum(len(local) for _, local, _ in posts)
    # A request of a million head_dim rows takes NIXL seconds to post: one timed request, no warm-up.
    single = descs > NIXL_ONE_REQUEST_DESCS
    warmup, iters = (0, 1) if single else (opts.warmup, opts.iters)
    times = [request(f"n{i}".encode()) for i in range(warmup + iters)][warmup:]
    _fill_cache(caches, 9 + p)  # fresh data for the checked request
    if device.type == "cuda":  # NIXL reads memory, not a stream: the fill must have landed
        torch.cuda.synchronize(device)
    request(b"check")
    store.set(f"{tag}/nixl/sent/{p}", b"1")
    out = {"nixl_post_us": statistics.median(t[0] for t in times),
           "nixl_complete_us": statistics.median(t[1] for t in times),
           "nixl_descs": descs, "nixl_single": single}
    if p == 0:
        out["nixl_wrong"] = sum(int(store.get(f"{tag}/nixl/wrong/{d}")) for d in range(D))
    store.set(f"{tag}/nixl/done/{p}", b"1")
    store.wait([f"{tag}/nixl/closed/{d}" for d in range(D)])
    return out


def _nixl_receiver(caches, canon, store, tag, d_rank, P, check) -> None:
    agent = _nixl_agent(f"{tag}-nixl-d{d_rank}", caches)
    store.set(f"{tag}/nixl/geo/{d_rank}", json.dumps(_plane_geometry(canon)).encode())
    store.set(f"{tag}/nixl/meta/{d_rank}", agent.get_agent_metadata())
    store.wait([f"{tag}/nixl/sent/{p}" for p in range(P)])
    store.set(f"{tag}/nixl/wrong/{d_rank}", str(check()).encode())
    store.wait([f"{tag}/nixl/done/{p}" for p in range(P)])
    del agent  # deregisters before the caches go
    store.set(f"{tag}/nixl/closed/{d_rank}", b"1")


def main_kv(opts) -> int:
    cpu = opts.device == "cpu"
    blocks = opts.kv_blocks or ([16, 128] if cpu else [128, 1000, 4000, 20000])
    sizes = opts.kv_block_bytes or [4096, 16384]
    cases = opts.kv_cases.split(",")
    ctas = opts.kv_ctas or [None]
    rows = [(c, b, n, k) for c in cases for b in sizes for n in (blocks if c != "llama70b" else [118]) for k in ctas
            if c != "llama70b" or b == 4096]
    rows = list(dict.fromkeys(rows))
    try:
        results = harness.spawn(_row_worker, 3, opts, rows, f"{os.getpid()}-{int(time.time())}")
    except SystemExit as e:
        return int(e.code or 2)
    lines = _table(results, cpu) + _layerwise_lines(results)
    for line in lines:
        print(line, flush=True)
    wrong = sum(r["wrong"] + r.get("nixl_wrong", 0) + r.get("cx_wrong", 0) for r in results)
    if opts.out:
        title = f"{opts.device.upper()}: commlib-perf kv_transfer"
        body = [f"## {title}", "",
                f"- machine: {machine_description(opts.device)}; {software_description(opts.device)}",
                f"- commit: {source_commit()}", f"- date: {now_utc()}", f"- command: `{opts.command_line}`",
                f"- timing: medians of {opts.iters} requests after {opts.warmup} warm-up ones, on prefill rank 0; "
                "three processes share the device (module docstring of commlib/perf/ops_kv.py)", "",
                "```"] + lines + ["```", ""]
        write_section(opts.out, title, "\n".join(body), f"# {NAME}: commlib.kv, prefill and decode instances on one "
                      "machine\n\nEach section is rewritten by the command it names (`--out` rewrites the section "
                      "of its device and keeps the others).\n\n")
        print(f"# wrote {opts.out}", flush=True)
    return 1 if wrong else 0


def _table(results, cpu: bool) -> List[str]:
    head = (f"{'case':>9} {'block':>6} {'blocks':>6} {'layers':>6} {'CTAs':>5} {'MB/req':>8} {'post us':>8} {'complete us':>11} "
            f"{'GPU us':>8} {'GB/s':>7} {'D2D GB/s':>8} {'% D2D':>6} {'wrong':>5}  "
            f"{'c/NIXL post':>11} {'complete us':>11} {'wrong':>5}  "
            f"{'NIXL post us':>12} {'complete us':>11} {'descs':>6} {'wrong':>5} {'vs NIXL':>7}")
    lines = [head]
    for r in results:
        t = r["gpu_us"] if r["gpu_us"] == r["gpu_us"] else r["complete_us"]  # CPU: no GPU time
        gbps = r["bytes"] / (t * 1e3)
        d2d = r["bytes"] / (r["d2d_us"] * 1e3) if r.get("d2d_us", float("nan")) == r.get("d2d_us") else float("nan")
        pct = 100 * gbps / d2d if d2d == d2d and gbps == gbps else float("nan")
        ctas = str(r["ctas"]) if r["ctas"] else os.environ.get("COMMLIB_KV_CTAS", "dflt")
        lines.append(f"{r['case']:>9} {r['block_bytes'] // 1024:>5}K {r['blocks']:>6} {r['layers']:>6} {ctas:>5} "
                     f"{r['bytes'] / 1e6:>8.2f} {r['post_us']:>8.1f} {r['complete_us']:>11.1f} {r['gpu_us']:>8.1f} "
                     f"{gbps:>7.1f} {d2d:>8.1f} {pct:>6.1f} {r['wrong']:>5}  " + _over_nixl_cells(r) + _nixl_cells(r))
    return lines


def _layerwise_lines(results) -> List[str]:
    rows = [r for r in results if "lw_overlap_ms" in r]
    if not rows:
        return []
    lines = ["", "# c/NIXL layer by layer: compute (a 384 x 384 fp32 matmul per layer) with each layer sent as it "
             "is done, until done()",
             f"{'case':>9} {'block':>6} {'blocks':>6} {'layers':>6} {'compute ms':>10} {'send alone ms':>13} "
             f"{'both ms':>8} {'exposed ms':>10}"]
    for r in rows:
        lines.append(f"{r['case']:>9} {r['block_bytes'] // 1024:>5}K {r['blocks']:>6} {r['layers']:>6} "
                     f"{r['lw_compute_ms']:>10.2f} {r['lw_alone_ms']:>13.2f} {r['lw_overlap_ms']:>8.2f} "
                     f"{r['lw_overlap_ms'] - r['lw_compute_ms']:>10.2f}")
    return lines


def _over_nixl_cells(r: dict) -> str:
    if "cx_post_us" not in r:
        return f"{'n/a':>11} {'n/a':>11} {'n/a':>5}  "
    return f"{r['cx_post_us']:>11.1f} {r['cx_complete_us']:>11.1f} {r['cx_wrong']:>5}  "


def _nixl_cells(r: dict) -> str:
    if "nixl_post_us" not in r:
        return f"{'n/a (NIXL not installed)':>45}"
    one = "1" if r.get("nixl_single") else " "
    return (f"{r['nixl_post_us']:>12.1f} {r['nixl_complete_us']:>11.1f} {r['nixl_descs']:>6} {r['nixl_wrong']:>5} "
            f"{r['nixl_complete_us'] / r['complete_us']:>6.1f}x{one}")


registry.register(registry.Collective(
    name=NAME, count=lambda nbytes, esize, n: nbytes // esize, bus_factor=lambda n: 1.0,
    setup=lambda case: (_ for _ in ()).throw(registry.Unsupported(f"{NAME} has a table of its own")),
    run=lambda backend, b, case: None, check=lambda b, case: 0, standalone=main_kv))
