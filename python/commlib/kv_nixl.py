"""commlib.kv across hosts: the KV transfer through NIXL (UCX backend). Used by ``commlib.kv.KVAgent``
when a destination rank runs on another host; docs/kv.md says what it does, the benchmark
(``commlib-perf kv_transfer``) shares its NIXL helpers.
"""
# Note [kv over nixl]
# Peers: every agent publishes its cache geometry under "kv/<instance>/<rank>/geometry" (JSON: host,
# pid, TP, dtype, strides in bytes, plane addresses) beside the native descriptor (Note [kv peers]);
# a receiving agent with NIXL creates its NIXL agent at register(), registers its cache with it once
# and publishes the agent's metadata under ".../nixl". A sender takes this path to a peer instance
# unless every rank of both instances is on its host (so that all senders of one destination rank
# take the same path: a request's contributors are counted on one side, native records or NIXL): it
# creates its own NIXL agent (once), registers its cache, loads each destination's metadata and
# prepares two descriptor lists per destination (prep_xfer_dlist), once.
# Granularity: the request's tokens cut into chunks of g = gcd(source block size, destination block
# size) tokens; a chunk lies in one block on each side. Within a chunk the copied (token, head) rows
# form runs of bytes contiguous on both sides (the same for every chunk: one per chunk when both
# sides hold the chunk's heads contiguously in the same order, one head_dim row each under a layout
# change). The lists hold one entry per (layer, plane, block, chunk in block, run), so a request is
# only a list of indices on each side (make_prepped_xfer): no address is computed per request. A
# request whose token count is not a multiple of g has a partial last chunk: its runs (at most g - 1
# tokens' worth) go as a second, small transfer with explicit descriptors. Lists larger than
# PREP_LIMIT entries are not prepared; such a peer gets explicit descriptors for the whole request
# (the way an engine without prepared lists moves it).
# Staging: a transform that cuts a chunk into more runs than the destination alone needs (a layout
# change: one head_dim row per run; TP 1 -> 2 from a token-major layout) is gathered on the sender:
# each full chunk's rows are copied (torch indexing, on the cache's device) into a registered
# staging buffer in destination order, so one descriptor covers each run contiguous at the
# destination (NHD -> HND: a head's tokens). The sender's list then covers the staging buffer's
# (slot, run) entries and the destination's covers (layer, plane, block, chunk, destination run).
# The buffer grows by doubling to the largest send_layers() call; a staged call's gather first waits
# for the transfers of the last one that still read it (so one staged call is in flight per peer
# while the caller computes the next layer). CUDA gathers on the caller's current stream (ordered
# after the compute that wrote the layer); CPU on the sending thread, so send_layer returns at once
# (the thread takes its jobs in submission order: a later job waits behind a staged one). Partial
# last chunks are not staged. STAGE = False turns it off.
# Completion: each transfer carries a notification (JSON, prefix MAGIC) with the request's header
# (id, sequence number, sender, contributors, announced layers, destination blocks) and the layers
# it completes; NIXL delivers it after the transfer's data. A request is announced by a standalone
# notification at begin (send(), which posts every layer at once, leaves it to the first transfer's
# notification, except for an empty request). The receiver (NixlInbox, commlib/kv_nixl_inbox.py)
# counts a layer landed from a sender when every transfer part of the post that carried it arrived,
# and reports a request the way the native records are reported (Note [kv protocol]): done when
# every contributor's every announced layer landed; failed when a sender reports a failure
# (CommError), when a sender that still owes layers of a stalled request stopped its heartbeat
# (PeerError: the process died or hangs; a pid on another host cannot be looked at, so each sending
# thread sets its store key kv/<instance>/<rank>/beat/<pid> every BEAT_S; while a request has not
# progressed for 2 BEAT_S its receiver reads its senders' keys at most every BEAT_S, and a value
# unchanged for DEAD_S is a stopped sender), or when nothing progresses for the agent's timeout
# (CommTimeoutError).
# Progress: NIXL agents run without NIXL's progress thread (it spins a core). send_layer() only
# prepares the layer's index lists (and, CUDA, the staging gather on the current stream) and
# returns: the sending agent's thread of its own (SendProgress) posts the transfers once the layer
# is written (CUDA: an event recorded on the current stream at send_layer, so the GPU keeps
# computing the next layers meanwhile) and polls them until NIXL reports them done, so a layer moves
# while the caller computes the next one, as the native path's copy kernel does. Its failures (a
# post NIXL refuses, a transfer NIXL fails or that runs past the agent's timeout) reach the
# receivers at once (a failure notification) and the sender at its next call of that request
# (send_layer, done, wait, poll). The sending agent runs in NIXL's strict sync mode (the caller's
# thread registers and announces, the progress thread posts and polls); the thread holds its
# SendProgress only while it works, so an agent dropped without close() ends it. A receiving agent
# runs a thread of its own (_progress) that is the only caller of its NIXL agent after registration:
# it asks for notifications (which progresses UCX: connection setup, TCP) every 0.1 ms while they
# come, every 1 ms when idle, and queues them for poll / wait. A rank that both sends and receives
# has two NIXL agents.
from __future__ import annotations

import collections
import importlib
import json
import math
import os
import threading
import time
import uuid
import weakref
from typing import Dict, List, Optional, Sequence

import numpy as np

MAGIC = b"cmlkv1"
PREP_LIMIT = 1 << 22  # entries of one prepared descriptor list (a peer above it: explicit descriptors)
STAGE = True  # gather on the sender when that makes fewer descriptors (False: runs straight from the cache)
MAX_DESTS = 8  # kernels::kKvMaxDests
BEAT_S = 0.5  # a sending agent's heartbeat period (Note [kv over nixl])
DEAD_S = 5.0  # a stalled request's sender whose heartbeat has not changed for this long: PeerError


def nixl_api():
    """NIXL's agent classes: the CUDA 13 wheel's (nixl-cu13), else the meta package's; None without NIXL."""
    for module in ("nixl_cu13._api", "nixl._api"):
        try:
            api = importlib.import_module(module)
        except Exception:  # not installed, or a build that cannot load here
            continue
        return api.nixl_agent, api.nixl_agent_config, api.nixl_thread_sync_t
    return None


def rdma_devices() -> List[str]:
    """This host's RDMA ports as UCX names them ("mlx5_0:1"), from /sys/class/infiniband."""
    root = "/sys/class/infiniband"
    out = []
    try:
        for dev in sorted(os.listdir(root)):
            for port in sorted(os.listdir(os.path.join(root, dev, "ports"))):
                out.append(f"{dev}:{port}")
    except OSError:
        pass
    return out


def make_agent(name: str, regions=None, tensors=None, mem: str = "DRAM", device: int = 0,
               only_rdma: bool = False, progress_thread: bool = False, threads: int = 1):
    """A NIXL agent with the UCX backend, `regions` ((address, bytes) pairs) or `tensors` registered.
    only_rdma: UCX may use this host's RDMA ports only (no TCP across hosts). progress_thread: NIXL's
    own (it spins a core; commlib.kv does without, Note [kv over nixl]). threads > 1: the agent
    serialises calls from several threads (NIXL's strict sync mode)."""
    nixl_agent, nixl_agent_config, sync_t = nixl_api()
    sync = sync_t.NIXL_THREAD_SYNC_STRICT if threads > 1 else None
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[], sync_mode=sync))
    params = {"ucx_devices": ",".join(rdma_devices())} if only_rdma else {}
    agent.create_backend("UCX", params)
    if tensors:
        agent.register_memory(list(tensors))
    if regions:
        agent.register_memory([(int(a), int(n), device, "") for a, n in regions], mem)
    return agent


def merged_regions(planes: Sequence[int], span: int):
    """(address, bytes) intervals covering every [plane, plane + span), overlaps merged."""
    out = []
    for a in sorted(int(p) for p in planes):
        if out and a <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], a + span - out[-1][0])
        else:
            out.append([a, span])
    return [(a, n) for a, n in out]


def _chunk_rows(tokens: int, heads: int):
    """(token, head) of every row of a chunk, token-major."""
    return np.repeat(np.arange(tokens, dtype=np.int64), heads), np.tile(np.arange(heads, dtype=np.int64), tokens)


def chunk_runs(src_strides, dst_strides, tokens: int, heads: int, row: int):
    """Runs of a chunk of `tokens` tokens x `heads` heads contiguous on both sides: (source offsets,
    destination offsets, lengths) relative to the chunk's first row; strides = (token, head) bytes."""
    t, h = _chunk_rows(tokens, heads)
    so = t * src_strides[0] + h * src_strides[1]
    do = t * dst_strides[0] + h * dst_strides[1]
    order = np.argsort(so, kind="stable")
    so, do = so[order], do[order]
    start = np.ones(len(so), dtype=bool)
    start[1:] = (so[1:] != so[:-1] + row) | (do[1:] != do[:-1] + row)
    first = np.flatnonzero(start)
    lengths = np.diff(np.append(first, len(so))) * row
    return so[first], do[first], lengths


def dst_runs(dst_strides, tokens: int, heads: int, row: int):
    """A chunk's rows in destination order and the runs contiguous at the destination: (token of each
    row, head of each row, run destination offsets, run lengths, run offsets in the staged chunk)."""
    t, h = _chunk_rows(tokens, heads)
    do = t * dst_strides[0] + h * dst_strides[1]
    order = np.argsort(do, kind="stable")
    t, h, do = t[order], h[order], do[order]
    start = np.ones(len(do), dtype=bool)
    start[1:] = do[1:] != do[:-1] + row
    first = np.flatnonzero(start)
    return t, h, do[first], np.diff(np.append(first, len(do))) * row, first * row


def layer_list(layers: Sequence[int]) -> str:
    """"0..2, 5" (the native agent's format)."""
    layers = sorted(layers)
    if not layers:
        return "none"
    out, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        out.append(str(layers[i]) if i == j else f"{layers[i]}..{layers[j]}")
        i = j + 1
    return ", ".join(out)


def mask_layers(mask: int) -> List[int]:
    return [l for l in range(mask.bit_length()) if mask >> l & 1]


def beat_key(instance: str, rank: int, pid: int) -> str:
    """The store key of a sending process's heartbeat (Note [kv over nixl])."""
    return f"kv/{instance}/{rank}/beat/{pid}"


def peer_name(instance: str, rank: int, pid: int, host: str) -> str:
    return f"instance '{instance}' rank {rank} (pid {pid}, host '{host}')"


def _message(header: dict, **fields) -> bytes:
    return MAGIC + json.dumps(dict(header, **fields), separators=(",", ":")).encode()


class _Dest:
    """One destination rank of a NIXL peer: its geometry, agent name and prepared lists."""

    def __init__(self, geo: dict, plan: dict):
        self.geo, self.plan = geo, plan
        self.rank = geo["rank"]
        self.name = peer_name(geo["instance"], geo["rank"], geo["pid"], geo["host"])
        self.agent_name = ""
        self.local = self.remote = None  # prepared lists (None: explicit descriptors)
        self.next_seq = 1
        self.dev = 0


class NixlPeer:
    """A sender's view of one peer instance reached through NIXL (Note [kv over nixl])."""

    def __init__(self, owner, name: str, mine: dict, ranks: List[dict], plans: List[dict]):
        self.owner, self.name, self.mine = owner, name, mine
        self.dests = [_Dest(ranks[p["rank"]], p) for p in plans]
        theirs = ranks[0]
        self.peer_blocks, self.peer_bs = theirs["num_blocks"], theirs["block_size"]
        self.g = math.gcd(mine["block_size"], self.peer_bs)
        self.row = mine["head_dim"] * mine["esize"]
        self.planes = mine["num_planes"]
        self.mem = "DRAM" if mine["device"] == "cpu" else "VRAM"
        self.dev = max(0, mine["device_index"])
        heads = plans[0]["heads"] if plans else 1
        self.runs = chunk_runs((mine["sT"], mine["sH"]), (theirs["sT"], theirs["sH"]), self.g, heads, self.row)
        self.tail_runs: Dict[int, tuple] = {}
        # Staging: the chunk's rows gathered in destination order, so that one descriptor covers a run
        # contiguous at the destination, when that is fewer than the runs contiguous on both sides.
        self.staged = None
        staged = dst_runs((theirs["sT"], theirs["sH"]), self.g, heads, self.row)
        if STAGE and plans and len(staged[2]) < len(self.runs[0]) and \
                self._entries(theirs, len(staged[2])) <= PREP_LIMIT:
            self.staged = staged
        self.stage_buf = self.stage_reg = self.stage_list = None
        self.stage_slots = 0
        self.stage_users = 0  # staged posts not yet ended (SendProgress.lock)
        self.orphans = []  # staging buffers left to timed-out transfers: (buffer, registration, list), kept to close
        self.plane_rows = None  # [layer][plane]: the plane as rows for the staging gather (gather_rows)
        self.gather = None  # (dtype, row elements, step bytes, strides) of those rows (gather_rows)
        agent = owner.nixl_agent()
        for d in self.dests:
            meta = owner.store_get(f"kv/{name}/{d.rank}/nixl", f"instance '{name}' rank {d.rank}")
            d.agent_name = agent.add_remote_agent(meta)
            if self.staged is not None:
                d.remote = agent.prep_xfer_dlist(d.agent_name, self._dlist(d.geo, d.plan["dst_head"], self.staged[2],
                                                                           self.staged[3]), self.mem)
            elif max(self._entries(mine, len(self.runs[0])), self._entries(d.geo, len(self.runs[0]))) <= PREP_LIMIT:
                d.local = agent.prep_xfer_dlist("", self._dlist(mine, d.plan["src_head"], self.runs[0], self.runs[2]),
                                                self.mem)
                d.remote = agent.prep_xfer_dlist(d.agent_name, self._dlist(d.geo, d.plan["dst_head"], self.runs[1],
                                                                           self.runs[2]), self.mem)
            d.dev = max(0, d.geo["device_index"])
        runs = len(self.runs[0])
        if self.staged is not None:
            how = (f"staged: rows gathered on the sender, {len(self.staged[2])} descriptor(s) per chunk of {self.g} "
                   f"tokens instead of {runs}")
        elif self.dests and self.dests[0].local is None:
            how = f"explicit descriptors per request, {runs} per chunk of {self.g} tokens"
        else:
            how = f"direct: {runs} descriptor(s) per chunk of {self.g} tokens"
        self.transport = f"{owner.transport_description()}; {how}"

    def _entries(self, geo: dict, runs: int) -> int:
        return geo["num_layers"] * self.planes * geo["num_blocks"] * (geo["block_size"] // self.g) * runs

    def stage(self, slots: int):
        """The staging buffer (registered, its list of (slot, run) prepared) for at least `slots`
        chunks; grown by doubling. No transfer of an earlier post reads it (the caller waited for
        stage_users 0, or the progress thread took it at 0)."""
        if slots > self.stage_slots:
            import torch
            agent = self.owner.nixl_agent()
            self.release_staging(agent)
            cap = max(slots, 2 * self.stage_slots)
            slot_bytes = len(self.staged[0]) * self.row
            self.stage_buf = torch.empty(cap * slot_bytes, dtype=torch.uint8, device=self.owner.device)
            base = self.stage_buf.data_ptr()
            self.stage_reg = agent.register_memory([(base, cap * slot_bytes, self.dev, "")], self.mem)
            addr = (np.uint64(base) + np.arange(cap, dtype=np.uint64)[:, None] * np.uint64(slot_bytes)
                    + self.staged[4].astype(np.uint64)[None, :]).reshape(-1)
            lengths = np.tile(self.staged[3].astype(np.uint64), cap)
            self.stage_list = agent.prep_xfer_dlist("", np.stack([addr, lengths, np.full_like(addr, self.dev)], 1),
                                                    self.mem)
            self.stage_slots = cap
        return self.stage_buf.view(self.stage_slots, len(self.staged[0]), self.row)

    def release_staging(self, agent) -> None:
        """Releases the staging buffer (the caller waited for its transfers); at close also the orphans."""
        if self.stage_list is not None:
            agent.release_dlist_handle(self.stage_list)
            agent.deregister_memory(self.stage_reg)
        self.stage_buf = self.stage_reg = self.stage_list = None
        self.stage_slots = 0

    def detach_staging(self) -> None:
        """A staged transfer outlived the timeout (SendProgress.lock held): its buffer stays registered
        for it until close, and the next staged call gathers into a new one, so one stuck transfer
        does not stall every later request to this peer."""
        if self.stage_list is not None:
            self.orphans.append((self.stage_buf, self.stage_reg, self.stage_list))
        self.stage_buf = self.stage_reg = self.stage_list = None
        self.stage_slots = 0

    def gather_rows(self):
        """The staging gather's view of this rank's cache (made once): every plane as a 2-D tensor of
        rows, row i at byte i * step from the plane's start, in the widest integer type the rows and
        strides allow, so that one index_select per (layer, plane) copies whole rows into the
        staging buffer (15x the per-byte advanced indexing on CPU). Returns (dtype, row elements,
        step bytes, (block, token, head) strides in bytes)."""
        if self.gather is None:
            import torch
            canon = self.owner._canon
            first = canon[0][0]
            strides = first.stride()[:3]
            if min(strides) < 0:
                raise ValueError("KVAgent: a cache with negative strides cannot be staged")
            w = next(w for w in (8, 4, 2, 1) if self.row % w == 0 and all(s % w == 0 for s in strides) and
                     all(v.data_ptr() % w == 0 for layer in canon for v in layer))
            dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[w]
            step = math.gcd(*strides) or w
            last = sum((n - 1) * s for n, s in zip(first.shape[:3], strides))
            shape = (last // step + 1, self.row // w)
            self.plane_rows = [[torch.as_strided(v.view(dtype), shape, (step // w, 1)) for v in layer]
                               for layer in canon]
            self.gather = (dtype, self.row // w, step, strides)
        return self.gather

    def _dlist(self, geo: dict, head0: int, offs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Entries (layer, plane, block, chunk in block, run) of one side: Nx3 (address, bytes, device)."""
        planes = np.array(geo["planes"], dtype=np.uint64)
        chunk = ((np.arange(geo["num_blocks"], dtype=np.uint64)[:, None] * np.uint64(geo["sB"])
                  + np.arange(geo["block_size"] // self.g, dtype=np.uint64)[None, :] * np.uint64(self.g * geo["sT"]))
                 .reshape(-1) + np.uint64(head0 * geo["sH"]))
        addr = (planes[:, None, None] + chunk[None, :, None] + offs.astype(np.uint64)[None, None, :]).reshape(-1)
        lengths = np.broadcast_to(lengths.astype(np.uint64), (len(planes), len(chunk), len(offs))).reshape(-1)
        return np.stack([addr, lengths, np.full_like(addr, max(0, geo["device_index"]))], 1)

    def tail(self, tokens: int):
        if tokens not in self.tail_runs:
            heads = self.dests[0].plan["heads"] if self.dests else 1
            self.tail_runs[tokens] = chunk_runs((self.mine["sT"], self.mine["sH"]),
                                                (self.dests[0].geo["sT"], self.dests[0].geo["sH"]), tokens, heads,
                                                self.row)
        return self.tail_runs[tokens]

    def release(self, agent) -> None:
        self.release_staging(agent)
        for _, reg, dlist in self.orphans:
            agent.release_dlist_handle(dlist)
            agent.deregister_memory(reg)
        self.orphans.clear()
        for d in self.dests:
            for h in (d.local, d.remote):
                if h is not None:
                    agent.release_dlist_handle(h)
            d.local = d.remote = None
            try:
                agent.remove_remote_agent(d.agent_name)
            except Exception:  # noqa: BLE001 - closing: the peer may be gone
                pass


class NixlSend:
    """One request pushed through NIXL: the per-request index arrays and the posted transfers."""

    def __init__(self, agent, peer: NixlPeer, request_id: str, src: np.ndarray, dst: np.ndarray, num_tokens: int,
                 announced: List[int]):
        self.agent, self.peer, self.request_id = agent, peer, request_id
        self.announced, self.sent = announced, set()
        self.progress: SendProgress = agent.send_progress()
        self.handles: List[list] = []  # [dest index, handle, post, posted at] in flight (the progress thread's)
        self.queued = 0                 # posts not yet started (progress.lock)
        self.failed: Optional[str] = None
        self.done_flag = False
        self.post = 0
        self._rows = None  # the staging gather's row indices per destination (_gather)
        g = peer.g
        full = num_tokens // g
        tok = np.arange(full, dtype=np.int64) * g
        self.src_chunk = src[tok // peer.mine["block_size"]] * (peer.mine["block_size"] // g) + \
            (tok % peer.mine["block_size"]) // g
        self.dst_chunk = dst[tok // peer.peer_bs] * (peer.peer_bs // g) + (tok % peer.peer_bs) // g
        self.tail = num_tokens - full * g
        if self.tail:
            t0 = full * g
            self.tail_src = (int(src[t0 // peer.mine["block_size"]]), t0 % peer.mine["block_size"])
            self.tail_dst = (int(dst[t0 // peer.peer_bs]), t0 % peer.peer_bs)
        mask = 0
        for l in announced:
            mask |= 1 << l
        self.headers = []
        owner = agent
        for d in peer.dests:
            seq = d.next_seq
            d.next_seq += 1
            self.headers.append(dict(r=request_id, s=seq, i=owner.instance, k=owner.tp_rank, p=os.getpid(),
                                     h=owner.host, n=d.plan["num_contributors"], f=d.plan["first_sender"], m=mask,
                                     b=len(dst)))
        self.empty = num_tokens == 0 or not peer.dests

    def announce(self) -> None:
        nixl = self.agent.nixl_agent()
        for d, header in zip(self.peer.dests, self.headers):
            nixl.send_notif(d.agent_name, _message(header, t="a"))
            if self.empty:
                nixl.send_notif(d.agent_name, _message(header, t="d", l=header["m"], q=0, c=1))

    def _addresses(self, geo: dict, layers: List[int], blocks: np.ndarray, offset_tokens: np.ndarray, head0: int,
                   offs: np.ndarray) -> np.ndarray:
        planes = np.array(geo["planes"], dtype=np.int64).reshape(geo["num_layers"], -1)[layers].reshape(-1)
        chunk = blocks * geo["sB"] + offset_tokens * geo["sT"] + head0 * geo["sH"]
        return (planes[:, None, None] + chunk[None, :, None] + offs[None, None, :]).reshape(-1)

    def send_layers(self, layers: List[int]) -> None:
        """Posts `layers` (checked by the caller) to every destination, without waiting: one prepared
        transfer and, with a partial last chunk, one explicit one, each carrying the notification.
        The sending agent's progress thread posts them once the data is written (CUDA: an event
        recorded on the current stream) and drives them (SendProgress); a failure is raised by the
        next call of this request."""
        self.check()
        if self.empty:
            self.sent.update(layers)
            return
        peer = self.peer
        self.post += 1
        mask = 0
        for l in layers:
            mask |= 1 << l
        lp = (np.array(layers, dtype=np.int64)[:, None] * peer.planes + np.arange(peer.planes)[None, :]).reshape(-1)
        R = len(peer.runs[0])
        staged = peer.staged is not None and len(self.src_chunk) > 0
        gather = None  # CPU: the layers the progress thread gathers before posting
        if staged:
            rows = len(layers) * peer.planes * len(self.src_chunk)
            if self.agent.device.type == "cuda":
                # On the current stream, after the compute that writes the layer. The staging
                # buffer is the peer's: the transfers still reading it go first.
                self.progress.wait_until(lambda: peer.stage_users == 0, self.agent.timeout.total_seconds(),
                                         f"the staged transfers to instance '{peer.name}'", self)
                self._gather(layers)
            else:
                gather = layers
        jobs = []
        for j, d in enumerate(peer.dests):
            parts = []
            if staged:
                rd = len(peer.staged[2])
                per_d = d.geo["num_blocks"] * (d.geo["block_size"] // peer.g) * rd
                rr = np.arange(rd, dtype=np.int64)
                li = ((j * rows + np.arange(rows, dtype=np.int64))[:, None] * rd + rr).reshape(-1)
                di = (lp[:, None, None] * per_d + self.dst_chunk[None, :, None] * rd + rr).reshape(-1)
                parts.append(("staged", d, li.astype(np.int32), di.astype(np.int32)))
            elif len(self.src_chunk):
                if d.local is not None:
                    per_s = peer.mine["num_blocks"] * (peer.mine["block_size"] // peer.g) * R
                    per_d = d.geo["num_blocks"] * (d.geo["block_size"] // peer.g) * R
                    rr = np.arange(R, dtype=np.int64)
                    si = (lp[:, None, None] * per_s + self.src_chunk[None, :, None] * R + rr).reshape(-1)
                    di = (lp[:, None, None] * per_d + self.dst_chunk[None, :, None] * R + rr).reshape(-1)
                    parts.append(("prepped", d, si.astype(np.int32), di.astype(np.int32)))
                else:
                    cs, cd = peer.mine["block_size"] // peer.g, peer.peer_bs // peer.g
                    sa = self._addresses(peer.mine, layers, self.src_chunk // cs, (self.src_chunk % cs) * peer.g,
                                         d.plan["src_head"], peer.runs[0])
                    da = self._addresses(d.geo, layers, self.dst_chunk // cd, (self.dst_chunk % cd) * peer.g,
                                         d.plan["dst_head"], peer.runs[1])
                    n = len(sa) // R
                    parts.append(("explicit", d, sa, da, np.tile(peer.runs[2], n)))
            if self.tail:
                so, do, ln = peer.tail(self.tail)
                sa = self._addresses(peer.mine, layers, np.array([self.tail_src[0]]), np.array([self.tail_src[1]]),
                                     d.plan["src_head"], so)
                da = self._addresses(d.geo, layers, np.array([self.tail_dst[0]]), np.array([self.tail_dst[1]]),
                                     d.plan["dst_head"], do)
                parts.append(("explicit", d, sa, da, np.tile(ln, len(sa) // len(so))))
            note = _message(self.headers[j], t="d", l=mask, q=self.post, c=len(parts))
            jobs += [(j, part, note) for part in parts]
        # Posted once written (CUDA: an event); a CPU staged call once no earlier post reads the staging buffer.
        ready = _written(self.agent.device) if gather is None else (lambda: peer.stage_users == 0)
        self.progress.submit(self, ready, jobs, staged, gather)
        self.sent.update(layers)  # only now: a call that raised above left its layers unsent (they may be sent again)

    def _post(self, jobs, staged: bool, ended: list, gather=None) -> None:
        """On the progress thread, the data written: gathers `gather`'s layers into the staging
        buffer (CPU), then creates and starts the transfers of one send_layers call; a post none of
        whose transfers started goes to `ended`."""
        nixl, peer = self.progress.nixl, self.peer
        post = _Post(peer if staged else None)
        try:
            if gather is not None and self.failed is None:
                self._gather(gather)
            for j, part, note in jobs:
                d = part[1]
                if self.failed is not None:
                    break
                try:
                    if part[0] == "prepped":
                        h = nixl.make_prepped_xfer("WRITE", d.local, part[2], d.remote, part[3], note)
                    elif part[0] == "staged":
                        h = nixl.make_prepped_xfer("WRITE", peer.stage_list, part[2], d.remote, part[3], note)
                    else:
                        n = len(part[2])
                        local = np.stack([part[2].astype(np.uint64), part[4].astype(np.uint64),
                                          np.full(n, peer.dev, dtype=np.uint64)], 1)
                        remote = np.stack([part[3].astype(np.uint64), part[4].astype(np.uint64),
                                           np.full(n, d.dev, dtype=np.uint64)], 1)
                        h = nixl.initialize_xfer("WRITE", nixl.get_xfer_descs(local, peer.mem),
                                                 nixl.get_xfer_descs(remote, peer.mem), d.agent_name, note)
                    state = nixl.transfer(h)
                except Exception as e:  # noqa: BLE001 - reported to the receiver and to the next call
                    state, h = f"ERR ({type(e).__name__}: {e})", None
                if state.startswith("ERR"):
                    self.fail(f"NIXL could not post the transfer to {d.name}: {state}")
                    break
                post.remaining += 1
                self.handles.append([j, h, post, time.monotonic()])
        finally:
            if post.remaining == 0:  # nothing started: the post ended here
                ended.append(post)

    def _gather(self, layers: List[int]) -> None:
        """Copies the full chunks of `layers` for every destination into the staging buffer, rows in
        destination order (slot (dest, layer, plane, chunk)): CUDA on the caller's current stream,
        CPU on the progress thread (the staging buffer is this post's: stage_users counts it)."""
        import torch
        peer = self.peer
        nch = len(self.src_chunk)
        rows = len(layers) * peer.planes * nch
        buf = peer.stage(rows * len(peer.dests))
        dtype, row_elems, step, (sb, st, sh) = peer.gather_rows()
        if self._rows is None:  # each staged row's index in the plane's rows, per destination (once)
            cs = peer.mine["block_size"] // peer.g
            t, h = peer.staged[0], peer.staged[1]
            chunk = (self.src_chunk // cs) * sb + ((self.src_chunk % cs) * peer.g) * st
            self._rows = [torch.from_numpy(((chunk[:, None] + t[None, :] * st + (h[None, :] + d.plan["src_head"]) * sh)
                                            // step).reshape(-1)).to(peer.owner.device) for d in peer.dests]
        for j in range(len(peer.dests)):
            slot = j * rows
            for l in layers:
                for p in range(peer.planes):
                    out = buf[slot:slot + nch].view(dtype).view(-1, row_elems)
                    torch.index_select(peer.plane_rows[l][p], 0, self._rows[j], out=out)
                    slot += nch

    def poll(self, now: float, ended: list) -> int:
        """On the progress thread: retires the transfers NIXL reports done (a post whose last one
        ended goes to `ended`); fails the request on an error or on a transfer older than the
        agent's timeout. Returns how many transfers ended."""
        nixl, pending = self.progress.nixl, []
        limit = self.agent.timeout.total_seconds()
        for entry in self.handles:
            j, h, post, posted = entry
            try:
                state = nixl.check_xfer_state(h)
            except Exception as e:  # noqa: BLE001
                state = f"ERR ({type(e).__name__}: {e})"
            if state == "PROC" and now - posted <= limit:
                pending.append(entry)
                continue
            if state == "DONE":
                nixl.release_xfer_handle(h)
            elif state == "PROC":
                self.fail(f"the transfers to instance '{self.peer.name}' did not complete within "
                          f"{int(limit * 1000)} ms")
                pending.append(entry)  # still NIXL's: released at close
                if post.staging_peer is not None and not post.abandoned:
                    post.abandoned = True  # its staging buffer goes with it (NixlPeer.detach_staging)
                    ended.append(post)
                continue
            else:
                self.fail(f"NIXL reported the transfer to {self.peer.dests[j].name} failed ({state})")
            post.remaining -= 1
            if post.remaining == 0:
                ended.append(post)
        count = len(self.handles) - len(pending)
        self.handles = pending
        return count

    def busy(self) -> bool:
        return bool(self.queued or (self.handles and self.failed is None))

    def fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            nixl = self.progress.nixl
            for d, header in zip(self.peer.dests, self.headers):
                try:
                    nixl.send_notif(d.agent_name, _message(header, t="f", e=reason[:240]))
                except Exception:  # noqa: BLE001 - the peer may be gone
                    pass

    def check(self) -> bool:
        """Whether every announced layer landed at every destination; raises CommError if one failed."""
        from .errors import CommError
        with self.progress.lock:
            failed, busy = self.failed, bool(self.queued or self.handles)
        if failed is not None:
            raise CommError(f"KVAgent.send: request '{self.request_id}' to instance '{self.peer.name}' failed: "
                            f"{failed}")
        self.done_flag = self.done_flag or (not busy and len(self.sent) == len(self.announced))
        if busy:
            time.sleep(0)  # a caller polling done() in a loop must not starve the progress thread of the GIL
        return self.done_flag


class _Post:
    """The transfers of one send_layers call: when they all ended, a staged post frees its peer's
    staging buffer."""

    def __init__(self, staging_peer):
        self.remaining = 0
        self.staging_peer = staging_peer  # counted in its stage_users by SendProgress.submit
        self.abandoned = False  # a transfer of it timed out: it keeps the staging buffer it reads

    def finish(self) -> None:
        """SendProgress.lock held."""
        if self.staging_peer is not None:
            if self.abandoned:
                self.staging_peer.detach_staging()
            self.staging_peer.stage_users -= 1
            self.staging_peer = None


def _written(device):
    """When the data written so far on `device`'s current stream is in memory: a predicate."""
    if device.type != "cuda":
        return lambda: True
    import torch
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.query


class SendProgress:
    """The sending side's progress (Note [kv over nixl]): one daemon thread per sending NIXL agent
    posts each send_layers call once its data is written and polls the transfers in flight (back to
    back for _SPIN polls after a post or a completion, yielding the GIL between polls, then every
    50 µs; asleep when none are in flight), so transfers move while the caller computes the next
    layers. The agent runs in NIXL's strict sync mode: the caller's thread registers and
    announces, this thread posts and polls. The thread holds this object only while it works: a
    KVAgent dropped without close() is collected and its thread ends within _IDLE_S."""

    _POLL_S = 0.00005
    _SPIN = 256  # polls without a pause after each post or completion (UCX over TCP moves only when polled)
    _IDLE_S = 0.1  # an idle thread looks this often whether its SendProgress is still referenced

    def __init__(self, nixl, beat=None):
        self.nixl = nixl
        self.beat = beat  # beat(n): publishes heartbeat n (every BEAT_S, from the thread)
        self.beats, self.beat_at = 0, -math.inf
        self.lock = threading.Condition()
        self.jobs = collections.deque()  # (send, ready, jobs, staged, gather), in submission order
        self.active: List[NixlSend] = []
        self.stopped = False
        self.thread = threading.Thread(target=_send_loop, args=(weakref.ref(self), self.lock),
                                       name="commlib-kv-nixl-send", daemon=True)
        self.thread.start()

    def submit(self, send: NixlSend, ready, jobs, staged: bool, gather=None) -> None:
        """Queues one send_layers call: posted once ready() holds. A staged call holds its peer's
        staging buffer until its transfers ended: from now (CUDA: gathered already), or from when
        the thread takes it (CPU, `gather`: its layers, which the thread gathers)."""
        with self.lock:
            send.queued += 1
            if staged and gather is None:
                send.peer.stage_users += 1
            self.jobs.append((send, ready, jobs, staged, gather))
            if send not in self.active:
                self.active.append(send)
            self.lock.notify_all()

    def wait_until(self, done, seconds: float, what: str, send: NixlSend) -> None:
        """Waits (caller's thread) until done() holds under the lock; CommTimeoutError after `seconds`."""
        deadline = time.monotonic() + seconds
        with self.lock:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    from .errors import CommTimeoutError
                    raise CommTimeoutError(f"KVAgent.send_layer: request '{send.request_id}': {what} did not "
                                           f"complete within {int(seconds * 1000)} ms")
                self.lock.wait(min(left, 0.001))

    def step(self) -> int:
        """One round of the thread (lock not held): posts the jobs whose data is written, polls the
        transfers in flight; returns how many posts and transfers moved."""
        with self.lock:
            ready = []
            while self.jobs and self.jobs[0][1]():
                job = self.jobs.popleft()
                if job[4] is not None:  # a CPU staged call: the staging buffer is its from now
                    job[0].peer.stage_users += 1
                ready.append(job)
            active = list(self.active)
        # NIXL is called without the lock, which only guards the queues and counters.
        ended: List[_Post] = []
        for send, _, jobs, staged, gather in ready:
            try:
                send._post(jobs, staged, ended, gather)
            except Exception as e:  # noqa: BLE001 - reported by the request's next call
                send.fail(f"posting failed: {type(e).__name__}: {e}")
        now = time.monotonic()
        moved = len(ready)
        for send in active:
            try:
                moved += send.poll(now, ended)
            except Exception as e:  # noqa: BLE001 - the thread must outlive one request's failure
                send.fail(f"polling failed: {type(e).__name__}: {e}")
        with self.lock:
            for send, *_ in ready:
                send.queued -= 1  # after its transfers joined send.handles
                if send not in self.active:
                    self.active.append(send)
            for post in ended:
                post.finish()
            self.active = [s for s in self.active if s.busy()]
            self.lock.notify_all()
        return moved

    def heartbeat(self) -> None:
        """Publishes the next heartbeat when BEAT_S has passed (the thread, no lock held)."""
        now = time.monotonic()
        if self.beat is None or now - self.beat_at < BEAT_S:
            return
        self.beat_at = now
        self.beats += 1
        try:
            self.beat(self.beats)
        except Exception:  # noqa: BLE001 - a store that does not answer: receivers fall back to their timeout
            pass

    def close(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify_all()
        self.thread.join()


def _send_loop(ref, lock) -> None:
    """SendProgress's thread: holds its SendProgress (through `ref`) only while it works."""
    spin = 0
    while True:
        progress = ref()
        if progress is None:
            return
        progress.heartbeat()
        with lock:
            if progress.stopped:
                return
            if not progress.jobs and not progress.active:
                progress = None
                lock.wait(SendProgress._IDLE_S)
                continue
        moved = progress.step()
        progress = None
        spin = 0 if moved else spin + 1
        time.sleep(0 if spin < SendProgress._SPIN else SendProgress._POLL_S)  # 0: only lets other threads run


def new_agent_name(instance: str, rank: int) -> str:
    return f"commlib-kv/{instance}/{rank}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
