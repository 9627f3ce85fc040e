"""The per-rank benchmark loop and the process launcher of commlib-perf.

Timing (per rank; the table shows the slowest rank):
* CPU: the median of per-op wall times over ``iters`` calls (every call is blocking). With
  ``--rounds R`` (default 4) a size's cells (every backend, out of place and in place) are timed
  in R rounds that take turns, each round one untimed call and then its share of the ``iters``
  calls, so all backends are timed in the same seconds: on a shared VM whose speed changes within
  seconds, timing one backend after the other measures the machine's phases as much as the ratio.
* CUDA, eager: CUDA events around ``iters`` calls on the current stream, divided by ``iters``
  (nccl-tests' average); with ``-z 1`` the host synchronises after every call.
* CUDA, ``-G N``: ``iters`` calls captured in one CUDA graph, replayed N times; the median replay
  time divided by ``iters``.
Correctness: after timing, every (backend, mode) runs once more on fresh random inputs into
poisoned outputs and counts wrong elements against an fp64 reference (``registry``).
"""
from __future__ import annotations

import os
import statistics
import sys
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from . import backends as _backends
from . import harness
from . import registry
from .registry import Case, Unsupported
from .report import PLOT_BESIDE_OUT, Table, machine_description, now_utc, software_description, source_commit, today

DIST_TIMEOUT = timedelta(seconds=600)
MODES = (("oop", False), ("ip", True))  # the table's two columns: out of place, in place


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agree(ok: bool, reason: Optional[str]) -> Optional[str]:
    """Every rank learns whether any rank could not run the case (so all skip it together)."""
    flags: List = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (ok, reason))
    for rank_ok, rank_reason in flags:
        if not rank_ok:
            return rank_reason or "unsupported"
    return None


def _prepare(desc, backend, case: Case, opts):
    """Sets one (backend, mode) cell up and warms it: (the call, None), or (None, why every rank
    skips it)."""
    reason = None
    try:
        bufs = desc.setup(case)
        fn = lambda: desc.run(backend, bufs, case)  # noqa: E731
        fn()  # first call: raises Unsupported before any communication when the backend lacks it
    except Unsupported as e:
        reason = str(e)
    reason = _agree(reason is None, reason)
    if reason:
        return None, reason
    for _ in range(opts.warmup):
        fn()
    _sync(case.device)
    return fn, None


def _wrong(desc, backend, case: Case, opts) -> int:
    """Wrong elements of one more call on fresh random inputs into poisoned outputs (0 unchecked)."""
    if not opts.check:
        return 0
    check_case = Case(**{**case.__dict__, "salt": case.salt + 1, "corrupt": case.rank == opts.corrupt_rank})
    bufs = desc.setup(check_case)
    _sync(case.device)
    desc.run(backend, bufs, check_case)
    _sync(case.device)
    return desc.check(bufs, check_case)


def measure(desc, backend, case: Case, opts) -> dict:
    """One (backend, mode) cell on this rank, timed alone: {'time_us', 'wrong'} or {'reason'}."""
    device = case.device
    fn, reason = _prepare(desc, backend, case, opts)
    if reason:
        return {"reason": reason}
    dist.barrier()
    if device.type == "cuda" and opts.graph_launches > 0:
        if not backend.capturable:
            return {"reason": f"{backend.name}: not CUDA-graph capturable (-G)"}
        t_us = harness.cuda_graph_us(fn, opts.iters, opts.graph_launches, device)
    elif device.type == "cuda":
        t_us = harness.cuda_eager_us(fn, opts.iters, device, blocking=bool(opts.blocking))
    else:
        t_us = harness.cpu_us(fn, opts.iters)
    return {"time_us": t_us, "wrong": _wrong(desc, backend, case, opts)}


def round_sizes(iters: int, rounds: int) -> List[int]:
    """How many of ``iters`` timed calls each round makes (no more rounds than calls)."""
    rounds = max(1, min(rounds, iters))
    return [iters // rounds + (1 if i < iters % rounds else 0) for i in range(rounds)]


def measure_in_rounds(desc, cells, opts) -> List[dict]:
    """CPU: the cells [(backend, case)] of one size timed in rounds that take turns (``--rounds``),
    so every backend is timed in the same seconds. Each cell: {'time_us', 'wrong'} or {'reason'}."""
    prepared = [_prepare(desc, backend, case, opts) for backend, case in cells]
    times: List[List[float]] = [[] for _ in cells]
    for calls in round_sizes(opts.iters, opts.rounds):
        for (fn, reason), cell_times in zip(prepared, times):
            if reason:
                continue
            dist.barrier()
            fn()  # untimed: brings this cell's buffers back after the other cells' rounds
            cell_times += harness.cpu_call_times_us(fn, calls)
    return [{"reason": reason} if reason else
            {"time_us": statistics.median(cell_times), "wrong": _wrong(desc, backend, case, opts)}
            for (backend, case), (_, reason), cell_times in zip(cells, prepared, times)]


def _sizes(opts) -> List[int]:
    sizes, s = [], opts.minbytes
    while s <= opts.maxbytes:
        sizes.append(s)
        nxt = int(s * opts.stepfactor) if opts.stepfactor > 1 else s + max(opts.stepbytes, 1)
        s = nxt if nxt > s else s + 1
    return sizes


def _bind_cpu(mode: str, local_rank: int, world_size: int) -> str:
    """Binds this rank to one CPU (mode "core") and says how. Unbound, the scheduler's wake-up
    placement often puts both ranks of a 2-core machine on one CPU after any sleep (a gloo call, the
    harness's barrier): every hand-off then waits for a context switch, 31-48 µs instead of ~4 for a
    4 KiB all_reduce, for milliseconds at a time (Note [host shm waiting] in csrc/transport/host_shm.cc)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # torchrun sets it
    if mode == "none" or len(cpus) < local_ranks:
        return "no" if mode == "none" else f"no ({len(cpus)} CPUs for {local_ranks} ranks)"
    os.sched_setaffinity(0, {cpus[local_rank % len(cpus)]})
    return "one CPU each"


def run_rank(opts, rank: int, world_size: int, store, local_rank: int) -> int:
    """The benchmark on one rank (the default process group is initialised). Returns the exit code."""
    device = torch.device("cuda", local_rank) if opts.device == "cuda" else torch.device("cpu")
    binding = None  # CPU runs only
    if device.type == "cpu":
        torch.set_num_threads(1)  # n processes share the machine's cores; no intra-op oversubscription
        binding = _bind_cpu(opts.cpu_bind, local_rank, world_size)
    out = sys.stdout if rank == 0 else open(os.devnull, "w")
    meta = {"version": _version(), "command": opts.command_line, "machine": machine_description(device.type),
            "date": today(), "world_size": world_size, "device": device.type, "iters": opts.iters,
            "warmup": opts.warmup, "time": now_utc(), "commit": source_commit(),
            "software": software_description(device.type),
            "timing": (f"median of per-op wall time, ranks bound: {binding}" if device.type == "cpu" else
                       f"CUDA graph of {opts.iters} ops x {opts.graph_launches} replays, median"
                       if opts.graph_launches > 0 else f"CUDA events, mean of {opts.iters} ops"
                       + (", blocking" if opts.blocking else ""))}
    in_rounds = device.type == "cpu" and opts.rounds > 1
    if in_rounds:
        meta["timing"] += f", {len(round_sizes(opts.iters, opts.rounds))} rounds taking turns between the backends"
    options = dict(vars(opts))  # what operations read as case.options
    backends = []
    try:
        for name in opts.backends:
            backends.append(_backends.make(name, store=store, rank=rank, world_size=world_size, algo=opts.algo,
                                           device=device))
        for be in backends:
            if isinstance(be, _backends.SymmMem):
                be.reserve(opts.maxbytes)
        labels = [be.label() for be in backends]
        table = Table(out, meta, labels, bool(opts.check))
        table.header()
        for op in opts.ops:
            desc = registry.get(op)
            table.section(op)
            for type_name in opts.dtypes:
                dtype = registry.DTYPES[type_name]
                esize = torch.tensor([], dtype=dtype).element_size()
                sizes = _sizes(opts)
                if desc.sizes is not None:
                    sizes = desc.sizes(sizes, esize, world_size, options)
                for redop in (opts.redops if desc.has_redop else ["none"]):
                    for nbytes in sizes:
                        count = desc.count(nbytes, esize, world_size)
                        actual = count * esize
                        rows, cells = [], []
                        for be in backends:
                            rows.append({"op": op, "backend": be.label(), "bytes": actual, "count": count,
                                         "type": type_name, "redop": redop,
                                         "root": opts.root if desc.has_root else -1})
                            for mode, in_place in MODES:
                                cells.append((be, Case(rank=rank, world_size=world_size, nbytes=actual,
                                                       dtype=dtype, redop=redop if desc.has_redop else "sum",
                                                       root=opts.root, device=device, in_place=in_place,
                                                       options=options)))
                        if in_rounds:
                            results = measure_in_rounds(desc, cells, opts)
                        else:
                            results = [measure(desc, be, case, opts) for be, case in cells]
                        for i, row in enumerate(rows):
                            for j, (mode, _) in enumerate(MODES):
                                row[mode] = results[i * len(MODES) + j]
                        _gather_rows(rows, desc, world_size)
                        if rank == 0:
                            table.add_size(rows)
        wrong = _broadcast_int(table.total_wrong() if rank == 0 else 0)
        if rank == 0:
            table.footer()
            _write_outputs(table, opts)
        return 1 if wrong else 0
    finally:
        for be in backends:
            be.close()
        if out is not sys.stdout:
            out.close()


def _gather_rows(rows: List[dict], desc, world_size: int) -> None:
    """Slowest rank's time and every rank's wrong elements, into rank 0's rows."""
    mine = [[(r[m].get("time_us"), r[m].get("wrong")) for m in ("oop", "ip")] for r in rows]
    everyone: List = [None] * world_size
    dist.all_gather_object(everyone, mine)
    for i, row in enumerate(rows):
        for j, mode in enumerate(("oop", "ip")):
            if row[mode].get("time_us") is None:
                continue
            t = max(rank_rows[i][j][0] for rank_rows in everyone)
            row[mode]["time_us"] = t
            row[mode]["wrong"] = sum(rank_rows[i][j][1] for rank_rows in everyone)
            row[mode]["algbw"], row[mode]["busbw"] = registry.busbw_gbps(desc, row["bytes"], t, world_size)


def _broadcast_int(value: int) -> int:
    obj = [value]
    dist.broadcast_object_list(obj, src=0)
    return int(obj[0])


def plot_path(opts) -> Optional[str]:
    """--plot FILE, or with a bare --plot the results file's name with .png (beside --out)."""
    if opts.plot == PLOT_BESIDE_OUT:
        return os.path.splitext(opts.out)[0] + ".png" if opts.out else None
    return opts.plot


def _write_outputs(table: Table, opts) -> None:
    plot = plot_path(opts)
    for path, text in ((opts.json, table.to_json if opts.json else None),
                       (opts.csv, table.to_csv if opts.csv else None),
                       (opts.out, (lambda: table.to_markdown(plot)) if opts.out else None)):
        if not path:
            continue
        if path == "-":
            print(text(), flush=True)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(text())
            print(f"# wrote {path}", flush=True)
    if plot:
        err = table.plot(plot)
        print(err if err else f"# wrote {plot}", file=sys.stderr if err else sys.stdout, flush=True)


def _version() -> str:
    try:
        import commlib
        return commlib.__version__
    except Exception:  # noqa: BLE001
        return "?"


# ---------------------------------------------------------------------------------------------
# Processes

def _init_pg(rank: int, world_size: int, store) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore("commlib-perf/pg", store), rank=rank,
                            world_size=world_size, timeout=DIST_TIMEOUT)


def _rank(rank: int, world_size: int, store, opts) -> int:
    """One spawned rank (``harness.spawn``): the exit code, or SystemExit(2) on an error."""
    try:
        if opts.device == "cuda":
            torch.cuda.set_device(rank)
        _init_pg(rank, world_size, store)
        code = run_rank(opts, rank, world_size, store, rank)
        dist.destroy_process_group()
        return code
    except (ValueError, TypeError) as e:
        if rank == 0:
            print(f"commlib-perf: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def launch(opts) -> int:
    """Runs the benchmark: under torchrun (RANK/WORLD_SIZE set) in this process, else on -np spawned
    local processes. Returns the exit code (0 ok, 1 wrong results, 2 error)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if opts.device == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size, timeout=DIST_TIMEOUT)
        from torch.distributed import distributed_c10d as c10d
        try:
            return run_rank(opts, rank, world_size, c10d._get_default_store(), local_rank)
        finally:
            dist.destroy_process_group()
    try:
        return int(harness.spawn(_rank, opts.np, opts))
    except SystemExit as e:
        return 2 if e.code else 0
