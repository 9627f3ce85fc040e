"""commlib: direct-data-access collectives for LLM inference.

``import commlib`` does no CUDA work; GPU state is created on first use.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C
from . import fused
from .communicator import Communicator
from .errors import CommError, PeerError, TimeoutError

__version__ = "0.1.0"


def knobs():
    """Every ``COMMLIB_*`` environment variable as (name, default, meaning)."""
    return list(_C.knobs())


__all__ = ["Communicator", "CommError", "PeerError", "TimeoutError", "knobs", "__version__"]
