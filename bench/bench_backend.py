"""Overhead of the "ddacomm" torch.distributed backend, side by side with NCCL (GPU, one node).

    torchrun --nproc_per_node 2 bench/bench_backend.py --out bench/results/backend_h200x2.md

Rows (bf16, default 64 KiB; all in one run, on the same buffers, never zeros):
  * eager dist.all_reduce on the "ddacomm" world vs on an "nccl" group of the same ranks
    (wall time per call including the host: what a decode step pays);
  * CUDA-graph replay of dist.all_reduce on "ddacomm" vs on "nccl", and vs the direct API
    (commlib.Communicator.all_reduce) where commlib's GPU all-reduce is built in.
Per-op time: median over repeats of (time of many back-to-back ops / ops). Correctness of every
path is checked against NCCL in the same run. Rank 0 prints (and writes --out) a markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist

from common import capture_graph, eager_us


def graph_us(fn, ops_per_graph: int, replays: int, repeats: int) -> float:
    graph = capture_graph(fn, ops_per_graph)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (replays * ops_per_graph))
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=64 << 10, help="message size in bytes (bf16)")
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args()

    import commlib  # registers "ddacomm"

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("ddacomm", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    nccl = dist.new_group(backend="nccl")
    count = args.bytes // 2
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    src = torch.rand(count, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5

    # correctness, same run
    a, b = src.clone(), src.clone()
    dist.all_reduce(a)
    dist.all_reduce(b, group=nccl)
    torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)

    buf_dda, buf_nccl = src.clone(), src.clone()
    rows = []
    t_dda = eager_us(lambda: dist.all_reduce(buf_dda), args.iters, args.repeats)
    t_nccl = eager_us(lambda: dist.all_reduce(buf_nccl, group=nccl), args.iters, args.repeats)
    rows.append(("eager dist.all_reduce", t_dda, t_nccl, "ddacomm / nccl", t_dda / t_nccl))

    buf_dda.copy_(src)
    buf_nccl.copy_(src)
    g_dda = graph_us(lambda: dist.all_reduce(buf_dda), 20, 50, args.repeats)
    g_nccl = graph_us(lambda: dist.all_reduce(buf_nccl, group=nccl), 20, 50, args.repeats)
    rows.append(("graph dist.all_reduce", g_dda, g_nccl, "ddacomm / nccl", g_dda / g_nccl))

    direct = None
    try:
        comm = commlib.Communicator.from_group(dist.group.WORLD, name="bench-direct")
        probe = src.clone()
        comm.all_reduce_(probe)
        ref = src.clone()
        dist.all_reduce(ref, group=nccl)
        torch.testing.assert_close(probe.float(), ref.float(), rtol=3e-2, atol=3e-2)
        buf_direct = src.clone()
        direct = graph_us(lambda: comm.all_reduce_(buf_direct), 20, 50, args.repeats)
        rows.append(("graph: dist.all_reduce vs direct API", g_dda, direct, "ddacomm / direct", g_dda / direct))
        # Where the eager time goes: the direct API, the backend object without torch.distributed's
        # Python layer, and the cost of launching one trivial kernel from Python on this machine.
        e_direct = eager_us(lambda: comm.all_reduce_(buf_direct), args.iters, args.repeats)
        rows.append(("eager: dist.all_reduce vs direct API", t_dda, e_direct, "ddacomm / direct", t_dda / e_direct))
        backend = dist.group.WORLD._get_backend(torch.device("cuda"))
        e_backend = eager_us(lambda: backend.allreduce([buf_dda]).wait(), args.iters, args.repeats)
        rows.append(("eager: backend.allreduce([t]) (no dist Python layer)", e_backend, t_nccl, "ddacomm / nccl",
                     e_backend / t_nccl))
        e_launch = eager_us(lambda: buf_direct.add_(0), args.iters, args.repeats)
        rows.append(("eager: one tensor.add_ (launch floor)", e_launch, t_nccl, "launch / nccl", e_launch / t_nccl))
    except Exception as e:  # noqa: BLE001 - the direct GPU path is optional (gpu-allreduce branch)
        if rank == 0:
            print(f"direct API not measured: {type(e).__name__}: {e}", file=sys.stderr)

    if rank == 0:
        lines = [
            f"# ddacomm backend overhead, {args.bytes} B bf16, {world} ranks",
            "",
            f"- command: `torchrun --nproc_per_node {world} bench/bench_backend.py "
            f"--bytes {args.bytes}{' --out ' + args.out if args.out else ''}`",
            f"- machine: {socket.gethostname()}, {torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            "- targets (issue #4): eager ddacomm <= 0.5x nccl; graph-replayed dist.all_reduce within 10% of the direct API",
            "",
            "| what | ddacomm (us) | reference (us) | ratio | value |",
            "| --- | ---: | ---: | --- | ---: |",
        ]
        for what, ours, ref, ratio_name, ratio in rows:
            lines.append(f"| {what} | {ours:.1f} | {ref:.1f} | {ratio_name} | {ratio:.2f} |")
        if direct is None:
            lines.append("| graph: dist.all_reduce vs direct API | | | not measured (no GPU all-reduce in this build) | |")
        table = "\n".join(lines) + "\n"
        print(table)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                f.write(table)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
