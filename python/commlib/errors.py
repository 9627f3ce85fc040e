"""commlib's exceptions.

Bad arguments raise the built-in ``ValueError`` (a value: size, op, algorithm) or ``TypeError``
(a dtype or device). Failures of the communication itself raise the classes below, which derive
from ``torch.distributed.DistBackendError`` so code written for NCCL catches them unchanged.
"""
import warnings

import torch.distributed as dist


class CommError(dist.DistBackendError):
    """A collective failed (CUDA error, peer failure). The message names operation, rank and peer."""


class CommTimeoutError(CommError):
    """A bounded wait for a peer expired; the message names the rank, the peer and the phase."""


class PeerError(CommError):
    """Ranks disagreed (world size, collective, sizes) or a peer process exited."""


def from_dispatcher(error: dist.DistBackendError) -> CommError:
    """commlib's class for ``error``, raised by a ``torch.ops.commlib`` op on this thread (the
    torch dispatcher carries only ``DistBackendError``); same message."""
    if isinstance(error, CommError):
        return error
    from commlib import _C
    return globals()[_C.last_error_class()](str(error))


def deprecated_alias(module: str, name: str):
    """``TimeoutError``: the old name of ``CommTimeoutError`` (kept for one release; not in
    ``__all__``, so ``from commlib import *`` leaves the built-in ``TimeoutError`` alone)."""
    if name == "TimeoutError":
        warnings.warn(f"{module}.TimeoutError is deprecated; use {module}.CommTimeoutError",
                      DeprecationWarning, stacklevel=3)
        return CommTimeoutError
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def __getattr__(name: str):
    return deprecated_alias("commlib.errors", name)


__all__ = ["CommError", "CommTimeoutError", "PeerError"]
