"""The registry of collective descriptors that commlib-perf times.

A descriptor says, for one operation, everything the runner needs and nothing about timing:

* ``name``: the CLI name (``all_reduce``).
* ``count(nbytes, esize, world_size)``: the element count nccl-tests prints for a size in bytes
  (the size is the bytes of the larger of input and output, as nccl-tests defines it).
* ``bus_factor(world_size)``: busbw = algbw * factor, nccl-tests' definitions.
* ``setup(case)``: allocates this rank's buffers (inputs random, outputs poisoned) -> ``Buffers``.
* ``run(backend, buffers, case)``: one call of the operation through ``backend``.
* ``check(buffers, case)``: the number of wrong elements of this rank's output, against a
  reference computed in fp64 from every rank's input (each rank regenerates its peers' inputs
  from their seeds, so no extra communication is needed).
* ``sizes(cli_sizes, esize, world_size, options)`` (optional): the byte sizes this operation
  measures, from the CLI's -b/-e/-f sizes (an operation over rows maps them to whole rows, drops
  repeats, or takes an explicit list from its own flag). Default: the CLI's sizes.

Other modules add their operations (``ops_fused``: fused_allreduce_rmsnorm, ``ops_ep``:
ep_dispatch_combine) by calling ``register(Collective(...))`` at import time: a module named
``commlib/perf/ops_NAME.py`` is imported by itself; others are listed in ``PLUGIN_MODULES`` (or
imported before ``commlib.perf.main`` runs); flags of
their own come from ``register_options`` and reach ``setup``/``run`` as ``case.options``. A backend
that lacks the operation raises ``Unsupported`` from ``run`` during the first (untimed) call, and
the table shows ``n/a``.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

# Modules imported (when present) before the CLI builds its parser; each may register
# descriptors and options. Missing modules are ignored, so a branch can add its line before its
# module lands (an ImportError inside a present module is raised).
PLUGIN_MODULES = (
    "commlib.perf.ops_fused",    # fused_allreduce_rmsnorm (tokens x hidden)
    "commlib.perf.ops_ep",       # ep_dispatch_combine (expert-parallel dispatch + combine)
    "commlib.perf.ops_cp",       # ring_attention (context-parallel prefill, commlib.cp)
    "commlib.perf.ops_tp_layer",  # tp_layer (a TP decoder layer: sequential / fused / tokenweave)
)

DTYPES: Dict[str, torch.dtype] = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"float32": "float", "fp32": "float", "float16": "half", "fp16": "half", "bf16": "bfloat16"}
REDOPS = ("sum", "prod", "max", "min", "avg")


class Unsupported(Exception):
    """A backend cannot run this operation with these arguments; the message says why."""


@dataclass
class Case:
    """What one measurement is about (identical on every rank)."""
    rank: int
    world_size: int
    nbytes: int
    dtype: torch.dtype
    redop: str
    root: int
    device: torch.device
    in_place: bool
    salt: int = 0                     # changes the random inputs between check calls
    corrupt: bool = False             # planted wrong result (tests only): this rank damages its output
    options: dict = field(default_factory=dict)  # the CLI's parsed flags (read-only), for operations' own

    @property
    def esize(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()


@dataclass
class Buffers:
    inp: torch.Tensor
    out: torch.Tensor
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Collective:
    name: str
    count: Callable[[int, int, int], int]
    bus_factor: Callable[[int], float]
    setup: Callable[[Case], Buffers]
    run: Callable[[object, Buffers, Case], None]
    check: Callable[[Buffers, Case], int]
    has_redop: bool = False
    has_root: bool = False
    sizes: Optional[Callable[[List[int], int, int, dict], List[int]]] = None
    # An operation with a table of its own (kv_transfer: two instances, post and completion
    # times): ``standalone(opts) -> exit code`` runs instead of the backend table; it runs alone.
    standalone: Optional[Callable[[argparse.Namespace], int]] = None


_REGISTRY: Dict[str, Collective] = {}
# (title, add(group), validate(opts) -> error message or None), in registration order.
_OPTIONS: Dict[str, Tuple[Callable[[argparse._ArgumentGroup], None],
                          Optional[Callable[[argparse.Namespace], Optional[str]]]]] = {}


def register(desc: Collective) -> Collective:
    """Adds (or replaces) a descriptor; returns it."""
    _REGISTRY[desc.name] = desc
    return desc


def register_options(title: str, add: Callable[[argparse._ArgumentGroup], None],
                     validate: Optional[Callable[[argparse.Namespace], Optional[str]]] = None) -> None:
    """Flags of an operation module: ``add`` declares them on an argument group titled ``title``
    (flag names must not clash with other modules'); ``validate(opts)`` returns an error message
    for bad values (the CLI exits with it) or None. The parsed values reach ``case.options``."""
    _OPTIONS[title] = (add, validate)


def option_groups() -> List[Tuple[str, Callable, Optional[Callable]]]:
    return [(title, add, validate) for title, (add, validate) in _OPTIONS.items()]


def plugin_modules() -> List[str]:
    """PLUGIN_MODULES, then every other ``commlib/perf/ops_*.py`` (found by name, sorted), so a new
    operation module needs no line here."""
    import pkgutil
    package = __name__.rpartition(".")[0]
    found = sorted(f"{package}.{m.name}" for m in pkgutil.iter_modules(importlib.import_module(package).__path__)
                   if m.name.startswith("ops_"))
    return list(PLUGIN_MODULES) + [m for m in found if m not in PLUGIN_MODULES]


def load_plugins() -> None:
    for module in plugin_modules():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module and not module.startswith(f"{e.name}."):  # a dependency of a present module
                raise


def get(name: str) -> Collective:
    load_plugins()
    if name not in _REGISTRY:
        raise ValueError(f"commlib-perf: operation '{name}' not known; known: {', '.join(names())}")
    return _REGISTRY[name]


def names() -> List[str]:
    return list(_REGISTRY)


def table_names() -> List[str]:
    """The operations of the backend table (``all``): every one without a table of its own."""
    return [n for n, d in _REGISTRY.items() if d.standalone is None]


# ---------------------------------------------------------------------------------------------
# Inputs, references, comparison

@functools.lru_cache(maxsize=9)
def _cpu_input(rank: int, count: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((1000003 * (rank + 1) + 7919 * count + 104729 * salt) & 0x7FFFFFFF)
    return (torch.rand(count, generator=g, dtype=torch.float32) * 2 + 0.5).to(dtype)


def rank_input(rank: int, count: int, dtype: torch.dtype, salt: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s input (a fresh copy): uniform in [0.5, 2.5) (never zero; prod/min/max stay
    meaningful). Every rank can regenerate every peer's input for its reference."""
    return _cpu_input(rank, count, dtype, salt).to(device, copy=True)


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan"))


def reduce_reference(inputs: List[torch.Tensor], redop: str) -> torch.Tensor:
    """fp64 reduction of the (dtype-rounded) inputs."""
    acc = inputs[0].double()
    for x in inputs[1:]:
        x = x.double()
        if redop in ("sum", "avg"):
            acc = acc + x
        elif redop == "prod":
            acc = acc * x
        elif redop == "min":
            acc = torch.minimum(acc, x)
        elif redop == "max":
            acc = torch.maximum(acc, x)
    if redop == "avg":
        acc = acc / len(inputs)
    return acc


_EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def count_wrong(got: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, num_roundings: int) -> int:
    """Elements of ``got`` farther from the fp64 ``expected`` than ``num_roundings`` roundings of
    ``dtype`` allow (a backend may accumulate in the dtype itself); NaN (a poisoned, unwritten
    element) is always wrong."""
    got64 = got.detach().reshape(-1).double().cpu()
    exp = expected64.reshape(-1).cpu()
    tol = exp.abs() * (_EPS[dtype] * max(1, num_roundings)) + 1e-30
    bad = ~((got64 - exp).abs() <= tol)
    return int(bad.sum())


def count_unequal(got: torch.Tensor, expected: torch.Tensor) -> int:
    g, e = got.detach().reshape(-1).cpu(), expected.reshape(-1).cpu()
    return int((~(g == e)).sum())


def plant(out: torch.Tensor, case: Case) -> None:
    """The planted wrong result (``--corrupt-rank``, tests only): damages one element of ``out``."""
    if case.corrupt and out.numel():
        out.view(-1)[out.numel() // 2] += 1000.0



# ---------------------------------------------------------------------------------------------
# Built-in collectives (sizes, busbw factors and in-place layouts as nccl-tests defines them)

def _all_reduce_setup(case: Case) -> Buffers:
    count = case.nbytes // case.esize
    inp = rank_input(case.rank, count, case.dtype, case.salt, case.device)
    out = inp if case.in_place else poison(torch.empty_like(inp))
    return Buffers(inp=inp, out=out, extra={"count": count})


def _all_reduce_run(backend, b: Buffers, case: Case) -> None:
    if case.in_place:
        backend.all_reduce(b.out, case.redop)
    else:  # native out of place where the backend has it, else copy + in place (backends.py)
        backend.all_reduce_out(b.out, b.inp, case.redop)


def _all_reduce_check(b: Buffers, case: Case) -> int:
    count = b.extra["count"]
    inputs = [rank_input(r, count, case.dtype, case.salt, torch.device("cpu")) for r in range(case.world_size)]
    plant(b.out, case)
    # Out of place must leave the input as generated: every changed input element counts as wrong.
    clobbered = 0 if case.in_place else count_unequal(b.inp, inputs[case.rank])
    roundings = case.world_size + (1 if case.redop == "avg" else 0)
    if case.redop in ("min", "max"):
        return clobbered + count_unequal(b.out, reduce_reference(inputs, case.redop).to(case.dtype))
    return clobbered + count_wrong(b.out, reduce_reference(inputs, case.redop), case.dtype, roundings)


register(Collective(
    name="all_reduce", count=lambda nbytes, esize, n: nbytes // esize,
    bus_factor=lambda n: 2.0 * (n - 1) / n, setup=_all_reduce_setup, run=_all_reduce_run,
    check=_all_reduce_check, has_redop=True))


def _rs_setup(case: Case) -> Buffers:
    n = case.world_size
    recv = case.nbytes // case.esize // n
    inp = rank_input(case.rank, recv * n, case.dtype, case.salt, case.device)
    out = inp[case.rank * recv:(case.rank + 1) * recv] if case.in_place else poison(
        torch.empty(recv, dtype=case.dtype, device=case.device))
    return Buffers(inp=inp, out=out, extra={"recv": recv})


def _rs_run(backend, b: Buffers, case: Case) -> None:
    backend.reduce_scatter(b.out, b.inp, case.redop)


def _rs_check(b: Buffers, case: Case) -> int:
    recv = b.extra["recv"]
    lo, hi = case.rank * recv, (case.rank + 1) * recv
    inputs = [rank_input(r, recv * case.world_size, case.dtype, case.salt, torch.device("cpu"))[lo:hi]
              for r in range(case.world_size)]
    plant(b.out, case)
    if case.redop in ("min", "max"):
        return count_unequal(b.out, reduce_reference(inputs, case.redop).to(case.dtype))
    return count_wrong(b.out, reduce_reference(inputs, case.redop), case.dtype,
                       case.world_size + (1 if case.redop == "avg" else 0))


register(Collective(
    name="reduce_scatter", count=lambda nbytes, esize, n: nbytes // esize // n * n,
    bus_factor=lambda n: (n - 1) / n, setup=_rs_setup, run=_rs_run, check=_rs_check, has_redop=True))


def _ag_setup(case: Case) -> Buffers:
    n = case.world_size
    send = case.nbytes // case.esize // n
    mine = rank_input(case.rank, send, case.dtype, case.salt, case.device)
    if case.in_place:
        out = poison(torch.empty(send * n, dtype=case.dtype, device=case.device))
        inp = out[case.rank * send:(case.rank + 1) * send]
        inp.copy_(mine)
    else:
        inp, out = mine, poison(torch.empty(send * n, dtype=case.dtype, device=case.device))
    return Buffers(inp=inp, out=out, extra={"send": send})


def _ag_run(backend, b: Buffers, case: Case) -> None:
    backend.all_gather(b.out, b.inp)


def _ag_check(b: Buffers, case: Case) -> int:
    send = b.extra["send"]
    expected = torch.cat([rank_input(r, send, case.dtype, case.salt, torch.device("cpu"))
                          for r in range(case.world_size)])
    plant(b.out, case)
    return count_unequal(b.out, expected)


register(Collective(
    name="all_gather", count=lambda nbytes, esize, n: nbytes // esize // n * n,
    bus_factor=lambda n: (n - 1) / n, setup=_ag_setup, run=_ag_run, check=_ag_check))


def _a2a_setup(case: Case) -> Buffers:
    n = case.world_size
    count = case.nbytes // case.esize // n * n
    inp = rank_input(case.rank, count, case.dtype, case.salt, case.device)
    out = poison(torch.empty_like(inp))
    return Buffers(inp=inp, out=out, extra={"count": count})


def _a2a_run(backend, b: Buffers, case: Case) -> None:
    if case.in_place:
        raise Unsupported("all_to_all has no in-place form")
    backend.all_to_all(b.out, b.inp)


def _a2a_check(b: Buffers, case: Case) -> int:
    n, count = case.world_size, b.extra["count"]
    block = count // n
    expected = torch.cat([rank_input(q, count, case.dtype, case.salt, torch.device("cpu"))
                          [case.rank * block:(case.rank + 1) * block] for q in range(n)])
    plant(b.out, case)
    return count_unequal(b.out, expected)


register(Collective(
    name="all_to_all", count=lambda nbytes, esize, n: nbytes // esize // n * n,
    bus_factor=lambda n: (n - 1) / n, setup=_a2a_setup, run=_a2a_run, check=_a2a_check))


def _bc_setup(case: Case) -> Buffers:
    count = case.nbytes // case.esize
    inp = rank_input(case.root, count, case.dtype, case.salt, case.device)
    if case.rank != case.root and case.in_place:
        poison(inp)
    out = inp if case.in_place else poison(torch.empty_like(inp))
    return Buffers(inp=inp, out=out, extra={"count": count})


def _bc_run(backend, b: Buffers, case: Case) -> None:
    if not case.in_place and case.rank == case.root:
        b.out.copy_(b.inp)  # broadcast is in place in every direct API; out-of-place = copy at root
    backend.broadcast(b.out, case.root)


def _bc_check(b: Buffers, case: Case) -> int:
    expected = rank_input(case.root, b.extra["count"], case.dtype, case.salt, torch.device("cpu"))
    plant(b.out, case)
    return count_unequal(b.out, expected)


register(Collective(
    name="broadcast", count=lambda nbytes, esize, n: nbytes // esize,
    bus_factor=lambda n: 1.0, setup=_bc_setup, run=_bc_run, check=_bc_check, has_root=True))


def busbw_gbps(desc: Collective, nbytes: int, time_us: float, world_size: int) -> tuple:
    """(algbw, busbw) in GB/s (1e9 bytes/s, as nccl-tests)."""
    if not time_us or math.isnan(time_us):
        return float("nan"), float("nan")
    algbw = nbytes / (time_us * 1e-6) / 1e9
    return algbw, algbw * desc.bus_factor(world_size)
