#!/usr/bin/env python3
"""GPU all-reduce benchmark: commlib flat / tree / auto vs NCCL vs torch symmetric memory.

Spawns its own processes (no torchrun):   python bench/gpu_all_reduce.py [--out FILE]
Tree geometry sweep (one run, one communicator per geometry; docs/gpu-allreduce.md, Knobs):
    python bench/gpu_all_reduce.py --tree-sweep [SPECS] [--out FILE]
  SPECS: comma-separated THREADS:MIN_PACKS:MAX_BLOCKS (COMMLIB_TREE_THREADS,
  COMMLIB_TREE_MIN_PACKS, COMMLIB_TREE_MAX_BLOCKS; 0 = built-in); without SPECS, DEFAULT_SWEEP. Times tree and tree-sym at 256 KiB, 1, 4 and
  16 MiB per geometry, next to NCCL and torch's two-shot, each result checked bitwise against flat.

Per size (bf16, 1 KiB .. 256 MiB): every implementation runs on the same random inputs; results
are first checked against NCCL (bf16 tolerance; commlib flat/tree/auto must also agree bitwise
with each other), then timed as CUDA-graph replays of `ops` back-to-back all-reduces; the per-op
time is the median over replays of (replay time / ops). Buffers are restored from pristine copies
between replays (not timed), so values stay finite. Prints a markdown table with ratios vs NCCL.
Columns:
  nccl            dist.all_reduce (NCCL, NVLS off as set by the machine's environment)
  flat / tree     commlib, forced algorithm, copy-in from an ordinary tensor
  flat-ll         commlib flat on a second communicator made with COMMLIB_FLAT_LL_MAX_BYTES huge: LL at every size
  tree-sym        commlib tree on a comm.symmetric_empty tensor (zero-copy up to 16 MiB, copy-in above)
  auto            commlib's choice (shown in the algo column); "nccl" choices run tree here
  symm-1shot      torch.ops.symm_mem.one_shot_all_reduce (out of place), when available
  symm-2shot      torch.ops.symm_mem.two_shot_all_reduce_ (in place), when available
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common import init_rank, knobs, publish, run_ranks, time_graph

SIZES = [1 << k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB
COLUMNS = ["nccl", "flat", "flat-ll", "tree", "tree-sym", "auto", "symm-1shot", "symm-2shot"]
LL_MAX_BENCH_BYTES = 1 << 20  # the LL variant is only measured up to here
SWEEP_SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20]
# THREADS:MIN_PACKS:MAX_BLOCKS; 0 = built-in (256 threads, 256 packs, 132 blocks).
# Both directions: more, smaller CTAs (1 pack per thread per phase at 1 MiB), and fewer CTAs with
# more packs per thread, as torch's two-shot does (at most 24 CTAs).
DEFAULT_SWEEP = ("0:0:0,512:512:128,256:256:128,256:128:132,256:256:256,128:128:132,"
                 "128:128:256,512:256:132,512:0:64,512:0:32,512:0:24")
TREE_KNOBS = ("COMMLIB_TREE_THREADS", "COMMLIB_TREE_MIN_PACKS", "COMMLIB_TREE_MAX_BLOCKS")


def ops_for(nbytes: int) -> int:
    return 50 if nbytes <= (1 << 20) else 20 if nbytes <= (16 << 20) else 4


def fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def worker(rank: int, world: int, port: int, args, queue):
    dev, comm, symm = init_rank(rank, world, port, "bench")
    import commlib
    group_name = dist.group.WORLD.group_name
    # flat-ll: a communicator whose flat calls all take the LL kernel (the knob is read at its first call).
    with knobs({"COMMLIB_FLAT_LL_MAX_BYTES": str(1 << 40)}):
        comm_ll = commlib.Communicator.from_group(name="bench-ll")
        comm_ll.all_reduce_(torch.ones(8, device=dev), algo="flat")

    rows = []
    sizes = [s for s in SIZES if s <= args.max_bytes]
    for nbytes in sizes:
        count = nbytes // 2
        g = torch.Generator(device=dev).manual_seed(1234 + rank)
        pristine = (torch.rand(count, generator=g, device=dev) * 2 - 1).to(torch.bfloat16)
        ref = pristine.clone()
        dist.all_reduce(ref)
        row = {"bytes": nbytes, "algo": commlib._C.select_all_reduce_algorithm(nbytes, world, torch.bfloat16)}
        bufs, fns, notes = {}, {}, []

        def plain():
            return torch.empty(count, dtype=torch.bfloat16, device=dev)

        bufs["nccl"] = plain()
        fns["nccl"] = lambda b=bufs["nccl"]: dist.all_reduce(b)
        for algo in ("flat", "tree", "auto"):
            bufs[algo] = plain()
            fns[algo] = lambda b=bufs[algo], a=algo: comm.all_reduce_(b, algo=a)
        if nbytes <= LL_MAX_BENCH_BYTES:
            bufs["flat-ll"] = plain()
            fns["flat-ll"] = lambda b=bufs["flat-ll"]: comm_ll.all_reduce_(b, algo="flat")
        bufs["tree-sym"] = comm.symmetric_empty((count,), torch.bfloat16, dev)
        fns["tree-sym"] = lambda b=bufs["tree-sym"]: comm.all_reduce_(b, algo="tree")
        if symm is not None:
            try:
                t1 = symm.empty(count, dtype=torch.bfloat16, device=dev)
                symm.rendezvous(t1, group_name)
                t2 = symm.empty(count, dtype=torch.bfloat16, device=dev)
                symm.rendezvous(t2, group_name)
                bufs["symm-1shot"], bufs["symm-2shot"] = t1, t2
                fns["symm-1shot"] = lambda b=t1: torch.ops.symm_mem.one_shot_all_reduce(b, "sum", group_name)
                fns["symm-2shot"] = lambda b=t2: torch.ops.symm_mem.two_shot_all_reduce_(b, "sum", group_name)
            except Exception as e:  # noqa: BLE001
                notes.append(f"torch symm_mem unavailable: {type(e).__name__}: {e}"[:200])

        # Correctness first, on the same inputs.
        results = {}
        for name, fn in fns.items():
            bufs[name].copy_(pristine)
            out = fn()
            results[name] = out if name == "symm-1shot" else bufs[name]
        torch.cuda.synchronize()
        for name, got in results.items():
            ok = torch.allclose(got.float(), ref.float(), rtol=3e-2, atol=3e-2)
            if not ok:
                notes.append(f"{name}: WRONG RESULT vs NCCL")
        for name in ("tree", "auto", "tree-sym", "flat-ll"):
            if name in results and not torch.equal(results[name], results["flat"]):
                notes.append(f"{name} != flat bitwise")

        for name, fn in fns.items():
            buf = bufs[name]
            row[name] = time_graph(fn, lambda b=buf: b.copy_(pristine), ops_for(nbytes), args.replays)
        row["notes"] = "; ".join(notes)
        rows.append(row)
        if rank == 0:
            print(f"{fmt_bytes(nbytes):>8}: " + ", ".join(f"{k} {row[k]:.1f}" for k in COLUMNS if k in row)
                  + (f"  [{row['notes']}]" if notes else ""), flush=True)
        del bufs, fns, results
        torch.cuda.empty_cache()
    if rank == 0:
        queue.put(rows)
    comm_ll.close()
    comm.close()
    dist.destroy_process_group()


def parse_sweep(specs: str) -> list[tuple[int, int, int, int]]:
    """'T:P:B[:R],...' -> [(threads, min_packs, max_blocks, relaxed_start)]; 0 = built-in."""
    out = []
    for spec in specs.split(","):
        parts = [int(x) for x in spec.strip().split(":")]
        if len(parts) != 3:
            raise SystemExit(f"--tree-sweep: '{spec}' is not THREADS:MIN_PACKS:MAX_BLOCKS")
        out.append(tuple(parts))
    return out


def tree_grid(nbytes: int, world: int, geo: tuple[int, int, int, int]) -> str:
    """blocks x threads the launcher picks for one bf16 chunk (Note [tree geometry])."""
    threads, min_packs, max_blocks, _ = geo
    threads, min_packs, max_blocks = threads or 256, min_packs or 256, max_blocks or 132
    slice_packs = -(-(nbytes // 16) // world)
    blocks = min(max(-(-slice_packs // min_packs), 1), max_blocks)
    per_block = -(-(-(-slice_packs // blocks)) // 32) * 32
    return f"{blocks}x{min(max(-(-per_block // 32) * 32, 32), threads)}"


def sweep_worker(rank: int, world: int, port: int, args, queue):
    """Times tree / tree-sym for every geometry of args.tree_sweep; one communicator per geometry
    (the COMMLIB_TREE_* knobs are read once, when a communicator first uses the GPU)."""
    dev, base, symm = init_rank(rank, world, port, "bench")
    import commlib
    group_name = dist.group.WORLD.group_name
    sizes = [s for s in SWEEP_SIZES if s <= args.max_bytes]
    geos = parse_sweep(args.tree_sweep)
    inputs, flat_ref, rows = {}, {}, []

    baseline = {"geometry": "baseline", "notes": ""}
    for nbytes in sizes:
        count = nbytes // 2
        g = torch.Generator(device=dev).manual_seed(4321 + rank)
        pristine = (torch.rand(count, generator=g, device=dev) * 2 - 1).to(torch.bfloat16)
        inputs[nbytes] = pristine
        ref = pristine.clone()
        base.all_reduce_(ref, algo="flat")
        flat_ref[nbytes] = ref
        buf = pristine.clone()
        baseline[f"nccl {nbytes}"] = time_graph(lambda b=buf: dist.all_reduce(b), lambda b=buf: b.copy_(pristine),
                                                ops_for(nbytes), args.replays)
        if symm is not None:
            try:
                t2 = symm.empty(count, dtype=torch.bfloat16, device=dev)
                symm.rendezvous(t2, group_name)
                baseline[f"symm-2shot {nbytes}"] = time_graph(
                    lambda b=t2: torch.ops.symm_mem.two_shot_all_reduce_(b, "sum", group_name),
                    lambda b=t2: b.copy_(pristine), ops_for(nbytes), args.replays)
            except Exception as e:  # noqa: BLE001
                baseline["notes"] = f"torch symm_mem unavailable: {type(e).__name__}: {e}"[:200]
    rows.append(baseline)

    for i, geo in enumerate(geos):
        with knobs({k: str(v) for k, v in zip(TREE_KNOBS, geo)}):
            comm = commlib.Communicator.from_group(name=f"tree-sweep-{i}")
            row = {"geometry": ":".join(map(str, geo)), "notes": ""}
            notes = []
            for nbytes in sizes:
                count, pristine = nbytes // 2, inputs[nbytes]
                bufs = {"tree": torch.empty(count, dtype=torch.bfloat16, device=dev),
                        "tree-sym": comm.symmetric_empty((count,), torch.bfloat16, dev)}
                for name, buf in bufs.items():
                    fn = lambda b=buf: comm.all_reduce_(b, algo="tree")  # noqa: E731
                    buf.copy_(pristine)
                    fn()
                    torch.cuda.synchronize()
                    if not torch.equal(buf, flat_ref[nbytes]):
                        notes.append(f"{name} {fmt_bytes(nbytes)} != flat bitwise")
                    row[f"{name} {nbytes}"] = time_graph(fn, lambda b=buf: b.copy_(pristine), ops_for(nbytes),
                                                         args.replays)
                row[f"grid {nbytes}"] = tree_grid(nbytes, world, geo)
                del bufs
            row["notes"] = "; ".join(notes)
            comm.close()
        rows.append(row)
        if rank == 0:
            print(f"{row['geometry']:>16}: " + ", ".join(
                f"{fmt_bytes(n)} tree {row[f'tree {n}']:.1f} sym {row[f'tree-sym {n}']:.1f}" for n in sizes)
                + (f"  [{row['notes']}]" if row["notes"] else ""), flush=True)
        torch.cuda.empty_cache()
    if rank == 0:
        queue.put((sizes, rows))
    base.close()
    dist.destroy_process_group()


def render_sweep(sizes, rows, world: int, command: str) -> str:
    base = rows[0]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "?"
    head = " | ".join(f"{fmt_bytes(n)} tree | {fmt_bytes(n)} tree-sym | grid" for n in sizes)
    lines = [
        f"# Tree all-reduce geometry sweep, bf16, {world} ranks, CUDA-graph replay (µs per op, median)",
        "",
        f"- command: `{command}`",
        f"- machine: {socket.gethostname()}, {world}x {gpu}, torch {torch.__version__}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "- geometry: COMMLIB_TREE_THREADS:MIN_PACKS:MAX_BLOCKS (0 = built-in); grid: "
        "blocks x threads of the copy-in kernel; (x.xx) = torch two-shot time / this time",
        "",
        "| " + " | ".join(f"{fmt_bytes(n)}" for n in sizes) + " | (baseline) |",
        "| " + " | ".join("---" for _ in sizes) + " | --- |",
        "| " + " | ".join(f"{base.get(f'nccl {n}', float('nan')):.1f}" for n in sizes) + " | NCCL |",
        "| " + " | ".join(f"{base.get(f'symm-2shot {n}', float('nan')):.1f}" for n in sizes) + " | torch two-shot |",
        "",
        f"| geometry | {head} | notes |",
        "| --- | " + " | ".join("--- | --- | ---" for _ in sizes) + " | --- |",
    ]

    def cell(row, key, n):
        t = row[f"{key} {n}"]
        two = base.get(f"symm-2shot {n}")
        return f"{t:.1f} ({two / t:.2f})" if two else f"{t:.1f}"

    for r in rows[1:]:
        lines.append(f"| {r['geometry']} | " + " | ".join(
            f"{cell(r, 'tree', n)} | {cell(r, 'tree-sym', n)} | {r[f'grid {n}']}" for n in sizes)
            + f" | {r['notes']} |")
    if base["notes"]:
        lines.append(f"\n{base['notes']}")
    return "\n".join(lines) + "\n"


def render(rows, world: int, command: str) -> str:
    def cell(row, key):
        return f"{row[key]:.1f}" if key in row else "n/a"

    def ratio(row, key):
        return f"{row['nccl'] / row[key]:.2f}x" if key in row else "n/a"

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "?"
    lines = [
        f"# GPU all-reduce, bf16, {world} ranks, CUDA-graph replay (µs per op, median)",
        "",
        f"- command: `{command}`",
        f"- machine: {socket.gethostname()}, {world}x {gpu}, torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, Python {platform.python_version()}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "- ratios are NCCL time / commlib time (> 1: commlib faster)",
        "",
        "| bytes | NCCL | flat | flat-ll | tree | tree-sym | auto (algo) | symm 1-shot | symm 2-shot "
        "| flat vs NCCL | flat-ll vs NCCL | tree vs NCCL | auto vs NCCL | tree vs symm 2-shot | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        vs2 = f"{r['symm-2shot'] / r['tree']:.2f}x" if "symm-2shot" in r else "n/a"
        lines.append(
            f"| {fmt_bytes(r['bytes'])} | {cell(r, 'nccl')} | {cell(r, 'flat')} | {cell(r, 'flat-ll')} | "
            f"{cell(r, 'tree')} | {cell(r, 'tree-sym')} | {cell(r, 'auto')} ({r['algo']}) | {cell(r, 'symm-1shot')} | "
            f"{cell(r, 'symm-2shot')} | {ratio(r, 'flat')} | {ratio(r, 'flat-ll')} | {ratio(r, 'tree')} | "
            f"{ratio(r, 'auto')} | {vs2} | "
            f"{r['notes']} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--max-bytes", type=int, default=256 << 20)
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    parser.add_argument("--tree-sweep", nargs="?", const=DEFAULT_SWEEP, default=None, metavar="SPECS",
                        help="time tree / tree-sym per launch geometry instead of the full table "
                             "(THREADS:MIN_PACKS:MAX_BLOCKS,...; default: DEFAULT_SWEEP)")
    args = parser.parse_args()
    command = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    if args.tree_sweep is not None:
        parse_sweep(args.tree_sweep)  # fail before starting the ranks
        sizes, rows = run_ranks(sweep_worker, args.world_size, args)
        publish(render_sweep(sizes, rows, args.world_size, command), args.out)
        return
    rows = run_ranks(worker, args.world_size, args)
    publish(render(rows, args.world_size, command), args.out)


if __name__ == "__main__":
    main()
