"""Smoke check of EPBuffer(transport="nvshmem") on one GPU, one process (world 1), step by step
with prints: NVSHMEM bootstrap, symmetric allocation, one dispatch + combine, compared bit for bit
with the peer-memory transport on the same inputs. For the GPU machine; the tests are
tests/gpu/test_ep_nvshmem.py."""
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    import commlib
    from commlib import _nvshmem
    print("NVSHMEM_DISABLE_NVLS =", os.environ.get("NVSHMEM_DISABLE_NVLS"), flush=True)
    print("library:", _nvshmem.library_path(), "exists:", _nvshmem.library_path().exists(), flush=True)
    import nvshmem
    import nvshmem.core
    print("nvshmem4py:", getattr(nvshmem, "__version__", "?"), "from", nvshmem.__file__, flush=True)
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    comm = commlib.Communicator(store, 0, 1, "nvshmem-smoke")
    t0 = time.time()
    nv = commlib.EPBuffer(comm, 8, 256, 8, 2, torch.bfloat16, device="cuda", transport="nvshmem")
    print(f"created {nv} in {time.time() - t0:.2f} s; kernels={nv.kernels}", flush=True)
    print("nvshmem version:", nvshmem.core.get_version(), flush=True)
    peer = commlib.EPBuffer(comm, 8, 256, 8, 2, torch.bfloat16, device="cuda", transport="peer")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda", generator=g)
    idx = torch.randint(0, 8, (8, 2), device="cuda", generator=g)
    idx[3, 1] = -1
    w = torch.rand(8, 2, device="cuda", generator=g)
    results = {}
    for name, buf in (("nvshmem", nv), ("peer", peer)):
        res = buf.dispatch(x, idx, w)
        print(f"{name}: dispatch queued", flush=True)
        out = buf.combine(res.expert_x * 2, res.handle)
        torch.cuda.synchronize()
        print(f"{name}: counts {res.expert_counts.tolist()} out[0,:4] {out[0, :4].tolist()}", flush=True)
        results[name] = (res.expert_counts.clone(), res.expert_x.clone(), out.clone())
        buf.check()
    (cn, xn, on), (cp, xp, op) = results["nvshmem"], results["peer"]
    same_rows = all(torch.equal(xn[l, :int(cn[l])], xp[l, :int(cp[l])]) for l in range(8))
    ok = torch.equal(cn, cp) and same_rows and torch.equal(on, op)
    print("nvshmem == peer bitwise:", ok, flush=True)
    ref = torch.zeros(8, 256, dtype=torch.float32, device="cuda")
    for k in range(2):
        ref += torch.where(idx[:, k:k + 1] >= 0, w[:, k:k + 1] * (x.float() * 2), 0)
    print("max |out - fp32 ref|:", (on.float() - ref).abs().max().item(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
