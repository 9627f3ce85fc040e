"""Where an EP dispatch + combine spends its time: the kernels' opt-in %globaltimer trace.

    CUDAFLAGS=-DCOMMLIB_EP_TRACE make build      # a build with the trace compiled in
    python bench/ep_trace.py [--tokens 1] [--model deepseek|mixtral] [--iters 200]

Two ranks (--world) replay a CUDA graph of `iters` dispatch + combine steps; then each rank prints block
0's trace of the last step, in µs from its dispatch kernel's start (points: EPTracePoint in
csrc/kernels/ep_params.hpp). Clocks of different GPUs are not compared.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from commlib.perf.harness import capture, spawn

POINTS = ["dispatch start", "rows pushed", "data signalled", "meta signalled",
          "own chunk expanded (non-push warps)", "peers' data landed", "dispatch end", "combine start",
          "partials signalled", "partials landed", "combine end", "previous step's combine end"]
MODELS = {"deepseek": (7168, 256, 8), "mixtral": (4096, 8, 2)}


def worker(rank, world, store, args):
    import commlib
    from commlib import _C
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    comm = commlib.Communicator(store, rank, world, "ep-trace")
    H, E, K = MODELS[args.model]
    T = args.tokens
    g = torch.Generator().manual_seed(7 + rank)
    w, idx = torch.rand(T, E, generator=g).topk(K, dim=1)
    idx, w = idx.to(dev), torch.softmax(w, 1).float().to(dev)
    x = torch.randn(T, H, device=dev).bfloat16()
    buf = commlib.EPBuffer(comm, T, H, E, K, torch.bfloat16, device=dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)

    def step():
        r = buf.dispatch(x, idx, w)
        buf.combine(r.expert_x, r.handle, out=out)

    graph = capture(step, args.iters, dev)
    store.set(f"ready{rank}", "1")
    store.wait([f"ready{r}" for r in range(world)])
    graph.replay()
    torch.cuda.synchronize()
    buf.check()
    store.set(f"trace{rank}", json.dumps(_C._ep_trace()))
    traces = [json.loads(store.get(f"trace{r}")) for r in range(world)]  # every rank's, in rank order
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(world)])
    comm.close()
    return traces


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--model", choices=list(MODELS), default="deepseek")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--world", type=int, default=2, help="ranks (1: the kernels' local costs alone)")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.world:
        sys.exit(f"ep_trace: needs {args.world} GPUs, found {torch.cuda.device_count()}")
    traces = spawn(worker, args.world, args)
    if not traces[0]:
        sys.exit("no trace: build with CUDAFLAGS=-DCOMMLIB_EP_TRACE")
    print(f"# EP trace, {args.model}, {args.tokens} tokens/rank, block 0, last of {args.iters} graph-replayed steps")
    print("| point | " + " | ".join(f"rank {r} µs" for r in range(args.world)) + " |")
    print("| --- | " + " | ".join("---:" for _ in range(args.world)) + " |")
    for i, name in enumerate(POINTS):
        cells = [f"{(traces[r][i] - traces[r][0]) / 1000:.2f}" for r in range(args.world)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
