"""commlib-perf: an nccl-tests-style benchmark that times commlib beside gloo / NCCL / torch
symmetric memory in one run.

    commlib-perf                                  # CPU: ddacomm vs gloo, 2 processes, 1K..64M
    commlib-perf all_reduce -b 8 -e 256M -f 2 -G 20 --backend ddacomm nccl symm
    commlib-perf fused_allreduce_rmsnorm --tokens 1,128,1024 -d bfloat16 -G 20   # tokens x --hidden
    commlib-perf ep_dispatch_combine --tokens 1,32,512 -d bfloat16             # vs the host-synced a2a
    commlib-perf kv_transfer --device cuda --kv-blocks 1000,20000             # prefill -> decode KV push
    torchrun --nproc-per-node 2 -m commlib.perf all_gather -d bfloat16

Exit code: 0 when every result is right, 1 when any #wrong is non-zero, 2 on errors.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import List, Optional

from . import registry
from .backends import ALGOS, BACKENDS, split_name
from .report import PLOT_BESIDE_OUT


def parse_size(text: str) -> int:
    """nccl-tests sizes: 8, 1K, 64M, 1G (powers of 1024)."""
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        value = int(float(num) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size '{text}' not understood; examples: 8, 1K, 64M, 1G") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size '{text}' must be >= 0")
    return value


def _num_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commlib-perf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*", default=None,
                   help="operations (default all_reduce; 'all' for every registered one)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1K"), help="smallest size (default 1K)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplier (default 2)")
    p.add_argument("-i", "--stepbytes", type=parse_size, default=parse_size("1M"),
                   help="size increment when -f 1 (default 1M)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("-w", "--warmup_iters", dest="warmup", type=int, default=5, help="warm-up iterations (default 5)")
    p.add_argument("--rounds", type=int, default=4,
                   help="CPU: time each size's cells in this many rounds that take turns between the "
                        "backends, so all are timed in the same seconds (default 4; 1: one cell after "
                        "the other)")
    p.add_argument("-c", "--check", type=int, default=1, help="check results on random data: 1 (default) or 0")
    p.add_argument("-d", "--datatype", default="float",
                   help="float, half, bfloat16 (or float32/float16/bf16), comma-separated, or all (default float)")
    p.add_argument("-o", "--op", default="sum", help="sum, prod, max, min, avg, comma-separated, or all (default sum)")
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast (default 0)")
    p.add_argument("-G", "--cudagraph", dest="graph_launches", type=int, default=0,
                   help="CUDA: capture -n ops in a CUDA graph and replay it this many times (median); 0: eager")
    p.add_argument("-z", "--blocking", type=int, default=0, help="CUDA: synchronise after every op (1) or not (0)")
    p.add_argument("-np", "--nprocs", dest="np", type=int, default=None,
                   help="processes to start (default: all local GPUs, or 2 on CPU); ignored under torchrun")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="tensor device (default cuda with >= 2 GPUs, else cpu)")
    p.add_argument("--backend", nargs="+", default=None, metavar="NAME",
                   help=f"one or several of {', '.join(BACKENDS)} (also comma-separated; ddacomm:flat, "
                        "ddacomm:tree ... time several algorithms side by side); the first is the "
                        "subject, the second the baseline of the ratio column (default: ddacomm gloo on CPU, "
                        "ddacomm nccl on GPU)")
    p.add_argument("--cpu-bind", dest="cpu_bind", choices=("core", "none"), default="core",
                   help="CPU tensors: bind local rank r to the r-th CPU this process may use (core, default, "
                        "as MPI launchers do, when there are at least as many CPUs as local ranks) or not (none)")
    p.add_argument("--algo", choices=("auto", "flat", "tree"), default="auto",
                   help="ddacomm (and symm) all_reduce algorithm (default auto)")
    p.add_argument("--json", metavar="FILE", help="write results as JSON ('-' for stdout)")
    p.add_argument("--csv", metavar="FILE", help="write results as CSV ('-' for stdout)")
    p.add_argument("--out", metavar="FILE.md",
                   help="write a results file: machine, commit, date, this exact command and the table "
                        "(bench/results/OP.md; rerunning the command rewrites it)")
    p.add_argument("--plot", metavar="FILE.png", nargs="?", const=PLOT_BESIDE_OUT,
                   help="plot latency and busbw against size (needs matplotlib); without FILE: beside --out, "
                        "same name with .png")
    # Tests only: rank R damages one element of its output in the check path (proves #wrong works).
    p.add_argument("--corrupt-rank", dest="corrupt_rank", type=int, default=-1, help=argparse.SUPPRESS)
    registry.load_plugins()
    for title, add, _ in registry.option_groups():  # flags of the operations modules register
        add(p.add_argument_group(title))
    return p


def _split(values) -> List[str]:
    out: List[str] = []
    for v in values if isinstance(values, (list, tuple)) else [values]:
        out += [x for x in str(v).replace(",", " ").split() if x]
    return out


def resolve(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    opts = parser.parse_args(argv)
    opts.command_line = "commlib-perf " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    gpus = _num_gpus()
    if opts.device is None:
        opts.device = "cuda" if gpus >= 2 else "cpu"
    if opts.device == "cuda" and gpus < 1:
        parser.error("--device cuda: no CUDA device visible")
    if opts.np is None:
        opts.np = gpus if opts.device == "cuda" else 2
    if opts.np < 1 or (opts.device == "cuda" and opts.np > gpus):
        parser.error(f"-np {opts.np} out of range; valid: 1..{gpus if opts.device == 'cuda' else 'any'}")
    ops = _split(opts.ops) if opts.ops else ["all_reduce"]
    opts.ops = registry.table_names() if ops == ["all"] else ops
    for op in opts.ops:
        if op not in registry.names():
            parser.error(f"operation '{op}' not known; known: {', '.join(registry.names())}")
        if registry.get(op).standalone is not None and len(opts.ops) > 1:
            parser.error(f"operation '{op}' has a table of its own: run it alone")
    types = _split(opts.datatype)
    types = list(registry.DTYPES) if types == ["all"] else [registry.DTYPE_ALIASES.get(t, t) for t in types]
    for t in types:
        if t not in registry.DTYPES:
            parser.error(f"-d {t} not supported; supported: {', '.join(registry.DTYPES)} (or all)")
    opts.dtypes = types
    redops = _split(opts.op)
    redops = list(registry.REDOPS) if redops == ["all"] else redops
    for r in redops:
        if r not in registry.REDOPS:
            parser.error(f"-o {r} not supported; supported: {', '.join(registry.REDOPS)} (or all)")
    opts.redops = redops
    backends = _split(opts.backend) if opts.backend else (["ddacomm", "nccl"] if opts.device == "cuda"
                                                          else ["ddacomm", "gloo"])
    for spec in backends:
        b, algo = split_name(spec)
        if b not in BACKENDS:
            parser.error(f"--backend {b} not known; valid: {', '.join(BACKENDS)} (ddacomm and symm also as "
                         f"NAME:ALGO, ALGO one of {', '.join(ALGOS)})")
        if algo is not None and (b not in ("ddacomm", "symm") or algo not in ALGOS):
            parser.error(f"--backend {spec}: only ddacomm and symm take an algorithm; valid: "
                         f"{', '.join(ALGOS)}")
        if opts.device == "cpu" and b in ("nccl", "symm"):
            parser.error(f"--backend {b} needs CUDA tensors; valid on CPU: ddacomm, gloo")
    if len(set(backends)) != len(backends):
        parser.error(f"--backend lists a backend twice: {' '.join(backends)}")
    opts.backends = backends
    if opts.plot == PLOT_BESIDE_OUT and not opts.out:
        parser.error("--plot without a file name needs --out (the plot goes beside it)")
    if opts.out == "-":
        parser.error("--out needs a file name (for the table on stdout, leave --out out)")
    if opts.minbytes > opts.maxbytes:
        parser.error(f"-b {opts.minbytes} is larger than -e {opts.maxbytes}")
    if opts.stepfactor < 1:
        parser.error(f"-f {opts.stepfactor} must be >= 1")
    if opts.iters < 1 or opts.warmup < 0 or opts.graph_launches < 0 or opts.rounds < 1:
        parser.error("-n and --rounds must be >= 1, -w and -G >= 0")
    if opts.graph_launches and opts.device != "cuda":
        parser.error("-G (CUDA-graph launches) needs --device cuda")
    if not 0 <= opts.root < opts.np and "RANK" not in __import__("os").environ:
        parser.error(f"-r {opts.root} out of range; valid: 0..{opts.np - 1}")
    for _, _, validate in registry.option_groups():
        error = validate(opts) if validate else None
        if error:
            parser.error(error)
    return opts


def main(argv: Optional[List[str]] = None) -> int:
    opts = resolve(argv)
    standalone = registry.get(opts.ops[0]).standalone
    if standalone is not None:
        return standalone(opts)
    from .runner import launch
    return launch(opts)


if __name__ == "__main__":
    sys.exit(main())
