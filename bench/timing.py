"""Timing shared by the GPU benchmark scripts in bench/ (run as scripts, so bench/ is on sys.path)."""
import statistics

import torch
import torch.distributed as dist


def time_graph(fn, restore, ops: int, replays: int) -> float:
    """Median µs per op of a CUDA graph holding `ops` calls of fn()."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture (first-use set-up, NCCL/symm-mem init)
            restore()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn()
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
