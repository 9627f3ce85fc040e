"""commlib.kv across hosts, the receiving side (Note [kv over nixl] in commlib/kv_nixl.py): a
receiving agent's NIXL notifications in, requests tracked, events out for ``commlib.kv.KVAgent``."""
from __future__ import annotations

import collections
import json
import threading
import time
import weakref
from typing import Dict, Optional

from .kv_nixl import BEAT_S, DEAD_S, MAGIC, beat_key, layer_list, mask_layers, peer_name


class _Contributor:
    def __init__(self, sender: str, header: dict):
        self.sender, self.seq = sender, header["s"]
        self.rank, self.pid, self.host, self.instance = header["k"], header["p"], header["h"], header["i"]
        self.landed = 0
        self.parts: Dict[int, int] = {}
        self.failed: Optional[str] = None
        # The sender's heartbeat (Note [kv over nixl]): its last value, when it last changed, when read.
        self.beat_key = beat_key(self.instance, self.rank, self.pid)
        self.beat: Optional[bytes] = None
        self.beat_changed = self.beat_read = time.monotonic()

    def name(self) -> str:
        return peer_name(self.instance, self.rank, self.pid, self.host)


class _Tracked:
    def __init__(self, header: dict):
        self.request_id = header["r"]
        self.num_contributors, self.mask, self.num_blocks = header["n"], header["m"], header["b"]
        self.first_sender = header["f"]
        self.contributors: Dict[int, _Contributor] = {}
        self.last_progress = time.monotonic()

    def landed(self) -> int:
        mask = self.mask
        for c in self.contributors.values():
            mask &= c.landed
        return mask


class NixlInbox:
    """A receiving agent's NIXL side: notifications in, requests tracked, events out (Note [kv over nixl])."""

    def __init__(self, agent, timeout_s: float, store):
        self.agent, self.timeout_s, self.store = agent, timeout_s, store
        self.arrived = collections.deque()  # get_new_notifs() results, from the progress thread
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_progress, args=(weakref.ref(self), agent, self.arrived, self.stop),
                                       name="commlib-kv-nixl", daemon=True)
        self.thread.start()
        self.tracked: Dict[str, _Tracked] = {}
        # sender agent -> (every seq up to this one reported, reported seqs above it): the sequence
        # numbers of one sender to this rank are consecutive, so the set stays small.
        self.finished: Dict[str, tuple] = {}

    def pump(self) -> None:
        now = time.monotonic()
        while self.arrived:
            self._take(self.arrived.popleft(), now)

    def _take(self, notifs: dict, now: float) -> None:
        for sender, messages in notifs.items():
            for raw in messages:
                if not raw.startswith(MAGIC):
                    continue
                m = json.loads(raw[len(MAGIC):])
                if self._stale(sender, m["s"]):
                    continue
                t = self.tracked.get(m["r"])
                if t is None:
                    t = self.tracked[m["r"]] = _Tracked(m)
                c = t.contributors.get(m["k"])
                if c is None:
                    c = t.contributors[m["k"]] = _Contributor(sender, m)
                t.last_progress = now  # any message of the request is progress
                if m["t"] == "d":
                    got = c.parts.get(m["q"], 0) + 1
                    c.parts[m["q"]] = got
                    if got == m["c"]:
                        c.landed |= m["l"]
                elif m["t"] == "f":
                    c.failed = m["e"]

    def _stale(self, sender: str, seq: int) -> bool:
        """A message of a request reported already (a late part of a timed-out one)."""
        low, done = self.finished.get(sender, (0, set()))
        return seq <= low or seq in done

    def evaluate(self, t: _Tracked, now: float):
        """(state, error class, reason, peer, layers landed): state "pending", "done" or "failed"."""
        landed = mask_layers(t.landed())
        num_layers = bin(t.mask).count("1")
        if len(t.contributors) == t.num_contributors and len(landed) == num_layers:
            return "done", "", "", self._peer(t), landed
        missing = [l for l in mask_layers(t.mask) if l not in landed]
        partial = (f"; layers landed: {layer_list(landed)} of {num_layers}; the request's {t.num_blocks} destination "
                   "blocks hold partial data for the other layers")
        for c in t.contributors.values():
            if c.failed is not None:
                return ("failed", "CommError", f"KV request '{t.request_id}' from {c.name()} failed at the sender: "
                        f"{c.failed}{partial}", c.name(), landed)
        if now - t.last_progress > 2 * BEAT_S:  # stalled: are its senders alive?
            for c in t.contributors.values():
                if c.landed & t.mask != t.mask and self._stopped(c, now):
                    return ("failed", "PeerError", f"KV request '{t.request_id}' from {c.name()}: the sender stopped: "
                            f"its heartbeat (store key '{c.beat_key}') has not changed for "
                            f"{int((now - c.beat_changed) * 1000)} ms (the process died or hangs): layer {missing[0]} "
                            f"has not landed{partial}", c.name(), landed)
        if now - t.last_progress > self.timeout_s:
            peer = self._peer(t)
            return ("failed", "CommTimeoutError", f"KV request '{t.request_id}' from {peer}: Timed out after "
                    f"{int(self.timeout_s * 1000)} ms without progress: layer {missing[0]} has not landed "
                    f"({len(t.contributors)} of {t.num_contributors} senders announced the request){partial}",
                    peer, landed)
        return "pending", "", "", self._peer(t), landed

    def _stopped(self, c: _Contributor, now: float) -> bool:
        """Whether contributor c's heartbeat, once seen, has not changed for DEAD_S (the store read at
        most every BEAT_S, only while a request of c stalls). A sender never seen beating is not
        judged (its receivers fall back to the timeout)."""
        if now - c.beat_read >= BEAT_S:
            c.beat_read = now
            try:
                beat = self.store.get(c.beat_key) if self.store.check([c.beat_key]) else None
            except Exception:  # noqa: BLE001 - a store that does not answer says nothing of the sender
                return False
            if beat != c.beat:
                c.beat, c.beat_changed = beat, now
        return c.beat is not None and now - c.beat_changed > DEAD_S

    def _peer(self, t: _Tracked) -> str:
        for c in sorted(t.contributors.values(), key=lambda c: c.rank):
            if c.landed & t.mask != t.mask:
                return c.name()
        if len(t.contributors) < t.num_contributors:
            c = next(iter(t.contributors.values()))
            missing = [r for r in range(t.first_sender, t.first_sender + t.num_contributors) if r not in t.contributors]
            return f"instance '{c.instance}' rank {missing[0]}"
        c = next(iter(t.contributors.values()))
        return c.name()

    def finish(self, t: _Tracked) -> None:
        for c in t.contributors.values():
            low, done = self.finished.get(c.sender, (0, set()))
            done.add(c.seq)
            while low + 1 in done:
                low += 1
                done.discard(low)
            self.finished[c.sender] = (low, done)
        del self.tracked[t.request_id]

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.tracked.clear()
        self.agent = None  # NIXL deregisters the cache when its agent goes

    def __del__(self):
        self.stop.set()


def _progress(inbox, agent, arrived, stop) -> None:
    """The receiving side's progress (Note [kv over nixl]): the one thread that calls into the
    receiver's NIXL agent after registration, so UCX moves (connection setup, TCP) while the
    agent's owner computes; 0.1 ms between calls while messages come, 1 ms when idle."""
    idle = 0
    while not stop.is_set() and inbox() is not None:
        try:
            notifs = agent.get_new_notifs()
        except Exception:  # noqa: BLE001 - the agent is being torn down
            return
        if notifs:
            arrived.append(notifs)
            idle = 0
        else:
            idle += 1
        stop.wait(0.0001 if idle < 100 else 0.001)
