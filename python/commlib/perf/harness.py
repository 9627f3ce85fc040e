"""The one benchmark harness: the timers and the process launcher that ``commlib-perf`` and the
scripts in ``bench/`` share.

Timers (µs per call of ``fn``; ``fn`` runs one operation):

* ``cpu_us``: the median of per-call wall times (CPU calls are blocking).
* ``cuda_eager_us``: CUDA events around ``iters`` calls on the current stream, divided by ``iters``
  (nccl-tests' average); ``blocking`` synchronises the host after every call.
* ``cuda_graph_us``: ``iters`` calls captured in one CUDA graph, replayed ``launches`` times; the
  median replay time divided by ``iters``. ``restore()`` (optional, untimed) runs before every
  replay, e.g. to put inputs that the calls update back.

Launcher: ``spawn(worker, world_size, *args)`` starts ``world_size`` local processes, each calling
``worker(rank, world_size, store, *args)`` with a shared ``TCPStore``; returns rank 0's return value.
A rank that fails ends the run with its traceback instead of leaving the others waiting.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import sys
import time
import traceback
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

STORE_TIMEOUT = timedelta(seconds=600)
FAILED_RANK_GRACE_S = 10.0  # how long the other ranks may take to notice a failed one


def cpu_call_times_us(fn: Callable[[], None], iters: int) -> List[float]:
    """The wall time of each of ``iters`` calls, µs."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def cpu_us(fn: Callable[[], None], iters: int) -> float:
    return statistics.median(cpu_call_times_us(fn, iters))


def cuda_eager_us(fn: Callable[[], None], iters: int, device: torch.device, blocking: bool = False) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
        if blocking:
            torch.cuda.synchronize(device)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def capture(fn: Callable[[], None], iters: int, device: torch.device,
            restore: Optional[Callable[[], None]] = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``iters`` calls of ``fn``. Two warm-up calls run first on a side stream, so
    first-use set-up (NCCL communicators, symmetric buffers, workspaces) stays out of the capture."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            if restore is not None:
                restore()
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return graph


def cuda_graph_us(fn: Callable[[], None], iters: int, launches: int, device: torch.device,
                  restore: Optional[Callable[[], None]] = None) -> float:
    graph = capture(fn, iters, device, restore)
    if restore is not None:
        restore()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize(device)
    times = []
    for _ in range(launches):
        if restore is not None:
            restore()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    del graph
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# Processes

def _rank_main(worker, rank: int, world_size: int, port: int, results, args) -> None:
    code = 2
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=STORE_TIMEOUT)
        value = worker(rank, world_size, store, *args)
        results.put((rank, value))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    except BaseException:  # noqa: BLE001
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    results.close()
    results.join_thread()  # the value reaches the pipe before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(worker: Callable, world_size: int, *args):
    """Runs ``worker(rank, world_size, store, *args)`` on ``world_size`` spawned processes and returns
    rank 0's return value (which must pickle). A worker ends its rank with ``sys.exit(code)`` to
    report a code; ``SystemExit(code)`` is raised here with the largest non-zero code of any rank."""
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, timeout=STORE_TIMEOUT,
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(worker, r, world_size, store.port, results, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    value, failed_at = None, None
    while any(p.is_alive() for p in procs):
        try:
            rank, got = results.get(timeout=0.05)
            if rank == 0:
                value = got
        except queue_mod.Empty:
            pass
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S:
            for p in procs:  # a rank failed and the others are stuck waiting for it
                if p.is_alive():
                    p.kill()
    for p in procs:
        p.join()
    while value is None:
        try:
            rank, got = results.get(timeout=0.2)
        except queue_mod.Empty:
            break
        if rank == 0:
            value = got
    codes = [p.exitcode for p in procs]
    worst = max((c if c and c > 0 else (2 if c else 0)) for c in codes)
    if worst:
        raise SystemExit(worst)
    return value
