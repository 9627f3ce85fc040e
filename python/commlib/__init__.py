"""commlib: direct-data-access collectives for LLM inference.

``import commlib`` does no CUDA work; GPU state is created on first use. It also loads the
``torch.ops.commlib`` operators (docs/ops.md).
"""
import warnings

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C
from . import cp, fused, hierarchy, kv, tokenweave
from .communicator import Communicator
from .ep import EPBuffer, EPDispatchResult, EPHandle, MaskedEPBuffer
from .errors import CommError, CommTimeoutError, PeerError
from .backend_registration import register_backend

__version__ = "0.1.0"


def knobs():
    """Every ``COMMLIB_*`` environment variable as (name, default, meaning)."""
    return list(_C.knobs())


def plan_counters() -> dict:
    """Plans executed by this process, by variant ({"flat_ll": 3, "host_tree": 0, ...}; every variant
    is listed). Each engine counts the plan it runs (Note [plan]); the "ddacomm" backend counts
    "nccl" for the calls it hands to NCCL."""
    return dict(_C.plan_counters())


def reset_plan_counters() -> None:
    """Sets every variant's count of ``plan_counters()`` to 0 (this process only)."""
    _C.reset_plan_counters()


def __getattr__(name: str):
    from .errors import deprecated_alias
    return deprecated_alias("commlib", name)


try:  # "ddacomm" for torch.distributed; registration must never make `import commlib` fail
    register_backend()
except Exception as e:  # noqa: BLE001
    warnings.warn(f"commlib: registering the torch.distributed backend \"ddacomm\" failed "
                  f"({type(e).__name__}: {e}); the direct API still works", RuntimeWarning, stacklevel=2)

__all__ = ["register_backend", "Communicator", "EPBuffer", "EPDispatchResult", "EPHandle", "MaskedEPBuffer", "CommError",
           "CommTimeoutError", "PeerError", "knobs", "plan_counters", "reset_plan_counters", "__version__"]
