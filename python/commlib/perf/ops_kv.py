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
* GPU: CUDA-event time of the request's stream work (block-id upload + copy kernel);
* GB/s: request bytes / GPU time (CPU: / completion time); D2D: the same bytes as one contiguous ``cudaMemcpyAsync``
  device-to-device on this GPU, and the ratio (the issue's target: >= 70 % at 16 KiB blocks, >= 50 %
  at 4 KiB, transforms included);
* wrong: bytes of one more request on fresh data that differ from the reference (indexing), read
  on the decode ranks; NIXL: the same request through NIXL (not in this build: n/a).
``llama70b`` is the anchor shape of the issue: 80 layers x 118 blocks x K, V = 18,880 block
descriptors of 4 KiB (Llama-3-70B at TP 8: one KV head of 128 dims, 16 tokens, bf16).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import List, Optional

import torch

from . import harness, registry
from .report import machine_description, software_description, source_commit, now_utc
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
            store.add(f"{tag}/finished", 1)
            while int(store.add(f"{tag}/finished", 0)) < P + D:
                time.sleep(0.001)
            agent.close()
        if rank == 0:
            result.update(case=case, block_bytes=block_bytes, blocks=blocks, layers=layers, ctas=ctas,
                          bytes=blocks * block_bytes * 2 * layers)
            results.append(result)
        store.add(f"{tag}/row", 1)
        while int(store.add(f"{tag}/row", 0)) < world_size:
            time.sleep(0.001)
    return results


def _send_rows(agent, peer, src_ids, dst_ids, opts, rank, device, caches, canon, store, tag, D) -> dict:
    cuda = device.type == "cuda"
    posts, completes, gpu = [], [], []
    agent.connect(peer)
    for i in range(opts.warmup + opts.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        x = agent.send(peer, f"r{i}", src_ids, dst_ids)
        t1 = time.perf_counter()
        if cuda:
            end.record()
        while not x.done():
            pass
        t2 = time.perf_counter()
        if i >= opts.warmup:
            posts.append((t1 - t0) * 1e6)
            completes.append((t2 - t0) * 1e6)
            if cuda:
                end.synchronize()
                gpu.append(start.elapsed_time(end) * 1e3)
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
    times = []
    for i in range(opts.warmup + opts.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        if i >= opts.warmup:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _receive(agent, store, tag, src_ids, dst_ids, canon, d_rank, P, D, bs, dst_bs, heads, head_dim, layers,
             src_layout, blocks, device, opts) -> Optional[dict]:
    """Decode rank: keeps reporting requests (freeing their records), then checks the last one."""
    for i in range(opts.warmup + opts.iters):
        agent.wait(f"r{i}")
    agent.wait("check")
    wrong = 0
    tok = torch.arange(blocks * bs, device=device)
    sb, st = src_ids.to(device).long()[tok // bs], tok % bs
    db, dt = dst_ids.to(device).long()[tok // dst_bs], tok % dst_bs
    hd, hp = heads // D, heads // P
    for p in range(P):  # the prefill ranks' fresh data, regenerated (the same generator and seeds)
        src_caches, src_canon = _cache(src_layout, layers, blocks, bs, hp, head_dim, device,
                                       lambda s: torch.empty(s, dtype=torch.bfloat16, device=device))
        _fill_cache(src_caches, 7 + p)
        for layer in range(layers):
            for plane in range(2):
                for h in range(hd):
                    g = d_rank * hd + h
                    if g // hp != p:
                        continue
                    got = canon[layer][plane][db, dt, h].view(torch.int16)
                    want = src_canon[layer][plane][sb, st, g % hp].view(torch.int16)
                    wrong += int((got != want).sum()) * 2
    store.set(f"{tag}/wrong/{d_rank}", str(wrong).encode())
    return None


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
    lines = _table(results, cpu)
    for line in lines:
        print(line, flush=True)
    wrong = sum(r["wrong"] for r in results)
    if opts.out:
        meta = [f"# {NAME}: commlib.kv, {opts.device.upper()}, prefill and decode instances on one machine", "",
                f"- machine: {machine_description(opts.device)}; {software_description(opts.device)}",
                f"- commit: {source_commit()}", f"- date: {now_utc()}", f"- command: `{opts.command_line}`",
                f"- timing: medians of {opts.iters} requests after {opts.warmup} warm-up ones, on prefill rank 0; "
                "three processes share the device (module docstring of commlib/perf/ops_kv.py)", "",
                "Regenerate: run the command above (it rewrites this file).", "", "```"] + lines + ["```", ""]
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as f:
            f.write("\n".join(meta))
        print(f"# wrote {opts.out}", flush=True)
    return 1 if wrong else 0


def _table(results, cpu: bool) -> List[str]:
    head = (f"{'case':>9} {'block':>6} {'blocks':>6} {'layers':>6} {'CTAs':>5} {'MB/req':>8} {'post us':>8} {'complete us':>11} "
            f"{'GPU us':>8} {'GB/s':>7} {'D2D GB/s':>8} {'% D2D':>6} {'wrong':>5}  NIXL")
    lines = [head]
    for r in results:
        t = r["gpu_us"] if r["gpu_us"] == r["gpu_us"] else r["complete_us"]  # CPU: no GPU time
        gbps = r["bytes"] / (t * 1e3)
        d2d = r["bytes"] / (r["d2d_us"] * 1e3) if r.get("d2d_us", float("nan")) == r.get("d2d_us") else float("nan")
        pct = 100 * gbps / d2d if d2d == d2d and gbps == gbps else float("nan")
        ctas = str(r["ctas"]) if r["ctas"] else os.environ.get("COMMLIB_KV_CTAS", "dflt")
        lines.append(f"{r['case']:>9} {r['block_bytes'] // 1024:>5}K {r['blocks']:>6} {r['layers']:>6} {ctas:>5} "
                     f"{r['bytes'] / 1e6:>8.2f} {r['post_us']:>8.1f} {r['complete_us']:>11.1f} {r['gpu_us']:>8.1f} "
                     f"{gbps:>7.1f} {d2d:>8.1f} {pct:>6.1f} {r['wrong']:>5}  n/a (not in this build)")
    return lines


registry.register(registry.Collective(
    name=NAME, count=lambda nbytes, esize, n: nbytes // esize, bus_factor=lambda n: 1.0,
    setup=lambda case: (_ for _ in ()).throw(registry.Unsupported(f"{NAME} has a table of its own")),
    run=lambda backend, b, case: None, check=lambda b, case: 0, standalone=main_kv))
