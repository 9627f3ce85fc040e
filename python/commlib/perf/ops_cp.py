"""commlib-perf operation ``ring_attention``: context-parallel causal prefill (commlib.cp).

One sequence of L tokens, Llama-3-70B-like attention per rank on GPU (64 Q heads, 8 KV heads,
head_dim 128; 8 / 2 / 64 on CPU), sharded over the ranks in the balanced layout; one timed call is
one ``ring_attention`` of this rank's shard. Size = the bytes of the whole sequence's q (L x H x D
x element size); ``--seqlens`` lists sequence lengths instead of -b/-e. ``--cp-mode`` picks
pass_kv, pass_q (streamed return), pass_q_a2a (the paper's post-loop all-to-all) or auto.
busbw is reported as algbw (factor 1): the figures that matter for this operation are time, the
1-GPU baseline and the scaling efficiency, which ``python -m commlib.perf.ops_cp`` prints.

* ``ddacomm``: ``cp.ring_attention(comm, ...)``: the copy-engine ring on CUDA, the all_to_all_v
  ring step on CPU.
* ``nccl`` / ``gloo``: the same ring over ``torch.distributed`` P2P (``DistTransport``).

Check: against the default attention call on the whole sequence computed on this rank (the
1-GPU result), |difference| <= 16 eps of the dtype (both round partial outputs differently).

``python -m commlib.perf.ops_cp [--seqlens 8192,32768] [--modes pass_kv,pass_q,pass_q_a2a]
[--iters N] [--emulate 2,4,8]`` (under torchrun, or alone for world 1) prints rows: sequence length,
mode, time, the 1-GPU baseline (the same attention on the whole sequence on one device) and the
scaling efficiency baseline / (N x time); at world 1 the difference between time and baseline is
the ring's own per-call cost (packing, merges, the plan). ``--emulate`` adds, at world 1, each step
of a pass-KV ring on N ranks: the slowest rank's block-pair attention, timed here, beside the K/V
block's size and its transfer time at select_mode's BW.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import cp
from . import registry
from .registry import Buffers, Case, Collective, Unsupported
from .rows import _int_list

NAME = "ring_attention"
GPU_SHAPE = (64, 8, 128)  # q heads, kv heads, head_dim
CPU_SHAPE = (8, 2, 64)
CP_MODES = {"pass_kv": ("pass_kv", "stream"), "pass_q": ("pass_q", "stream"),
            "pass_q_a2a": ("pass_q", "all_to_all"), "auto": ("auto", "stream")}


def _add(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--seqlens", type=_int_list, default=None, metavar="L1,L2,...",
                       help=f"{NAME}: sequence lengths (replaces -b/-e for this operation)")
    group.add_argument("--cp-mode", choices=tuple(CP_MODES), default="auto",
                       help=f"{NAME}: pass_kv, pass_q (streamed return), pass_q_a2a (post-loop all-to-all), auto")


registry.register_options(NAME, _add, lambda opts: None)


def _shape(case: Case):
    return GPU_SHAPE if case.device.type == "cuda" else CPU_SHAPE


@functools.lru_cache(maxsize=4)
def _sequence(length: int, h: int, hkv: int, d: int, dtype: torch.dtype, salt: int):
    g = torch.Generator().manual_seed(7919 * length + salt)
    return tuple(torch.randn(length, n, d, generator=g).to(dtype) for n in (h, hkv, hkv))


def _setup(case: Case) -> Buffers:
    h, hkv, d = _shape(case)
    length = case.nbytes // (h * d * case.esize)
    q, k, v = _sequence(length, h, hkv, d, case.dtype, case.salt)
    sh = cp.shard([0, length], case.world_size, case.rank)
    dev = case.device
    qs, ks, vs = (t[sh.index].to(dev) for t in (q, k, v))
    out = registry.poison(torch.empty_like(qs))
    return Buffers(qs, out, {"k": ks, "v": vs, "length": length, "index": sh.index})


def _run(backend, b: Buffers, case: Case) -> None:
    if case.in_place:
        raise Unsupported(f"{NAME} has no in-place form")
    mode, ret = CP_MODES[case.options.get("cp_mode") or "auto"]
    e = b.extra
    if backend.name == "ddacomm":
        comm = backend.comm
    elif backend.name in ("nccl", "gloo"):
        comm = backend.group
    else:
        raise Unsupported(f"{backend.name}: {NAME} runs on ddacomm, nccl and gloo")
    out = cp.ring_attention(comm, b.inp, e["k"], e["v"], cu_seqlens_q=[0, e["length"]], mode=mode,
                            pass_q_return=ret)
    b.out.copy_(out)


def _check(b: Buffers, case: Case) -> int:
    h, hkv, d = _shape(case)
    length = b.extra["length"]
    q, k, v = (t.to(case.device) for t in _sequence(length, h, hkv, d, case.dtype, case.salt))
    cu = torch.tensor([0, length], dtype=torch.int32, device=case.device)
    ref, _ = cp.default_attention(q, k, v, cu, cu, length, length, True, d ** -0.5)
    registry.plant(b.out, case)
    want = ref[b.extra["index"].to(case.device)].double()
    bad = ~((b.out.double() - want).abs() <= 16 * torch.finfo(case.dtype).eps)
    return int(bad.sum())


def _sizes(cli_sizes, esize: int, world_size: int, options: dict):
    h, _, d = GPU_SHAPE if options.get("device") == "cuda" else CPU_SHAPE
    row = h * d * esize
    lengths = options.get("seqlens") or [max(1, s // row) for s in cli_sizes]
    return sorted({length * row for length in lengths})


registry.register(Collective(name=NAME, count=lambda nbytes, esize, n: nbytes // esize, bus_factor=lambda n: 1.0,
                             setup=_setup, run=_run, check=_check, sizes=_sizes))


# ---- the scaling table: time, 1-GPU baseline, efficiency ----

def _time(fn, device, iters: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def scaling_rows(comm, seqlens: List[int], modes: List[str], device: torch.device, dtype: torch.dtype,
                 iters: int, shape=None) -> List[dict]:
    """One row per (sequence length, mode): median time of ring_attention, the 1-GPU baseline and
    the scaling efficiency. ``comm``: a commlib.Communicator (rank and world from it)."""
    h, hkv, d = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    n, rank = comm.world_size, comm.rank
    rows = []
    for length in seqlens:
        q, k, v = (t.to(device) for t in _sequence(length, h, hkv, d, dtype, 0))
        cu = torch.tensor([0, length], dtype=torch.int32, device=device)
        base = _time(lambda: cp.default_attention(q, k, v, cu, cu, length, length, True, d ** -0.5), device, iters)
        sh = cp.shard([0, length], n, rank)
        qs, ks, vs = (t[sh.index.to(device)] for t in (q, k, v))
        for name in modes:
            mode, ret = CP_MODES[name]
            t = _time(lambda: cp.ring_attention(comm, qs, ks, vs, cu_seqlens_q=[0, length], mode=mode,
                                                pass_q_return=ret), device, iters)
            rows.append({"seqlen": length, "mode": name, "time_ms": t * 1e3, "baseline_ms": base * 1e3,
                         "efficiency": base / (n * t)})
    return rows


def emulated_step_rows(seqlens: List[int], world_sizes: List[int], device: torch.device, dtype: torch.dtype,
                       iters: int, shape=None) -> List[dict]:
    """World-1 estimate of a pass-KV ring's step on N ranks: every rank's block-pair attention of
    each step timed on this one device (the step costs the slowest rank's), beside the K/V block's
    bytes and its transfer time at select_mode's BW (tuned or default). ``hidden``: the transfer
    fits under the step's attention."""
    h, hkv, d = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    bw, _ = cp.machine_constants(device.type, 2)
    rows = []
    for length in seqlens:
        q, k, v = (t.to(device) for t in _sequence(length, h, hkv, d, dtype, 0))
        for n in world_sizes:
            plan = cp._plan([length], [[0]] * n, n, "balanced", True, device)
            shards = [cp.shard([0, length], n, r) for r in range(n)]
            blocks = [(q[s.index.to(device)], k[s.index.to(device)], v[s.index.to(device)]) for s in shards]
            block_bytes = 2 * max(plan.kv_rows) * hkv * d * torch.tensor([], dtype=dtype).element_size()
            for step in range(n):
                worst = 0.0
                for r in range(n):
                    src = (r - step) % n
                    qr, kb, vb = blocks[r][0], blocks[src][1], blocks[src][2]

                    def one():
                        state = cp._State(qr.shape[0], h, d, device)
                        cp._block_attention(plan, r, src, qr, kb, vb, cp.default_attention, d ** -0.5, state)
                    worst = max(worst, _time(one, device, iters))
                rows.append({"seqlen": length, "world": n, "step": step, "attn_ms": worst * 1e3,
                             "block_mib": block_bytes / 2**20, "transfer_ms": block_bytes / bw * 1e3,
                             "hidden": block_bytes / bw <= worst})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commlib.perf.ops_cp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=_int_list, default=None)
    p.add_argument("--modes", default="pass_kv,pass_q,pass_q_a2a")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--emulate", type=_int_list, default=None, metavar="N1,N2,...",
                   help="world 1: per-step cost of a pass-KV ring on N ranks (attention per step vs the "
                        "K/V block's transfer at the tuned BW)")
    opts = p.parse_args(argv)
    modes = [m for m in opts.modes.split(",") if m]
    for m in modes:
        if m not in CP_MODES:
            p.error(f"--modes: '{m}' not supported; supported: {', '.join(CP_MODES)}")
    device_type = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    import commlib
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if world > 1:
        dist.init_process_group("gloo")
        store = dist.distributed_c10d._get_default_store()
    else:
        store = dist.HashStore()
    comm = commlib.Communicator(store, rank, world, "ops-cp")
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    seqlens = opts.seqlens or ([8192, 32768, 131072] if device_type == "cuda" else [1024, 4096])
    rows = scaling_rows(comm, seqlens, modes, device, dtype, opts.iters)
    if opts.emulate and rank == 0:
        print(f"# emulated pass-KV steps on one device ({dtype}); transfer at BW "
              f"{cp.machine_constants(device_type, 2)[0] / 1e9:.0f} GB/s")
        print(f"# {'seqlen':>8} {'N':>3} {'step':>4} {'attn ms':>10} {'block MiB':>10} {'xfer ms':>10} hidden")
        for r in emulated_step_rows(seqlens, opts.emulate, device, dtype, opts.iters):
            print(f"  {r['seqlen']:>8d} {r['world']:>3d} {r['step']:>4d} {r['attn_ms']:>10.3f} {r['block_mib']:>10.2f} "
                  f"{r['transfer_ms']:>10.3f} {'yes' if r['hidden'] else 'no'}")
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu"
        print(f"# ring_attention causal prefill, {dtype}, heads "
              f"{GPU_SHAPE if device_type == 'cuda' else CPU_SHAPE} (q, kv, head_dim), world {world}, {name}")
        print(f"# {'seqlen':>8} {'mode':>10} {'time ms':>10} {'1-GPU ms':>10} {'efficiency':>10}")
        for r in rows:
            print(f"  {r['seqlen']:>8d} {r['mode']:>10} {r['time_ms']:>10.3f} {r['baseline_ms']:>10.3f} "
                  f"{r['efficiency']:>10.3f}")
    comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
