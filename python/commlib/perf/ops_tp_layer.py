"""commlib-perf operation ``tp_layer``: one Llama-style tensor-parallel decoder layer
(``commlib.models.llama.TPDecoderLayer``), and the TokenWeave sweep report.

In the commlib-perf table (``commlib-perf tp_layer --tokens 256,1024,4096 -d bfloat16 -G 10``):

* ``ddacomm``: the layer in ``--tp-mode`` (default ``tokenweave``: the adaptive policy; ``split``:
  always the wave-aware split; ``fused``; ``nocomm``: the all-reduces removed, the floor), over
  commlib's communicator.
* ``nccl`` / ``gloo`` / ``symm``: the layer in ``sequential`` mode with that backend's
  ``all_reduce`` (what engines do today), so the ratio column is the speed-up over sequential.

Size = tokens x hidden x element size (``--tokens``); busbw counts the layer's two all-reduces of
[tokens, hidden]. Out-of-place only. Inputs: hidden and residual random (normal, seeded per size),
one sequence of all the tokens; weights random with a fixed seed (``--tp-model``: ``llama-70b``,
Llama-3.3-70B's layer, default on GPU; ``small`` on CPU). Check: the output against the whole
layer computed without sharding from the joined shards (fp64 on CPU, fp32 on GPU; attention by
KV-head group), within 0.1 x (1 + |ref|) per element (bf16 roundings of ~10 ops; see
tests/cpu/test_tokenweave.py); NaN is wrong. ``nocomm`` is checked against the rank's own shards
as a layer (``shard_as_layer``: what the rank computes without the all-reduces).

The sweep report, ``python -m commlib.perf.ops_tp_layer`` (one process: world 1 on one GPU; under
``torchrun --nproc-per-node N``: world N), prints per token count the layer's time in every mode
(CUDA-graph replay, median), the ratios against ``sequential``, the no-communication floor, the
split the policy chose against the best of a sweep of forced splits, and the fused op's SM budget;
``--out bench/results/tp_layer.md`` writes it as the results file.
At world 1 the all-reduce is local and the overlapped fused op takes its own CTA count (Note
[overlap SM budget] in tokenweave.py), so the report measures what one GPU can (the wave steps, the
split, the cost of splitting; the overlap line: what a GEMM loses beside the fused op on the SM
budget of world sizes > 1), not the hidden communication.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from ..models.llama import LlamaConfig
from . import harness, registry, rows
from .registry import Buffers, Case, Collective, Unsupported

NAME = "tp_layer"
LAYER_MODES = ("tokenweave", "split", "fused", "nocomm", "sequential")
TOLERANCE = 0.1
SEED = 1234


CONFIGS = {"llama-70b": LlamaConfig.llama_70b(), "small": LlamaConfig.small()}


def _add(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--tp-model", dest="tp_model", choices=("llama-70b", "small"), default=None,
                       help=f"{NAME}: layer shapes (default llama-70b on GPU, small on CPU)")
    group.add_argument("--tp-mode", dest="tp_mode", choices=LAYER_MODES, default="tokenweave",
                       help=f"{NAME}: what ddacomm runs (default tokenweave: the adaptive policy; split: always "
                            "the wave-aware split; nocomm: the all-reduces removed); nccl/gloo run sequential")
    group.add_argument("--tp-num-sms", dest="tp_num_sms", type=int, default=None,
                       help=f"{NAME}: CTAs of the fused op beside the other group's compute (default tuned, else 16)")


def _validate(opts: argparse.Namespace) -> Optional[str]:
    if NAME not in getattr(opts, "ops", []):
        return None
    if opts.tp_num_sms is not None and opts.tp_num_sms < 1:
        return f"--tp-num-sms {opts.tp_num_sms} must be >= 1"
    return None


registry.register_options(NAME, _add, _validate)


def _model(options: dict, device: torch.device) -> str:
    return options.get("tp_model") or ("llama-70b" if device.type == "cuda" else "small")


class _GroupInfo:
    """What a sequential-only layer needs of a communicator: its place in the group."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def _layer(backend, case: Case):
    """The backend's layer (built once per backend, model and dtype; weights generated on the device)."""
    from ..models.llama import TPDecoderLayer
    model = _model(case.options, case.device)
    key = ("tp_layer", model, case.dtype)
    layer = backend.resources.get(key)
    if layer is None:
        cfg = CONFIGS[model]
        if backend.name == "ddacomm":
            layer = TPDecoderLayer(cfg, backend.comm, dtype=case.dtype, device=case.device, seed=SEED,
                                   num_sms=case.options.get("tp_num_sms"), init_device=case.device)
        else:  # the baseline: sequential with the backend's own all_reduce
            layer = TPDecoderLayer(cfg, _GroupInfo(case.rank, case.world_size), mode="sequential", dtype=case.dtype,
                                   device=case.device, seed=SEED, init_device=case.device,
                                   all_reduce=lambda t: backend.all_reduce(t, "sum"))
        backend.resources[key] = layer
    return layer


def _inputs(case: Case, tokens: int, hidden: int):
    g = torch.Generator().manual_seed((7919 * tokens + 104729 * case.salt + 17) & 0x7FFFFFFF)
    x = torch.randn(tokens, hidden, generator=g).to(case.dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(case.dtype)
    return x, residual


def _setup(case: Case) -> Buffers:
    model = _model(case.options, case.device)
    hidden = CONFIGS[model].hidden
    tokens = rows.tokens_of(case, hidden)
    x, residual = (t.to(case.device) for t in _inputs(case, tokens, hidden))
    out = registry.poison(torch.empty_like(x))
    return Buffers(inp=x, out=out, extra={"residual": residual, "residual0": residual.clone(), "tokens": tokens,
                                          "model": model})


def _run(backend, b: Buffers, case: Case) -> None:
    if case.in_place:
        raise Unsupported(f"{NAME} has no in-place form")
    try:
        layer = _layer(backend, case)
    except TypeError as err:  # e.g. float32 on CUDA: the fused GPU op takes 16-bit types
        raise Unsupported(f"{backend.name}: {err}") from err
    if backend.name == "ddacomm":
        mode = case.options.get("tp_mode") or "tokenweave"
    else:
        mode = "sequential"
    split = None
    if mode == "split":
        mode, split = "tokenweave", _wave_split(layer, b.extra["tokens"])
    try:
        out, _ = layer.forward(b.inp, b.extra["residual"], mode=mode, split=split)
    except TypeError as err:  # e.g. float32 on CUDA
        raise Unsupported(f"{backend.name}: {err}") from err
    b.out.copy_(out)
    b.extra["backend"] = backend.name


def _wave_split(layer, tokens: int) -> int:
    from .. import tokenweave
    return tokenweave.wave_aware_split(tokens, layer.gemm_shapes, layer.wave_steps)


# ---------------------------------------------------------------------------------------------
# The GEMMs' wave steps (commlib.tokenweave.find_wave_step on times measured here)

def measure_gemm_times(shape, tokens: Iterable[int], dtype: torch.dtype = torch.bfloat16, device=None,
                       iters: int = 20, repeats: int = 5) -> List[float]:
    """µs per ``F.linear`` of ``[T, k] x [n, k]^T`` (``shape``: a ``tokenweave.GemmShape``) for each
    T on this GPU: ``iters`` calls captured in a CUDA graph, the median of ``repeats`` replays
    (random data, never zeros)."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise ValueError(f"measure_gemm_times: device {device} not supported; supported: cuda")
    tokens = list(tokens)
    g = torch.Generator(device=device).manual_seed(7)
    weight = torch.randn(shape.n, shape.k, device=device, dtype=torch.float32, generator=g).to(dtype)
    x_max = torch.randn(max(tokens), shape.k, device=device, dtype=torch.float32, generator=g).to(dtype)
    out_max = torch.empty(max(tokens), shape.n, device=device, dtype=dtype)
    times = []
    for n in tokens:
        x, out = x_max[:n], out_max[:n]
        fn = lambda: torch.matmul(x, weight.t(), out=out)  # noqa: E731
        times.append(harness.cuda_graph_us(fn, iters, repeats, device))
    return times


def measure_wave_steps(shapes, dtype: torch.dtype = torch.bfloat16, device=None, max_tokens: int = 2048,
                       granule: Optional[int] = None, iters: int = 20) -> Dict[str, int]:
    """GPU: each shape's wave step ("NxK" -> tokens), from its times at granule, 2 granule, ...,
    ``max_tokens`` tokens (``measure_gemm_times`` then ``tokenweave.find_wave_step``)."""
    from .. import tokenweave
    granule = granule or tokenweave.WAVE_STEP_GRANULE
    tokens = list(range(granule, max_tokens + 1, granule))
    return {s.key: tokenweave.find_wave_step(tokens, measure_gemm_times(s, tokens, dtype, device, iters), granule)
            for s in shapes}


def _check(b: Buffers, case: Case) -> int:
    from ..models.llama import full_weights, reference_forward, shard_as_layer
    cfg = CONFIGS[b.extra["model"]]
    dtype = torch.float32 if case.device.type == "cuda" else torch.float64
    if case.options.get("tp_mode") == "nocomm" and b.extra.get("backend") == "ddacomm":
        cfg, w = shard_as_layer(cfg, case.world_size, case.rank, SEED, device=case.device, dtype=dtype)
    else:
        w = full_weights(cfg, case.world_size, SEED, device=case.device, dtype=dtype)
    ref, _ = reference_forward(cfg, w, b.inp, b.extra["residual0"])
    registry.plant(b.out, case)
    diff = (b.out.to(ref.dtype) - ref).abs()
    return int((~(diff <= TOLERANCE * (1 + ref.abs()))).sum())


def _sizes(cli_sizes, esize: int, world_size: int, options: dict):
    device = torch.device(options.get("device") or "cpu")
    return rows.row_sizes(cli_sizes, esize, CONFIGS[_model(options, device)].hidden, options.get("tokens"))


registry.register(Collective(
    name=NAME, count=lambda nbytes, esize, n: nbytes // esize, bus_factor=lambda n: 4.0 * (n - 1) / n,
    setup=_setup, run=_run, check=_check, sizes=_sizes))


# ---------------------------------------------------------------------------------------------
# The sweep report (python -m commlib.perf.ops_tp_layer)

def _time_graph(fn, device, iters: int, replays: int) -> float:
    """µs per call: ``iters`` calls in one CUDA graph, median of ``replays`` replays."""
    return harness.cuda_graph_us(fn, iters, replays, device)


def overlap_cost(layer, x: torch.Tensor, residual: torch.Tensor, device, iters: int, replays: int) -> dict:
    """What running the fused op beside a GEMM costs: half the batch's gate/up GEMM alone, the fused
    op on the other half alone, and both at once on two streams. At world 1 the fused op is local,
    a stand-in of the communication with the same SM budget.
    ``gemm_loss`` = (both - gemm) / gemm: an upper bound on the GEMM's slow-down (it includes any
    part of the fused op that did not fit under the GEMM). The budget is the layer's, else the
    built-in one of world sizes > 1 (``tokenweave.DEFAULT_NUM_SMS``): the cost a world-N overlap pays."""
    from .. import tokenweave
    num_sms = layer.num_sms or tokenweave.DEFAULT_NUM_SMS
    half = max(1, x.shape[0] // 2)
    a, b = x[:half], x[half:2 * half] if x.shape[0] >= 2 else x[:half]
    gu = torch.empty(half, 2 * layer.ffn, device=device, dtype=x.dtype)
    out = torch.empty_like(b)
    res = residual[half:2 * half].clone() if x.shape[0] >= 2 else residual[:half].clone()
    weight, eps = layer.weights["norm_post"], layer.config.eps
    side = layer.schedule.comm_stream

    def gemm():
        torch.matmul(a, layer._t["gate_up"], out=gu)

    def fused():
        layer.comm.fused_allreduce_rmsnorm(b, res, weight, eps, out=out, num_sms=num_sms)

    def both():
        if side is None:  # CPU: no streams
            fused()
            gemm()
            return
        cur = torch.cuda.current_stream(device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            fused()
        gemm()
        cur.wait_stream(side)

    t = {name: _max_over_ranks(_time_graph(fn, device, iters, replays), device)
         for name, fn in (("gemm", gemm), ("fused", fused), ("both", both))}
    return {"tokens": half, "num_sms": num_sms, **t, "gemm_loss": (t["both"] - t["gemm"]) / t["gemm"]}


def _max_over_ranks(t: float, device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    v = torch.tensor([t], device=device)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    return float(v.item())


def sweep(tokens: List[int], model: str = "llama-70b", iters: int = 5, replays: int = 10,
          split_step: int = 64, num_sms: Optional[int] = None, out=sys.stdout, device=None,
          measure_waves: bool = False, lines: Optional[List[str]] = None) -> List[dict]:
    """The sweep report on this process's GPU (world: torch.distributed's, else 1). One row per
    token count: µs per layer in every mode, ratios vs sequential, the floor, the chosen split and
    the best of the forced splits (multiples of ``split_step``; 0: none forced). ``lines``, when
    given, collects what rank 0 prints."""
    import commlib
    from .. import tokenweave
    from ..models.llama import TPDecoderLayer
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.distributed_c10d._get_default_store()
    else:
        rank, world = 0, 1
        store = dist.HashStore()
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    comm = commlib.Communicator(dist.PrefixStore("tp-layer-sweep", store), rank, world, "tp-layer-sweep")
    cfg = CONFIGS[model]
    group = dist.new_group(backend="nccl") if dist.is_initialized() else None
    layer = TPDecoderLayer(cfg, comm, device=device, seed=SEED, group=group, num_sms=num_sms, init_device=device)
    params = tokenweave.tuned_params(world)

    def p(line):
        if rank == 0:
            print(line, file=out, flush=True)
            if lines is not None:
                lines.append(line)

    if measure_waves:  # this GPU's wave steps for this world's shapes, used by the policy below
        layer.wave_steps = measure_wave_steps(layer.gemm_shapes, layer.dtype, device)
        params = tokenweave.TokenWeaveParams(layer.wave_steps, layer.split_min_tokens, layer.num_sms,
                                             "wave steps measured now")
    budget = f"{layer.num_sms} CTAs" if layer.num_sms else "the op's own (whole GPU; world 1: nothing to hide)"
    p(f"# tp_layer sweep: {model} (hidden {cfg.hidden}, {cfg.num_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim}, "
      f"ffn {cfg.ffn}), bf16, world {world}, "
      f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    engine = "NCCL (torch.distributed)" if group is not None else "commlib all_reduce_ (world 1: local)"
    p(f"# sequential all_reduce: {engine}")
    p(f"# tokenweave params ({params.source}): wave steps {layer.wave_steps}, "
      f"split_min_tokens {'never' if layer.split_min_tokens >= tokenweave.NO_SPLIT else layer.split_min_tokens}, fused op SM budget beside compute: {budget}; "
      f"CUDA graph of {iters} layers x {replays} replays, median, slowest rank")
    p(f"# {'tokens':>6} {'seq us':>10} {'fused us':>10} {'tw us':>10} {'split us':>10} {'floor us':>10} "
      f"{'fused x':>8} {'tw x':>8} {'tw/floor':>8} {'spl/flr':>8} {'split':>6} {'best':>6} {'best us':>10}")
    results = []
    for T in tokens:
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16).to(device)
        res0 = torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16).to(device)
        res = res0.clone()  # updated by every call: drifts, stays finite (normalised outputs)

        def timed(mode, split=None):
            def fn():
                layer.forward(x, res, mode=mode, split=split)
            return _max_over_ranks(_time_graph(fn, device, iters, replays), device)

        row = {"tokens": T, "sequential": timed("sequential"), "fused": timed("fused"),
               "tokenweave": timed("tokenweave"), "nocomm": timed("nocomm"),
               "policy_split": layer.split_for(T),
               "wave_split": tokenweave.wave_aware_split(T, layer.gemm_shapes, layer.wave_steps)}
        if not row["wave_split"]:
            row["split"] = None
        elif row["wave_split"] == row["policy_split"]:  # the policy ran this split: the same configuration
            row["split"] = row["tokenweave"]
        else:
            row["split"] = timed("tokenweave", row["wave_split"])
        swept = {}
        for s in range(split_step, T - split_step + 1, split_step) if split_step > 0 else ():
            swept[s] = timed("tokenweave", s)
        if row["wave_split"] and row["wave_split"] not in swept:
            swept[row["wave_split"]] = row["split"]
        row["swept"] = swept
        best = min(swept, key=swept.get) if swept else None
        row["best_split"], row["best_split_us"] = best, swept.get(best)
        row["overlap"] = overlap_cost(layer, x, res, device, iters, replays)
        results.append(row)
        fmt = lambda v: f"{v:10.1f}" if v else f"{'-':>10}"  # noqa: E731
        split_floor = f"{row['split'] / row['nocomm']:8.3f}" if row["split"] else f"{'-':>8}"
        p(f"  {T:>6d} {fmt(row['sequential'])} {fmt(row['fused'])} {fmt(row['tokenweave'])} {fmt(row['split'])} "
          f"{fmt(row['nocomm'])} {row['sequential'] / row['fused']:8.3f} {row['sequential'] / row['tokenweave']:8.3f} "
          f"{row['tokenweave'] / row['nocomm']:8.3f} {split_floor} {row['wave_split'] or '-':>6} {best or '-':>6} "
          f"{fmt(row['best_split_us'])}")
        ov = row["overlap"]
        p(f"  {'':>6} overlap at {ov['tokens']} + {ov['tokens']} tokens: gate/up GEMM {ov['gemm']:.1f} us alone, "
          f"fused op ({ov['num_sms']} CTAs) {ov['fused']:.1f} us alone, both on two streams {ov['both']:.1f} us "
          f"(GEMM slowed by at most {ov['gemm_loss']:.1%})")
    forced = f"the fastest of the forced splits (multiples of {split_step}) and the wave-aware split" \
        if split_step > 0 else "the wave-aware split (no forced splits)"
    p("# x = time(sequential) / time(mode); tw = tokenweave (the policy: split at 'split' only when tokens >= "
      "split_min_tokens); split = the wave-aware split always; floor = nocomm (all-reduces removed); spl/flr = "
      f"split / floor; best = {forced}")
    comm.close()
    return results


def write_results(path: str, command: str, world: int, lines: List[str]) -> None:
    """The results file (bench/results/tp_layer.md): machine, commit, date, command, the report."""
    from . import report
    device = torch.cuda.get_device_name()
    where = ("no peer: the all-reduces are local, so this measures the cost of splitting and of the overlap, "
             "not hidden communication" if world == 1 else f"{world} ranks, one GPU each")
    text = [f"# tp_layer: one Llama-3.3-70B decoder layer, sequential vs fused vs tokenweave (world {world})", "",
            f"- machine: {torch.cuda.device_count()}x {device} ({where}); {report.software_description('cuda')}",
            f"- commit: {report.source_commit()}",
            f"- date: {report.now_utc()}",
            f"- command: `{command}`", "", "```", *lines, "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(text))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlib.perf.ops_tp_layer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--model", choices=("llama-70b", "small"), default="llama-70b")
    ap.add_argument("-n", "--iters", type=int, default=5, help="layers per CUDA graph")
    ap.add_argument("-G", "--replays", type=int, default=10)
    ap.add_argument("--split-step", type=int, default=128,
                    help="the forced splits' spacing in tokens (0: force none; only the wave-aware split)")
    ap.add_argument("--num-sms", type=int, default=None, help="the fused op's CTAs beside compute")
    ap.add_argument("--measure-wave-steps", action="store_true",
                    help="measure the GEMMs' wave steps on this GPU first and use them (not written to the tune file)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", metavar="FILE.md", default=None,
                    help="write the report as a results file (machine, commit, date, command), e.g. "
                         "bench/results/tp_layer.md")
    opts = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tokens = [int(t) for t in opts.tokens.split(",")]
    lines: List[str] = []
    results = sweep(tokens, opts.model, opts.iters, opts.replays, opts.split_step, opts.num_sms,
                    measure_waves=opts.measure_wave_steps, lines=lines)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if opts.json and rank0:
        with open(opts.json, "w") as f:
            json.dump({"model": opts.model, "world_size": world,
                       "device": torch.cuda.get_device_name(), "results": results}, f, indent=1, default=str)
    if opts.out and rank0:
        args = sys.argv[1:] if argv is None else list(argv)
        write_results(opts.out, shlex.join(["python", "-m", "commlib.perf.ops_tp_layer", *args]), world, lines)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
