"""The NCCL shim on GPUs (docs/nccl.md): ranks load python/commlib/lib/libnccl.so.2 with ctypes (as
vLLM's PyNcclCommunicator does), form a communicator from the shim's own unique id, and call
ncclAllReduce, ncclReduceScatter, ncclAllGather, ncclBroadcast / ncclBcast, ncclAlltoAll and
ncclSend / ncclRecv (alone, in a group, and to the rank itself) on torch CUDA tensors, then an
all-reduce and an all-gather on a communicator split from it; the route must be commlib's
(commlibNcclCommRoute). A forwarded call (an int32 all-reduce, max) goes to the real NCCL, which
needs a GPU per rank (skipped when COMMLIB_TEST_SHARE_GPUS puts ranks on one GPU).

References: every rank regenerates every rank's input from its seed; reductions against an fp64 sum
(avg = sum / n) within the dtype's rounding, data movement against the exact bytes. Inputs are
fresh random values; outputs are poisoned (NaN / -7) first, so an element left unwritten fails;
odd sizes and 0 elements included."""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from commlib.nccl import UniqueId  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "python" / "commlib" / "lib" / "libnccl.so.2"
NCCL_TYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
              torch.float64: 8, torch.bfloat16: 9}
NCCL_SUM, NCCL_MAX, NCCL_AVG = 0, 2, 4
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SIZES = [0, 1, 7, 1023, 65537]

if not SHIM.exists():
    pytest.skip("NCCL shim not built (needs CUDA and the nvidia-nccl wheel)", allow_module_level=True)


def rank_input(rank, count, dtype, salt=0):
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + 104729 * salt + 17)
    if dtype.is_floating_point:
        return (torch.rand(count, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    return torch.randint(-1000, 1000, (count,), generator=g, dtype=torch.int64).to(dtype)


def poisoned(count, dtype, dev):
    return torch.full((count,), float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=dev)


class Shim:
    """One rank's shim communicator (ctypes), made from rank 0's unique id shared over the pool's store."""

    def __init__(self, ctx, key):
        self.lib = ctypes.CDLL(str(SHIM))
        self.lib.ncclGetLastError.restype = ctypes.c_char_p
        self.lib.commlibNcclCommRoute.restype = ctypes.c_char_p
        uid = UniqueId()
        if ctx.rank == 0:
            assert self.lib.ncclGetUniqueId(ctypes.byref(uid)) == 0
            ctx.store.set(key, ctypes.string_at(ctypes.byref(uid), 128))
        else:
            ctypes.memmove(ctypes.byref(uid), ctx.store.get(key), 128)
        self.comm = ctypes.c_void_p()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), ctx.world_size, uid, ctx.rank))
        self.stream = torch.cuda.current_stream()

    def check(self, rc):
        assert rc == 0, f"NCCL result {rc}: {self.lib.ncclGetLastError(None).decode()}"

    def route(self):
        return self.lib.commlibNcclCommRoute(self.comm).decode()

    def call(self, name, *args):
        self.check(getattr(self.lib, name)(*args, self.comm, ctypes.c_void_p(self.stream.cuda_stream)))

    def destroy(self):
        self.check(self.lib.ncclCommDestroy(self.comm))


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def _collectives(ctx):
    dev = torch.device("cuda", ctx.device)
    n = ctx.world_size
    shim = Shim(ctx, "nccl-shim-id/collectives")
    assert shim.route().startswith("commlib:"), shim.route()
    for dtype in FLOATS:
        t = NCCL_TYPES[dtype]
        for count in SIZES:
            inputs = [rank_input(r, count, dtype) for r in range(n)]
            total = sum(x.double() for x in inputs)
            for op, ref in ((NCCL_SUM, total), (NCCL_AVG, total / n)):
                out = poisoned(count, dtype, dev)
                src = inputs[ctx.rank].to(dev)
                shim.call("ncclAllReduce", ptr(src), ptr(out), ctypes.c_size_t(count), t, op)
                torch.cuda.synchronize()
                torch.testing.assert_close(out.cpu().double(), ref, rtol=TOL[dtype], atol=TOL[dtype] * n * 2)
                inplace = inputs[ctx.rank].to(dev)  # in place
                shim.call("ncclAllReduce", ptr(inplace), ptr(inplace), ctypes.c_size_t(count), t, op)
                torch.cuda.synchronize()
                assert torch.equal(inplace.cpu(), out.cpu())
            # reduce_scatter: rank r gets block r of the sum of every rank's n * count input.
            big = [rank_input(r, n * count, dtype, salt=1) for r in range(n)]
            total = sum(x.double() for x in big)[ctx.rank * count:(ctx.rank + 1) * count]
            out = poisoned(count, dtype, dev)
            shim.call("ncclReduceScatter", ptr(big[ctx.rank].to(dev)), ptr(out), ctypes.c_size_t(count), t, NCCL_SUM)
            torch.cuda.synchronize()
            torch.testing.assert_close(out.cpu().double(), total, rtol=TOL[dtype], atol=TOL[dtype] * n * 2)
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.int8]:
        t = NCCL_TYPES[dtype]
        for count in SIZES:
            inputs = [rank_input(r, count, dtype, salt=2) for r in range(n)]
            out = poisoned(n * count, dtype, dev)
            shim.call("ncclAllGather", ptr(inputs[ctx.rank].to(dev)), ptr(out), ctypes.c_size_t(count), t)
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), torch.cat(inputs)), (dtype, count)
            root = n - 1
            out = poisoned(count, dtype, dev)
            shim.call("ncclBroadcast", ptr(inputs[ctx.rank].to(dev)), ptr(out), ctypes.c_size_t(count), t, root)
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), inputs[root]), (dtype, count)
            buf = inputs[ctx.rank].to(dev) if ctx.rank == 0 else poisoned(count, dtype, dev)
            shim.call("ncclBcast", ptr(buf), ctypes.c_size_t(count), t, 0)
            torch.cuda.synchronize()
            assert torch.equal(buf.cpu(), inputs[0]), (dtype, count)
            # all_to_all: block q of rank r's input lands as block r of rank q's output.
            blocks = [rank_input(r, n * count, dtype, salt=3) for r in range(n)]
            out = poisoned(n * count, dtype, dev)
            shim.call("ncclAlltoAll", ptr(blocks[ctx.rank].to(dev)), ptr(out), ctypes.c_size_t(count), t)
            torch.cuda.synchronize()
            expected = torch.cat([blocks[r][ctx.rank * count:(ctx.rank + 1) * count] for r in range(n)])
            assert torch.equal(out.cpu(), expected), (dtype, count)
            inplace = blocks[ctx.rank].to(dev)  # sendbuff == recvbuff, as nccl-tests' in-place pass
            shim.call("ncclAlltoAll", ptr(inplace), ptr(inplace), ctypes.c_size_t(count), t)
            torch.cuda.synchronize()
            assert torch.equal(inplace.cpu(), expected), ("in place", dtype, count)
    err = ctypes.c_int(-1)
    shim.check(shim.lib.ncclCommGetAsyncError(shim.comm, ctypes.byref(err)))
    assert err.value == 0
    shim.destroy()


def _send_recv(ctx):
    dev = torch.device("cuda", ctx.device)
    n = ctx.world_size
    shim = Shim(ctx, "nccl-shim-id/p2p")
    assert shim.route().startswith("commlib:"), shim.route()
    right, left = (ctx.rank + 1) % n, (ctx.rank - 1) % n
    for dtype in [torch.float32, torch.bfloat16, torch.int32]:
        t = NCCL_TYPES[dtype]
        for count in [0, 1, 4097, (3 << 20) + 5]:  # the last is several channel slots
            mine = rank_input(ctx.rank, count, dtype, salt=4).to(dev)
            got = poisoned(count, dtype, dev)
            # A ring exchange in one group: every rank sends right and receives from the left at once.
            shim.check(shim.lib.ncclGroupStart())
            shim.call("ncclSend", ptr(mine), ctypes.c_size_t(count), t, right)
            shim.call("ncclRecv", ptr(got), ctypes.c_size_t(count), t, left)
            shim.check(shim.lib.ncclGroupEnd())
            torch.cuda.synchronize()
            assert torch.equal(got.cpu(), rank_input(left, count, dtype, salt=4)), (dtype, count)
            # Alone (no group): even ranks send first, odd ranks receive first.
            got = poisoned(count, dtype, dev)
            order = [("ncclSend", mine, right), ("ncclRecv", got, left)]
            for name, buf, peer in order if ctx.rank % 2 == 0 else order[::-1]:
                shim.call(name, ptr(buf), ctypes.c_size_t(count), t, peer)
            torch.cuda.synchronize()
            assert torch.equal(got.cpu(), rank_input(left, count, dtype, salt=4)), (dtype, count)
    # All-to-all by send/recv as torch does it: every peer, this rank itself included, in one group.
    t = NCCL_TYPES[torch.float32]
    for count in [0, 5, 4099]:
        blocks = [rank_input(r, n * count, torch.float32, salt=6) for r in range(n)]
        src = blocks[ctx.rank].to(dev)
        out = poisoned(n * count, torch.float32, dev)
        shim.check(shim.lib.ncclGroupStart())
        for peer in range(n):
            shim.call("ncclSend", ptr(src[peer * count:(peer + 1) * count]), ctypes.c_size_t(count), t, peer)
            shim.call("ncclRecv", ptr(out[peer * count:(peer + 1) * count]), ctypes.c_size_t(count), t, peer)
        shim.check(shim.lib.ncclGroupEnd())
        torch.cuda.synchronize()
        expected = torch.cat([blocks[r][ctx.rank * count:(ctx.rank + 1) * count] for r in range(n)])
        assert torch.equal(out.cpu(), expected), count
    shim.destroy()


def _split(ctx):
    dev = torch.device("cuda", ctx.device)
    n = ctx.world_size
    shim = Shim(ctx, "nccl-shim-id/split")
    child = ctypes.c_void_p()
    shim.check(shim.lib.ncclCommSplit(shim.comm, 0, -ctx.rank, ctypes.byref(child), None))  # keys reversed
    assert shim.lib.commlibNcclCommRoute(child).decode().startswith("commlib:")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    count, t = 1023, NCCL_TYPES[torch.float32]
    inputs = [rank_input(r, count, torch.float32, salt=7) for r in range(n)]
    out = poisoned(count, torch.float32, dev)
    shim.check(shim.lib.ncclAllReduce(ptr(inputs[ctx.rank].to(dev)), ptr(out), ctypes.c_size_t(count), t, NCCL_SUM,
                                      child, stream))
    gathered = poisoned(n * count, torch.float32, dev)
    shim.check(shim.lib.ncclAllGather(ptr(inputs[ctx.rank].to(dev)), ptr(gathered), ctypes.c_size_t(count), t, child,
                                      stream))
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu().double(), sum(x.double() for x in inputs), rtol=1e-5, atol=1e-5 * n * 2)
    # Child rank q is parent rank n - 1 - q.
    assert torch.equal(gathered.cpu(), torch.cat([inputs[n - 1 - q] for q in range(n)]))
    shim.check(shim.lib.ncclCommDestroy(child))
    shim.destroy()


def _forwarded(ctx):
    dev = torch.device("cuda", ctx.device)
    n = ctx.world_size
    shim = Shim(ctx, "nccl-shim-id/forwarded")
    for count in [1, 1000]:
        inputs = [rank_input(r, count, torch.int32, salt=5) for r in range(n)]
        out = poisoned(count, torch.int32, dev)
        shim.call("ncclAllReduce", ptr(inputs[ctx.rank].to(dev)), ptr(out), ctypes.c_size_t(count),
                  NCCL_TYPES[torch.int32], NCCL_MAX)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.stack(inputs).max(dim=0).values)
    shim.destroy()


@pytest.mark.parametrize("world_size", [2])
def test_collectives_run_on_commlib(ranks, world_size):
    ranks(world_size).run(_collectives)


@pytest.mark.parametrize("world_size", [2])
def test_send_recv_run_on_commlib(ranks, world_size):
    ranks(world_size).run(_send_recv)


@pytest.mark.parametrize("world_size", [2])
def test_split_communicators_run_on_commlib(ranks, world_size):
    ranks(world_size).run(_split)


@pytest.mark.nccl
@pytest.mark.parametrize("world_size", [2])
def test_other_calls_go_to_the_real_nccl(ranks, world_size):
    ranks(world_size).run(_forwarded)


# ---- torch's ProcessGroupNCCL on the shim (LD_AUDIT), ranks sharing the GPUs there are ----

PG_SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
maps = open("/proc/self/maps").read()
assert os.environ["SHIM"] in maps, "torch's NCCL is not the shim"

def inp(r, count, dtype, salt):
    g = torch.Generator().manual_seed(1000003 * r + 7919 * count + 104729 * salt + 17)
    return torch.rand(count, generator=g, dtype=torch.float64) * 4 - 2

for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    for count in (1, 1023, 65537):
        xs = [inp(r, count, dtype, 1) for r in range(n)]
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            t = xs[rank].to(dtype).to(dev)
            dist.all_reduce(t, op=op)
            ref = sum(x.to(dtype).double() for x in xs) / (n if op == dist.ReduceOp.AVG else 1)
            torch.testing.assert_close(t.double().cpu(), ref, rtol=tol, atol=tol * 2 * n)
        big = [inp(r, n * count, dtype, 2).to(dtype) for r in range(n)]
        out = torch.full((count,), float("nan"), dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(out, big[rank].to(dev))
        ref = sum(b.double() for b in big)[rank * count:(rank + 1) * count]
        torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol * 2 * n)
        parts = [inp(r, count, dtype, 3).to(dtype) for r in range(n)]
        gathered = torch.full((n * count,), float("nan"), dtype=dtype, device=dev)
        dist.all_gather_into_tensor(gathered, parts[rank].to(dev))
        assert torch.equal(gathered.cpu(), torch.cat(parts))
        b = parts[rank].to(dev) if rank == n - 1 else torch.full((count,), float("nan"), dtype=dtype, device=dev)
        dist.broadcast(b, src=n - 1)
        assert torch.equal(b.cpu(), parts[n - 1])
        blocks = [inp(r, n * count, dtype, 4).to(dtype) for r in range(n)]
        a2a = torch.full((n * count,), float("nan"), dtype=dtype, device=dev)
        dist.all_to_all_single(a2a, blocks[rank].to(dev))
        assert torch.equal(a2a.cpu(), torch.cat([blocks[r][rank * count:(rank + 1) * count] for r in range(n)]))
        right, left = (rank + 1) % n, (rank - 1) % n
        got = torch.full((count,), float("nan"), dtype=dtype, device=dev)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, parts[rank].to(dev), right),
                                       dist.P2POp(dist.irecv, got, left)])
        for q in reqs:
            q.wait()
        assert torch.equal(got.cpu(), parts[left])

# a captured all-reduce, replayed with new inputs
src = torch.empty(4097, device=dev)
work = torch.empty_like(src)
dist.all_reduce(work.fill_(1))
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
    work.copy_(src)
    dist.all_reduce(work)
for i in range(20):
    xs = [inp(r, 4097, torch.float32, 10 + i) for r in range(n)]
    src.copy_(xs[rank].float())
    graph.replay()
    torch.testing.assert_close(work.double().cpu(), sum(x.float().double() for x in xs), rtol=1e-5, atol=1e-4)
dist.destroy_process_group()
print("OK", rank)
'''


@pytest.mark.parametrize("world_size", [2])
def test_process_group_nccl_on_the_shim(world_size, tmp_path):
    """init_process_group("nccl") under LD_AUDIT: torch's ProcessGroupNCCL loads the shim, and every
    collective, a send / receive ring and a captured graph match fp64 references, with the ranks on
    distinct GPUs or, with COMMLIB_TEST_SHARE_GPUS=1, on one (where the real NCCL would refuse)."""
    import os
    import socket
    import subprocess
    import sys
    audit = SHIM.parent / "libcommlib_nccl_audit.so"
    assert audit.exists(), "the LD_AUDIT library is built with the shim"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "pg.py"
    script.write_text(PG_SCRIPT)
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, LD_AUDIT=str(audit), SHIM=str(SHIM.resolve()), RANK=str(rank),
                   WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   COMMLIB_NCCL_HOST="127.0.0.1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", NCCL_NVLS_ENABLE="0")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    for rank, (rc, out, err) in enumerate(outs):
        assert rc == 0 and f"OK {rank}" in out, f"rank {rank} rc {rc}\n{out[-2000:]}\n{err[-4000:]}"
