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
[--iters N] [--emulate 2,4,8] [--out bench/results/cp.md]`` (under torchrun, or alone for world 1) prints rows: sequence length,
mode, time, the 1-GPU baseline (the fastest attention PyTorch offers here on the whole sequence
on one device, ``best_attention``: cuDNN, FlashAttention or efficient attention on CUDA) and the
scaling efficiency baseline / (N x time); at world 1 the difference between time and baseline is
the ring's own per-call cost (packing, merges, the plan). ``--emulate`` adds, at world 1, each step
of a pass-KV ring on N ranks: the slowest rank's block-pair attention and merge, timed here with
each rank's steps issued back to back as the ring issues them (``_time_steps``), beside
the K/V block's size and its transfer time at select_mode's BW, and per N the steps' sum against
the ideal (the baseline / N). ``--torch-cp`` adds, per sequence length,
PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` (ring SDPA on DTensor) on the
same inputs as a baseline row (skipped with the reason where it does not run). ``--grid`` measures
partial prefill at 1-10 % new tokens (P cached, T new) and decode (B one-token sequences, each with
a P-token cache, round-robin) in pass-KV, pass-Q (streamed return) and pass-Q (post-loop
all-to-all), and prints which mode ``select_mode`` picks, which was fastest, and how often the pick
was the fastest (the issue's criterion: >= 90 % of the grid). ``--merge T1,T2`` times
merge_attention_states of two partials: the fused CUDA kernel against the same arithmetic in torch
ops, with the bytes it moves per second. ``--out FILE`` rewrites FILE with what rank 0 printed,
under the machine, commit, date and command of the run.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import cp
from . import registry
from .registry import Buffers, Case, Collective, Unsupported
from .report import machine_description, now_utc, software_description, source_commit
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
    """Median (s) of ``iters`` calls of ``fn``, each followed by a synchronize (after a barrier of
    the process group, if any), after one untimed call."""
    return _time_interleaved([fn], device, iters)[0]


def _time_interleaved(fns, device, iters: int) -> List[float]:
    """Medians (s) of each of ``fns``, timed as ``_time`` times one but in turn within every
    iteration, so a drift of the machine (clocks, another process) over the run reaches them all alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:
        fn()
    sync()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, out in zip(fns, times):
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
    return [sorted(t)[len(t) // 2] for t in times]


def best_attention(q, k, v, length: int, device, iters: int):
    """(ms, backend) of the fastest single-sequence causal attention PyTorch offers here: every
    backend of ``cp.default_attention`` that runs this call (on CUDA cuDNN, FlashAttention and
    efficient attention; on CPU the one path)."""
    d = q.shape[-1]
    cu = torch.tensor([0, length], dtype=torch.int32, device=device)
    backends = ("cudnn", "flash", "efficient") if device.type == "cuda" else ("auto",)
    best = None
    for name in backends:
        if name == "cudnn" and not cp.attention._cudnn_fits(q, k, cu, length, length, True):
            continue
        try:
            t = _time(lambda: cp.default_attention(q, k, v, cu, cu, length, length, True, d ** -0.5, backend=name),
                      device, iters)
        except RuntimeError:  # a backend this build or GPU lacks is not a baseline
            continue
        if best is None or t < best[0]:
            best = (t, name)
    if best is None:
        raise RuntimeError(f"best_attention: no backend of {', '.join(backends)} ran a causal call of {length} tokens")
    return best[0] * 1e3, best[1]


def scaling_rows(comm, seqlens: List[int], modes: List[str], device: torch.device, dtype: torch.dtype,
                 iters: int, shape=None) -> List[dict]:
    """One row per (sequence length, mode): median time of ring_attention, the 1-GPU baseline (the
    fastest attention PyTorch offers here, ``best_attention``, timed in turn with the ring in the
    same iterations: each row's own) and the scaling efficiency. ``comm``: a commlib.Communicator
    (rank and world from it)."""
    h, hkv, d = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    n, rank = comm.world_size, comm.rank
    rows = []
    for length in seqlens:
        q, k, v = (t.to(device) for t in _sequence(length, h, hkv, d, dtype, 0))
        _, base_name = best_attention(q, k, v, length, device, iters)
        cu = torch.tensor([0, length], dtype=torch.int32, device=device)

        def baseline():
            cp.default_attention(q, k, v, cu, cu, length, length, True, d ** -0.5, backend=base_name)

        sh = cp.shard([0, length], n, rank)
        qs, ks, vs = (t[sh.index.to(device)] for t in (q, k, v))
        for name in modes:
            mode, ret = CP_MODES[name]
            # The baseline timed in turn with the ring, in the same iterations: the row's 1-GPU time.
            b, t = _time_interleaved([baseline, lambda: cp.ring_attention(
                comm, qs, ks, vs, cu_seqlens_q=[0, length], mode=mode, pass_q_return=ret)], device, iters)
            rows.append({"seqlen": length, "mode": name, "time_ms": t * 1e3, "baseline_ms": b * 1e3,
                         "baseline": base_name, "efficiency": b / (n * t)})
    return rows


def _time_steps(run, steps: int, device, iters: int) -> List[float]:
    """Per-step times (s, medians over ``iters``) of ``run(mark)``, which calls ``mark()`` after each
    of its ``steps`` steps. On CUDA the steps are issued back to back, as a ring issues them, and
    timed by events between the marks: a step's time is the GPU's, including any wait for the
    host to launch it (a step whose host work outlasts its GPU work shows that), with no
    synchronize between steps."""
    cuda = device.type == "cuda"
    run(lambda: None)
    if cuda:
        torch.cuda.synchronize(device)
    per_step = []
    for _ in range(iters):
        if cuda:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            torch.cuda.synchronize(device)
            marks[0].record()
            done = iter(marks[1:])
            run(lambda: next(done).record())
            torch.cuda.synchronize(device)
            per_step.append([marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(steps)])
        else:
            stamps = [time.perf_counter()]
            run(lambda: stamps.append(time.perf_counter()))
            per_step.append([stamps[i + 1] - stamps[i] for i in range(steps)])
    return [sorted(t[i] for t in per_step)[len(per_step) // 2] for i in range(steps)]


def emulated_ring(plan, blocks, r: int, mark=lambda: None):
    """Rank r's steps of a pass-KV ring over ``blocks`` (every rank's (q, k, v) shard) on this one
    device: step s attends r's queries to the block of rank (r - s) mod N, merged into one running
    state as the ring merges them (Note [merge lag]); ``mark()`` after each step. Returns r's
    (out, lse): the ring's result for r's queries."""
    q = blocks[r][0]
    n, d = len(blocks), q.shape[-1]
    state = cp.merge._State(q.shape[0], q.shape[1], d, q.device)
    for step in range(n):
        src = (r - step) % n
        cp.plan._block_attention(plan, r, src, q, blocks[src][1], blocks[src][2], cp.default_attention, d ** -0.5,
                                 state)
        result = state.result(q.dtype) if step == n - 1 else None
        mark()
    return result


def emulated_attention(plan, blocks, r: int):
    """The attention calls alone of rank r's ring steps, inputs gathered beforehand: returns
    ``run(mark)`` for ``_time_steps``: the floor the attention library sets under each step."""
    n = len(blocks)
    q = blocks[r][0]
    scale = q.shape[-1] ** -0.5
    steps = []
    for step in range(n):
        _, kb, vb = blocks[(r - step) % n]
        steps.append([(cp.plan._rows(q, c.q_rows, c.q_span), cp.plan._rows(kb, c.k_rows, c.k_span),
                       cp.plan._rows(vb, c.k_rows, c.k_span), c) for c in plan.calls(r, (r - step) % n)])

    def run(mark):
        for calls in steps:
            for qc, kc, vc, c in calls:
                cp.default_attention(qc, kc, vc, c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal, scale)
            mark()
    return run


def emulated_step_rows(seqlens: List[int], world_sizes: List[int], device: torch.device, dtype: torch.dtype,
                       iters: int, shape=None) -> List[dict]:
    """World-1 estimate of a pass-KV ring's steps on N ranks: each rank's steps (its block-pair
    attention against the block the ring brings at that step, merged into one running state as
    the ring merges them, Note [merge lag], the last one into the result) issued back to back on
    this one device as the ring issues them and timed per step (``_time_steps``); a step costs the
    slowest rank's, beside the K/V block's bytes and its transfer time at select_mode's BW (tuned
    or default). ``hidden``: the transfer fits under the step. The ring's own host work per step
    (posting and waiting for the transfer) is not in it. ``attn_only_ms``: the same steps' attention
    calls alone on inputs gathered beforehand (``emulated_attention``), the floor the attention
    library sets: what the ring adds is the step time over it."""
    h, hkv, d = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    bw, _ = cp.machine_constants(device.type, 2)
    rows = []
    for length in seqlens:
        q, k, v = (t.to(device) for t in _sequence(length, h, hkv, d, dtype, 0))
        for n in world_sizes:
            plan = cp.plan._plan([length], [[0]] * n, n, "balanced", True, device)
            shards = [cp.shard([0, length], n, r) for r in range(n)]
            blocks = [(q[s.index.to(device)], k[s.index.to(device)], v[s.index.to(device)]) for s in shards]
            block_bytes = 2 * max(plan.kv_rows) * hkv * d * torch.tensor([], dtype=dtype).element_size()

            per_rank = [_time_steps(functools.partial(emulated_ring, plan, blocks, r), n, device, iters)
                        for r in range(n)]
            floor = [_time_steps(emulated_attention(plan, blocks, r), n, device, iters) for r in range(n)]
            for step in range(n):
                worst = max(t[step] for t in per_rank)
                rows.append({"seqlen": length, "world": n, "step": step, "attn_ms": worst * 1e3,
                             "attn_only_ms": max(t[step] for t in floor) * 1e3,
                             "block_mib": block_bytes / 2**20, "transfer_ms": block_bytes / bw * 1e3,
                             "hidden": block_bytes / bw <= worst})
    return rows


def torch_cp_rows(seqlens: List[int], device: torch.device, dtype: torch.dtype, iters: int,
                  shape=None) -> List[dict]:
    """PyTorch's context_parallel on the same causal sequence as scaling_rows: the q/k/v of the
    whole sequence as [1, H, L, D] buffers, sharded by the context manager (its own round-robin
    load balancing), F.scaled_dot_product_attention timed inside it. GQA through ``enable_gqa``
    where the CP dispatch takes it, else K/V repeated to H heads (``mode`` says which). A length
    where it fails gives a row with ``error`` instead of a time."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    h, hkv, d = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    n = dist.get_world_size()
    mesh = init_device_mesh(device.type, (n,))
    rows = []
    for length in seqlens:
        q, k, v = (t.to(device).transpose(0, 1).unsqueeze(0).contiguous()
                   for t in _sequence(length, h, hkv, d, dtype, 0))
        row = {"seqlen": length, "mode": "torch_cp"}
        for gqa in (True, False):
            try:
                qb, kb, vb = q.clone(), k.clone(), v.clone()
                if not gqa:
                    kb, vb = (x.repeat_interleave(h // hkv, dim=1) for x in (kb, vb))
                with context_parallel(mesh, buffers=[qb, kb, vb], buffer_seq_dims=[2, 2, 2],
                                      no_restore_buffers={qb, kb, vb}):
                    t = _time(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa),
                              device, iters)
                row.update(time_ms=t * 1e3, mode="torch_cp" if gqa else "torch_cp_mha", error=None)
                break
            except Exception as e:  # noqa: BLE001 - a baseline that does not run here is reported, not fatal
                row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        rows.append(row)
    return rows


# ---- the merge of attention states: the fused kernel vs the same arithmetic in torch ops ----

def merge_rows(tokens: List[int], device: torch.device, dtype: torch.dtype, iters: int, num_states: int = 2,
               shape=None) -> List[dict]:
    """Per token count: cp.merge_attention_states of ``num_states`` partials ([T, H, D] in
    ``dtype``, LSE [H, T]) into ``dtype``, timed as the fused op (CUDA) and as the torch-ops path
    (``cp.merge._merge2``, what CPU tensors run), with the bytes moved (every partial read once, the
    result written once) over the time."""
    h, _, d = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    esize = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for t in tokens:
        g = torch.Generator(device=device).manual_seed(t)
        outs = [torch.randn(t, h, d, generator=g, device=device).to(dtype) for _ in range(num_states)]
        lses = [torch.randn(h, t, generator=g, device=device) * 3 for _ in range(num_states)]

        def torch_ops():
            o, lse = outs[0].float(), lses[0]
            for o2, l2 in zip(outs[1:], lses[1:]):
                o, lse = cp.merge._merge2(o, lse, o2.float(), l2)
            return o.to(dtype), lse

        nbytes = (num_states + 1) * t * h * d * esize + (num_states + 1) * h * t * 4
        sum_out = torch.empty_like(outs[0])
        row = {"tokens": t, "states": num_states, "mib": nbytes / 2**20,
               "torch_ms": _time(torch_ops, device, iters) * 1e3, "fused_ms": None,
               # the memory roofline of the same bytes: torch.add over the outputs (LSE bytes not counted)
               "add_ms": _time(lambda: torch.add(outs[0], outs[1], out=sum_out), device, iters) * 1e3
               if num_states == 2 else None,
               "add_mib": 3 * t * h * d * esize / 2**20}
        if cp.merge._merge_kernel(outs[0]):
            row["fused_ms"] = _time(lambda: cp.merge_attention_states(outs, lses), device, iters) * 1e3
            ref, _ = torch_ops()
            got, _ = cp.merge_attention_states(outs, lses)
            row["max_diff"] = (got.float() - ref.float()).abs().max().item() if t else 0.0
        rows.append(row)
    return rows


# ---- the (T, P) grid: pass-KV vs pass-Q (stream, all-to-all), and select_mode's hit rate ----

GRID_MODES = ("pass_kv", "pass_q", "pass_q_a2a")


def _grid_cases(device_type: str, world_size: int, cached: Optional[List[int]] = None,
                fractions=(0.01, 0.025, 0.05, 0.1), decode_batches=(1, 8, 32)):
    """(kind, T, P, batch) cases: partial prefill of one sequence with P cached tokens and T new
    ones at each fraction T/(T+P), and decode of ``batch`` one-token sequences with P cached each."""
    cached = cached or ([16384, 65536] if device_type == "cuda" else [512, 2048])
    cases = []
    for p in cached:
        for f in fractions:
            t = max(2 * world_size, int(round(p * f / (1 - f))))
            cases.append(("prefill", t, p, 1))
        for b in decode_batches:
            if b * p <= 1 << 20:  # at most 1M cached tokens in all (the cache is b x P per case)
                cases.append(("decode", b, p, b))
    return cases


def grid_rows(comm, device: torch.device, dtype: torch.dtype, iters: int, shape=None, cases=None) -> List[dict]:
    """One row per (T, P) case: each mode's median time, the fastest, select_mode's pick (the
    rule ring_attention's ``auto`` applies) and whether the pick was the fastest. The cache is split
    evenly over the ranks; prefill shards the new tokens in the balanced layout, decode places the
    sequences round-robin (auto is pass-Q there by construction; the row still times all three)."""
    h, hkv, d = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    n, rank = comm.world_size, comm.rank
    rows = []
    for kind, t_new, p_cached, batch in cases or _grid_cases(device.type, n):
        lens = [1] * batch if kind == "decode" else [t_new]
        cu = [0]
        for x in lens:
            cu.append(cu[-1] + x)
        layout = "round_robin" if kind == "decode" else "balanced"
        g = torch.Generator().manual_seed(31 * t_new + p_cached)
        q, k, v = (torch.randn(cu[-1], x, d, generator=g).to(dtype) for x in (h, hkv, hkv))
        per_rank = [[p_cached // n + (1 if r < p_cached % n else 0) for _ in lens] for r in range(n)]
        gd = torch.Generator(device=device).manual_seed(17 * t_new + p_cached + rank)  # the cache: made in place
        kc, vc = (torch.randn(sum(per_rank[rank]), hkv, d, generator=gd, device=device).to(dtype) for _ in range(2))
        sh = cp.shard(cu, n, rank, layout=layout)
        qs, ks, vs = (x[sh.index].to(device) for x in (q, k, v))
        times = {}
        for name in GRID_MODES:
            mode, ret = CP_MODES[name]
            times[name] = _time(lambda: cp.ring_attention(comm, qs, ks, vs, cu_seqlens_q=cu, layout=layout,
                                                          kv_cache=(kc, vc, per_rank[rank]), mode=mode,
                                                          pass_q_return=ret), device, iters) * 1e3
        pick = "pass_q" if kind == "decode" else cp.select_mode(
            t_new, p_cached * batch, n, h, hkv, d, dtype, device_type=device.type)
        best = min(times, key=times.get)
        pick_ms = min(times[m] for m in GRID_MODES if CP_MODES[m][0] == pick)
        rows.append({"kind": kind, "T": t_new, "P": p_cached * batch, "new_fraction": t_new / (t_new + p_cached * batch),
                     **{f"{m}_ms": times[m] for m in GRID_MODES}, "fastest": best, "pick": pick,
                     "hit": pick_ms <= times[best], "stream_vs_a2a": times["pass_q"] / times["pass_q_a2a"]})
    return rows


def print_grid(rows: List[dict], header: str) -> None:
    print(f"# {header}")
    print(f"# {'kind':>7} {'T':>7} {'P':>8} {'new %':>6} {'pass_kv ms':>10} {'pass_q ms':>10} {'q_a2a ms':>10} "
          f"{'fastest':>10} {'pick':>8} hit")
    for r in rows:
        print(f"  {r['kind']:>7} {r['T']:>7d} {r['P']:>8d} {100 * r['new_fraction']:>6.2f} {r['pass_kv_ms']:>10.3f} "
              f"{r['pass_q_ms']:>10.3f} {r['pass_q_a2a_ms']:>10.3f} {r['fastest']:>10} {r['pick']:>8} "
              f"{'yes' if r['hit'] else 'no'}")
    hits = sum(r["hit"] for r in rows)
    stream = sum(r["stream_vs_a2a"] <= 1.0 for r in rows)
    print(f"# select_mode picked the fastest mode in {hits} of {len(rows)} cases "
          f"({100.0 * hits / max(1, len(rows)):.0f} %; criterion >= 90 %); pass-Q's streamed return beat the "
          f"post-loop all-to-all in {stream} of {len(rows)}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commlib.perf.ops_cp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=_int_list, default=None)
    p.add_argument("--modes", default="pass_kv,pass_q,pass_q_a2a")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--torch-cp", action="store_true",
                   help="add PyTorch's context_parallel on the same inputs as a baseline row")
    p.add_argument("--grid", action="store_true",
                   help="the (T, P) grid: pass-KV vs pass-Q (stream, all-to-all) at 1-10%% new tokens and "
                        "decode, and select_mode's hit rate")
    p.add_argument("--grid-cached", type=_int_list, default=None, metavar="P1,P2,...",
                   help="--grid: cached tokens per case (default 16384,65536 on GPU, 512,2048 on CPU)")
    p.add_argument("--no-scaling", action="store_true", help="skip the full-prefill scaling rows")
    p.add_argument("--merge", type=_int_list, default=None, metavar="T1,T2,...",
                   help="time merge_attention_states of 2 partials of T tokens: the fused kernel vs torch ops")
    p.add_argument("--emulate", type=_int_list, default=None, metavar="N1,N2,...",
                   help="world 1: per-step cost of a pass-KV ring on N ranks (attention per step vs the "
                        "K/V block's transfer at the tuned BW)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="rewrite FILE (e.g. bench/results/cp.md) with the tables rank 0 prints")
    opts = p.parse_args(argv)
    if not opts.out:
        return _run(opts, p)
    printed = _Tee(sys.stdout)
    with contextlib.redirect_stdout(printed):
        rc = _run(opts, p)
    if int(os.environ.get("RANK", 0)) == 0:
        device_type = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        command = "python -m commlib.perf.ops_cp " + " ".join(argv if argv is not None else sys.argv[1:])
        text = "\n".join([
            "# ring_attention: context-parallel causal prefill (commlib.perf.ops_cp)", "",
            f"- machine: {machine_description(device_type)}; {software_description(device_type)}",
            f"- commit: {source_commit()}", f"- date: {now_utc()}", f"- command: `{command}`",
            "- columns: the module docstring of commlib/perf/ops_cp.py; the 1-GPU baseline is the fastest "
            "causal attention PyTorch offers on the machine (`best_attention`)", "",
            "Regenerate: run the command above (it rewrites this file).", "", "```",
            printed.getvalue().rstrip("\n"), "```", ""])
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as f:
            f.write(text)
        print(f"# wrote {opts.out}", flush=True)
    return rc


class _Tee(io.StringIO):
    """Keeps what is printed and passes it on (a long run shows its rows as they come)."""

    def __init__(self, through):
        super().__init__()
        self._through = through

    def write(self, text: str) -> int:
        self._through.write(text)
        return super().write(text)

    def flush(self) -> None:
        self._through.flush()


def _run(opts, p: argparse.ArgumentParser) -> int:
    modes = [m for m in opts.modes.split(",") if m]
    for m in modes:
        if m not in CP_MODES:
            p.error(f"--modes: '{m}' not supported; supported: {', '.join(CP_MODES)}")
    device_type = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    import commlib
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    if world > 1:
        dist.init_process_group(backend)
        store = dist.distributed_c10d._get_default_store()
    else:
        store = dist.HashStore()
        if opts.torch_cp:  # PyTorch's context_parallel needs a process group (and a mesh), even of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    comm = commlib.Communicator(store, rank, world, "ops-cp")
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    seqlens = opts.seqlens or ([8192, 32768, 131072] if device_type == "cuda" else [1024, 4096])
    rows = [] if opts.no_scaling else scaling_rows(comm, seqlens, modes, device, dtype, opts.iters)
    torch_rows = torch_cp_rows(seqlens, device, dtype, opts.iters) if opts.torch_cp else []
    grid = grid_rows(comm, device, dtype, opts.iters,
                     cases=_grid_cases(device_type, world, opts.grid_cached)) if opts.grid else []
    if opts.emulate and rank == 0:
        print(f"# emulated pass-KV steps on one device ({dtype}); transfer at BW "
              f"{cp.machine_constants(device_type, 2)[0] / 1e9:.0f} GB/s")
        print(f"# {'seqlen':>8} {'N':>3} {'step':>4} {'step ms':>10} {'attn only':>10} {'block MiB':>10} "
              f"{'xfer ms':>10} hidden")
        steps = emulated_step_rows(seqlens, opts.emulate, device, dtype, opts.iters)
        for r in steps:
            print(f"  {r['seqlen']:>8d} {r['world']:>3d} {r['step']:>4d} {r['attn_ms']:>10.3f} {r['attn_only_ms']:>10.3f} "
                  f"{r['block_mib']:>10.2f} {r['transfer_ms']:>10.3f} {'yes' if r['hidden'] else 'no'}")
        h_, hkv_, d_ = GPU_SHAPE if device_type == "cuda" else CPU_SHAPE
        print("# per seqlen and N: the steps' sum against the ideal (the best 1-GPU attention / N); 'attn' = the "
              "attention calls alone over the ideal, 'ring' = the steps over the attention calls alone")
        print(f"# {'seqlen':>8} {'N':>3} {'steps ms':>10} {'ideal ms':>10} {'ratio':>6} {'attn':>6} {'ring':>6} 1-GPU")
        measured = {r["seqlen"]: (r["baseline_ms"], r["baseline"]) for r in rows}  # same shape and data
        for length in seqlens:
            if length in measured:
                base_ms, base_name = measured[length]
            else:
                q1, k1, v1 = (t.to(device) for t in _sequence(length, h_, hkv_, d_, dtype, 0))
                base_ms, base_name = best_attention(q1, k1, v1, length, device, opts.iters)
            for n in opts.emulate:
                total = sum(r["attn_ms"] for r in steps if r["seqlen"] == length and r["world"] == n)
                alone = sum(r["attn_only_ms"] for r in steps if r["seqlen"] == length and r["world"] == n)
                print(f"  {length:>8d} {n:>3d} {total:>10.3f} {base_ms / n:>10.3f} {total * n / base_ms:>6.3f} "
                      f"{alone * n / base_ms:>6.3f} {total / alone:>6.3f} {base_name} {base_ms:.3f} ms")
    merges = merge_rows(opts.merge, device, dtype, opts.iters) if opts.merge and rank == 0 else []
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu"
        if merges:
            print(f"# merge_attention_states, 2 partials -> {dtype}, heads "
                  f"{GPU_SHAPE if device_type == 'cuda' else CPU_SHAPE} (q, kv, head_dim), {name}")
            print(f"# {'tokens':>8} {'MiB':>8} {'fused ms':>10} {'GB/s':>8} {'torch ms':>10} {'GB/s':>8} "
                  f"{'add ms':>8} {'add GB/s':>8} {'of add':>6} max|diff|")
            for r in merges:
                fused = r["fused_ms"]
                f_txt = (f"{fused:>10.4f} {r['mib'] * 2**20 / (fused * 1e6):>8.1f}" if fused else f"{'-':>10} {'-':>8}")
                add_bw = r["add_mib"] * 2**20 / (r["add_ms"] * 1e6) if r["add_ms"] else None
                a_txt = f"{r['add_ms']:>8.4f} {add_bw:>8.1f}" if add_bw else f"{'-':>8} {'-':>8}"
                of_add = f"{r['mib'] * 2**20 / (fused * 1e6) / add_bw:>6.2f}" if fused and add_bw else f"{'-':>6}"
                print(f"  {r['tokens']:>8d} {r['mib']:>8.1f} {f_txt} {r['torch_ms']:>10.4f} "
                      f"{r['mib'] * 2**20 / (r['torch_ms'] * 1e6):>8.1f} {a_txt} {of_add} "
                      f"{r.get('max_diff', float('nan')):.2e}")
        print(f"# ring_attention causal prefill, {dtype}, heads "
              f"{GPU_SHAPE if device_type == 'cuda' else CPU_SHAPE} (q, kv, head_dim), world {world}, {name}")
        print(f"# {'seqlen':>8} {'mode':>10} {'time ms':>10} {'1-GPU ms':>10} {'efficiency':>10} 1-GPU backend")
        base = {r["seqlen"]: r["baseline_ms"] for r in rows}
        for r in rows:
            print(f"  {r['seqlen']:>8d} {r['mode']:>10} {r['time_ms']:>10.3f} {r['baseline_ms']:>10.3f} "
                  f"{r['efficiency']:>10.3f} {r['baseline']}")
        for r in torch_rows:
            if r.get("error"):
                print(f"# {r['seqlen']:>8d} {r['mode']:>10} not run: {r['error']}")
            elif r["seqlen"] in base:
                print(f"  {r['seqlen']:>8d} {r['mode']:>10} {r['time_ms']:>10.3f} {base[r['seqlen']]:>10.3f} "
                      f"{base[r['seqlen']] / (world * r['time_ms']):>10.3f}")
            else:
                print(f"  {r['seqlen']:>8d} {r['mode']:>10} {r['time_ms']:>10.3f} {'-':>10} {'-':>10}")
        if grid:
            print_grid(grid, f"(T, P) grid, world {world}, {dtype}, heads (q, kv, head_dim) "
                             f"{GPU_SHAPE if device_type == 'cuda' else CPU_SHAPE}; times in ms (median of "
                             f"{opts.iters})")
            if world == 1:
                print("# world 1: no ring, every mode is local work; the hit rate is meaningful from world 2 on")
    comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
