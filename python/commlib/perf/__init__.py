"""commlib-perf: nccl-tests-style benchmark of commlib beside gloo / NCCL / torch symmetric memory.

``python -m commlib.perf --help`` lists the flags; ``register(Collective(...))`` adds an operation
(see ``commlib.perf.registry``).
"""
from .registry import Buffers, Case, Collective, Unsupported, register


def main(argv=None) -> int:
    from .__main__ import main as _main
    return _main(argv)


__all__ = ["Buffers", "Case", "Collective", "Unsupported", "register", "main"]
