"""A/B timing of the CPU all_reduce of two commlib builds, 2 ranks, fp32, in place.

    python bench/cpu_all_reduce_ab.py <python dir of build A> [sizes in bytes ...]

Unlike ``commlib-perf`` (which times back-to-back calls, so a rank that arrives first also times
the wait for its peer), every timed call starts right after ``comm.barrier()``: the number is the
call's own cost, less sensitive to the scheduling of a shared 2-core machine. Median and 10th
percentile per size, slowest rank. ``ALGO`` (auto/flat/tree) and ``ITERS`` in the environment;
each rank is bound to its own CPU, as ``commlib-perf`` does, unless ``CPU_BIND=0``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Dict, List, Tuple


def _worker(rank: int, port: int, pkg: str, sizes: List[int], iters: int, algo: str, q: mp.Queue) -> None:
    sys.path.insert(0, pkg)
    if os.environ.get("CPU_BIND", "1") == "1" and len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})  # as commlib-perf binds
    import torch
    import torch.distributed as dist

    import commlib
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=(rank == 0), timeout=timedelta(seconds=60))
    comm = commlib.Communicator(store, rank, 2, "ab")
    res: Dict[int, Tuple[float, float]] = {}
    for nbytes in sizes:
        t = torch.rand(nbytes // 4) + rank
        n = iters if nbytes < (1 << 20) else max(5, iters // 20)
        for _ in range(5):
            comm.all_reduce_(t, algo=algo)
        times = []
        for _ in range(n):
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_reduce_(t, algo=algo)
            times.append(time.perf_counter() - t0)
        times.sort()
        res[nbytes] = (statistics.median(times) * 1e6, times[len(times) // 10] * 1e6)
    q.put((rank, res))


def main() -> None:
    pkg = os.path.abspath(sys.argv[1])
    sizes = [int(s) for s in sys.argv[2:]] or [1024, 16384, 32768, 65536, 131072, 1 << 20, 32 << 20]
    algo = os.environ.get("ALGO", "auto")
    iters = int(os.environ.get("ITERS", "400"))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    q: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_worker, args=(r, port, pkg, sizes, iters, algo, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    for n in sizes:
        med = max(out[r][n][0] for r in range(2))
        p10 = max(out[r][n][1] for r in range(2))
        print(f"{pkg} {algo:>5} {n:>10} B  median {med:10.2f} us  p10 {p10:10.2f} us")


if __name__ == "__main__":
    main()
