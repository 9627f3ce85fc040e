"""Property-based fuzzing on the rank pool (tests/cpu/test_fuzz_*.py).

Hypothesis draws the cases in the parent, from a fixed seed (the same cases on every run and every
rank), and one world size's cases travel to the ranks in ONE ``pool.run`` (a round trip per example
would cost more than the examples). Each rank runs every case and returns the ones that failed, so
one bad case does not hide the others. When a case fails, hypothesis replays the same draws with
one ``pool.run`` per example, and shrinks the first failing one to a minimal case that it prints
("Falsifying example"): that case becomes a regular test in the op's own test file.

``COMMLIB_FUZZ_EXAMPLES`` multiplies every test's number of cases (default 1; e.g. 50 for a long
run: docs in bench/README.md).
"""
from __future__ import annotations

import os
import traceback
import zlib

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

SCALE = max(1, int(os.environ.get("COMMLIB_FUZZ_EXAMPLES", "1")))

ALL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
              "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
FLOATS = ("float32", "float16", "bfloat16")
SENTINEL = {torch.uint8: 251, torch.bool: False}  # other integer types: -77; floating: NaN


def _settings(max_examples, phases):
    return settings(max_examples=max_examples, deadline=None, database=None, phases=phases,
                    suppress_health_check=list(HealthCheck), print_blob=False)


def draw_cases(strategy, count: int, key: str) -> list:
    """``count`` cases from ``strategy``, the same on every run (seeded by ``key``)."""
    cases = []

    @seed(zlib.crc32(key.encode()))
    @_settings(count, [Phase.generate])
    @given(strategy)
    def collect(case):
        cases.append(case)

    collect()
    return cases


def run_cases(get_pool, fn, strategy, count: int, key: str, *args):
    """Draws ``count * SCALE`` cases and runs ``fn(ctx, cases, *args)`` (which returns
    ``run_each``'s failures) on one pool; on a failure, shrinks it (see the module docstring)."""
    cases = draw_cases(strategy, count * SCALE, key)
    failures = _failures(get_pool().run(fn, cases, *args))
    if not failures:
        return len(cases)
    first = min(failures)

    @seed(zlib.crc32(key.encode()))
    @_settings(first + 1, [Phase.generate, Phase.shrink])
    @given(strategy)
    def check_alone(case):
        failed = _failures(get_pool().run(fn, [case], *args))
        assert not failed, failed[0]

    check_alone()  # raises with the shrunk case when the replay finds the failure
    raise AssertionError(f"{len(failures)} of {len(cases)} cases failed (the first did not fail alone): "
                         f"case {first}: {cases[first]!r}\n{failures[first]}")


def _failures(per_rank: list) -> dict:
    out = {}
    for rank, failed in enumerate(per_rank):
        for i, text in failed:
            out.setdefault(i, f"rank {rank}: {text}")
    return out


def run_each(cases, check, *args) -> list:
    """On a rank: ``check(case, *args)`` for every case; returns [(index, error text)] of those that
    raised. Every rank sees the same cases, so a check that raises on all ranks leaves them in step."""
    failed = []
    for i, case in enumerate(cases):
        try:
            check(case, *args)
        except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - every failure is reported with its case
            failed.append((i, f"{type(e).__name__}: {e}\ncase {case!r}\n{traceback.format_exc(limit=-3)}"))
    return failed


# ---- tensors: values from a seed, views with offsets and strides, poison ----------------------------
def values(rank: int, count: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """``count`` values of rank ``rank`` (any rank can make any rank's): floats in +-[0.5, 2.5) (sums do
    not cancel to 0; products stay in range), integers in [0, 100), bools."""
    g = torch.Generator().manual_seed(1000003 * rank + 7919 * count + 31 * salt)
    x = torch.rand(count, generator=g, dtype=torch.float64)
    if dtype.is_floating_point:
        sign = torch.where(torch.rand(count, generator=g) < 0.3, -1.0, 1.0).double()
        return ((x * 2 + 0.5) * sign).to(dtype)
    if dtype == torch.bool:
        return x < 0.5
    return (x * 100).to(dtype)


def poison_value(dtype: torch.dtype):
    return float("nan") if dtype.is_floating_point else SENTINEL.get(dtype, -77)


# A layout is how a logical shape lies in its storage: "contiguous", "offset" (storage offset 3),
# "strided" (every stride doubled: gaps between elements), "transposed" (2-D+: dims reversed in
# memory), "padded" (2-D+: rows padded by 5 elements). The storage is poisoned first.
LAYOUTS = ("contiguous", "offset", "strided", "transposed", "padded")


def _strides(shape, layout):
    dims = list(range(len(shape)))
    order = dims[::-1] if layout == "transposed" and len(shape) >= 2 else dims  # fastest dim last
    strides = [0] * len(shape)
    step = 2 if layout == "strided" else 1
    for i, d in enumerate(reversed(order)):
        strides[d] = step
        step *= max(1, shape[d])
        if i == 0 and layout == "padded" and len(shape) >= 2:
            step += 5
    offset = 3 if layout == "offset" else 0
    size = offset + 1 + sum((s - 1) * st for s, st in zip(shape, strides)) if all(shape) else offset
    return strides, offset, size


def placed(shape, layout: str, dtype: torch.dtype, fill=None):
    """(view, storage): a tensor of ``shape`` laid out as ``layout`` in a poisoned storage, holding
    ``fill`` (a tensor of numel elements, in logical order) when given."""
    strides, offset, size = _strides(tuple(shape), layout)
    storage = torch.full((size,), poison_value(dtype), dtype=dtype)
    view = storage.as_strided(tuple(shape), strides, offset)
    if fill is not None:
        view.copy_(fill.reshape(tuple(shape)))
    return view, storage


def outside_untouched(view: torch.Tensor, storage: torch.Tensor) -> bool:
    """True when no storage element outside ``view`` changed from the poison."""
    mask = torch.zeros(storage.shape, dtype=torch.bool)
    mask.as_strided(view.shape, view.stride(), view.storage_offset() - storage.storage_offset()).fill_(True)
    rest = storage[~mask]
    p = poison_value(storage.dtype)
    return bool(torch.isnan(rest).all()) if storage.dtype.is_floating_point else bool((rest == p).all())


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bitwise comparison (NaN == NaN)."""
    if t.dtype.is_floating_point:
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t.view(torch.uint8) if t.dtype == torch.bool else t  # bool: its bytes (a sum of trues may be 2)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bits first: a bool tensor's contiguous() would turn its byte 2 (a sum of trues) into 1
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


# ---- strategies -----------------------------------------------------------------------------------
def shapes(max_dims: int = 3, max_side: int = 9, large: int = 70001):
    """Shapes of 0..max_dims dims, sides 0..max_side; one in 8 a large 1-D (odd) size."""
    small = st.lists(st.integers(0, max_side), min_size=0, max_size=max_dims).map(tuple)
    return st.one_of(*[small] * 7, st.integers(1, large).map(lambda n: (n,)))


layouts = st.sampled_from(LAYOUTS)
salts = st.integers(0, 2 ** 20)
