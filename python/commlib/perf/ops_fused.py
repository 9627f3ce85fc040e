"""commlib-perf operation ``fused_allreduce_rmsnorm``: all-reduce of x + residual add + RMSNorm.

What each backend runs, on the same inputs (x: [tokens, hidden], different on every rank; residual
and weight identical on every rank; eps 1e-6):

* ``ddacomm``: ``comm.fused_allreduce_rmsnorm`` (commlib.fused) — one fused op (on GPU the P2P
  reduce-scatter -> norm -> all-gather kernel). ``--residual-mode`` picks replicated (vLLM's
  ``fused_add_rms_norm``) or sharded (TokenWeave); ``--fused-num-sms`` passes ``num_sms``.
* every other backend (``nccl``, ``gloo``, ``symm``): the unfused sequence through the backend's
  own collectives plus torch ops. Replicated: copy x, all_reduce, ``residual += sum``,
  ``out = rms_norm(residual) * weight``. Sharded: reduce_scatter of x (padded to world x
  ceil(tokens / world) rows, so each rank's chunk is its ``token_slice``), the owned rows' residual
  add + norm, all_gather of the normalised rows.

Sizes (``commlib.perf.rows``): tokens x hidden x element size; ``--tokens`` lists token counts;
``--hidden`` default 8192. busbw = algbw x 2(n-1)/n (an all-reduce of x). Out-of-place only
(``out`` may not alias x or residual): the in-place columns show n/a.

Check: every rank regenerates every rank's x and the shared residual and weight, computes in fp64
``r = residual + sum(x)``, ``out = r / sqrt(mean(r^2) + eps) * weight`` and counts the elements of
``out`` (all rows) and of the residual rows this rank updates (all rows replicated, its token slice
sharded) farther from it than ``_tolerance`` allows: (n + 3) roundings of the dtype of the terms
that enter (sum of |x|, |r|) plus the norm's reduction, so both the fused op (fp32 in registers)
and the unfused baseline (all-reduce in the dtype on gloo) pass, and a wrong or missing row does not.
"""
from __future__ import annotations

import argparse
import functools
import math
from typing import Optional

import torch

from ..fused import token_slice
from . import registry, rows
from .registry import Buffers, Case, Collective, Unsupported

NAME = "fused_allreduce_rmsnorm"
DEFAULT_HIDDEN = 8192
EPS = 1e-6
RESIDUAL_MODES = ("replicated", "sharded")


def _add(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--residual-mode", dest="residual_mode", choices=RESIDUAL_MODES, default="replicated",
                       help=f"{NAME}: residual replicated on every rank (vLLM) or sharded by token slice "
                            "(TokenWeave); the baselines run the matching unfused sequence (default replicated)")
    group.add_argument("--fused-num-sms", dest="fused_num_sms", type=int, default=None,
                       help=f"{NAME}, ddacomm on GPU: CTAs of the fused kernel (default: COMMLIB_FUSED_NUM_SMS, "
                            "else by size up to commlib-tune's fused_num_sms or 16)")


def _validate(opts: argparse.Namespace) -> Optional[str]:
    if NAME not in getattr(opts, "ops", []):
        return None
    hidden = rows.hidden_of(vars(opts), DEFAULT_HIDDEN)
    if hidden % 8 or hidden > 16384:
        return f"--hidden {hidden} not supported by {NAME}; supported: multiples of 8 up to 16384"
    if opts.fused_num_sms is not None and opts.fused_num_sms < 1:
        return f"--fused-num-sms {opts.fused_num_sms} must be >= 1"
    return None


registry.register_options(NAME, _add, _validate)


@functools.lru_cache(maxsize=16)
def _cpu_rows(seed: int, tokens: int, hidden: int, dtype: torch.dtype, low: float, high: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed & 0x7FFFFFFF)
    return (torch.rand(tokens, hidden, generator=g, dtype=torch.float32) * (high - low) + low).to(dtype)


def _inputs(rank: int, tokens: int, hidden: int, dtype: torch.dtype, salt: int):
    """(x of ``rank``, residual, weight) on the CPU: x and residual zero-mean (uniform in [-1, 1) and
    [-2, 2)), so the residual that the timed calls keep updating does not grow; weight in [0.75, 1.25)."""
    base = 7919 * tokens + 31 * hidden + 104729 * salt
    x = _cpu_rows(1000003 * (rank + 1) + base, tokens, hidden, dtype, -1.0, 1.0)
    residual = _cpu_rows(17 + base, tokens, hidden, dtype, -2.0, 2.0)
    weight = _cpu_rows(29 + base, 1, hidden, dtype, 0.75, 1.25)[0]
    return x, residual, weight


def _shape(case: Case):
    hidden = rows.hidden_of(case.options, DEFAULT_HIDDEN)
    return rows.tokens_of(case, hidden), hidden


def _mode(case: Case) -> str:
    return case.options.get("residual_mode") or "replicated"


def _setup(case: Case) -> Buffers:
    tokens, hidden = _shape(case)
    x, residual, weight = (t.to(case.device, copy=True) for t in _inputs(case.rank, tokens, hidden, case.dtype,
                                                                           case.salt))
    out = registry.poison(torch.empty_like(x))
    n = case.world_size
    per_rank = (tokens + n - 1) // n
    extra = {"residual": residual, "weight": weight, "tokens": tokens, "hidden": hidden,
             "work": torch.empty_like(x)}
    if _mode(case) == "sharded":  # the unfused baseline's padded buffers (rows past tokens stay zero)
        extra["x_pad"] = torch.zeros(n * per_rank, hidden, dtype=case.dtype, device=case.device)
        extra["part"] = torch.empty(per_rank, hidden, dtype=case.dtype, device=case.device)
        extra["normed"] = torch.zeros(per_rank, hidden, dtype=case.dtype, device=case.device)
        extra["gathered"] = torch.empty(n * per_rank, hidden, dtype=case.dtype, device=case.device)
    return Buffers(inp=x, out=out, extra=extra)


def _rms_norm(r: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The baseline's norm: torch's rms_norm (fp32 statistics for 16-bit inputs)."""
    if hasattr(torch.nn.functional, "rms_norm"):
        return torch.nn.functional.rms_norm(r, (r.shape[-1],), weight, EPS)
    rf = r.float()
    return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(r.dtype)


def _run(backend, b: Buffers, case: Case) -> None:
    if case.in_place:
        raise Unsupported(f"{NAME} has no in-place form (out may not alias x or residual)")
    mode, e = _mode(case), b.extra
    if backend.name == "ddacomm":
        try:
            backend.comm.fused_allreduce_rmsnorm(b.inp, e["residual"], e["weight"], EPS, residual_mode=mode,
                                                 out=b.out, num_sms=case.options.get("fused_num_sms"))
        except TypeError as err:  # e.g. float32 on CUDA (the kernels take bfloat16 and float16)
            raise Unsupported(f"ddacomm: {err}") from err
        return
    if mode == "replicated":
        work = e["work"]
        work.copy_(b.inp)
        backend.all_reduce(work, "sum")
        e["residual"].add_(work)
        b.out.copy_(_rms_norm(e["residual"], e["weight"]))
        return
    tokens = e["tokens"]
    begin, end = token_slice(tokens, case.world_size, case.rank)
    e["x_pad"][:tokens].copy_(b.inp)
    backend.reduce_scatter(e["part"], e["x_pad"], "sum")
    owned = e["residual"][begin:end]
    owned.add_(e["part"][:end - begin])
    e["normed"][:end - begin].copy_(_rms_norm(owned, e["weight"]))
    backend.all_gather(e["gathered"], e["normed"])
    b.out.copy_(e["gathered"][:tokens])


def _tolerance(s_abs: torch.Tensor, r64: torch.Tensor, rstd: torch.Tensor, w64: torch.Tensor,
               out64: torch.Tensor, dtype: torch.dtype, world_size: int, hidden: int):
    """(residual bound, out bound) per element, fp64: see the module docstring."""
    eps = registry._EPS[dtype]
    k = world_size + 3
    res_tol = k * eps * (s_abs + r64.abs()) + 1e-30
    out_tol = (k * eps * ((s_abs + r64.abs()) * rstd * w64.abs() + out64.abs())
               + eps * (math.log2(hidden) + 1) * out64.abs() + 1e-30)
    return res_tol, out_tol


def _wrong(got: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> int:
    diff = (got.detach().double().cpu() - expected).abs()
    return int((~(diff <= tol)).sum())  # NaN (an unwritten, poisoned element) is wrong


def _check(b: Buffers, case: Case) -> int:
    e = b.extra
    tokens, hidden, n = e["tokens"], e["hidden"], case.world_size
    xs = [_inputs(r, tokens, hidden, case.dtype, case.salt)[0].double() for r in range(n)]
    _, residual0, weight = _inputs(case.rank, tokens, hidden, case.dtype, case.salt)
    s64 = torch.stack(xs).sum(0)
    s_abs = torch.stack(xs).abs().sum(0)
    r64 = residual0.double() + s64
    rstd = 1.0 / torch.sqrt((r64 * r64).mean(dim=1, keepdim=True) + EPS)
    w64 = weight.double()
    out64 = r64 * rstd * w64
    res_tol, out_tol = _tolerance(s_abs, r64, rstd, w64, out64, case.dtype, n, hidden)
    registry.plant(b.out, case)
    wrong = _wrong(b.out, out64, out_tol)
    begin, end = (0, tokens) if _mode(case) == "replicated" else token_slice(tokens, n, case.rank)
    wrong += _wrong(e["residual"][begin:end], r64[begin:end], res_tol[begin:end])
    return wrong


def _sizes(cli_sizes, esize: int, world_size: int, options: dict):
    return rows.row_sizes(cli_sizes, esize, rows.hidden_of(options, DEFAULT_HIDDEN), options.get("tokens"))


registry.register(Collective(
    name=NAME, count=lambda nbytes, esize, n: nbytes // esize, bus_factor=lambda n: 2.0 * (n - 1) / n,
    setup=_setup, run=_run, check=_check, sizes=_sizes))
