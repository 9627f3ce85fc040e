"""Experiment: the CUDA-graph floor of a step of 1, 2 or 3 tiny kernels (one 1-element add each) on
one GPU, µs per step: what a dispatch + combine pair costs before any work of its own."""
import torch

a = torch.zeros(1, device="cuda")
b = torch.zeros(1, device="cuda")
for kernels in (1, 2, 3):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a.add_(1)
        g.capture_begin()
        for _ in range(200):
            a.add_(1)
            if kernels > 1:
                b.add_(1)
            if kernels > 2:
                a.add_(1)
        g.capture_end()
    torch.cuda.synchronize()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / 200)
    ts.sort()
    print(f"floor: {kernels} tiny kernel(s) per step: {ts[5]:.2f} µs per step (median of 10 replays of 200)")
