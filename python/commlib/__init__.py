"""commlib: direct-data-access collectives for LLM inference.

``import commlib`` does no CUDA work; GPU state is created on first use.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C
from . import fused
from .communicator import Communicator
from .ep import EPBuffer, EPDispatchResult, EPHandle
from .errors import CommError, PeerError, TimeoutError
from .backend_registration import register_backend

__version__ = "0.1.0"


def knobs():
    """Every ``COMMLIB_*`` environment variable as (name, default, meaning)."""
    return list(_C.knobs())


try:  # "ddacomm" for torch.distributed; registration must never make `import commlib` fail
    register_backend()
except Exception:  # noqa: BLE001
    pass

__all__ = ["register_backend", "Communicator", "EPBuffer", "EPDispatchResult", "EPHandle", "CommError", "PeerError",
           "TimeoutError", "knobs", "__version__"]
