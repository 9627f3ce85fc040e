"""Expert-parallel dispatch + combine: commlib EPBuffer vs the two usual baselines, one run.

    python bench/bench_ep.py [--out bench/results/ep_h200x2.md] [--tokens 1,8,32,128,512,4096]
                             [--iters 50] [--models deepseek,mixtral] [--max-tokens N]

Spawns one process per GPU (default 2). For each model shape and tokens per rank it measures,
on the same random routing (top-k distinct experts per token, softmax weights), bf16:
  commlib  EPBuffer.dispatch + combine, captured in one CUDA graph, replayed (and eager)
  (a)      the host-synchronised NCCL path: all_to_all_single of the counts, .tolist(), permute,
           all_to_all_single with splits, all_to_all_single back, un-permute, weighted sum (eager)
  (b)      all_gather_into_tensor + reduce_scatter_tensor of [world * tokens, hidden], CUDA graph
Time = median over repeats of (elapsed of `iters` replays / iters), CUDA events. The experts are
the identity, so combine must return x * sum_k w: checked in the same run (bf16 tolerance).
--max-tokens N sizes every EPBuffer for max(N, tokens) tokens per rank (default: the measured
token count), e.g. a decode step in a buffer registered for larger batches.
Payload GB/s: bytes of token rows that cross to other ranks (dispatch + combine, each token once
per owner rank) per direction, divided by the commlib graph time.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import capture_graph

MODELS = {
    "deepseek": dict(name="DeepSeek-V3-like", hidden=7168, num_experts=256, topk=8),
    "mixtral": dict(name="Mixtral-like", hidden=4096, num_experts=8, topk=2),
}


def routing(num_tokens, num_experts, topk, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    w, idx = scores.topk(topk, dim=1)
    return idx.to(device), torch.softmax(w, dim=1).float().to(device)


def timed(fn, iters, repeats=7):
    """Median microseconds per call of fn() (which runs `iters` ops) over repeats."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / iters)
    t = torch.tensor([statistics.median(samples)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return float(t)


def nccl_host_path(x, idx, w, num_experts, world):
    """The usual eager MoE all-to-all (baseline a), identity experts; the implementation is the one
    commlib-perf's ep_dispatch_combine times (commlib.perf.ops_ep). Returns combined [T, H]."""
    from commlib.perf.ops_ep import host_sync_dispatch_combine
    return host_sync_dispatch_combine(x, idx, w, num_experts)


def crossing_rows(idx, num_experts, world, rank):
    L = num_experts // world
    owners = torch.zeros(idx.shape[0], world, dtype=torch.bool, device=idx.device)
    owners.scatter_(1, idx // L, True)
    owners[:, rank] = False
    return int(owners.sum())


def worker(rank, world, port, args, q):
    import commlib
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("nccl", store=dist.PrefixStore("nccl", store), rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    comm = commlib.Communicator(store, rank, world, "bench-ep")
    dev = torch.device("cuda", rank)
    rows = []
    for model in args.models:
        m = MODELS[model]
        H, E, K = m["hidden"], m["num_experts"], m["topk"]
        for T in args.tokens:
            x = (torch.randn(T, H, device=dev) + 0.1).bfloat16()
            idx, w = routing(T, E, K, dev, seed=1234 + rank * 7 + T)
            buf = commlib.EPBuffer(comm, max(T, args.max_tokens), H, E, K, torch.bfloat16, device=dev)
            out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)

            def step():
                r = buf.dispatch(x, idx, w)
                buf.combine(r.expert_x, r.handle, out=out)

            step()
            torch.cuda.synchronize()
            buf.check()
            ref = (x.float() * w.sum(1, keepdim=True)).bfloat16()
            ok = torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
            iters = max(1, min(args.iters, 4096 // max(T, 1) * 8))
            g = capture_graph(step, iters, before_capture=dist.barrier)
            t_graph = timed(g.replay, iters)

            def eager():
                for _ in range(iters):
                    step()
            t_eager = timed(eager, iters)
            del g
            # (a) host-synchronised NCCL path
            na = nccl_host_path(x, idx, w, E, world)
            ok = ok and torch.allclose(na.float(), ref.float(), rtol=2e-2, atol=2e-2)

            def host_path():
                for _ in range(iters):
                    nccl_host_path(x, idx, w, E, world)
            t_a = timed(host_path, iters)
            # (b) all-gather + reduce-scatter in a graph
            gathered = torch.empty(world * T, H, dtype=torch.bfloat16, device=dev)
            scattered = torch.empty(T, H, dtype=torch.bfloat16, device=dev)

            def agrs():
                dist.all_gather_into_tensor(gathered, x)
                dist.reduce_scatter_tensor(scattered, gathered)
            gb = capture_graph(agrs, iters, before_capture=dist.barrier)
            t_b = timed(gb.replay, iters)
            del gb
            cross = crossing_rows(idx, E, world, rank) * H * 2
            t_cross = torch.tensor([float(cross)], device=dev)
            dist.all_reduce(t_cross, op=dist.ReduceOp.MAX)
            flag = torch.tensor([0.0 if ok else 1.0], device=dev)
            dist.all_reduce(flag)
            rows.append(dict(model=m["name"], tokens=T, kernels=buf.kernels, graph=t_graph, eager=t_eager, a=t_a,
                             b=t_b, gbps=2 * float(t_cross) / (t_graph * 1e3), ok=float(flag) == 0))
            del buf
            torch.cuda.empty_cache()
    if rank == 0:
        q.put(rows)
    comm.close()
    dist.destroy_process_group()


def render(rows, args):
    lines = [
        "# EP dispatch + combine, commlib vs NCCL baselines",
        "",
        f"- command: `python bench/bench_ep.py {' '.join(sys.argv[1:])}`",
        f"- machine: {torch.cuda.get_device_name(0)} x{args.world}, torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {platform.node()}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}",
        "- COMMLIB_* environment: " + (", ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                                 if k.startswith("COMMLIB_")) or "none (defaults)"),
        "- bf16, random top-k routing, identity experts; µs per dispatch+combine (median, slowest rank)",
        "",
        "| model | tokens/rank | kernels | commlib graph | commlib eager | (a) NCCL host-sync | (b) AG+RS graph "
        "| speedup vs best | payload GB/s/dir | check |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        best = min(r["a"], r["b"])
        lines.append(f"| {r['model']} | {r['tokens']} | {r['kernels']} | {r['graph']:.1f} | {r['eager']:.1f} | "
                     f"{r['a']:.1f} | {r['b']:.1f} | {best / r['graph']:.2f}x | {r['gbps']:.0f} | {'ok' if r['ok'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument("--tokens", default="1,8,32,128,512,4096")
    ap.add_argument("--models", default="deepseek,mixtral")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=0, help="EPBuffer max_tokens_per_rank (default: tokens)")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.models = args.models.split(",")
    if torch.cuda.device_count() < args.world:
        sys.exit(f"bench_ep: needs {args.world} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never multicast (DESIGN.md, Safety)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = q.get(timeout=3600)
    for p in procs:
        p.join()
    text = render(rows, args)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
