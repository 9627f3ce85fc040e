"""Experiment: where the two ranks of a CPU all_reduce run after a sleep, and what it costs.

    python bench/probes/cpu_colocation.py [cells] [--pin] [--after gloo|sleep|none]

Two processes; per cell: 25 gloo all_reduces of 4 KiB (or a 5 ms sleep, or nothing), 5 commlib
warm-up calls, then 100 timed 4 KiB commlib all_reduces (back to back, as commlib-perf times
them). Prints each cell whose median is above 20 µs with the CPUs each rank ran those calls on,
and a summary. --pin binds rank r to CPU r first (commlib-perf's default --cpu-bind core)."""
import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta

LIBC = ctypes.CDLL(None)


def worker(rank, port, args, q):
    import torch
    import torch.distributed as dist

    import commlib
    torch.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=(rank == 0), timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=2)
    comm = commlib.Communicator(store, rank, 2, "colocation")
    t, g = torch.rand(1024) + rank, torch.rand(1024)
    cells = []
    for _ in range(args.cells):
        if args.after == "gloo":
            for _ in range(25):
                dist.all_reduce(g)
        elif args.after == "sleep":
            time.sleep(0.005)
        for _ in range(5):
            comm.all_reduce_(t)
        times, cpus = [], []
        for _ in range(100):
            t0 = time.perf_counter()
            comm.all_reduce_(t)
            times.append(time.perf_counter() - t0)
            cpus.append(LIBC.sched_getcpu())
        cells.append((statistics.median(times) * 1e6, {c: cpus.count(c) for c in sorted(set(cpus))}))
    q.put((rank, cells))
    comm.close()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cells", type=int, nargs="?", default=60)
    p.add_argument("--pin", action="store_true")
    p.add_argument("--after", choices=("gloo", "sleep", "none"), default="gloo")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 29881, args, q)) for r in range(2)]
    for proc in procs:
        proc.start()
    res = dict(q.get() for _ in procs)
    for proc in procs:
        proc.join()
    slow = same = 0
    for i, ((m0, c0), (m1, c1)) in enumerate(zip(res[0], res[1])):
        shared = bool(set(c0) & set(c1))
        same += shared
        if max(m0, m1) > 20:
            slow += 1
            print(f"cell {i}: median {m0:.0f} / {m1:.0f} us; rank 0 on CPUs {c0}, rank 1 on {c1}")
    meds = [max(a[0], b[0]) for a, b in zip(res[0], res[1])]
    print(f"after={args.after} pin={args.pin}: {args.cells} cells, median of cell medians "
          f"{statistics.median(meds):.1f} us, {slow} above 20 us, {same} with both ranks on one CPU at some point")


if __name__ == "__main__":
    main()
