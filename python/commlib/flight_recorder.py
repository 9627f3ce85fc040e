"""The direct API's calls in torch's flight recorder (Note [flight recorder]).

While torch's recorder is on (``TORCH_FR_BUFFER_SIZE`` > 0), a ``Communicator`` talks to its native
communicator through a ``RecordingComm``: each collective becomes one entry of the recorder that
gloo, NCCL and the "ddacomm" backend record into, named as torch's analyzer expects
(``_C.fr_profiling_name``), and a failed call notes commlib's error text and, when
``TORCH_FR_DUMP_TEMP_FILE`` is set, writes this rank's dump to it + rank. With the recorder off the communicator holds the native object
itself, so the call path is unchanged.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from . import _C
from .errors import CommError

# Native method -> (the analyzer's op name, index of the input tensor, of the output tensor, of the
# algorithm argument).
_RECORDED = {
    "all_reduce": ("all_reduce", 0, 0, 2),
    "all_reduce_out": ("all_reduce", 1, 0, 3),
    "reduce_scatter": ("_reduce_scatter_base", 1, 0, None),
    "all_gather": ("_all_gather_base", 1, 0, None),
    "broadcast": ("broadcast", 0, 0, None),
    "all_to_all_v": ("all_to_all_single", 1, 0, None),
    "all_to_all_v_device": ("all_to_all_single", 1, 0, None),
    "barrier": ("barrier", None, None, None),
}


def enabled() -> bool:
    return _C.fr_enabled()


class RecordingComm:
    """A native communicator whose collectives are recorded; everything else passes through."""

    def __init__(self, native, name: str, rank: int, world_size: int, timeout: timedelta):
        self._native = native
        self._rank = rank
        self._group = _C.FrGroup(name, "commlib", list(range(world_size)), rank,
                                 int(timeout.total_seconds() * 1000))
        self._names: dict = {}

    def __getattr__(self, attr):
        value = getattr(self._native, attr)
        spec = _RECORDED.get(attr)
        if spec is None:
            return value

        def recorded(*args):
            return self._call(value, spec, args)
        setattr(self, attr, recorded)  # found directly from now on
        return recorded

    def _name(self, cuda: bool, op: str, variant: str) -> str:
        key = (cuda, op, variant)
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = _C.fr_profiling_name(cuda, op, variant, self._rank)
        return name

    def _call(self, method, spec, args):
        op, i_in, i_out, i_algo = spec
        inputs = [args[i_in]] if i_in is not None else []
        outputs = [args[i_out]] if i_out is not None else []
        variant = str(args[i_algo]) if i_algo is not None else ""
        cuda = bool(inputs) and inputs[0].is_cuda
        # A captured call runs at each replay, unseen; and no event may be queried while a stream
        # is captured (that invalidates a global-mode capture).
        if cuda and torch.cuda.is_current_stream_capturing():
            return method(*args)
        # started now on the CPU; a GPU call is started by issued(), once it is enqueued
        call = self._group.record(self._name(cuda, op, variant or "host"), False, inputs, outputs, not cuda)
        try:
            result = method(*args)
        except CommError as e:
            call.timed_out(str(e))
            if _C.fr_dump_requested():
                self.dump()
            raise
        # CPU: completed now; GPU: once the stream passes this point (a pooled event, Note [flight recorder]).
        self._group.issued(call, inputs[0].device.index if cuda else -1)
        return result

    def dump(self) -> str:
        """Writes this rank's flight-recorder dump (TORCH_FR_DUMP_TEMP_FILE + rank); returns the file."""
        self._group.poll()
        return _C.fr_dump_to_file(self._rank)
