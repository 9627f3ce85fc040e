"""One-GPU check of the fused kernels' arithmetic and a per-CTA speed probe (world size 1).

    python bench/fused_world1_check.py

A 1-rank communicator has no peers, so the barrier kernel's phase B (reduce, residual add, sum of
squares, normalise) is all that runs: every output is compared bit for bit with
commlib.fused.reference_rmsnorm on the CPU, for hidden sizes 8 .. 16384, odd token counts, both
dtypes, both residual modes and CTA counts 1 .. 132 (the LL kernel off). Then it times the kernel
(CUDA-graph replay) at 1024 / 4096 tokens x 8192 by CTA count. World 1 runs the generic-world
instantiation (one pack per thread per step, sized for 8 sources), so its times are not those of
the specialised 2/4/8-rank kernels. Useful when only one GPU is available; the 2-GPU suite
(tests/gpu) is the real test.
"""
import datetime
import os
import statistics
import sys

os.environ["COMMLIB_FUSED_LL_MAX_BYTES"] = "0"
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commlib  # noqa: E402
from common import capture_graph  # noqa: E402
from commlib.fused import reference_rmsnorm  # noqa: E402


def main() -> int:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", 29811, 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    comm = commlib.Communicator(store, 0, 1, "world1")
    eps = 1e-6
    bad = 0
    cases = 0
    for dtype in (torch.bfloat16, torch.float16):
        for hidden in (8, 1032, 4096, 7168, 8192, 16384):
            for tokens in (1, 3, 37, 301):
                for sms in (1, 7, 40, 132):
                    for mode in ("replicated", "sharded"):
                        g = torch.Generator().manual_seed(hidden * 7 + tokens)
                        x = torch.randn(tokens, hidden, generator=g).to(dtype)
                        res = (2 * torch.randn(tokens, hidden, generator=g)).to(dtype)
                        w = (1 + 0.25 * torch.randn(hidden, generator=g)).to(dtype)
                        want_out, want_res = reference_rmsnorm(x, res, w, eps)
                        xr, rr = x.to(dev), res.to(dev)
                        out = torch.full_like(xr, float("nan"))
                        comm.fused_allreduce_rmsnorm(xr, rr, w.to(dev), eps, residual_mode=mode, out=out, num_sms=sms)
                        ok = torch.equal(out.cpu(), want_out) and torch.equal(rr.cpu(), want_res)
                        cases += 1
                        if not ok:
                            bad += 1
                            print(f"MISMATCH dtype={dtype} hidden={hidden} tokens={tokens} sms={sms} mode={mode}")
    print(f"bitwise check: {cases - bad}/{cases} cases equal")
    hidden = 8192
    w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    print("| tokens | " + " | ".join(f"{s} CTAs" for s in (8, 16, 32, 64, 132)) + " |  (µs, world 1, sharded)")
    for tokens in (1024, 4096):
        x = torch.randn(tokens, hidden, device=dev).bfloat16()
        res = torch.randn(tokens, hidden, device=dev).bfloat16()
        out = torch.empty_like(x)
        row = []
        for sms in (8, 16, 32, 64, 132):
            fn = lambda: comm.fused_allreduce_rmsnorm(x, res, w, eps, residual_mode="sharded", out=out, num_sms=sms)  # noqa: E731
            graph = capture_graph(fn, 20)
            times = []
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1000 / 20)
            row.append(statistics.median(times))
        print(f"| {tokens} | " + " | ".join(f"{t:.1f}" for t in row) + " |")
    comm.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
