"""The probes' one measurement: µs per step of a CUDA graph of `steps` steps, median of replays."""
import torch


def graph_step_us(step, steps=200, replays=7):
    """Captures `steps` calls of step() (after one eager warm-up call) and returns the median time
    per step over `replays` replays, in µs."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()
        g.capture_begin()
        for _ in range(steps):
            step()
        g.capture_end()
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(replays):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / steps)
    return sorted(ts)[replays // 2]
