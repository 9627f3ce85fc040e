#!/usr/bin/env python3
"""Fused all-reduce + residual add + RMSNorm: commlib (p2p) vs sequential NCCL vs torch two-shot.

Spawns its own processes (no torchrun):   python bench/bench_fused_rmsnorm.py [--out FILE]

hidden 8192 (default), bf16, 2 ranks, tokens 1 .. 16384. Per token count every implementation
runs on the same random inputs and is checked first:
  fused-rep / fused-shard   comm.fused_allreduce_rmsnorm, residual_mode replicated / sharded
                            (out bitwise equal to commlib all_reduce + commlib.fused.reference_rmsnorm,
                            and within bf16 tolerance of NCCL + torch rms_norm)
  nccl-seq                  dist.all_reduce(x); residual += x; out = torch rms_norm(residual) * w
  symm-2shot-seq            torch.ops.symm_mem.two_shot_all_reduce_ + add + rms_norm (when available)
  commlib-seq               comm.all_reduce_(x) (auto) + add + torch rms_norm: the unfused commlib path
then timed as CUDA-graph replays of `ops` back-to-back calls (median over replays of replay/ops,
µs). Inputs are restored from pristine copies between replays (not timed) so values stay finite.
An SM sweep (num_sms 2, 4, 8, 16, 32; --sweep-sms) of fused-rep (--sweep-modes) follows at --sweep-tokens. Token
counts whose slice is at most COMMLIB_FUSED_LL_MAX_BYTES run the LL kernel, the others the
barrier kernel (docs/fused.md). Prints markdown; --out writes it.

Knob A/B in the same run: --ab-env NAME=V1,V2,... (repeatable) times the fused op (--sweep-modes) at
--ab-tokens once per value of each knob (the others as in the environment), each value checked bit
for bit first. Each value gets a communicator of its own (knobs are read once per communicator) and its
own graph, e.g.
  --ab-env COMMLIB_FUSED_LL_ROW_CTAS=1,2,4,8,0 --ab-env COMMLIB_FUSED_LL_MAX_BYTES=0,262144
"""
from __future__ import annotations

import argparse
import datetime
import platform
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common import init_rank, knobs, publish, run_ranks, time_graph

TOKENS = [1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384]
SM_SWEEP = [2, 4, 8, 16, 32]
EPS = 1e-6


def ops_for(tokens: int) -> int:
    return 50 if tokens <= 128 else 20 if tokens <= 2048 else 5


def rms_norm(t, w):
    return torch.nn.functional.rms_norm(t, (t.shape[-1],), w, EPS)


def parse_ab(specs: list[str]) -> list[tuple[str, list[str]]]:
    """--ab-env NAME=V1,V2 ... -> [(NAME, [V1, V2]), ...]."""
    knobs = []
    for spec in specs:
        name, _, values = spec.partition("=")
        if not name.startswith("COMMLIB_") or not values:
            raise SystemExit(f"--ab-env {spec!r}: expected COMMLIB_<KNOB>=V1,V2,...")
        knobs.append((name, values.split(",")))
    return knobs


def make_inputs(dev, tokens: int, hidden: int, dtype, x_seed: int, res_seed: int):
    """Fresh random x (seeded per rank) and residual (the same seed on every rank), their working
    copies, an output, and restore() that puts the inputs back between graph replays."""
    gx = torch.Generator(device=dev).manual_seed(x_seed)
    gr = torch.Generator(device=dev).manual_seed(res_seed)
    x0 = torch.randn(tokens, hidden, generator=gx, device=dev).to(dtype)
    res0 = (2 * torch.randn(tokens, hidden, generator=gr, device=dev)).to(dtype)
    x, res, out = x0.clone(), res0.clone(), torch.empty_like(x0)

    def restore():
        x.copy_(x0)
        res.copy_(res0)
    return x0, res0, x, res, out, restore


def ab_sweep(comm, dev, rank: int, hidden: int, weight, args) -> list[dict]:
    """Times the fused op at --ab-tokens for every value of every --ab-env knob (bit-checked first)."""
    from commlib.fused import reference_rmsnorm
    dtype, points = weight.dtype, []
    for tokens in args.ab_tokens:
        x0, res0, x, res, out, restore = make_inputs(dev, tokens, hidden, dtype,
                                                     4321 + rank * 7 + tokens, 199 + tokens)
        summed = x0.clone()
        comm.all_reduce_(summed)
        exact_out, exact_res = reference_rmsnorm(summed.cpu(), res0.cpu(), weight.cpu(), EPS)
        begin, end = comm.token_slice(tokens)
        for name, values in parse_ab(args.ab_env):
            for mode in args.sweep_modes:
                point = {"tokens": tokens, "mode": mode, "knob": name}
                for value in values:
                    # A communicator resolves its knobs once (docs/cpp.md): one communicator per value.
                    with knobs({name: value}):
                        c = type(comm).from_group(name=f"ab-{name}-{value}-{mode}-{tokens}")
                        fn = lambda m=mode, c=c: c.fused_allreduce_rmsnorm(x, res, weight, EPS, out=out, residual_mode=m)
                        restore()
                        out.fill_(float("nan"))
                        fn()
                        torch.cuda.synchronize()
                        lo, hi = (0, tokens) if mode == "replicated" else (begin, end)
                        ok = torch.equal(out.cpu(), exact_out) and torch.equal(res[lo:hi].cpu(), exact_res[lo:hi])
                        t = time_graph(fn, restore, ops_for(tokens), args.replays)
                        c.close()
                    point[value] = f"{t:.1f}" if ok else f"{t:.1f} WRONG"
                points.append(point)
        if rank == 0:
            print(f"A/B {tokens} tokens: " + "; ".join(f"{p['knob']} {p['mode']} " + ", ".join(
                f"{v}={p[v]}" for v in p if v not in ("tokens", "mode", "knob")) for p in points
                if p["tokens"] == tokens), flush=True)
    return points


def worker(rank: int, world: int, port: int, args, queue):
    from commlib.fused import reference_rmsnorm
    dev, comm, symm = init_rank(rank, world, port, "bench-fused")
    group_name = dist.group.WORLD.group_name
    hidden, dtype = args.hidden, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(77)
    weight = (1 + 0.25 * torch.randn(hidden, generator=g, device=dev)).to(dtype)

    rows, sweep = [], []
    for tokens in [t for t in TOKENS if t <= args.max_tokens]:
        x0, res0, x, res, out, restore = make_inputs(dev, tokens, hidden, dtype,
                                                     1234 + rank * 7 + tokens, 99 + tokens)
        row, notes = {"tokens": tokens}, []

        # References: NCCL + torch, and commlib all_reduce + the documented arithmetic.
        summed = x0.clone()
        dist.all_reduce(summed)
        ref_res = (res0.float() + summed.float()).to(dtype)
        ref_out = rms_norm(ref_res, weight)
        summed_c = x0.clone()
        comm.all_reduce_(summed_c)
        exact_out, exact_res = reference_rmsnorm(summed_c.cpu(), res0.cpu(), weight.cpu(), EPS)

        fns = {}
        fns["fused-rep"] = lambda: comm.fused_allreduce_rmsnorm(x, res, weight, EPS, out=out)
        fns["fused-shard"] = lambda: comm.fused_allreduce_rmsnorm(x, res, weight, EPS, out=out,
                                                                  residual_mode="sharded")

        def nccl_seq():
            dist.all_reduce(x)
            res.add_(x)
            out.copy_(rms_norm(res, weight))
        fns["nccl-seq"] = nccl_seq

        def commlib_seq():
            comm.all_reduce_(x)
            res.add_(x)
            out.copy_(rms_norm(res, weight))
        fns["commlib-seq"] = commlib_seq
        if symm is not None:
            try:
                xs = symm.empty(tokens, hidden, dtype=dtype, device=dev)
                symm.rendezvous(xs, group_name)

                def symm_seq():
                    xs.copy_(x)
                    torch.ops.symm_mem.two_shot_all_reduce_(xs, "sum", group_name)
                    res.add_(xs)
                    out.copy_(rms_norm(res, weight))
                fns["symm-2shot-seq"] = symm_seq
            except Exception as e:  # noqa: BLE001
                notes.append(f"torch symm_mem unavailable: {type(e).__name__}: {e}"[:160])

        begin, end = comm.token_slice(tokens)
        for name, fn in fns.items():
            restore()
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            ok = torch.allclose(out.float(), ref_out.float(), rtol=5e-2, atol=5e-2)
            if name.startswith("fused"):
                ok = ok and torch.equal(out.cpu(), exact_out)
                lo, hi = (0, tokens) if name == "fused-rep" else (begin, end)
                ok = ok and torch.equal(res[lo:hi].cpu(), exact_res[lo:hi])
            if not ok:
                notes.append(f"{name}: WRONG RESULT")
        for name, fn in fns.items():
            row[name] = time_graph(fn, restore, ops_for(tokens), args.replays)
        if tokens in args.sweep_tokens:
            for mode in args.sweep_modes:
                point = {"tokens": tokens, "mode": mode}
                for sms in args.sweep_sms:
                    point[sms] = time_graph(
                        lambda s=sms, m=mode: comm.fused_allreduce_rmsnorm(x, res, weight, EPS, out=out, num_sms=s,
                                                                           residual_mode=m),
                        restore, ops_for(tokens), args.replays)
                sweep.append(point)
        row["notes"] = "; ".join(notes)
        rows.append(row)
        if rank == 0:
            print(f"{tokens:>6} tokens: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()
                                                      if isinstance(v, float)) + (f" [{row['notes']}]" if notes else ""),
                  flush=True)
        torch.cuda.empty_cache()
    ab = ab_sweep(comm, dev, rank, hidden, weight, args) if args.ab_env else []
    if rank == 0:
        queue.put((rows, sweep, ab))
    comm.close()
    dist.destroy_process_group()


def render(rows, sweep, world: int, hidden: int, command: str, sms_list: list[int], ab=()) -> str:
    def cell(r, k):
        return f"{r[k]:.1f}" if k in r else "n/a"

    def speedup(r, k, base):
        return f"{r[base] / r[k]:.2f}x" if k in r and base in r else "n/a"

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "?"
    lines = [
        f"# Fused all-reduce + residual add + RMSNorm, hidden {hidden}, bf16, {world} ranks "
        "(CUDA-graph replay, µs per op, median)",
        "",
        f"- command: `{command}`",
        f"- machine: {socket.gethostname()}, {world}x {gpu}, torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, Python {platform.python_version()}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "- speed-ups are baseline time / fused time (> 1: fused faster); targets: >= 2x vs nccl-seq at "
        "1-32 tokens, >= 1.8x at >= 128",
        "",
        "| tokens | fused-rep | fused-shard | nccl-seq | symm-2shot-seq | commlib-seq | rep vs nccl "
        "| shard vs nccl | rep vs symm | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['tokens']} | {cell(r, 'fused-rep')} | {cell(r, 'fused-shard')} | {cell(r, 'nccl-seq')} | "
                     f"{cell(r, 'symm-2shot-seq')} | {cell(r, 'commlib-seq')} | {speedup(r, 'fused-rep', 'nccl-seq')} | "
                     f"{speedup(r, 'fused-shard', 'nccl-seq')} | {speedup(r, 'fused-rep', 'symm-2shot-seq')} | "
                     f"{r['notes']} |")
    if sweep:
        lines += ["", "## SM sweep (num_sms)", "",
                  "| tokens | mode | " + " | ".join(str(s) for s in sms_list) + " | best <= 16 SMs / best |",
                  "| --- | --- | " + " | ".join("---" for _ in sms_list) + " | --- |"]
        for p in sweep:
            best = min(p[s] for s in sms_list)
            small = [p[s] for s in sms_list if s <= 16]
            ratio = f"{best / min(small) * 100:.0f}%" if small else "n/a"
            lines.append(f"| {p['tokens']} | {p['mode']} | " + " | ".join(f"{p[s]:.1f}" for s in sms_list) + f" | {ratio} |")
    knobs = []
    for p in ab:
        if p["knob"] not in knobs:
            knobs.append(p["knob"])
    for knob in knobs:
        points = [p for p in ab if p["knob"] == knob]
        values = [v for v in points[0] if v not in ("tokens", "mode", "knob")]
        lines += ["", f"## A/B {knob} (µs per op; WRONG: not bitwise equal)", "",
                  "| tokens | mode | " + " | ".join(values) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in values) + " |"]
        for p in points:
            lines.append(f"| {p['tokens']} | {p['mode']} | " + " | ".join(p[v] for v in values) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=[1, 128, 1024, 8192])
    parser.add_argument("--sweep-sms", type=int, nargs="*", default=SM_SWEEP, help="num_sms values of the sweep")
    parser.add_argument("--sweep-modes", nargs="*", default=["replicated"], choices=["replicated", "sharded"],
                        help="residual modes of the sweep")
    parser.add_argument("--ab-env", action="append", default=[], metavar="COMMLIB_<KNOB>=V1,V2",
                        help="knob A/B: time the fused op at --ab-tokens once per value (repeatable)")
    parser.add_argument("--ab-tokens", type=int, nargs="*", default=[1, 8, 32, 64, 128],
                        help="token counts of the --ab-env sweep")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    parse_ab(args.ab_env)  # fail early on a malformed spec
    rows, sweep, ab = run_ranks(worker, args.world_size, args)
    publish(render(rows, sweep, args.world_size, args.hidden, "python " + " ".join(sys.argv), args.sweep_sms, ab),
            args.out)


if __name__ == "__main__":
    main()
