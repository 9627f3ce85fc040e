"""What the GPU benchmark scripts in bench/ share: process start-up, the commlib / NCCL / torch
symmetric-memory set-up of a rank, CUDA-graph capture and timing, eager timing, COMMLIB_* knobs
set for a block. (Scripts run from bench/, so it is on sys.path.)"""
import contextlib
import datetime
import os
import queue as queue_mod
import socket
import statistics
import sys
import time
from typing import Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def knobs(values: Dict[str, str]):
    """os.environ updated with `values` inside the block, restored after. A communicator reads most
    COMMLIB_* GPU knobs once, at its first GPU call (so that call must happen inside the block); the
    fused op's LL knobs are read at every call, so a graph captured inside the block keeps them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def capture_graph(step, iters: int, warmup=None, before_capture=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `iters` calls of step(). warmup() (default: one step()) runs first on a side
    stream, so first-use set-up (buffers, NCCL / symm-mem init) stays outside the capture;
    before_capture() (e.g. a barrier) runs between the two."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (warmup or step)()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            step()
    return graph


def eager_us(fn, iters: int, repeats: int = 1) -> float:
    """Median over `repeats` of the host wall time per call of `iters` back-to-back fn() calls
    (µs), each sample started after a barrier and ended by a device synchronisation."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def time_graph(fn, restore, ops: int, replays: int) -> float:
    """Median µs per op of a CUDA graph holding `ops` calls of fn()."""
    def warmup():
        for _ in range(2):
            restore()
            fn()
    graph = capture_graph(fn, ops, warmup=warmup)
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(replays + 3):
        restore()
        if i == 0:
            dist.barrier(device_ids=[torch.cuda.current_device()])
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1000.0 / ops)
    del graph
    return statistics.median(times)


def init_rank(rank: int, world: int, port: int, comm_name: str):
    """One benchmark rank: NCCL process group, a commlib communicator and, where this torch has
    them, torch's symmetric-memory all-reduce ops (never multicast). Returns (device, comm, symm)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never multicast (DESIGN.md, Safety)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=dev)
    import commlib
    comm = commlib.Communicator(dist.PrefixStore("commlib-bench", store), rank, world, comm_name)
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        if hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "two_shot_all_reduce_"):
            symm = symm_mem
    except Exception:  # noqa: BLE001
        symm = None
    return dev, comm, symm


def run_ranks(worker, world: int, args):
    """Starts worker(rank, world, port, args, queue) on `world` GPUs and returns what rank 0 puts
    on the queue; exits with a message if a rank fails instead of waiting forever."""
    if torch.cuda.device_count() < world:
        sys.exit(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit("a benchmark process failed (see its traceback above)")
    for p in procs:
        p.join()
    return result


def publish(text: str, out) -> None:
    """Prints the table and, with --out, writes it there too."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
