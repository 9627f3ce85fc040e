"""Smallest GPU check: 2 processes, one all_reduce per algorithm, printed. For debugging set-up."""
import faulthandler
import sys
from datetime import timedelta

import torch
import torch.multiprocessing as mp


def worker(rank, world, port):
    faulthandler.enable()
    import torch.distributed as dist

    import commlib
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=(rank == 0), timeout=timedelta(seconds=60))
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
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(worker, args=(2, port), nprocs=2)
