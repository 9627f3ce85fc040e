"""commlib-tune: measures this machine's all_reduce crossovers (and, on GPU, the fused kernel's
CTA count) and caches them.

    commlib-tune                 # CPU: flat vs tree over shared memory, 2 processes
    commlib-tune -np 2 --device cuda   # GPU: flat vs tree vs NCCL, and fused_allreduce_rmsnorm's num_sms
    torchrun --nnodes=N ... -m commlib.perf.tune --hierarchical   # a multi-node job: two-level vs flat

The cache (``COMMLIB_TUNE_FILE``, default ``~/.cache/commlib/tune.txt``) is a text file, one
``<section> key=value ...`` record per line (Note [tune file format]; strings percent-encoded,
nested fields as dotted keys). It holds one ``entry`` per (device model, world size, link type,
library version)::

    entry key.device=NVIDIA%20H200 key.world_size=2 key.link=nvlink key.version=0.1.0 all_reduce.flat_max_bytes=262144 all_reduce.tree_max_bytes=33554432 fused_num_sms=16 collectives.all_gather=16777216
    all_reduce world_size=2 flat_max_bytes=262144 tree_max_bytes=33554432
    fused_num_sms world_size=2 num_sms=16
    host_all_reduce world_size=2 flat_max_bytes=65536
    collectives world_size=2 op=all_gather max_bytes=16777216

``commlib-tune --cp`` also measures ring attention's machine constants (``measure_cp``: attention
FLOP/s and the copy-engine ring bandwidth) into ``cp`` records (``key.*``, ``bw_bytes_per_s``,
``attn_flops_per_s``), which ``commlib.cp.select_mode`` reads.

The ``entry`` records are what commlib-tune reads (keyed; CPU entries have link "shm"); the
``all_reduce``, ``fused_num_sms`` and ``collectives`` records (from the GPU entries) and
``host_all_reduce`` (from the CPU entries) are rewritten on every save (``write_file``, Note [tune
file writer]) and are what the library reads, in C++, for the Python API and the torch backend
alike (csrc/core/algorithm_selector.hpp, Note [tune file format]): the file describes one machine.
The Python side of the library reads the file through ``commlib.tuned`` (which imports nothing of
this package). A malformed file raises ValueError naming the file and the line.

all_reduce with ``algo="auto"`` uses flat up to ``flat_max_bytes`` (inclusive), tree up to
``tree_max_bytes``, and NCCL above where an NCCL engine is attached (tree otherwise; on CPU there
is no NCCL, so ``tree_max_bytes`` is the largest size measured). ``fused_num_sms``: the GPU fused
all-reduce + RMSNorm kernel's CTA count, the smallest of FUSED_NUM_SMS_CANDIDATES whose time at
1024 tokens x hidden 8192 bf16 is within 5% of the best; absent on CPU or when not measured. The
fused op uses it as the cap of its by-size CTA count when the caller passes ``num_sms=None`` and
``COMMLIB_FUSED_NUM_SMS`` is 0. ``collectives`` (GPU, from the entries' ``collectives`` dicts):
per op (reduce_scatter, all_gather, broadcast, all_to_all) the largest message the torch backend
gives to commlib's push kernel rather than NCCL (Note [collective crossovers]). Explicit ``COMMLIB_*`` knobs win over the cache; without a
matching entry the built-in table applies.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

# The reading side lives in the product (commlib.tuned); the names are here too for the CLI's callers.
from ..tuned import (COLLECTIVE_OPS, FORMAT_VERSION, cache_path, cp_entries, cpu_model, format_file,  # noqa: F401
                     gpu_link, load, load_cp, make_key, read_file, tokenweave_tuned, validate)

FUSED_NUM_SMS_CANDIDATES = (8, 16, 32, 64, 132)
FUSED_TUNE_TOKENS, FUSED_TUNE_HIDDEN = 1024, 8192  # a representative prefill chunk (bf16)
FUSED_WITHIN = 0.05  # the smallest count within this fraction of the best time wins


# Note [tune file writer]
# Every change to the tune file goes through write_file: the savers below only edit the file's own
# records (the keyed "entries", and the "tokenweave", "cp" and "hierarchical" lists of read_file's
# dict), and write_file derives, from the entries, the records the C++ selector reads
# (csrc/core/algorithm_selector.cc, Note [tune file format]) and writes the whole file atomically,
# one line per record (commlib.tuned.format_file; comments and blank lines are not kept). A change
# of what the C++ side reads is a change of write_file alone.

def write_file(data: dict, path: Optional[str] = None) -> Path:
    """Writes the tune file ``data`` (Note [tune file writer]): validates it, rewrites the lists the
    C++ selector reads from its GPU and CPU entries, and replaces the file atomically (a reader
    never sees half a file). Returns the path."""
    p = cache_path(path)
    validate(data, p)
    gpu_entries = [e for e in data["entries"] if e["key"].get("link") != "shm"]
    data["all_reduce"] = [
        {"world_size": e["key"]["world_size"], "flat_max_bytes": e["all_reduce"]["flat_max_bytes"],
         "tree_max_bytes": e["all_reduce"]["tree_max_bytes"]} for e in gpu_entries]
    # tuned_fused_num_sms in C++.
    data["fused_num_sms"] = [{"world_size": e["key"]["world_size"], "num_sms": e["fused_num_sms"]}
                             for e in gpu_entries if e.get("fused_num_sms") is not None]
    # The other CUDA collectives' crossovers (Note [collective crossovers]).
    data["collectives"] = [{"world_size": e["key"]["world_size"], "op": op, "max_bytes": int(max_bytes)}
                           for e in gpu_entries for op, max_bytes in (e.get("collectives") or {}).items()]
    # The CPU all-reduce's flat limit (resolve_host_all_reduce).
    data["host_all_reduce"] = [{"world_size": e["key"]["world_size"],
                                "flat_max_bytes": e["all_reduce"]["flat_max_bytes"]}
                               for e in data["entries"] if e["key"].get("link") == "shm"]
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tune-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(format_file(data))
    os.replace(tmp, p)
    return p


def read_for_save(path: Optional[str] = None) -> dict:
    """The records a save keeps: read_file's, except that an older commlib's JSON file, which the
    library refuses, is replaced (with a note on stderr) rather than refused here too."""
    p = cache_path(path)
    if p.exists() and p.read_text().lstrip().startswith("{"):
        print(f"commlib-tune: replacing {p}, a JSON tune file of an older commlib", file=sys.stderr)
        return {"version": FORMAT_VERSION, "entries": []}
    return read_file(path)


def save(entry: dict, path: Optional[str] = None) -> Path:
    """Adds ``entry`` to the cache, replacing one with the same key."""
    data = read_for_save(path)
    data["entries"] = [e for e in data["entries"] if e["key"] != entry["key"]] + [entry]
    return write_file(data, path)


def _threshold(sizes: List[int], below: list, above: list) -> int:
    """The size t minimising the summed log-slowdown of "``below`` up to t, ``above`` past t"
    against the per-size best: one threshold fitted to all sizes, so a single noisy point does not
    move it. Returns 0 when ``below`` should never be used. None times count as very slow."""
    best = [min([t for t in (a, b) if t is not None] or [1.0]) for a, b in zip(below, above)]

    def slow(t, b):
        return math.log(t / b) if t is not None and b > 0 else 30.0

    costs = [sum(slow(below[i], best[i]) for i in range(k)) + sum(slow(above[i], best[i]) for i in range(k, len(sizes)))
             for k in range(len(sizes) + 1)]
    k = min(range(len(costs)), key=lambda j: (costs[j], -j))
    return sizes[k - 1] if k > 0 else 0


def crossovers(sizes: List[int], times: dict) -> dict:
    """From per-size times {"flat": [...], "tree": [...], ("nccl": [...])}: flat_max_bytes (flat up
    to it, 0: never) and tree_max_bytes (flat/tree up to it, NCCL above; the largest size when there
    is no NCCL), each the single threshold that fits all measured sizes best."""
    flat, tree, nccl = times["flat"], times["tree"], times.get("nccl")
    if not sizes:
        return {"flat_max_bytes": 0, "tree_max_bytes": 0}
    others = [min([t for t in (tr, nc) if t is not None] or [None]) if nccl else tr
              for tr, nc in zip(tree, nccl or [None] * len(sizes))]
    flat_max = _threshold(sizes, flat, others)
    tree_max = sizes[-1]
    if nccl:
        ours = [min([t for t in (f, t2) if t is not None] or [None]) for f, t2 in zip(flat, tree)]
        tree_max = max(_threshold(sizes, ours, nccl), flat_max)
    return {"flat_max_bytes": int(flat_max), "tree_max_bytes": int(tree_max)}


def _run_perf(argv: List[str]) -> dict:
    from .__main__ import resolve
    from .runner import launch
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        opts = resolve(argv + ["--json", out])
        code = launch(opts)
        if code != 0:
            raise RuntimeError(f"commlib-tune: measurement {' '.join(argv)} failed (exit code {code})")
        with open(out) as f:
            return json.load(f)


def measure(device: str, np_: int, minbytes: str, maxbytes: str, iters: int) -> tuple:
    """Runs the all_reduce sweep per algorithm; returns (sizes, {algo: [time_us per size]})."""
    common = ["all_reduce", "-b", minbytes, "-e", maxbytes, "-f", "2", "-n", str(iters), "-w", "3",
              "-np", str(np_), "--device", device, "-d", "bfloat16" if device == "cuda" else "float"]
    if device == "cuda":
        common += ["-G", "10"]
    # One run, every algorithm timed side by side per size: robust to load that drifts over time.
    algos = ["flat", "tree"] + (["nccl"] if device == "cuda" else [])
    result = _run_perf(common + ["--backend", *[a if a == "nccl" else f"ddacomm:{a}" for a in algos]])
    times = {}
    for algo in algos:
        label = algo if algo == "nccl" else f"ddacomm:{algo}"
        rows = [r for r in result["results"] if r["backend"] == label]
        sizes = [r["bytes"] for r in rows]
        times[algo] = [(r.get("ip") or {}).get("time_us") for r in rows]
    return sizes, times


def pick_fused_num_sms(times: Dict[int, Optional[float]], within: float = FUSED_WITHIN) -> Optional[int]:
    """The smallest CTA count whose time is within ``within`` of the best (fewer CTAs leave more
    SMs to the GEMMs that overlap the fused op); None when nothing was measured."""
    measured = {k: t for k, t in times.items() if t is not None and t > 0}
    if not measured:
        return None
    best = min(measured.values())
    return min(k for k, t in measured.items() if t <= best * (1 + within))


def measure_fused_num_sms(np_: int, iters: int, counts=FUSED_NUM_SMS_CANDIDATES, tokens: int = FUSED_TUNE_TOKENS,
                          hidden: int = FUSED_TUNE_HIDDEN) -> Dict[int, Optional[float]]:
    """GPU only: µs per fused_allreduce_rmsnorm (``tokens`` x ``hidden`` bf16, replicated residual,
    CUDA-graph replay) for each CTA count, one commlib-perf run per count."""
    times: Dict[int, Optional[float]] = {}
    for k in counts:
        result = _run_perf(["fused_allreduce_rmsnorm", "--tokens", str(tokens), "--hidden", str(hidden),
                            "-d", "bfloat16", "-n", str(iters), "-w", "3", "-G", "10", "-np", str(np_),
                            "--device", "cuda", "--backend", "ddacomm", "--fused-num-sms", str(k)])
        rows = [r for r in result["results"] if r["backend"] == "ddacomm"]
        times[k] = (rows[0].get("oop") or {}).get("time_us") if rows else None
    return times


# ---------------------------------------------------------------------------------------------
# TokenWeave (commlib.tokenweave): GEMM wave steps, the split crossover, the overlap's SM budget.
# Stored apart from the entries, in "tokenweave" records, one per (GPU, world size):
# {"device", "world_size", "wave_steps": {"NxK": tokens}, "split_min_tokens", "num_sms"}, a line
# `tokenweave device=... world_size=2 wave_steps.8192x1024=256 ... split_min_tokens=1024 num_sms=16`.

TOKENWEAVE_TOKENS = (256, 512, 1024, 2048, 4096)
TOKENWEAVE_NUM_SMS_CANDIDATES = (4, 8, 16, 32, 132)
TOKENWEAVE_NUM_SMS_TOKENS = 2048


def save_tokenweave(record: dict, path: Optional[str] = None) -> Path:
    """Adds ``record`` to the ``tokenweave`` records, replacing the one of the same device
    and world size."""
    data = read_for_save(path)
    keep = [r for r in data.get("tokenweave") or []
            if (r.get("device"), r.get("world_size")) != (record["device"], record["world_size"])]
    data["tokenweave"] = keep + [record]
    return write_file(data, path)


def split_crossover(tokens: List[int], unsplit: List[Optional[float]], split: List[Optional[float]]) -> int:
    """``split_min_tokens`` from the layer's times unsplit (fused) and split (tokenweave) per token
    count: the single threshold that fits all counts best (``_threshold``); past the largest count
    when splitting never pays."""
    if not tokens:
        raise ValueError("split_crossover: no token counts measured")
    below = _threshold(tokens, unsplit, split)
    if below == 0:
        return int(tokens[0])
    later = [t for t in tokens if t > below]
    return int(later[0]) if later else int(tokens[-1]) + 1


def _tp_layer_times(np_: int, iters: int, tokens, mode: str, num_sms: Optional[int] = None) -> Dict[int, float]:
    argv = ["tp_layer", "--tokens", ",".join(str(t) for t in tokens), "-d", "bfloat16", "-n", str(iters), "-w", "3",
            "-G", "5", "-np", str(np_), "--device", "cuda", "--backend", "ddacomm", "--tp-mode", mode, "-c", "0"]
    if num_sms is not None:
        argv += ["--tp-num-sms", str(num_sms)]
    result = _run_perf(argv)
    out = {}
    for r in result["results"]:
        t = (r.get("oop") or {}).get("time_us")
        if r["backend"] == "ddacomm" and t:
            out[int(r["count"]) // int(r.get("hidden") or 8192)] = t
    return out


def tokenweave_main(np_: int, iters: int, path: Optional[str] = None) -> int:
    """commlib-tune --tokenweave: measures on this machine (GPU) the wave steps of the Llama-70B
    layer's GEMMs at ``np_`` ranks (in this process, GPU 0), the fused op's SM budget beside the
    split layer, and the crossover (``commlib-perf tp_layer`` fused vs split); writes the record."""
    import torch

    from .. import tokenweave
    from .ops_tp_layer import CONFIGS, measure_wave_steps
    cfg = CONFIGS["llama-70b"]
    shapes = tokenweave.layer_gemm_shapes(cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn, np_)
    steps = measure_wave_steps(shapes, torch.bfloat16, torch.device("cuda", 0), iters=iters)
    print("# wave steps (tokens): " + ", ".join(f"{k} {w}" for k, w in steps.items()))
    record = {"device": torch.cuda.get_device_name(0), "world_size": int(np_), "wave_steps": steps,
              "split_min_tokens": None, "num_sms": None}
    try:
        by_sms = {k: _tp_layer_times(np_, iters, [TOKENWEAVE_NUM_SMS_TOKENS], "split", k).get(
            TOKENWEAVE_NUM_SMS_TOKENS) for k in TOKENWEAVE_NUM_SMS_CANDIDATES}
        print("# split layer at %d tokens: " % TOKENWEAVE_NUM_SMS_TOKENS
              + ", ".join(f"{k} CTAs {t:.1f} us" if t else f"{k} CTAs n/a" for k, t in by_sms.items()))
        measured = {k: t for k, t in by_sms.items() if t}
        record["num_sms"] = min(measured, key=lambda k: (measured[k], k)) if measured else None
        unsplit = _tp_layer_times(np_, iters, TOKENWEAVE_TOKENS, "fused")
        split = _tp_layer_times(np_, iters, TOKENWEAVE_TOKENS, "split", record["num_sms"])
        tokens = [t for t in TOKENWEAVE_TOKENS if t in unsplit and t in split]
        for t in tokens:
            print(f"  {t:>6d} tokens: fused {unsplit[t]:10.1f} us, split {split[t]:10.1f} us")
        if tokens:
            record["split_min_tokens"] = split_crossover(tokens, [unsplit[t] for t in tokens],
                                                         [split[t] for t in tokens])
    except RuntimeError as e:  # keep the wave steps; the policy then keeps its built-in crossover
        print(f"commlib-tune: tokenweave crossover not measured: {e}", file=sys.stderr)
    written = save_tokenweave(record, path)
    print(f"# wrote {written}: {json.dumps(record)}")
    return 0


def measure_collectives(np_: int, minbytes: str, maxbytes: str, iters: int, ops=COLLECTIVE_OPS) -> dict:
    """GPU: for each op, commlib's push kernel ("ddacomm:flat": never routed to NCCL) and NCCL timed
    side by side per size; returns {op: max_bytes}, the single crossover that fits all sizes best
    (commlib's kernel up to it, NCCL above; 0: NCCL everywhere). An op whose sweep fails is left out
    (it keeps the built-in limit)."""
    limits = {}
    for op in ops:
        argv = [op, "-b", minbytes, "-e", maxbytes, "-f", "2", "-n", str(iters), "-w", "3", "-np", str(np_),
                "--device", "cuda", "-d", "bfloat16", "-G", "10", "--backend", "ddacomm:flat", "nccl"]
        try:
            result = _run_perf(argv)
        except RuntimeError as e:
            print(f"commlib-tune: {op} not measured: {e}", file=sys.stderr)
            continue
        rows = {label: [r for r in result["results"] if r["backend"] == label] for label in ("ddacomm:flat", "nccl")}
        sizes = [r["bytes"] for r in rows["nccl"]]
        # Out-of-place times (all_to_all has no in-place form), the form the torch verbs take.
        times = {label: [(r.get("oop") or {}).get("time_us") for r in rs] for label, rs in rows.items()}
        if sizes and len(rows["ddacomm:flat"]) == len(sizes):
            limits[op] = int(_threshold(sizes, times["ddacomm:flat"], times["nccl"]))
            print(f"# {op}: " + ", ".join(
                f"{s} B {a if a is None else round(a, 2)}/{b if b is None else round(b, 2)} us"
                for s, a, b in zip(sizes, times["ddacomm:flat"], times["nccl"])) + f" -> max_bytes {limits[op]}")
    return limits


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="commlib-tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", "--nprocs", dest="np", type=int, default=None, help="processes (default: GPUs, or 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default cuda with >= 2 GPUs, else cpu")
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--file", default=None, help="cache path (default $COMMLIB_TUNE_FILE or ~/.cache/commlib/tune.txt)")
    p.add_argument("--show", action="store_true", help="print the cache and exit")
    p.add_argument("--cp", action="store_true", help="also measure ring attention's BW and C (commlib.cp.select_mode)")
    p.add_argument("--no-fused", dest="fused", action="store_false",
                   help="GPU: skip the fused kernel's CTA-count sweep (fused_num_sms stays empty)")
    p.add_argument("--no-collectives", dest="collectives", action="store_false",
                   help="GPU: skip the reduce_scatter / all_gather / broadcast / all_to_all crossovers")
    p.add_argument("--tokenweave", action="store_true",
                   help="GPU: measure only TokenWeave's wave steps, SM budget and split crossover (tokenweave_main)")
    p.add_argument("--hierarchical", action="store_true",
                   help="run under torchrun on every node of a multi-node job: measures the two-level "
                        "crossover of this job's host layout (measure_hierarchical) and writes it on each host")
    opts = p.parse_args(argv)
    if opts.hierarchical:
        return hierarchical_main(opts.iters, opts.device, opts.file)
    if opts.show:
        print(format_file(read_file(opts.file)), end="")
        return 0
    from .__main__ import _num_gpus
    gpus = _num_gpus()
    if opts.tokenweave:
        return tokenweave_main(opts.np or max(1, gpus), opts.iters, opts.file)
    device = opts.device or ("cuda" if gpus >= 2 else "cpu")
    np_ = opts.np or (gpus if device == "cuda" else 2)
    sizes, times = measure(device, np_, opts.minbytes, opts.maxbytes, opts.iters)
    if not sizes:
        p.error("no sizes measured; check -b/-e")
    key = make_key(device, np_)
    entry = {"key": key, "all_reduce": crossovers(sizes, times), "fused_num_sms": None}
    print(f"# {'bytes':>12} " + " ".join(f"{a + ' (us)':>12}" for a in times))
    for i, s in enumerate(sizes):
        print(f"  {s:>12d} " + " ".join(f"{times[a][i]:12.2f}" if times[a][i] else f"{'n/a':>12}" for a in times))
    if device == "cuda" and opts.fused:
        try:
            fused = measure_fused_num_sms(np_, opts.iters)
        except RuntimeError as e:  # keep the crossovers; the fused op then keeps its built-in cap
            print(f"commlib-tune: fused_num_sms not measured: {e}", file=sys.stderr)
            fused = {}
        entry["fused_num_sms"] = pick_fused_num_sms(fused)
        print(f"# fused_allreduce_rmsnorm {FUSED_TUNE_TOKENS} x {FUSED_TUNE_HIDDEN} bf16: "
              + ", ".join(f"{k} CTAs {t:.2f} us" if t else f"{k} CTAs n/a" for k, t in fused.items())
              + f" -> fused_num_sms {entry['fused_num_sms']}")
    if device == "cuda" and opts.collectives:
        entry["collectives"] = measure_collectives(np_, opts.minbytes, opts.maxbytes, opts.iters)
    path = save(entry, opts.file)
    print(f"# wrote {path}: {json.dumps(entry)}")
    if opts.cp:
        print(f"# cp: {json.dumps(tune_cp(device, np_, opts.file))}")
    return 0


# ---- context parallelism: select_mode's BW and C (commlib.cp) ----
CP_ATTN_SHAPE = {"cuda": (8192, 64, 8, 128), "cpu": (1024, 8, 2, 64)}  # tokens, q heads, kv heads, head_dim
CP_COPY_BYTES = {"cuda": 256 << 20, "cpu": 32 << 20}


def _median_time(fn, sync, iters: int) -> float:
    import time
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_cp(device_type: str, iters: int = 10) -> dict:
    """ring attention's machine constants, measured in this process: ``attn_flops_per_s`` (C: the
    default attention call on one causal sequence, bf16 on CUDA / fp32 on CPU, 4*T*T/2*H*D FLOPs)
    and ``bw_bytes_per_s`` (BW: one ring step's transfer, a copy-engine copy from GPU 0 into GPU 1;
    on CPU a memory copy; None with one GPU, where there is no ring)."""
    import torch

    from .. import cp
    t, h, hkv, d = CP_ATTN_SHAPE[device_type]
    dev = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    q = torch.randn(t, h, d, dtype=dtype, device=dev)
    k = torch.randn(t, hkv, d, dtype=dtype, device=dev)
    v = torch.randn(t, hkv, d, dtype=dtype, device=dev)
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    sec = _median_time(lambda: cp.default_attention(q, k, v, cu, cu, t, t, True, d ** -0.5), sync, iters)
    flops = 4.0 * t * t / 2 * h * d / sec
    bw = None
    nbytes = CP_COPY_BYTES[device_type]
    if device_type == "cpu":
        a, b = torch.empty(nbytes, dtype=torch.uint8).random_(), torch.empty(nbytes, dtype=torch.uint8)
        bw = nbytes / _median_time(lambda: b.copy_(a), sync, iters)
    elif torch.cuda.device_count() >= 2:
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").random_()
        b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        bw = nbytes / _median_time(lambda: b.copy_(a, non_blocking=True), lambda: (torch.cuda.synchronize(0),
                                                                               torch.cuda.synchronize(1)), iters)
    return {"bw_bytes_per_s": bw, "attn_flops_per_s": flops}


def tune_cp(device_type: str, world_size: int, path: Optional[str] = None) -> dict:
    """Measures (``measure_cp``) and caches the cp constants under this machine's key in the
    tune file's ``cp`` records; returns the new entry."""
    entry = {"key": make_key(device_type, world_size), **measure_cp(device_type)}
    data = read_for_save(path)
    data["cp"] = [e for e in cp_entries(data) if e.get("key") != entry["key"]] + [entry]
    write_file(data, path)
    return entry


# ---- the two-level crossover of multi-host "ddacomm" groups (Note [hierarchical crossover]) ----
HIER_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")
HIER_SIZES = tuple(1 << k for k in range(10, 27, 2))  # 1 KiB .. 64 MiB per rank


def hierarchical_min_bytes(sizes: List[int], flat: list, two_level: list) -> int:
    """The smallest message that should go two-level: flat up to the fitted threshold (``_threshold``),
    two-level past it; 0 when two-level wins everywhere."""
    t = _threshold(sizes, flat, two_level)
    return 0 if t == 0 else int(t) + 1


def measure_hierarchical(sizes=HIER_SIZES, iters: int = 10, device: Optional[str] = None) -> List[dict]:
    """Collective over the default process group of a job spanning several hosts (e.g. under
    torchrun): times each of HIER_OPS on two "ddacomm" groups of all ranks, one forced flat and one
    forced two-level (COMMLIB_HIER_ALGO), takes the slowest rank's median per size (so every rank
    gets the same answer) and returns the tune file's ``hierarchical`` entries for this layout
    (save them with ``save_hierarchical``). Raises ValueError when the group does not run two-level
    (one host, or hosts of unequal size)."""
    import time

    import torch
    import torch.distributed as dist

    from .. import backend_registration  # noqa: F401  (registers "ddacomm")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    groups = {}
    before = os.environ.get("COMMLIB_HIER_ALGO")
    try:
        for mode in ("flat", "hier"):
            os.environ["COMMLIB_HIER_ALGO"] = mode
            groups[mode] = dist.new_group(backend="ddacomm")
    finally:
        if before is None:
            os.environ.pop("COMMLIB_HIER_ALGO", None)
        else:
            os.environ["COMMLIB_HIER_ALGO"] = before
    layout = groups["hier"]._get_backend(torch.device("cpu")).host_layout
    if layout is None:
        raise ValueError("commlib.perf.tune.measure_hierarchical: the default group does not run two-level "
                         "collectives (one host, or hosts of unequal size)")
    num_hosts, local_size = layout[0], layout[1]
    world = dist.get_world_size()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def call(op, group, n):
        if op == "all_reduce":
            t = torch.ones(n, dtype=torch.float32, device=dev)
            return lambda: dist.all_reduce(t, group=group)
        if op == "reduce_scatter":
            out, inp = torch.empty(n, device=dev), torch.ones(n * world, device=dev)
            return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
        if op == "all_gather":
            out, inp = torch.empty(n * world, device=dev), torch.ones(n, device=dev)
            return lambda: dist.all_gather_into_tensor(out, inp, group=group)
        if op == "broadcast":
            t = torch.ones(n, device=dev)
            return lambda: dist.broadcast(t, src=0, group=group)
        return lambda: dist.barrier(group=group)

    entries = []
    for op in HIER_OPS:
        op_sizes = [0] if op == "barrier" else [int(s) for s in sizes]
        times = {"flat": [], "hier": []}
        for nbytes in op_sizes:
            for mode, group in groups.items():
                fn = call(op, group, max(nbytes // 4, 1))
                fn()  # warm-up (lazy set-up)
                sync()
                samples = []
                for _ in range(iters):
                    dist.barrier(group=groups["flat"])
                    start = time.perf_counter()
                    fn()
                    sync()
                    samples.append(time.perf_counter() - start)
                slowest = torch.tensor([sorted(samples)[len(samples) // 2]], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=groups["flat"])
                times[mode].append(float(slowest))
        if op == "barrier":  # no size: 0 takes the two-level barrier, 1 never does
            min_bytes = 0 if times["hier"][0] <= times["flat"][0] else 1
        else:
            min_bytes = hierarchical_min_bytes(op_sizes, times["flat"], times["hier"])
        entries.append({"op": op, "num_hosts": num_hosts, "local_size": local_size, "min_bytes": min_bytes})
    for group in groups.values():
        dist.destroy_process_group(group)
    return entries


def hierarchical_main(iters: int, device: Optional[str], path: Optional[str]) -> int:
    """``commlib-tune --hierarchical`` under torchrun: one process per GPU (or CPU rank) per node."""
    import torch
    import torch.distributed as dist

    from .. import backend_registration
    backend_registration.register_backend()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo")
    try:
        entries = measure_hierarchical(iters=iters, device=device)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"# {os.uname().nodename}: wrote {save_hierarchical(entries, path)}: {json.dumps(entries)}")
    finally:
        dist.destroy_process_group()
    return 0


def save_hierarchical(entries: List[dict], path: Optional[str] = None) -> Path:
    """Puts ``entries`` in the ``hierarchical`` records, replacing those of the same op and
    layout (Note [tune file format]). Every host reads its own file: write it on each host."""
    data = read_for_save(path)
    new = {(e["op"], e["num_hosts"], e["local_size"]) for e in entries}
    keep = [e for e in data.get("hierarchical") or [] if (e.get("op"), e.get("num_hosts"), e.get("local_size")) not in new]
    data["hierarchical"] = keep + list(entries)
    return write_file(data, path)


if __name__ == "__main__":
    sys.exit(main())
