"""NVSHMEM for ``EPBuffer(transport="nvshmem")`` (Note [EP NVSHMEM protocol] in
csrc/kernels/ep_nvshmem_params.hpp): initialises NVSHMEM once per process through nvshmem4py with
the unique-id method over the communicator's store, then attaches commlib's NVSHMEM kernels
(libcommlib_nvshmem.so, loaded only here). ``import commlib`` never needs nvshmem4py.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import _C

_LIBRARY = Path(__file__).with_name("libcommlib_nvshmem.so")
_UID_KEY = "commlib/nvshmem/uid"
# (rank, world_size) NVSHMEM was initialised with in this process, or None.
_initialised = None


def _unavailable(reason: str) -> ValueError:
    return ValueError(f"EPBuffer: transport 'nvshmem' not available: {reason}; supported here: auto, peer")


def library_path() -> Path:
    return _LIBRARY


def available() -> bool:
    """Whether this build has the NVSHMEM kernels and nvshmem4py is importable (no initialisation)."""
    if not hasattr(_C, "ep_nvshmem_attach") or not _LIBRARY.exists():
        return False
    try:
        import nvshmem.core  # noqa: F401
    except ImportError:
        return False
    return True


def _device_object(index: int):
    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    dev = Device(index)
    dev.set_current()
    return dev


def attach(comm, device_index: int) -> None:
    """Collective over ``comm`` the first time in a process: NVSHMEM's PEs are ``comm``'s ranks."""
    global _initialised
    # NVSHMEM never creates NVLink multicast objects with this set (docs/architecture.md, Safety).
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if not hasattr(_C, "ep_nvshmem_attach"):
        raise _unavailable("this commlib build has no CUDA")
    if not _LIBRARY.exists():
        raise _unavailable(f"commlib was built without NVSHMEM ({_LIBRARY.name} missing: the nvidia-nvshmem-cu13 "
                           "wheel's headers were not found at build time)")
    try:
        import numpy as np
        import nvshmem.core as nvshmem
    except ImportError as e:
        raise _unavailable(f"nvshmem4py is not installed (pip install 'commlib[nvshmem]'): {e}") from e
    rank, world_size = comm.rank, comm.world_size
    if _initialised is None:
        store = getattr(comm, "_store", None)
        if store is None:
            raise _unavailable("NVSHMEM bootstraps over a commlib.Communicator's store; got a native communicator")
        if rank == 0:
            uid = nvshmem.get_unique_id()
            store.set(_UID_KEY, uid._data.view(np.uint8).tobytes())
        else:
            uid = nvshmem.get_unique_id(empty=True)
            raw = store.get(_UID_KEY)
            view = uid._data.view(np.uint8)
            if len(raw) != view.size:
                raise ValueError(f"EPBuffer: NVSHMEM unique id from rank 0 has {len(raw)} bytes; expected {view.size}")
            view[:] = np.frombuffer(raw, dtype=np.uint8)
        nvshmem.init(device=_device_object(device_index), uid=uid, rank=rank, nranks=world_size,
                     initializer_method="uid")
        if rank == 0:
            # Every rank read it before init could complete (init is collective); a later job on the
            # same store must not find a stale id.
            try:
                store.delete_key(_UID_KEY)
            except (RuntimeError, NotImplementedError):
                pass
        _initialised = (rank, world_size)
    elif _initialised != (rank, world_size):
        raise ValueError(f"EPBuffer: transport 'nvshmem': NVSHMEM was initialised in this process for rank "
                         f"{_initialised[0]} of {_initialised[1]}; this communicator is rank {rank} of {world_size} "
                         "(one NVSHMEM world per process: use the same group)")
    my_pe, n_pes = _C.ep_nvshmem_attach(str(_LIBRARY), int(device_index))
    if (my_pe, n_pes) != (rank, world_size):
        raise ValueError(f"EPBuffer: transport 'nvshmem': the kernels see PE {my_pe} of {n_pes}; expected rank "
                         f"{rank} of {world_size}")
