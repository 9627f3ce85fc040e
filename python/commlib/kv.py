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
A destination on another host is reached through NIXL (``pip install nixl-cu13``; commlib.kv_nixl,
Note [kv over nixl]); the calls are the same.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from datetime import timedelta
from typing import Iterable, List, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import _C
from . import kv_nixl, kv_nixl_inbox
from .errors import CommError, CommTimeoutError, PeerError

LAYOUTS = {"NHD": "BTHD", "HND": "BHTD", "flash_attn": "KBTHD", "flashinfer_nhd": "BKTHD",
           "flashinfer_hnd": "BKHTD", "MLA": "BTD"}
ROLES = ("prefill", "decode", "both")
_ERRORS = {"CommTimeoutError": CommTimeoutError, "PeerError": PeerError, "CommError": CommError}
_log = logging.getLogger("commlib.kv")


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


class _NixlKVSend(KVSend):
    """A request pushed through NIXL (Note [kv over nixl]); the same calls as ``KVSend``."""

    def __init__(self, agent: "KVAgent", send: "kv_nixl.NixlSend", request_id: str, layers: List[int]):
        super().__init__(agent, 0, request_id, layers)
        self._send = send

    def send_layer(self, layer: int) -> None:
        """Posts one announced layer and returns; it moves in the background once the current stream
        has written it. Its source blocks must stay unchanged until ``done()`` (Note [kv over nixl])."""
        self.send_layers([layer])

    def send_layers(self, layers: Iterable[int]) -> None:
        layers = sorted(int(l) for l in layers)
        n = self._agent.num_layers
        for first, count in _runs(layers):
            if first < 0 or first + count > n:
                raise ValueError(f"KVAgent.send_layer: layers [{first}, {first + count}) out of range; valid: "
                                 f"0..{n - 1}")
        for i, l in enumerate(layers):
            if l not in self._send.announced:
                raise ValueError(f"KVAgent.send_layer: request '{self.request_id}': layer {l} was not announced by "
                                 "send/begin")
            if l in self._send.sent or l in layers[:i]:
                raise ValueError(f"KVAgent.send_layer: request '{self.request_id}': layer {l} sent already")
        self._send.send_layers(layers)  # posted once the current stream has written them (Note [kv over nixl])

    def done(self) -> bool:
        return self._send.check()

    def wait(self, timeout: Optional[timedelta] = None) -> None:
        seconds = self._agent._seconds(timeout)
        deadline = time.monotonic() + seconds
        while not self._send.check():
            if time.monotonic() >= deadline:
                raise CommTimeoutError(
                    f"KVAgent.wait_send: request '{self.request_id}' to instance '{self._send.peer.name}': not "
                    f"complete after {int(seconds * 1000)} ms ({len(self._send.sent)} of {len(self._send.announced)} "
                    "layers sent)")
            time.sleep(0.0001)


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
    landed for that long (``CommTimeoutError``) or when its sender exited (``PeerError``: at once on
    this host; from another host once its heartbeat has stopped for 5 s, docs/kv.md).
    ``num_ctas``: the CUDA copy kernel's largest grid, its SM budget (default ``COMMLIB_KV_CTAS``).
    ``require_rdma``: a destination on another host is reached through NIXL over RDMA or not at
    all (``ValueError`` at connect when either host has no RDMA port; UCX may use only those ports).
    One thread drives an agent; ``close()`` (or collection) releases everything.
    """

    def __init__(self, store: dist.Store, instance: str, role: str, tp_rank: int = 0, tp_size: int = 1,
                 device: Union[str, torch.device] = "cpu", timeout: timedelta = timedelta(seconds=300),
                 num_ctas: Optional[int] = None, require_rdma: bool = False):
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
        self.require_rdma = bool(require_rdma)
        self.host = _C.host_id()
        self._store = store
        self._geo = None          # this rank's geometry, as published (Note [kv over nixl])
        self._nixl = None         # the NIXL agent it sends through, made at the first remote connect
        self._sending = None      # its kv_nixl.SendProgress, made with the first NIXL send
        self._inbox = None        # receivers with NIXL: their own NIXL agent (made at register) and what arrives
        self._local_peers = set()  # peers reached through the native agent
        self._remote = {}          # peer -> kv_nixl.NixlPeer
        self._nixl_sends = {}      # id -> kv_nixl.NixlSend, until poll() reports it
        self._events: List[KVEvent] = []  # native events wait() took while looking for another request
        self._transport_logged = False
        self._closed = False

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
        # [layer][plane] as [B, T, H, head_dim bytes] uint8 views: what a NIXL sender gathers from
        perm = [plane_axes.index(a) for a in "BTHD" if a in plane_axes]
        views = [p.permute(perm).view(torch.uint8) for p in planes]
        views = [v if "H" in plane_axes else v.unsqueeze(2) for v in views]
        n = len(views) // len(caches)
        self._canon = [views[i * n:(i + 1) * n] for i in range(len(caches))]
        self._geo = dict(instance=self.instance, rank=self.tp_rank, tp_size=self.tp_size, role=self.role,
                         receives=self.role != "prefill", host=self.host, pid=os.getpid(), device=self.device.type,
                         device_index=-1 if self.device.index is None else self.device.index,
                         axes=axes, dtype=str(first.dtype).replace("torch.", ""), esize=esize,
                         num_layers=len(caches), num_planes=1 if "H" not in axes else 2, mla="H" not in axes,
                         num_blocks=size["B"], block_size=size["T"], heads=size.get("H", 1), head_dim=size["D"],
                         sB=stride["B"], sT=stride["T"], sH=stride.get("H", 0), planes=[p.data_ptr() for p in planes],
                         span=span, nixl=False, rdma=kv_nixl.rdma_devices())
        if self._geo["receives"] and kv_nixl.nixl_api() is not None:
            try:
                rx = self._make_nixl()
                self._store.set(f"kv/{self.instance}/{self.tp_rank}/nixl", rx.get_agent_metadata())
                # Its thread drives rx from now.
                self._inbox = kv_nixl_inbox.NixlInbox(rx, self.timeout.total_seconds(), self._store)
                self._geo["nixl"] = True
            except Exception as e:  # noqa: BLE001 - NIXL imports but cannot start: this host's peers still work
                _log.warning("commlib.kv: instance '%s' rank %d: NIXL did not start (%s: %s); senders on other "
                             "hosts cannot reach it", self.instance, self.tp_rank, type(e).__name__, e)
                self._inbox = None
        self._store.set(f"kv/{self.instance}/{self.tp_rank}/geometry", json.dumps(self._geo).encode())

    def connect(self, peer: str) -> List[int]:
        """Sender: maps the ranks of instance ``peer`` that this rank writes to (done by the first
        send too); returns their TP ranks. Waits (up to the timeout) for the peer to register. A
        peer with a destination rank on another host is reached through NIXL (Note [kv over nixl])."""
        peer = str(peer)
        if peer in self._remote:
            return [d.rank for d in self._remote[peer].dests]
        if self._geo is None or self.role == "decode" or peer in self._local_peers:
            self._native.connect(peer)  # its checks and errors (not registered, not a sender, ...)
            return self._native.destinations(peer)
        # connect()'s checks and the TP routes, as the native agent does them (Note [kv peer checks]).
        plans = self._native.check_peer(peer)
        first = json.loads(self.store_get(f"kv/{peer}/0/geometry", f"instance '{peer}' rank 0"))
        ranks = [first] + [json.loads(self.store_get(f"kv/{peer}/{r}/geometry", f"instance '{peer}' rank {r}"))
                           for r in range(1, first["tp_size"])]
        # Every rank of both instances on this host: the native path. Otherwise NIXL for all of
        # them, so that the senders of one destination rank agree (Note [kv over nixl]).
        own = [json.loads(self.store_get(f"kv/{self.instance}/{r}/geometry", f"instance '{self.instance}' rank {r}"))
               for r in range(self.tp_size)]
        if all(g["host"] == self.host for g in ranks + own):
            self._native.connect(peer)
            self._local_peers.add(peer)
            return self._native.destinations(peer)
        self._check_nixl(peer, ranks, plans)
        self._remote[peer] = kv_nixl.NixlPeer(self, peer, self._geo, ranks, plans)
        if not self._transport_logged:
            self._transport_logged = True
            text = self._remote[peer].transport
            (_log.warning if "TCP" in text else _log.info)("commlib.kv: instance '%s' rank %d -> instance '%s': %s",
                                                           self.instance, self.tp_rank, peer, text)
        return [d.rank for d in self._remote[peer].dests]

    def transport(self, peer: str) -> str:
        """How this rank reaches instance ``peer`` (after connect): "local: ..." (this host's shared or
        CUDA IPC memory) or "NIXL/UCX ..." with what can be known of the transport (NIXL names its
        backend, not the UCX transport it picked: the RDMA ports UCX may use, or TCP when there are none)."""
        peer = str(peer)
        if peer in self._remote:
            return self._remote[peer].transport
        if peer in self._local_peers:
            return "local: " + ("CUDA IPC (peer GPU memory)" if self.device.type == "cuda" else "shared memory (memfd)")
        raise ValueError(f"KVAgent.transport: not connected to instance '{peer}'")

    # ---- NIXL (Note [kv over nixl]) ----
    def store_get(self, key: str, who: str) -> bytes:
        """The store's value of ``key``, waiting up to the timeout (``CommTimeoutError`` naming ``who``)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self._store.check([key]):
            if time.monotonic() >= deadline:
                raise CommTimeoutError(f"KVAgent.connect: {who} did not register its KV cache within "
                                       f"{int(self.timeout.total_seconds() * 1000)} ms (store key '{key}')")
            time.sleep(0.005)
        return self._store.get(key)

    def nixl_agent(self):
        """The NIXL agent this rank sends through (created once, its cache registered). A receiving
        rank has another, driven by its inbox's thread (Note [kv over nixl])."""
        if self._nixl is None:
            if self._geo is None or self._closed:
                raise ValueError(f"KVAgent: the KV agent of instance '{self.instance}' is closed or not registered")
            self._nixl = self._make_nixl(threads=2)  # this thread and its SendProgress
        return self._nixl

    def send_progress(self) -> "kv_nixl.SendProgress":
        """The thread that posts and drives this rank's NIXL sends (made with the first one)."""
        if self._sending is None:
            store, key = self._store, kv_nixl.beat_key(self.instance, self.tp_rank, os.getpid())
            self._sending = kv_nixl.SendProgress(self.nixl_agent(), lambda n: store.set(key, str(n)))
        return self._sending

    def _make_nixl(self, threads: int = 1):
        g = self._geo
        return kv_nixl.make_agent(kv_nixl.new_agent_name(self.instance, self.tp_rank),
                                  regions=kv_nixl.merged_regions(g["planes"], g["span"]),
                                  mem="DRAM" if self.device.type == "cpu" else "VRAM", device=max(0, g["device_index"]),
                                  only_rdma=self.require_rdma and bool(g["rdma"]), threads=threads)

    def transport_description(self) -> str:
        devices = self._geo["rdma"]
        if not devices:
            return ("NIXL/UCX; this host has no RDMA port (/sys/class/infiniband is empty): across hosts UCX "
                    "runs over TCP")
        return (f"NIXL/UCX; RDMA ports {', '.join(devices)} " +
                ("(UCX may use only these: require_rdma)" if self.require_rdma else
                 "(UCX picks among them and TCP; NIXL does not say which)"))

    def _check_nixl(self, peer: str, ranks: list, plans: list) -> None:
        """What a NIXL peer needs beyond connect()'s checks (check_peer): NIXL on both sides, RDMA when required."""
        what, mine = "KVAgent.connect", self._geo
        if kv_nixl.nixl_api() is None:
            hosts = sorted({g["host"] for g in ranks} | {self.host})
            raise ValueError(f"{what}: instances '{self.instance}' and '{peer}' span hosts {', '.join(hosts)}; across "
                             "hosts the KV transfer needs NIXL, which does not import here: pip install nixl-cu13 "
                             "(or commlib[nixl]) (docs/kv.md)")
        for p in plans:
            d = ranks[p["rank"]]
            if not d["nixl"]:
                raise ValueError(f"{what}: {kv_nixl.peer_name(d['instance'], d['rank'], d['pid'], d['host'])} on host "
                                 f"'{d['host']}' has no NIXL agent (NIXL does not import or start there: pip install "
                                 "nixl-cu13); across hosts the KV transfer needs it on both sides")
            if self.require_rdma and not (mine["rdma"] and d["rdma"]):
                host = self.host if not mine["rdma"] else d["host"]
                raise ValueError(f"{what}: require_rdma: host '{host}' has no RDMA port (/sys/class/infiniband is "
                                 f"empty), so NIXL/UCX would carry the KV cache to "
                                 f"{kv_nixl.peer_name(d['instance'], d['rank'], d['pid'], d['host'])} over TCP; "
                                 "refusing (KVAgent(require_rdma=False) allows it)")

    # ---- sending ----
    def begin(self, peer: str, request_id: str, src_blocks, dst_blocks, layers=None,
              num_tokens: Optional[int] = None) -> KVSend:
        """Announces a request to ``peer`` without copying: ``src_blocks`` (this rank's block ids, in
        token order) go to ``dst_blocks`` (the peer's), ``num_tokens`` (default: all tokens of the source
        blocks) tokens of ``layers`` (default all). Send the layers with ``KVSend.send_layer`` as they
        are computed. Block ids: CPU int tensors (fastest) or lists. Bad input raises ``ValueError``
        before anything is written."""
        return self._begin(peer, request_id, src_blocks, dst_blocks, layers, num_tokens, announce=True)

    def _begin(self, peer: str, request_id: str, src_blocks, dst_blocks, layers, num_tokens: Optional[int],
               announce: bool, stream: Optional[int] = None) -> KVSend:
        """begin(); announce=False: the caller sends every layer at once (send), so a NIXL peer learns
        of the request from its first transfer's notification (Note [kv over nixl])."""
        if layers is None:
            layer_list: List[int] = []
        elif isinstance(layers, int):
            layer_list = [layers]
        else:
            layer_list = [int(l) for l in layers]
        peer = str(peer)
        if peer not in self._local_peers and peer not in self._remote and self._geo is not None \
                and self.role != "decode":
            self.connect(peer)
        if peer in self._remote:
            return self._begin_nixl(self._remote[peer], str(request_id), _block_ids("src_blocks", src_blocks),
                                    _block_ids("dst_blocks", dst_blocks), num_tokens, layer_list, announce)
        handle = self._native.begin(str(peer), str(request_id), _block_ids("src_blocks", src_blocks),
                                    _block_ids("dst_blocks", dst_blocks), -1 if num_tokens is None else int(num_tokens),
                                    layer_list, self._stream() if stream is None else stream)
        return KVSend(self, handle, str(request_id), layer_list or list(range(self.num_layers)))

    def send(self, peer: str, request_id: str, src_blocks, dst_blocks, layers=None,
             num_tokens: Optional[int] = None) -> KVSend:
        """``begin`` and send every announced layer at once (one launch per run of layers)."""
        stream = self._stream()  # one query for both calls (a few us each)
        x = self._begin(peer, request_id, src_blocks, dst_blocks, layers, num_tokens, announce=False, stream=stream)
        if layers is None and not isinstance(x, _NixlKVSend):
            self._native.send_layers(x._handle, 0, self.num_layers, stream)  # one launch
        else:
            x.send_layers(x.layers)
        return x

    def _begin_nixl(self, peer: "kv_nixl.NixlPeer", request_id: str, src: torch.Tensor, dst: torch.Tensor,
                    num_tokens: Optional[int], layer_list: List[int], announce: bool) -> KVSend:
        """``begin`` to a NIXL peer: the native agent's checks and messages, then the announcement
        (an empty request's always: it has no transfer to carry it)."""
        # The native agent's checks and messages (Note [kv request checks]).
        ntok = _C.kv_check_request(request_id, src, dst, -1 if num_tokens is None else int(num_tokens),
                                   self._geo["num_blocks"], self._geo["block_size"], peer.peer_blocks, peer.peer_bs,
                                   layer_list, self.num_layers)
        s, d = src.numpy().astype("int64"), dst.numpy().astype("int64")
        announced = list(layer_list or range(self.num_layers))
        send = kv_nixl.NixlSend(self, peer, request_id, s, d, ntok, announced)
        if announce or send.empty:
            send.announce()
        self._nixl_sends[id(send)] = send
        return _NixlKVSend(self, send, request_id, announced)

    def _nixl_events(self, request_id: Optional[str] = None) -> List[KVEvent]:
        """Finished NIXL requests (received: all, or only ``request_id``; sent: all unless one is asked for)."""
        out = []
        if self._inbox is not None:
            self._inbox.pump()
            now = time.monotonic()
            for t in list(self._inbox.tracked.values()):
                if request_id is not None and t.request_id != request_id:
                    continue
                state, cls, reason, peer, landed = self._inbox.evaluate(t, now)
                if state != "pending":
                    self._inbox.finish(t)
                    out.append(KVEvent(t.request_id, "recv", state, _ERRORS[cls](reason) if cls else None, reason, peer,
                                       bin(t.mask).count("1"), landed, t.num_blocks))
        if request_id is None:
            for key, send in list(self._nixl_sends.items()):
                try:
                    if not send.check():
                        continue
                    event = KVEvent(send.request_id, "send", "done", None, "", f"instance '{send.peer.name}'",
                                    len(send.announced), [], 0)
                except CommError as e:
                    event = KVEvent(send.request_id, "send", "failed", e, str(e), f"instance '{send.peer.name}'",
                                    len(send.announced), [], 0)
                del self._nixl_sends[key]
                out.append(event)
        return out

    # ---- receiving ----
    def poll(self) -> List[KVEvent]:
        """Requests finished since the last poll: received here (kind "recv") and sent from here
        (kind "send"), done or failed, each reported once (by poll or by wait)."""
        events = [_event(t) for t in self._native.poll()]
        if self._events:
            events, self._events = self._events + events, []
        if self._inbox is not None or self._nixl_sends:
            events += self._nixl_events()
        return events

    def wait(self, request_id: str, timeout: Optional[timedelta] = None) -> KVEvent:
        """Waits until ``request_id`` landed from every sender and returns its event (reported: a
        later poll does not list it). Raises its error (``CommTimeoutError`` / ``PeerError`` /
        ``CommError``, naming the request, peer and layer) if it failed, and ``CommTimeoutError``
        (not reported: wait again) if it is still incomplete after ``timeout`` (default: the agent's)."""
        request_id, seconds = str(request_id), self._seconds(timeout)
        if self._inbox is None and not self._events:
            event = _event(self._native.wait(request_id, seconds))
        else:
            event = self._wait_any(request_id, seconds)
        if event.error is not None:
            raise event.error
        return event

    def _wait_any(self, request_id: str, seconds: float) -> KVEvent:
        """wait() when requests may also arrive through NIXL: polls both, keeps the other events for poll()."""
        deadline = time.monotonic() + seconds
        for round in range(1 << 62):
            for i, e in enumerate(self._events):
                if e.kind == "recv" and e.request_id == request_id:
                    return self._events.pop(i)
            events = self._nixl_events(request_id) if self._inbox is not None else []
            if events:
                return events[0]
            self._events += [_event(t) for t in self._native.poll()]
            if any(e.kind == "recv" and e.request_id == request_id for e in self._events):
                continue
            if time.monotonic() >= deadline:
                break
            time.sleep(0 if round < 32 else 0.0001 if round < 2000 else 0.001)
        t = self._inbox.tracked.get(request_id) if self._inbox is not None else None
        if t is not None:
            _, _, _, peer, landed = self._inbox.evaluate(t, time.monotonic())
            missing = [l for l in kv_nixl.mask_layers(t.mask) if l not in landed]
            raise CommTimeoutError(f"KVAgent.wait: Timed out after {int(seconds * 1000)} ms: KV request '{request_id}' "
                                   f"from {peer}: layer {missing[0]} has not landed (layers landed: "
                                   f"{kv_nixl.layer_list(landed)} of {bin(t.mask).count('1')})")
        return _event(self._native.wait(request_id, 0.0))  # its message: what arrived, who is connected

    def wait_layer(self, request_id: str, layer: int, timeout: Optional[timedelta] = None) -> None:
        """Waits until layer ``layer`` of the request landed from every sender (layer-wise streaming);
        ``CommTimeoutError`` after ``timeout`` (default: the agent's); raises the request's failure."""
        if not self._layer(str(request_id), int(layer), self._seconds(timeout)):
            raise CommTimeoutError(f"KVAgent.wait_layer: layer {layer} of KV request '{request_id}' has not landed "
                                   f"after {self._seconds(timeout):.3f} s")

    def layer_ready(self, request_id: str, layer: int) -> bool:
        """Whether layer ``layer`` of the request landed from every sender (does not wait)."""
        return self._layer(str(request_id), int(layer), 0.0)

    def _layer(self, request_id: str, layer: int, seconds: float) -> bool:
        if self._inbox is None and not self._events:
            return self._native.wait_layer(request_id, layer, seconds)
        deadline = time.monotonic() + seconds
        for round in range(1 << 62):
            if self._native.wait_layer(request_id, layer, 0.0):  # also checks the layer's range
                return True
            for e in self._events:  # a request wait() took from the native agent while looking for another
                if e.kind == "recv" and e.request_id == request_id:
                    if e.error is not None:
                        raise e.error
                    return layer in e.layers_done
            if self._inbox is not None:
                self._inbox.pump()
                t = self._inbox.tracked.get(request_id)
                if t is not None:
                    state, cls, reason, _, landed = self._inbox.evaluate(t, time.monotonic())
                    if layer in landed and len(t.contributors) == t.num_contributors:
                        return True
                    if state == "failed":
                        raise _ERRORS[cls](reason)
            if time.monotonic() >= deadline:
                return False
            time.sleep(0 if round < 32 else 0.0001 if round < 2000 else 0.001)
        return False

    def close(self) -> None:
        """Releases the agent's memory, mappings and server; peers' later sends to it fail."""
        self._closed = True
        if self._sending is not None:
            self._sending.close()  # nothing posts or polls from here on
            self._sending = None
        if self._nixl is not None:
            for send in self._nixl_sends.values():
                for _, h, _, _ in send.handles:
                    try:
                        self._nixl.release_xfer_handle(h)
                    except Exception:  # noqa: BLE001 - closing: a transfer still in flight stays NIXL's
                        pass
            for peer in self._remote.values():
                peer.release(self._nixl)
            self._nixl_sends.clear()
            self._remote.clear()
            self._nixl = None  # NIXL deregisters the cache when its agent goes
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
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
