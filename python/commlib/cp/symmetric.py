"""The copy-engine ring: ``SymmetricTransport`` (slots in symmetric memory, no SM) and the
process's watchdog thread that bounds its waits from the host.

Note [cp copy-engine ring]
    On CUDA with a commlib.Communicator the ring uses no SM. Each message slot (K/V, Q: two each,
    double-buffered; partial (O, LSE) returns: one per step) lives in symmetric memory (cuMem,
    mapped into every peer) and has exactly one sender per receiver, so two 32-bit flags per slot
    suffice: ready[X] in the receiver's memory, free[X] in the sender's. Sender, on a copy stream
    that first waits for the current stream: wait free[X] == 1, write free[X] = 0, copy the block
    into the receiver's slot (cudaMemcpyAsync between peer-mapped addresses: a copy-engine
    transfer), write ready[X] = 1 at the receiver (cuStreamWriteValue32 fences first, so the data
    lands before the flag). Receiver, on the current stream: wait ready[X] == 1, write ready[X] = 0,
    compute, then write free[X] = 1 at the sender. The flags return to their initial values after
    every use (no sequence numbers), so a captured CUDA graph replays the same operations. A
    stream wait has no timeout on the device: Note [cp ring watchdog] bounds it from the host. The
    slot protocol runs in C++ (commlib._C.CopyEngineRing, Note [copy-engine slots] in
    csrc/cuda/cuda_copy_engine.hpp, the mechanism the GPU send / recv also runs on); this module
    lays out the slots, owns the streams and watches the calls.

Note [cp ring watchdog]
    cuStreamWaitValue32 cannot time out, and an SM-side bounded wait would cost the SMs the ring
    exists to leave free; so the bound comes from the host, automatically. Every eager call on the
    copy-engine ring records an event after each step's wait (current stream) and each send (copy
    stream) and hands them to one daemon thread per process with a deadline of the communicator's
    timeout (COMMLIB_TIMEOUT_MS, else init_process_group's / Communicator's timeout). When a call's
    events are not all complete by then, the thread (1) names the first wait still pending (slot,
    step, the peer it waits for, or the peer that has not released a slot), (2) marks the ring
    failed, (3) unblocks this rank's streams: on a side stream it fills the call's receive slots
    with NaN and writes ready = free = 1 into this rank's flags, repeatedly, until the call's
    events complete (a side stream may share a hardware queue with the blocked one, so a write
    that does not complete within a poll moves to a fresh stream). The stuck call so produces NaN
    rows instead of a hang (merge rule: a NaN LSE poisons its row), and the next ring_attention
    on the communicator raises commlib.CommTimeoutError on every rank (the failure travels in the
    header all-gather), naming the rank, the peer and the slot. The ring of that communicator
    stays failed: its flags no longer match the peers'. Calls captured in a CUDA graph are not
    watched (a replay is not a ring_attention call): SymmetricTransport.synchronize(timeout_s)
    bounds a wait for a replay. The thread runs in the relaxed stream-capture mode, so its event
    queries never invalidate a graph that another thread captures meanwhile.
"""
from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from typing import Optional

import torch

from .transport import RingTransport


class SymmetricTransport(RingTransport):
    """The ring on GPUs with no SM: slots in symmetric memory, each message one copy-engine
    transfer into the receiver's slot, the signals stream memory operations (Note [cp copy-engine
    ring]). Needs a CUDA build of commlib and a ``commlib.Communicator``."""

    _ALIGN = 256

    def __init__(self, comm, timeout_s: Optional[float] = None):
        from .. import _C
        if not hasattr(_C, "cp_symmetric_peer_views"):
            raise TypeError("SymmetricTransport: this commlib build has no CUDA; supported: a CUDA build")
        self._C = _C
        self._max_slots = _C.CopyEngineRing.MAX_SLOTS
        self._flags_bytes = _C.CopyEngineRing.FLAGS_BYTES  # ready[], free[] (int32), then the slots
        self._comm = weakref.ref(comm)  # the communicator owns this transport, not the reverse
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.timeout_s = float(_C.cp_comm_timeout_s(comm.native)) if timeout_s is None else float(timeout_s)
        self._key = None
        self._slots: dict = {}
        self._sender: dict = {}
        self._last_wait: list = []
        self._copy_stream = None
        self.failure: Optional[str] = None  # set by the watchdog (Note [cp ring watchdog])
        self._trace: Optional[list] = None  # this call's progress events, while watched

    @property
    def comm(self):
        return self._comm()

    def allocate(self, specs: dict, device) -> None:
        device = torch.device(device)
        key = (tuple(sorted((k, tuple(v[0]), v[1]) for k, v in specs.items())), device)
        if key == self._key:
            return  # the same layout: the flags' protocol covers reuse across calls
        offsets, off = {}, self._flags_bytes
        for name in sorted(specs):
            shape, dtype = specs[name]
            nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            offsets[name] = (off, nbytes)
            off += -(-nbytes // self._ALIGN) * self._ALIGN
        # A new layout may put one slot where a peer still reads or writes another of the last call:
        # drain every rank's ring work first (host sync; a repeated layout, e.g. decode, skips this).
        if self._key is not None:
            torch.cuda.synchronize(self._buf.device)
            self.comm.barrier()
        if self._key is None or off > self._buf.numel() or self._buf.device != device:
            # Collective: every rank has the same specs (the shapes come from the global layout).
            capacity = max(off, int(1.5 * self._buf.numel())) if self._key is not None else off
            buf = self.comm.symmetric_empty((capacity,), dtype=torch.uint8, device=device)
            views = self._C.cp_symmetric_peer_views(self.comm.native, buf)
            flags = buf[:self._flags_bytes].view(torch.int32).view(2, self._max_slots)
            flags[0].zero_()   # ready[X]: this rank's slot X holds a message (written by its sender)
            flags[1].fill_(1)  # free[X]: the receiver of this rank's slot-X messages may take one
            torch.cuda.synchronize(device)
            self.comm.barrier()  # every rank's flags are initialised before any peer writes them
            self._buf, self._views = buf, views
            self._ring = self._C.CopyEngineRing(self.comm.native, buf)
        self._key = key
        self._slots = {}
        self._offsets = {name: o for name, (o, _) in offsets.items()}
        for name, (o, nbytes) in offsets.items():
            shape, dtype = specs[name]
            self._slots[name] = [v[o:o + nbytes].view(dtype).view(shape) for v in self._views]
        if self._copy_stream is None or self._copy_stream.device != device:
            self._copy_stream = torch.cuda.Stream(device)

    def _slot_index(self, name: str) -> int:
        """Fixed flag index per slot name: kv0, kv1, q0, q1, then p1, p2, ..."""
        fixed = {"kv0": 0, "kv1": 1, "q0": 2, "q1": 3}
        x = fixed[name] if name in fixed else 3 + int(name[1:])
        if x >= self._max_slots:
            raise ValueError(f"ring_attention: the copy-engine ring supports world sizes up to "
                             f"{self._max_slots - 3}; slot {name} is past it")
        return x

    def slot(self, name: str) -> torch.Tensor:
        return self._slots[name][self.rank]

    def start(self, sends, recvs):
        cur = torch.cuda.current_stream()
        sends = [(peer, name, self._message(name, src)) for peer, name, src in sends]
        cs = self._copy_stream
        cs.wait_stream(cur)  # the sources are written
        for peer, name, src in sends:
            # Wait for the peer's release, one copy-engine transfer into its slot, signal it there.
            self._ring.send(peer, self._slot_index(name), self._offsets[name], src, cs.cuda_stream)
            src.record_stream(cs)
            self._progress(cs, f"rank {peer} to release slot {name} (this rank sends into it)")
        for peer, name in recvs:
            self._sender[name] = peer
        done = torch.cuda.Event()
        done.record(cs)
        return done, [name for _, name in recvs]

    def _message(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """``src`` as the bytes of slot ``name`` (contiguous, on the current stream)."""
        slot = self._slots[name][self.rank]
        if src.dtype != slot.dtype or src.shape != slot.shape:
            raise ValueError(f"ring_attention: a message for slot {name} must be a {slot.dtype} tensor of "
                             f"shape {tuple(slot.shape)}; got {src.dtype} {tuple(src.shape)}")
        return src.contiguous()

    def wait(self, token) -> None:
        done, names = token
        self._last_wait = names
        cur = torch.cuda.current_stream()
        cur.wait_event(done)  # this step's sends no longer read their sources
        for name in names:
            self._ring.receive(self._slot_index(name), cur.cuda_stream)
            self._progress(cur, f"slot {name} from rank {self._sender.get(name)}")

    def release(self, names) -> None:
        cur = torch.cuda.current_stream()
        for name in names:
            self._ring.release(self._sender[name], self._slot_index(name), cur.cuda_stream)

    # ---- Note [cp ring watchdog] ----
    def check(self) -> None:
        """Raises commlib.CommTimeoutError if the watchdog found this ring stuck."""
        if self.failure is not None:
            from ..errors import CommTimeoutError
            raise CommTimeoutError(self.failure)

    def begin_call(self) -> None:
        """Starts recording this call's progress (not during CUDA-graph capture)."""
        self._trace = None if torch.cuda.is_current_stream_capturing() else []

    def end_call(self) -> None:
        """Hands the call's progress events to the watchdog (deadline: now + the timeout)."""
        trace, self._trace = self._trace, None
        if trace and self._key is not None:
            recv = [name for name in self._slots if self._sender.get(name) is not None]
            _watchdog().watch(self, trace, time.monotonic() + self.timeout_s, recv)

    def _progress(self, stream, what: str) -> None:
        if self._trace is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
            self._trace.append((ev, what))

    _GRACE_S = 30.0  # how long the watchdog keeps unblocking one stuck call

    def _call_done(self, trace) -> bool:
        torch.cuda.set_device(self._buf.device)  # the watchdog thread's current device
        return all(ev.query() for ev, _ in trace)

    def _on_timeout(self, trace, recv_slots, elapsed) -> None:
        """The watchdog's action on a call past its deadline (Note [cp ring watchdog])."""
        pending = next((what for ev, what in trace if not ev.query()), "the end of the call")
        self.failure = (
            f"ring_attention: rank {self.rank}: the copy-engine ring did not complete within {self.timeout_s:g} s "
            f"(elapsed {elapsed:.1f} s): waiting for {pending}; this call's output was filled with NaN and the ring "
            "of this communicator is no longer usable (create a new communicator)")
        print(f"commlib: {self.failure}", file=sys.stderr, flush=True)
        device = self._buf.device
        stream, issued, end = torch.cuda.Stream(device), None, time.monotonic() + self._GRACE_S
        while time.monotonic() < end and not all(ev.query() for ev, _ in trace):
            if issued is not None and not issued.query():
                stream = torch.cuda.Stream(device)  # the last write sits behind the blocked queue
            self._unblock(stream, recv_slots)
            issued = torch.cuda.Event()
            issued.record(stream)
            time.sleep(_RingWatchdog._POLL_S)

    def _unblock(self, stream, recv_slots) -> None:
        """On ``stream``: NaN into this rank's receive slots, ready = free = 1 in its flags."""
        with torch.cuda.stream(stream):
            for name in recv_slots:
                slot = self._slots[name][self.rank]
                if slot.dtype.is_floating_point:
                    slot.fill_(float("nan"))
            self._buf[:self._flags_bytes].view(torch.int32).fill_(1)

    def synchronize(self, timeout_s: Optional[float] = None) -> None:
        """Waits for the current stream, at most ``timeout_s`` (default: the transport's timeout);
        raises ``commlib.CommTimeoutError`` naming the slots still waiting (for a replayed graph,
        which the watchdog does not see)."""
        from ..errors import CommTimeoutError as CommTimeout
        ev = torch.cuda.Event()
        ev.record()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while not ev.query():
            if time.monotonic() > deadline:
                raise CommTimeout(f"ring_attention: rank {self.rank}: the ring did not complete within "
                                  f"{self.timeout_s if timeout_s is None else timeout_s} s; " + self._stuck())
            time.sleep(1e-4)

    def _stuck(self) -> str:
        """Which flags block, read on a side stream (the blocked stream cannot run a copy)."""
        side = torch.cuda.Stream(self._buf.device)
        with torch.cuda.stream(side):
            flags = self._buf[:self._flags_bytes].view(torch.int32).view(2, -1).to("cpu", non_blocking=False)
        waits = [f"slot {name} from rank {self._sender[name]}" for name in self._last_wait
                 if flags[0, self._slot_index(name)] == 0]
        return ("the last step waits for " + ", ".join(waits)) if waits else \
            "a peer has not released a slot this rank sends into"


class _RingWatchdog:
    """The process's ring watchdog thread (Note [cp ring watchdog]). It calls two methods of a
    watched transport: ``_call_done(trace)`` (every event of the call complete) and
    ``_on_timeout(trace, recv_slots, elapsed)`` (record the failure, unblock the streams)."""

    _POLL_S = 0.01

    def __init__(self):
        self._lock = threading.Condition()
        self._calls: list = []
        self._thread = threading.Thread(target=self._run, name="commlib-cp-watchdog", daemon=True)
        self._thread.start()

    def watch(self, transport, trace, deadline, recv_slots) -> None:
        with self._lock:
            self._calls.append((weakref.ref(transport), trace, deadline, tuple(recv_slots), time.monotonic()))
            self._lock.notify()

    def pending(self) -> int:
        with self._lock:
            return len(self._calls)

    def _run(self) -> None:
        _relax_stream_capture_mode()
        while True:
            with self._lock:
                while not self._calls:
                    self._lock.wait()
                calls = list(self._calls)
            done, now = [], time.monotonic()
            for call in calls:
                ref, trace, deadline, recv_slots, started = call
                transport = ref()
                try:
                    if transport is None or transport._call_done(trace):
                        done.append(call)
                    elif now > deadline:
                        transport._on_timeout(trace, recv_slots, now - started)
                        done.append(call)
                except Exception as e:  # noqa: BLE001 - a broken context must not kill the thread
                    if transport is not None and transport.failure is None:
                        transport.failure = f"ring_attention: rank {transport.rank}: the ring watchdog failed: {e}"
                    done.append(call)
            with self._lock:
                self._calls = [c for c in self._calls if not any(c is d for d in done)]
            time.sleep(self._POLL_S)


def _relax_stream_capture_mode() -> None:
    """The calling thread's queries never invalidate another thread's CUDA-graph capture."""
    if torch.cuda.is_available():
        from .. import _C
        if hasattr(_C, "cp_relax_stream_capture_mode"):
            _C.cp_relax_stream_capture_mode()


_watchdog_lock = threading.Lock()
_watchdog_instance: list = []


def _watchdog() -> _RingWatchdog:
    with _watchdog_lock:
        if not _watchdog_instance:
            _watchdog_instance.append(_RingWatchdog())
        return _watchdog_instance[0]
