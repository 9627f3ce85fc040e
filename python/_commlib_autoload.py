"""Registers the torch.distributed backend "ddacomm" for torch's plugin entry points, without
importing commlib.

Note [lazy registration]
    torch runs the "torch.backends" entry points at the end of every ``import torch`` (and torch
    >= 2.14 the "torch.distributed.backends" ones when a group asks for a backend by name). Both
    point here. This module imports nothing of commlib: it registers "ddacomm" with a creator that
    imports commlib when the first group is made. So a plain ``import torch`` neither pays for
    importing commlib (its extension, the CUDA runtime it links) nor fails when the extension
    cannot load (a stale editable install, a build for another torch, a missing library): then
    this module warns, and asking for "ddacomm" raises an error that says what to rebuild.
    ``import commlib`` registers the same backend itself (commlib.backend_registration); whichever
    runs first registers, the other finds it registered.

Must never raise: torch turns an exception here into a failed ``import torch``.
"""
import importlib.machinery
import importlib.util
import os

BACKEND_NAME = "ddacomm"


def _extension_problem():
    """Why commlib's extension cannot be loaded, seen from the files alone (nothing is imported),
    or None when the extension file is there."""
    spec = importlib.util.find_spec("commlib")  # a top-level package: found, not executed
    if spec is None or not spec.submodule_search_locations:
        return "the package commlib is not installed"
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if os.path.exists(os.path.join(folder, "_C" + suffix)):
                return None
    return f"its extension commlib._C is missing from {list(spec.submodule_search_locations)[0]}"


def _create(*args, **kwargs):
    """The "ddacomm" creator: imports commlib on first use and hands over to its creator."""
    try:
        from commlib import backend_registration
    except Exception as e:
        raise RuntimeError(
            f'torch.distributed backend "{BACKEND_NAME}": commlib cannot be imported ({type(e).__name__}: {e}); '
            f"rebuild it against this torch (`make build`, or "
            f"`pip install --no-build-isolation -e .` in the commlib checkout)") from e
    return backend_registration.create_backend(*args, **kwargs)


def register() -> None:
    try:
        import torch.distributed as dist
        if not dist.is_available() or BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
            return
        problem = _extension_problem()
        if problem is not None:
            import warnings
            warnings.warn(f'commlib: the torch.distributed backend "{BACKEND_NAME}" will not work: {problem}; '
                          f"rebuild commlib against this torch", RuntimeWarning, stacklevel=2)
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    except Exception as e:  # noqa: BLE001 - a broken optional backend must not break `import torch`
        try:
            import warnings
            warnings.warn(f'commlib: registering the torch.distributed backend "{BACKEND_NAME}" failed '
                          f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
        except Exception:  # noqa: BLE001 - warnings configured as errors
            pass
