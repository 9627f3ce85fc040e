"""Soak and leak checks (not a CI test): long randomized op sequences, create / use / destroy cycles,
CUDA-graph replays, each checked against a reference, with what a process holds counted before and
after (Note [soak]).

    python -m commlib.perf.soak --sequences 20000 --world 2,3,4            # CPU, random delays
    python -m commlib.perf.soak --sequences 2000 --device cuda --world 2,4 # ranks on the GPUs (shared)
    python -m commlib.perf.soak --cycles 10000 --world 2                   # create / use / destroy
    python -m commlib.perf.soak --replays 1000000 --device cuda --world 1  # CUDA-graph replays
    ... --out bench/results/soak.md                                       # rewrites the section it ran

Note [soak]
Every rank draws the same seeded sequence of operations (all_reduce flat / tree / auto and every
reduction, reduce_scatter, all_gather, broadcast, all_to_all_v with random splits, send / recv
around the ring, barrier, the fused all-reduce + RMSNorm), with random sizes (odd ones included)
and a random sleep of 0-200 µs before one op in eight on a random rank, so the ranks reach each op
at different times. Every result is compared with the reference computed on every rank from the
same seeds (bitwise where commlib promises bits: the rank-ordered fp32 reductions). With
``--device cuda`` the tensors live on rank r's GPU r % (GPUs), so more ranks than GPUs share them,
and the draws keep to what the GPU path serves (all_reduce sum and avg); the references stay on
the CPU. The cycle mode
creates a communicator, runs a few ops (shared-memory collectives, send / recv, an EPBuffer; on
CUDA the GPU state) and closes it, and counts /dev/shm/commlib-* segments, open file descriptors,
resident memory (also at half the cycles: growth that levels off is a cache filling, growth that
does not is a leak) and, on CUDA, torch's allocated bytes and the device's used memory as the
driver counts it (commlib's own allocations included), every rank at the same point, before and
after. The replay mode captures
all_reduce (each variant), the fused op and EP dispatch + combine into CUDA graphs and replays
them, checking the outputs every ``--check-every`` replays. A failure ends the run with a message
naming the step, the op and the seed.
"""
from __future__ import annotations

import argparse
import gc
import glob
import os
import random
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .harness import spawn
from .report import machine_description, now_utc, software_description, source_commit, write_section

REDUCTIONS = ("sum", "avg", "min", "max", "prod")
CUDA_REDUCTIONS = ("sum", "avg")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all_v", "send_recv", "barrier",
       "fused")


def _input(rank: int, step: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * step + count)
    return (torch.rand(count, generator=g) * 2 + 0.5).to(dtype)


def _reduce(xs, op: str) -> torch.Tensor:
    acc = xs[0].float()
    for x in xs[1:]:
        x = x.float()
        acc = {"sum": acc + x, "avg": acc + x, "prod": acc * x, "min": torch.minimum(acc, x),
               "max": torch.maximum(acc, x)}[op]
    if op == "avg":
        acc = acc / len(xs)
    return acc.to(xs[0].dtype)


def _one_step(comm, rank: int, n: int, step: int, rng: random.Random, device: torch.device) -> str:
    """Runs one randomly drawn op (the same draw on every rank) with its tensors on ``device`` and
    checks it against the CPU reference; returns its name."""
    op = rng.choice(OPS)
    dtype = rng.choice((torch.float32, torch.bfloat16, torch.float16))
    count = rng.choice((0, 1, 7, 1023, 4097, 65_537, 300_007))
    delay_rank = rng.randrange(n) if rng.random() < 0.125 else -1
    delay_s = rng.random() * 200e-6  # drawn on every rank: the draws stay the same everywhere
    if delay_rank == rank:
        time.sleep(delay_s)

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        return torch.equal(got.cpu(), want)

    def nans(*shape) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    if op == "all_reduce":
        red = rng.choice(REDUCTIONS if device.type == "cpu" else CUDA_REDUCTIONS)
        algo = rng.choice(("auto", "flat", "tree"))
        xs = [_input(r, step, count, dtype) for r in range(n)]
        out = comm.all_reduce(xs[rank].to(device), red, algo)
        ok = same(out, _reduce(xs, red))
    elif op == "reduce_scatter":
        xs = [_input(r, step, count * n, dtype) for r in range(n)]
        out = nans(count)
        comm.reduce_scatter(out, xs[rank].to(device))
        ok = same(out, _reduce(xs, "sum")[rank * count:(rank + 1) * count])
    elif op == "all_gather":
        xs = [_input(r, step, count, dtype) for r in range(n)]
        out = nans(count * n)
        comm.all_gather(out, xs[rank].to(device))
        ok = same(out, torch.cat(xs))
    elif op == "broadcast":
        root = rng.randrange(n)
        t = _input(rank, step, count, dtype).to(device)
        comm.broadcast(t, root)
        ok = same(t, _input(root, step, count, dtype))
    elif op == "all_to_all_v":
        rows = [[rng.randrange(5) for _ in range(n)] for _ in range(n)]  # rows[s][d]: s sends d
        ins = rows[rank]
        outs = [rows[s][rank] for s in range(n)]
        x = torch.cat([torch.full((ins[d], 3), float(rank * 100 + d), dtype=dtype) for d in range(n)])
        out = nans(sum(outs), 3)
        comm.all_to_all_v(out, x.to(device), outs, ins)
        ok = same(out, torch.cat([torch.full((outs[s], 3), float(s * 100 + rank), dtype=dtype) for s in range(n)]))
    elif op == "send_recv":
        if n == 1:
            return op
        t = _input(rank, step, count, dtype).to(device)
        got = nans(count)
        work = comm.batch_isend_irecv([("send", t, (rank + 1) % n, step % 7), ("recv", got, (rank - 1) % n, step % 7)])
        work.wait()
        ok = same(got, _input((rank - 1) % n, step, count, dtype))
    elif op == "barrier":
        comm.barrier()
        ok = True
    else:  # fused all-reduce + residual + RMSNorm, replicated residual
        tokens, hidden = rng.choice(((1, 64), (3, 96), (17, 128)))
        if device.type == "cuda" and dtype == torch.float32:
            dtype = torch.bfloat16  # the CUDA fused kernels take bf16 / fp16 (no new draw: ranks stay in step)
        xs = [_input(r, step, tokens * hidden, dtype).view(tokens, hidden) for r in range(n)]
        residual = _input(n + 1, step, tokens * hidden, dtype).view(tokens, hidden)
        weight = _input(n + 2, step, hidden, dtype)
        ref_res = (residual.float() + _reduce(xs, "sum").float()).to(dtype)
        var = ref_res.float().pow(2).mean(-1, keepdim=True)
        ref = (ref_res.float() * torch.rsqrt(var + 1e-6)).to(dtype) * weight
        res = residual.to(device, copy=True)
        out, res = comm.fused_allreduce_rmsnorm(xs[rank].to(device), res, weight.to(device), 1e-6)
        out, res = out.cpu(), res.cpu()
        # The reference rounds the sum before adding the residual; the fused op does not: within rounding.
        ok = torch.allclose(res.float(), ref_res.float(), rtol=2e-2, atol=2e-2) and \
            torch.allclose(out.float(), ref.float(), rtol=4e-2, atol=4e-2)
    if not ok:
        raise AssertionError(f"soak: step {step}: {op} ({dtype}, {count} elements) differs from the reference "
                             f"on rank {rank}")
    return op


def _sequences_worker(rank: int, world_size: int, store, steps: int, seed: int, device_type: str = "cpu"):
    import commlib
    device = torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    comm = commlib.Communicator(dist.PrefixStore("soak", store), rank, world_size, "soak",
                                timeout=timedelta(seconds=120))
    rng = random.Random(seed)
    counts: dict = {}
    start = time.monotonic()
    for step in range(steps):
        op = _one_step(comm, rank, world_size, step, rng, device)
        counts[op] = counts.get(op, 0) + 1
    elapsed = time.monotonic() - start
    comm.close()
    return {"steps": steps, "seconds": elapsed, "ops": counts}


# Device memory the cycles may gain without counting as a leak: the driver's own pools move by a
# page or two of 2 MiB; a leak of one communicator's buffers a cycle is megabytes a cycle.
DEVICE_GROWTH_BYTES = 8 << 20


def _held() -> dict:
    """What this process holds: shared-memory segments of commlib, file descriptors, resident KiB."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"shm": len(glob.glob("/dev/shm/commlib-*")), "fds": len(os.listdir("/proc/self/fd")), "rss_kib": rss}


def _cycles_worker(rank: int, world_size: int, store, cycles: int, device: str):
    import commlib
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())

    def one(i: int):
        comm = commlib.Communicator(dist.PrefixStore(f"cycle/{i}", store), rank, world_size, f"cycle-{i}",
                                    timeout=timedelta(seconds=60))
        x = torch.ones(4097, device=device)
        comm.all_reduce_(x)
        assert float(x[0]) == world_size
        if world_size > 1 and not cuda:
            comm.batch_isend_irecv([("send", x, (rank + 1) % world_size), ("recv", torch.empty_like(x),
                                                                           (rank - 1) % world_size)]).wait()
        buf = commlib.EPBuffer(comm, 4, 16, 2 * world_size, 2, torch.float32, device=device)
        idx = torch.tensor([[0, 1]] * 4, device=device)
        res = buf.dispatch(torch.ones(4, 16, device=device), idx, torch.ones(4, 2, device=device))
        buf.combine(res.expert_x, res.handle)
        del buf, res
        comm.close()

    def count(tag: str):
        """What the process holds, with every rank at the same point: the device's used memory
        (the driver's count: commlib's own allocations too, of every process on the GPU) is read
        after every rank gave torch's cached blocks back and before any rank goes on."""
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        store.set(f"{tag}/{rank}", "1")
        store.wait([f"{tag}/{r}" for r in range(world_size)])
        held = dict(_held(), gpu_allocated=0)
        if cuda:
            free, total = torch.cuda.mem_get_info()
            held.update(gpu_allocated=torch.cuda.memory_allocated(), device_used=total - free)
        store.set(f"{tag}-read/{rank}", "1")
        store.wait([f"{tag}-read/{r}" for r in range(world_size)])
        return held

    for i in range(3):  # first-use allocations (torch's caching allocator, lazy libraries) settle
        one(-1 - i)
    before = count("settled")
    start = time.monotonic()
    half_rss = before["rss_kib"]
    for i in range(cycles):
        one(i)
        if i + 1 == cycles // 2:
            half_rss = _held()["rss_kib"]
    elapsed = time.monotonic() - start
    after = count("finished")
    return {"cycles": cycles, "seconds": elapsed, "before": before, "after": after, "half_rss_kib": half_rss}


def _replays_worker(rank: int, world_size: int, store, replays: int, check_every: int):
    import commlib
    torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = commlib.Communicator(dist.PrefixStore("replay", store), rank, world_size, "replay",
                                timeout=timedelta(seconds=120))
    device = torch.device("cuda", torch.cuda.current_device())
    rows = [_replay_all_reduce(comm, rank, world_size, device, algo, count, replays, check_every)
            for algo, count in (("flat", 4096), ("tree", 1 << 20))]
    rows.append(_replay_fused(comm, rank, device, replays, check_every))
    rows.append(_replay_ep(comm, rank, device, replays, check_every))
    comm.close()
    return rows


def _replay(name: str, step, check, replays: int, check_every: int, device) -> tuple:
    """Captures step() (after one eager warm-up on the capture stream), replays it `replays` times,
    check() every `check_every` replays; returns (name, replays, seconds)."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()  # first-use set-up outside capture
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    done, start = 0, time.monotonic()
    while done < replays:
        for _ in range(min(check_every, replays - done)):
            graph.replay()
        done += min(check_every, replays - done)
        torch.cuda.synchronize(device)
        check(done)
    return name, done, time.monotonic() - start


def _replay_all_reduce(comm, rank: int, world_size: int, device, algo: str, count: int, replays: int,
                       check_every: int) -> tuple:
    """all_reduce_ of `count` bf16 with `algo`, the input restored in the graph: the reference sum."""
    src = _input(rank, 0, count, torch.bfloat16).to(device)
    ref = _reduce([_input(r, 0, count, torch.bfloat16) for r in range(world_size)], "sum").to(device)
    x = src.clone()

    def step():
        x.copy_(src)
        comm.all_reduce_(x, algo=algo)

    def check(done):
        comm.check_gpu_error()
        if not torch.equal(x, ref):
            raise AssertionError(f"soak: all_reduce {algo} differs from the reference after {done} replays")
        x.fill_(float("nan"))

    return _replay(f"all_reduce {algo} ({count} bf16)", step, check, replays, check_every, device)


def _replay_fused(comm, rank: int, device, replays: int, check_every: int) -> tuple:
    """The fused all-reduce + RMSNorm of 8 tokens of hidden 8192 (bf16): every replay restores the
    inputs and must give the eager call's bits (the residual updated in place included)."""
    tokens, hidden = 8, 8192
    x0 = _input(rank, 1, tokens * hidden, torch.bfloat16).view(tokens, hidden).to(device)
    res0 = _input(0, 2, tokens * hidden, torch.bfloat16).view(tokens, hidden).to(device)
    weight = (_input(0, 3, hidden, torch.bfloat16).abs() + 0.5).to(device)
    x, res, out = x0.clone(), res0.clone(), torch.empty_like(x0)
    comm.fused_allreduce_rmsnorm(x, res, weight, 1e-6, out=out)
    ref_out, ref_res = out.clone(), res.clone()

    def step():
        res.copy_(res0)
        comm.fused_allreduce_rmsnorm(x, res, weight, 1e-6, out=out)

    def check(done):
        comm.check_gpu_error()
        if not (torch.equal(out, ref_out) and torch.equal(res, ref_res)):
            raise AssertionError(f"soak: fused_allreduce_rmsnorm differs from the eager call after {done} replays")
        out.fill_(float("nan"))

    return _replay(f"fused_allreduce_rmsnorm ({tokens} x {hidden} bf16)", step, check, replays, check_every, device)


def _replay_ep(comm, rank: int, device, replays: int, check_every: int) -> tuple:
    """EP dispatch, an expert that doubles its rows, and combine, 32 tokens of hidden 2048 to 4 of 16
    experts (bf16): every replay must give the eager step's combined bits."""
    import commlib
    tokens, hidden, experts, topk = 32, 2048, 16, 4
    g = torch.Generator().manual_seed(1000 + rank)
    x = _input(rank, 4, tokens * hidden, torch.bfloat16).view(tokens, hidden).to(device)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(device)
    w = (torch.rand(tokens, topk, generator=g) + 0.1).to(device)
    buf = commlib.EPBuffer(comm, tokens, hidden, experts, topk, torch.bfloat16, device=device)
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)

    def step():
        r = buf.dispatch(x, idx, w)
        buf.combine(r.expert_x * 2, r.handle, out=out)

    step()
    comm.barrier()
    ref = out.clone()

    def check(done):
        buf.check()
        if not torch.equal(out, ref):
            raise AssertionError(f"soak: EP dispatch + combine differs from the eager step after {done} replays")
        out.fill_(float("nan"))

    return _replay(f"ep dispatch + combine ({tokens} x {hidden} bf16, top {topk} of {experts})", step, check,
                   replays, check_every, device)


def _section(title: str, command: str, lines: list) -> str:
    return "\n".join([f"## {title}", "", f"- machine: {machine_description('cuda' if 'cuda' in command else 'cpu')}",
                      f"- software: {software_description('cuda' if 'cuda' in command else 'cpu')}",
                      f"- commit: {source_commit()}", f"- date: {now_utc()}", f"- command: `{command}`", "",
                      *lines, ""])


def _write_section(path: str, title: str, body: str) -> None:
    """Replaces the section `title` of the results file (or appends it), keeping the others."""
    write_section(path, title, body, "# Soak and leak checks\n\nSections are rewritten by "
                  "`python -m commlib.perf.soak ... --out bench/results/soak.md` (Note [soak]).\n\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m commlib.perf.soak", description=__doc__.split("\n")[0])
    p.add_argument("--sequences", type=int, default=0, help="random op steps per world size (CPU)")
    p.add_argument("--cycles", type=int, default=0, help="communicator create / use / destroy cycles")
    p.add_argument("--replays", type=int, default=0, help="CUDA-graph replays per captured op (--device cuda)")
    p.add_argument("--check-every", type=int, default=10_000)
    p.add_argument("--world", default="2", help="comma-separated world sizes")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="results file whose section this run rewrites")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.world.split(",")]
    command = "python -m commlib.perf.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.sequences:
        lines = ["| world | steps | seconds | ops (count) | result |", "| ---: | ---: | ---: | --- | --- |"]
        for n in worlds:
            r = spawn(_sequences_worker, n, args.sequences, args.seed, args.device)
            ops = ", ".join(f"{k} {v}" for k, v in sorted(r["ops"].items()))
            lines.append(f"| {n} | {r['steps']} | {r['seconds']:.1f} | {ops} | every result checked: bitwise, the fused op within rounding |")
            print(lines[-1], flush=True)
            if args.out:  # after each world size: a run stopped by a time limit keeps what it measured
                _write_section(args.out, f"Random op sequences ({args.device})", _section(
                    f"Random op sequences ({args.device})", command, lines))
    if args.cycles:
        lines = ["| world | cycles | seconds | /dev/shm segments | fds | RSS KiB (start → half → end) | "
                 "torch GPU bytes | device used MiB |", "| ---: | ---: | ---: | --- | --- | --- | --- | --- |"]
        leaked = False
        for n in worlds:
            r = spawn(_cycles_worker, n, args.cycles, args.device)
            b, a = r["before"], r["after"]
            used = (f"{b['device_used'] / 2**20:.0f} → {a['device_used'] / 2**20:.0f}" if "device_used" in b
                    else "-")
            leaked |= (a["shm"] != b["shm"] or a["fds"] != b["fds"] or a["gpu_allocated"] != b["gpu_allocated"]
                       or a.get("device_used", 0) - b.get("device_used", 0) > DEVICE_GROWTH_BYTES)
            lines.append(f"| {n} | {r['cycles']} | {r['seconds']:.1f} | {b['shm']} → {a['shm']} | {b['fds']} → "
                         f"{a['fds']} | {b['rss_kib']} → {r['half_rss_kib']} → {a['rss_kib']} | "
                         f"{b['gpu_allocated']} → {a['gpu_allocated']} | {used} |")
            print(lines[-1], flush=True)
            if args.out:
                _write_section(args.out, f"Create / use / destroy cycles ({args.device})", _section(
                    f"Create / use / destroy cycles ({args.device})", command, lines))
        if leaked:
            print("soak: something grew over the cycles (table above)", file=sys.stderr)
            return 1
    if args.replays:
        if args.device != "cuda":
            p.error("--replays needs --device cuda")
        lines = ["| world | captured op | replays | seconds |", "| ---: | --- | ---: | ---: |"]
        for n in worlds:
            for name, done, secs in spawn(_replays_worker, n, args.replays, args.check_every):
                lines.append(f"| {n} | {name} | {done} | {secs:.1f} |")
                print(lines[-1], flush=True)
            if args.out:
                _write_section(args.out, "CUDA-graph replays", _section("CUDA-graph replays", command, lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
