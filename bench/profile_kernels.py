"""Per-kernel GPU times of commlib ops (torch.profiler, CUPTI), to see where an op's time goes.

    python bench/profile_kernels.py [--out FILE.md] [--iters 20]
                                    [--ep-tokens 1,128,4096] [--fused-tokens 1,1024,4096]
                                    [--fused-sms 0,16] [--allreduce-bytes 1M,4M]

Spawns 2 processes (one per GPU; commlib.perf.harness.spawn). For each case it runs the op eagerly `iters` times under the
profiler on rank 0 and lists every GPU kernel and memcpy/memset launched: calls per op and mean
device time, plus the op's wall time per call (host launch included), so launch gaps, extra torch
kernels and the slowest kernel phase are visible. Cases: EP dispatch + combine (DeepSeek-V3-like:
hidden 7168, 256 experts, top-8), fused all-reduce + RMSNorm (hidden 8192, both residual modes,
num_sms 0 = default), tree all-reduce (bf16).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from commlib.perf.harness import cuda_eager_us, spawn


def parse_bytes(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def kernel_table(prof, iters: int) -> list[tuple[str, int, float]]:
    """(name, calls per op, mean µs) of every device activity, slowest total first."""
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name != "CUDA" or dev_us <= 0:
            continue
        rows.append((e.key[:90], e.count / iters, dev_us / e.count))
    return sorted(rows, key=lambda r: -r[1] * r[2])


def profiled(fn, iters: int, rank: int):
    """µs per call of fn() (CUDA events around `iters` eager calls, launch gaps included) and, on
    rank 0, the kernel table."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    wall = cuda_eager_us(fn, iters, torch.device("cuda", torch.cuda.current_device()))
    dist.barrier()
    if rank != 0:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return wall, []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return wall, kernel_table(prof, iters)


def worker(rank: int, world: int, store, args):
    import commlib
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", store=dist.PrefixStore("nccl", store), rank=rank, world_size=world,
                            device_id=dev)
    comm = commlib.Communicator(store, rank, world, "profile")
    cases = []
    for T in args.ep_tokens:
        H, E, K = 7168, 256, 8
        g = torch.Generator(device="cpu").manual_seed(1234 + rank * 7 + T)
        w, idx = torch.rand(T, E, generator=g).topk(K, dim=1)
        idx, w = idx.to(dev), torch.softmax(w, dim=1).float().to(dev)
        x = torch.randn(T, H, device=dev).bfloat16()
        buf = commlib.EPBuffer(comm, T, H, E, K, torch.bfloat16, device=dev)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)

        def ep_step(buf=buf, x=x, idx=idx, w=w, out=out):
            r = buf.dispatch(x, idx, w)
            buf.combine(r.expert_x, r.handle, out=out)
        cases.append((f"EP dispatch+combine DeepSeek-like, {T} tokens/rank", ep_step))
    hidden = 8192
    weight = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    for T in args.fused_tokens:
        x = torch.randn(T, hidden, device=dev).bfloat16()
        res = torch.randn(T, hidden, device=dev).bfloat16()
        out = torch.empty_like(x)
        for mode in ("replicated", "sharded"):
            for sms in args.fused_sms:
                def fused(x=x, res=res, out=out, mode=mode, sms=sms):
                    comm.fused_allreduce_rmsnorm(x, res, weight, 1e-6, residual_mode=mode, out=out,
                                                 num_sms=sms or None)
                cases.append((f"fused {mode}, {T} tokens, num_sms {sms or 'default'}", fused))
    for nbytes in args.allreduce_bytes:
        t = torch.randn(nbytes // 2, device=dev).bfloat16()
        cases.append((f"all_reduce tree bf16 {nbytes >> 10} KiB", lambda t=t: comm.all_reduce_(t, algo="tree")))
        nccl_t = t.clone()
        cases.append((f"all_reduce NCCL bf16 {nbytes >> 10} KiB", lambda t=nccl_t: dist.all_reduce(t)))
    results = []
    for name, fn in cases:
        wall, table = profiled(fn, args.iters, rank)
        results.append((name, wall, table))
    dist.barrier()
    comm.close()
    dist.destroy_process_group()
    return results


def render(results, args) -> str:
    lines = ["# Per-kernel GPU times (torch.profiler), 2 ranks, rank 0", "",
             f"- command: `python {' '.join(sys.argv)}`",
             f"- machine: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
             f"{platform.node()}",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- {args.iters} eager calls per case; per call: CUDA events around the calls (launch gaps included)", ""]
    for name, wall, table in results:
        lines += [f"## {name}: {wall:.1f} µs/call", "", "| kernel | calls/op | mean µs |", "| --- | ---: | ---: |"]
        lines += [f"| `{k}` | {c:.2f} | {us:.1f} |" for k, c, us in table[:8]]
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=20)
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    ap.add_argument("--ep-tokens", type=ints, default=[1, 128, 4096])
    ap.add_argument("--fused-tokens", type=ints, default=[1, 1024, 4096])
    ap.add_argument("--fused-sms", type=ints, default=[0, 16])
    ap.add_argument("--allreduce-bytes", type=lambda s: [parse_bytes(v) for v in s.split(",") if v],
                    default=[1 << 20, 4 << 20])
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if torch.cuda.device_count() < 2:
        sys.exit(f"profile_kernels: needs 2 GPUs, found {torch.cuda.device_count()}")
    text = render(spawn(worker, 2, args), args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
