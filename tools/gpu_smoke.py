"""Smallest GPU check: 2 processes, one all_reduce per algorithm, printed. For debugging set-up.

    python tools/gpu_smoke.py
"""
import faulthandler
import sys
from datetime import timedelta

import torch

from commlib.perf.harness import spawn

WORLD_SIZE = 2


def worker(rank, world, store):
    faulthandler.enable()
    import commlib
    torch.cuda.set_device(rank)
    print(f"[{rank}] store ok", flush=True)
    comm = commlib.Communicator(store, rank, world, "smoke", timeout=timedelta(seconds=20))
    print(f"[{rank}] comm ok", flush=True)
    for algo in ("flat", "tree"):
        t = torch.full((1000,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
        comm.all_reduce_(t, algo=algo)
        torch.cuda.synchronize()
        print(f"[{rank}] {algo}: {t[:3].tolist()} (expect {sum(range(1, world + 1))})", flush=True)
    comm.close()


if __name__ == "__main__":
    if torch.cuda.device_count() < WORLD_SIZE:
        sys.exit(f"gpu_smoke: needs {WORLD_SIZE} GPUs, found {torch.cuda.device_count()}")
    spawn(worker, WORLD_SIZE)
