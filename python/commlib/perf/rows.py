"""What the commlib-perf operations over ``[tokens, hidden]`` rows share (``ops_fused``, ``ops_ep``):
the ``--tokens`` / ``--hidden`` flags and the mapping between the table's sizes and tokens.

Size of such an operation = the bytes of one rank's ``x`` = tokens x hidden x element size; count =
tokens x hidden. Without ``--tokens``, each -b/-e/-f size becomes ``max(1, size // (hidden x
element size))`` tokens, repeats dropped (so the printed sizes are whole rows); ``--tokens`` lists
the token counts instead and -b/-e are ignored for these operations.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from . import registry


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"'{text}': every value must be an integer >= 1")
    return values


def _add(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--tokens", type=_int_list, default=None, metavar="T1,T2,...",
                       help="rows of x on each rank, e.g. 1,128,1024 (replaces -b/-e for these operations; "
                            "default: size // (hidden * element size) for each -b/-e size, at least 1)")
    group.add_argument("--hidden", type=int, default=None,
                       help="hidden size (default per operation: fused_allreduce_rmsnorm 8192; "
                            "ep_dispatch_combine 7168 on GPU, 256 on CPU)")


def _validate(opts: argparse.Namespace) -> Optional[str]:
    if opts.hidden is not None and opts.hidden < 1:
        return f"--hidden {opts.hidden} must be >= 1"
    return None


registry.register_options("operations over [tokens, hidden] rows", _add, _validate)


def hidden_of(options: dict, default: int) -> int:
    """``--hidden`` if given, else the operation's default."""
    return int(options.get("hidden") or default)


def row_sizes(cli_sizes: List[int], esize: int, hidden: int, tokens: Optional[List[int]]) -> List[int]:
    """The byte sizes measured: whole rows, from ``--tokens`` or from the CLI's sizes."""
    row_bytes = hidden * esize
    counts = list(tokens) if tokens else [max(1, s // row_bytes) for s in cli_sizes]
    seen, out = set(), []
    for t in counts:
        if t not in seen:
            seen.add(t)
            out.append(t * row_bytes)
    return out


def tokens_of(case: registry.Case, hidden: int) -> int:
    return case.nbytes // (hidden * case.esize)


__all__ = ["hidden_of", "row_sizes", "tokens_of"]
