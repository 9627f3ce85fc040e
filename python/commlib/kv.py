"""KV-cache transfer for disaggregated prefill / decode (docs/kv.md).

A prefill instance and a decode instance are separate process groups, each of its own TP size.
Every process (TP rank) of both makes one ``KVAgent`` over a torch ``Store`` that both instances
reach, registers its paged KV cache once, and the prefill side pushes requests into the decode
side's blocks::

    agent = commlib.kv.KVAgent(store, "decode0", "decode", tp_rank, tp_size, device="cuda")
    agent.register(kv_caches, layout="flash_attn")       # one tensor [2, B, T, H, D] per layer
    ...
    agent.wait("req-7")                                   # decode: the request landed

    agent = commlib.kv.KVAgent(store, "prefill0", "prefill", tp_rank, tp_size, device="cuda")
    agent.register(kv_caches, layout="flash_attn")
    agent.send("decode0", "req-7", src_blocks, dst_blocks)   # all layers, one launch
    x = agent.begin("decode0", "req-8", src_blocks, dst_blocks)  # layer-wise streaming:
    x.send_layer(0); ...; x.send_layer(num_layers - 1)       #   decode may use layer 0 already

Layouts (the axes of each layer's tensor, outermost first; B block, T token in block, H KV head,
D head_dim, K the K/V plane): ``"NHD"`` (= ``"BTHD"``: a (k, v) pair per layer), ``"HND"``
(``"BHTD"``, pairs), ``"flash_attn"`` (``"KBTHD"``: vLLM's FlashAttention cache),
``"flashinfer_nhd"`` (``"BKTHD"``), ``"flashinfer_hnd"`` (``"BKHTD"``), ``"MLA"`` (``"BTD"``: the
latent cache, one tensor per layer); any other axes string of these letters works too.
The two sides may differ in layout, block size and TP size; the copy transforms on the way.
"""
from __future__ import annotations

import math
from datetime import timedelta
from typing import Iterable, List, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import _C
from .errors import CommError, CommTimeoutError, PeerError

LAYOUTS = {"NHD": "BTHD", "HND": "BHTD", "flash_attn": "KBTHD", "flashinfer_nhd": "BKTHD",
           "flashinfer_hnd": "BKHTD", "MLA": "BTD"}
ROLES = ("prefill", "decode", "both")
_ERRORS = {"CommTimeoutError": CommTimeoutError, "PeerError": PeerError, "CommError": CommError}


class KVEvent(NamedTuple):
    """A finished request. ``kind``: "recv" (it landed here) or "send" (this rank's part of it landed
    at the peer: its source blocks may be reused). ``state``: "done" or "failed" (then ``error`` is the
    exception, ``reason`` its message, naming the request, the peer and the first missing layer).
    ``layers_done``: layers that landed from every sender (all of them when done)."""
    request_id: str
    kind: str
    state: str
    error: Optional[Exception]
    reason: str
    peer: str
    num_layers: int
    layers_done: List[int]
    num_blocks: int


def _event(t) -> KVEvent:
    request_id, kind, state, error_class, reason, peer, num_layers, layers_done, num_blocks = t
    error = _ERRORS[error_class](reason) if state == "failed" else None
    return KVEvent(request_id, kind, state, error, reason, peer, num_layers, list(layers_done), num_blocks)


def host_empty(shape: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A CPU tensor in memory a KV peer process can write (a memfd). A receiving agent's CPU cache
    must be allocated with it; sending agents may use any CPU tensor."""
    esize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(int(s) for s in shape)
    raw = _C.kv_host_empty(max(1, numel) * esize)
    return raw[:numel * esize].view(dtype).view(tuple(int(s) for s in shape))


def _axes(layout: str) -> str:
    axes = LAYOUTS.get(layout, layout)
    if (not isinstance(axes, str) or sorted(set(axes)) != sorted(axes) or not set("BTD") <= set(axes)
            or not set(axes) <= set("KBTHD") or ("K" in axes and "H" not in axes)):
        raise ValueError(f"KVAgent.register: layout {layout!r} not supported; supported: {', '.join(LAYOUTS)} or an "
                         "axes string of B (block), T (token), H (head), D (head_dim), K (K/V plane), e.g. 'BKTHD'")
    return axes


class KVSend:
    """One request being pushed (``KVAgent.send`` / ``begin``)."""

    def __init__(self, agent: "KVAgent", handle: int, request_id: str, layers: List[int]):
        self._agent, self._handle, self.request_id, self.layers = agent, handle, request_id, layers

    def send_layer(self, layer: int) -> None:
        """Copies one announced layer (CUDA: one launch on the current stream, after the work that
        wrote it; CPU: done on return). Each layer is sent once."""
        self._agent._native.send_layers(self._handle, int(layer), 1, self._agent._stream())

    def send_layers(self, layers: Iterable[int]) -> None:
        """Copies several layers, one launch per run of consecutive layers."""
        stream = self._agent._stream()
        for first, count in _runs(sorted(int(l) for l in layers)):
            self._agent._native.send_layers(self._handle, first, count, stream)

    def done(self) -> bool:
        """Whether every announced layer landed at every destination (the source blocks may be reused)."""
        return self._agent._native.send_done(self._handle)

    def wait(self, timeout: Optional[timedelta] = None) -> None:
        """Waits until ``done()``; ``CommTimeoutError`` after ``timeout`` (default: the agent's)."""
        self._agent._native.wait_send(self._handle, self._agent._seconds(timeout))


def _runs(layers: List[int]):
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        yield layers[i], j - i + 1
        i = j + 1


def _block_ids(what: str, ids) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise TypeError(f"KVAgent.send: {what} is on {ids.device}; supported: a CPU tensor or a list of ints")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1:
            raise TypeError(f"KVAgent.send: {what} must be a 1-D integer tensor, got {ids.dtype} of shape "
                            f"{tuple(ids.shape)}")
        return ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
    values = list(ids)
    t = torch.as_tensor(values) if values else torch.empty(0, dtype=torch.int64)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1:
        raise TypeError(f"KVAgent.send: {what} must be integer block ids, got {t.dtype} of shape {tuple(t.shape)}")
    return t.to(torch.int32)


class KVAgent:
    """One process's KV-cache agent (docs/kv.md).

    ``KVAgent(store, instance, role, tp_rank=0, tp_size=1, device="cpu", timeout=300 s)``: ``store``
    a ``torch.distributed.Store`` every instance reaches; ``instance`` names this instance (its ranks
    share it); ``role`` "prefill" (sends), "decode" (receives) or "both"; ``device`` where the cache
    lives. ``timeout`` bounds every wait: a receiver reports a request failed when no layer of it
    landed for that long (``CommTimeoutError``) or at once when its sender exited (``PeerError``).
    ``num_ctas``: the CUDA copy kernel's largest grid, its SM budget (default ``COMMLIB_KV_CTAS``).
    One thread drives an agent; ``close()`` (or collection) releases everything.
    """

    def __init__(self, store: dist.Store, instance: str, role: str, tp_rank: int = 0, tp_size: int = 1,
                 device: Union[str, torch.device] = "cpu", timeout: timedelta = timedelta(seconds=300),
                 num_ctas: Optional[int] = None):
        if not isinstance(store, dist.Store):
            raise TypeError(f"KVAgent: store must be a torch.distributed.Store, got {type(store).__name__}")
        if role not in ROLES:
            raise ValueError(f"KVAgent: role {role!r} not supported; supported: {', '.join(ROLES)}")
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"KVAgent: timeout must be a positive timedelta, got {timeout!r}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise TypeError(f"KVAgent: device {device} not supported; supported: cpu, cuda")
        self.instance, self.role, self.tp_rank, self.tp_size = str(instance), role, int(tp_rank), int(tp_size)
        self.device, self.timeout = device, timeout
        self._native = _C.KVAgent(store, self.instance, role, self.tp_rank, self.tp_size, device.type,
                                  device.index if device.index is not None else -1, timeout.total_seconds(),
                                  int(num_ctas or 0))
        self._caches = None
        self.num_layers = 0

    # ---- registration ----
    def register(self, caches: Sequence, layout: str = "NHD") -> None:
        """Registers this rank's paged cache: ``caches[layer]`` is one tensor (layouts with a K axis,
        and MLA) or a (k, v) pair. Every layer has the same shape, strides and dtype; head_dim is
        contiguous. Once per agent; publishes this rank's descriptor to the store."""
        axes = _axes(layout)
        if not isinstance(caches, (list, tuple)) or not caches:
            raise TypeError("KVAgent.register: caches must be a non-empty list with one entry per layer")
        planes = []
        for i, entry in enumerate(caches):
            if "K" in axes:
                if not isinstance(entry, torch.Tensor) or entry.dim() != len(axes):
                    raise ValueError(f"KVAgent.register: layer {i}: layout {axes!r} needs one {len(axes)}-D tensor "
                                     "per layer")
                kv_axis = axes.index("K")
                if entry.shape[kv_axis] != 2:
                    raise ValueError(f"KVAgent.register: layer {i}: the K axis (dim {kv_axis}) has size "
                                     f"{entry.shape[kv_axis]}; expected 2")
                planes += [entry.select(kv_axis, 0), entry.select(kv_axis, 1)]
            elif "H" in axes:
                if not (isinstance(entry, (list, tuple)) and len(entry) == 2
                        and all(isinstance(t, torch.Tensor) for t in entry)):
                    raise ValueError(f"KVAgent.register: layer {i}: layout {axes!r} needs a (k, v) pair of tensors")
                planes += list(entry)
            else:
                if not isinstance(entry, torch.Tensor):
                    raise ValueError(f"KVAgent.register: layer {i}: an MLA layout needs one tensor per layer")
                planes.append(entry)
        plane_axes = axes.replace("K", "")
        first = planes[0]
        for p in planes:
            if p.dim() != len(plane_axes):
                raise ValueError(f"KVAgent.register: a plane has shape {tuple(p.shape)}; layout {axes!r} needs "
                                 f"{len(plane_axes)} dims per K or V plane")
            if p.shape != first.shape or p.stride() != first.stride() or p.dtype != first.dtype:
                raise ValueError(f"KVAgent.register: every layer and plane needs the same shape, strides and dtype; "
                                 f"got {tuple(p.shape)}/{p.stride()}/{p.dtype} and {tuple(first.shape)}/"
                                 f"{first.stride()}/{first.dtype}")
            if p.device != self.device:
                raise TypeError(f"KVAgent.register: a cache tensor is on {p.device}; this agent's device is "
                                f"{self.device}")
        size = dict(zip(plane_axes, first.shape))
        esize = first.element_size()
        stride = {a: s * esize for a, s in zip(plane_axes, first.stride())}
        if first.stride()[plane_axes.index("D")] != 1:
            raise ValueError(f"KVAgent.register: head_dim must be contiguous (stride 1); strides {first.stride()}")
        span = sum((n - 1) * abs(s) for n, s in zip(first.shape, first.stride())) * esize + esize
        self._native.register_cache(axes, str(first.dtype).replace("torch.", ""), esize, len(caches),
                                    1 if "H" not in axes else 2, "H" not in axes, size["B"], size["T"],
                                    size.get("H", 1), size["D"], stride["B"], stride["T"], stride.get("H", 0),
                                    [p.data_ptr() for p in planes], span)
        self._caches = caches  # the agent addresses their memory: keep it alive
        self.num_layers = len(caches)

    def connect(self, peer: str) -> List[int]:
        """Sender: maps the ranks of instance ``peer`` that this rank writes to (done by the first
        send too); returns their TP ranks. Waits (up to the timeout) for the peer to register."""
        self._native.connect(str(peer))
        return self._native.destinations(str(peer))

    # ---- sending ----
    def begin(self, peer: str, request_id: str, src_blocks, dst_blocks, layers=None,
              num_tokens: Optional[int] = None) -> KVSend:
        """Announces a request to ``peer`` without copying: ``src_blocks`` (this rank's block ids, in
        token order) go to ``dst_blocks`` (the peer's), ``num_tokens`` (default: all tokens of the source
        blocks) tokens of ``layers`` (default all). Send the layers with ``KVSend.send_layer`` as they
        are computed. Block ids: CPU int tensors (fastest) or lists. Bad input raises ``ValueError``
        before anything is written."""
        if layers is None:
            layer_list: List[int] = []
        elif isinstance(layers, int):
            layer_list = [layers]
        else:
            layer_list = [int(l) for l in layers]
        handle = self._native.begin(str(peer), str(request_id), _block_ids("src_blocks", src_blocks),
                                    _block_ids("dst_blocks", dst_blocks), -1 if num_tokens is None else int(num_tokens),
                                    layer_list, self._stream())
        return KVSend(self, handle, str(request_id), layer_list or list(range(self.num_layers)))

    def send(self, peer: str, request_id: str, src_blocks, dst_blocks, layers=None,
             num_tokens: Optional[int] = None) -> KVSend:
        """``begin`` and send every announced layer at once (one launch per run of layers)."""
        x = self.begin(peer, request_id, src_blocks, dst_blocks, layers, num_tokens)
        stream = self._stream()
        if layers is None:
            self._native.send_layers(x._handle, 0, self.num_layers, stream)
        else:
            x.send_layers(x.layers)
        return x

    # ---- receiving ----
    def poll(self) -> List[KVEvent]:
        """Requests finished since the last poll: received here (kind "recv") and sent from here
        (kind "send"), done or failed, each reported once (by poll or by wait)."""
        return [_event(t) for t in self._native.poll()]

    def wait(self, request_id: str, timeout: Optional[timedelta] = None) -> KVEvent:
        """Waits until ``request_id`` landed from every sender and returns its event (reported: a
        later poll does not list it). Raises its error (``CommTimeoutError`` / ``PeerError`` /
        ``CommError``, naming the request, peer and layer) if it failed, and ``CommTimeoutError``
        (not reported: wait again) if it is still incomplete after ``timeout`` (default: the agent's)."""
        event = _event(self._native.wait(str(request_id), self._seconds(timeout)))
        if event.error is not None:
            raise event.error
        return event

    def wait_layer(self, request_id: str, layer: int, timeout: Optional[timedelta] = None) -> None:
        """Waits until layer ``layer`` of the request landed from every sender (layer-wise streaming);
        ``CommTimeoutError`` after ``timeout`` (default: the agent's); raises the request's failure."""
        if not self._native.wait_layer(str(request_id), int(layer), self._seconds(timeout)):
            raise CommTimeoutError(f"KVAgent.wait_layer: layer {layer} of KV request '{request_id}' has not landed "
                                   f"after {self._seconds(timeout):.3f} s")

    def layer_ready(self, request_id: str, layer: int) -> bool:
        """Whether layer ``layer`` of the request landed from every sender (does not wait)."""
        return self._native.wait_layer(str(request_id), int(layer), 0.0)

    def close(self) -> None:
        """Releases the agent's memory, mappings and server; peers' later sends to it fail."""
        self._native.close()

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    def _seconds(self, timeout: Optional[timedelta]) -> float:
        if timeout is None:
            return self.timeout.total_seconds()
        if not isinstance(timeout, timedelta) or timeout.total_seconds() < 0:
            raise ValueError(f"KVAgent: timeout must be a non-negative timedelta, got {timeout!r}")
        return timeout.total_seconds()

    def __repr__(self) -> str:
        return (f"commlib.kv.KVAgent(instance={self.instance!r}, role={self.role!r}, tp_rank={self.tp_rank}, "
                f"tp_size={self.tp_size}, device={self.device}, layers={self.num_layers})")


__all__ = ["KVAgent", "KVEvent", "KVSend", "LAYOUTS", "host_empty"]
