"""The selection rule: pass-KV or pass-Q for a call's shape (``select_mode``), and the machine
constants it weighs (``machine_constants``: commlib-tune's measurement, else built-in defaults)."""
from __future__ import annotations

from typing import Optional

import torch

from .layout import _DTYPE_NAMES, _DTYPES

# select_mode's machine constants when commlib-tune has not measured them (see docs/cp.md):
# per-direction ring bandwidth in bytes/s and achieved attention FLOP/s, by device type.
DEFAULT_BW = {"cuda": 350e9, "cpu": 4e9}
DEFAULT_ATTN_FLOPS = {"cuda": 450e12, "cpu": 5e10}


_tuned: dict = {}


def machine_constants(device_type: str, world_size: int):
    """(BW bytes/s, C FLOP/s) for select_mode: commlib-tune's measurement for this machine when
    cached (``commlib.tuned.load_cp``), else the built-in defaults."""
    if device_type not in DEFAULT_BW:
        raise ValueError(f"select_mode: device type '{device_type}' not supported; supported: cpu, cuda")
    from ..tuned import cache_path, load_cp
    ck = (device_type, world_size, str(cache_path()))
    if ck not in _tuned:
        try:
            _tuned[ck] = load_cp(device_type, world_size)
        except Exception:  # noqa: BLE001 - a missing or unreadable cache means the defaults
            _tuned[ck] = None
    tuned = _tuned[ck]
    if tuned:
        return float(tuned["bw_bytes_per_s"]), float(tuned["attn_flops_per_s"])
    return DEFAULT_BW[device_type], DEFAULT_ATTN_FLOPS[device_type]


def select_mode(T: int, P: int, world_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, *, bw: Optional[float] = None, flops: Optional[float] = None,
                device_type: str = "cuda") -> str:
    """pass-KV or pass-Q for T new and P cached tokens (totals over the batch): Algorithm 5 of
    "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783).

    pass-KV when pass-KV's per-step transfer hides behind the step's attention,
    T >= N*C*NKV*e / (2*NH*BW), or when T/(T+P) >= 2*NKV/NH - 4*T*BW/(N*C*e); pass-Q otherwise.
    Full prefill (P = 0) is pass-KV; e is the element size in bytes. ``bw`` / ``flops`` default to
    ``machine_constants(device_type, world_size)``. ``head_dim`` cancels out of both conditions.
    """
    what = "select_mode"
    for name, value, low in (("T", T, 0), ("P", P, 0), ("world_size", world_size, 1), ("num_q_heads", num_q_heads, 1),
                             ("num_kv_heads", num_kv_heads, 1), ("head_dim", head_dim, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{what}: {name} must be an integer >= {low}, got {value!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{what}: num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if dtype not in _DTYPES:
        raise TypeError(f"{what}: dtype {dtype} not supported; supported: {_DTYPE_NAMES}")
    if P == 0:
        return "pass_kv"
    if T == 0:
        return "pass_q"
    if bw is None or flops is None:
        d_bw, d_flops = machine_constants(device_type, world_size)
        bw, flops = bw or d_bw, flops or d_flops
    e = torch.tensor([], dtype=dtype).element_size()
    n, nh, nkv = world_size, num_q_heads, num_kv_heads
    if T >= n * flops * nkv * e / (2.0 * nh * bw):
        return "pass_kv"
    if T / (T + P) >= 2.0 * nkv / nh - 4.0 * T * bw / (n * flops * e):
        return "pass_kv"
    return "pass_q"
