"""The one multi-process launcher of the test suite.

``ranks(n)`` (fixture factory) returns a pool of n worker processes that stays up for the whole
session: ``pool.run(fn, *args)`` calls ``fn(ctx, *args)`` on every rank at once and returns the
per-rank results (re-raising the first rank's failure with its traceback). ``fn`` must be a
module-level function of a test module. ``ctx`` has ``rank``, ``world_size``, ``store`` (a
TCPStore shared by the ranks), ``comm`` (a default ``commlib.Communicator``, created on first
use), ``gloo()`` (a gloo process group over the same store, for reference results) and
``new_comm(name, **kw)``; ``ctx.progress(what)`` prints rank 0's progress with the time when
``COMMLIB_TEST_PROGRESS=1`` (for slow runs, e.g. many ranks sharing a GPU; run pytest with ``-s``).
A pool whose worker died or timed out is replaced on next use. A rank that does not answer (the
timeout, or ERROR_GRACE_S after another rank failed) is asked for the Python stacks of its threads
(faulthandler on SIGUSR1), and the failure carries them: a hang names where each silent rank was.

GPU tests are marked ``gpu`` and skip unless at least 2 CUDA devices are visible.
``COMMLIB_TEST_SHARE_GPUS=1`` lets the ranks share the GPUs there are (rank r on GPU r mod count), so
a multi-rank GPU test runs on one GPU: a check of the protocol's logic only (the ranks' kernels
take turns on the GPU, so waits last time slices), never a measurement. Tests marked ``nccl`` (an
NCCL reference group) still skip then: NCCL refuses two ranks on one GPU.
"""
from __future__ import annotations

import faulthandler
import glob
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import pytest

DEFAULT_TIMEOUT_S = float(os.environ.get("COMMLIB_TEST_TIMEOUT_S", "600"))
SHARE_GPUS = os.environ.get("COMMLIB_TEST_SHARE_GPUS", "0") == "1"
PROGRESS = os.environ.get("COMMLIB_TEST_PROGRESS", "0") == "1"
ERROR_GRACE_S = 20.0


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs, as many as the test's world_size parameter "
                            "(2 without one); skipped otherwise")
    config.addinivalue_line("markers", "nccl: uses an NCCL group, which needs one GPU per rank; skipped when "
                            "COMMLIB_TEST_SHARE_GPUS puts two ranks on one GPU")


def num_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def pytest_collection_modifyitems(config, items):
    have = num_gpus()
    for item in items:
        if "gpu" not in item.keywords:
            continue
        params = getattr(item, "callspec", None)
        need = max(1, int(params.params.get("world_size", 2))) if params is not None else 2
        if have < need and not (SHARE_GPUS and have >= 1):
            item.add_marker(pytest.mark.skip(reason=f"needs >= {need} CUDA GPUs"))
        elif have < need and "nccl" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"NCCL needs {need} distinct GPUs (ranks share {have})"))


class RankContext:
    def __init__(self, rank: int, world_size: int, store, device: int | None):
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.device = device
        self._comm = None
        self._gloo = None
        self._names = 0
        self.scratch: dict = {}
        self._t0 = time.monotonic()

    def progress(self, what: str) -> None:
        if PROGRESS and self.rank == 0:
            print(f"[{time.monotonic() - self._t0:8.1f} s] world {self.world_size}: {what}", file=sys.stderr, flush=True)

    @property
    def comm(self):
        if self._comm is None or self._comm.closed:
            self._comm = self.new_comm("test-default")
        return self._comm

    def new_comm(self, name: str | None = None, **kwargs):
        import commlib
        if name is None:
            self._names += 1
            name = f"test-{self._names}"
        return commlib.Communicator(self.store, self.rank, self.world_size, name, **kwargs)

    def gloo(self):
        import torch.distributed as dist
        if self._gloo is None:
            if not dist.is_initialized():
                # A fresh key prefix each time: a gloo group made again after drop_default_group
                # shares no rendezvous key with the last one (torch names it "0" again).
                n = self.scratch["gloo-groups"] = self.scratch.get("gloo-groups", 0) + 1
                dist.init_process_group("gloo", store=dist.PrefixStore(f"gloo/{n}", self.store), rank=self.rank,
                                        world_size=self.world_size, timeout=timedelta(seconds=120))
            self._gloo = dist.group.WORLD
        return self._gloo

    def drop_default_group(self):
        """Destroys the default process group (the pool's gloo group or a test's own), so a test can
        make its own; the next gloo() makes a new one."""
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        self._gloo = None


def _worker(rank, world_size, port, sys_path, conn, env, dump_path):
    sys.path[:] = sys_path
    os.environ.update(env)
    dump = open(dump_path, "w")  # noqa: SIM115 - open for the process's life: faulthandler writes here
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    import torch
    import torch.distributed as dist
    torch.manual_seed(1234 + rank)
    device = None
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        device = rank
        torch.cuda.set_device(device)
    elif SHARE_GPUS and torch.cuda.is_available():
        device = rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timedelta(seconds=120))
    ctx = RankContext(rank, world_size, store, device)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(ctx, *args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            conn.send(("err", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}", type(e).__name__))
    if ctx._comm is not None:
        ctx._comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class RankFailure(Exception):
    """A rank raised: ``.errors`` maps rank -> (exception type name, formatted message)."""

    def __init__(self, errors: dict, silent: list | None = None, stacks: str = ""):
        self.errors = errors
        self.silent = silent or []  # ranks that never answered once another had failed
        rank, (_, text) = sorted(errors.items())[0]
        if self.silent:
            text = f"ranks {self.silent} did not answer after rank {rank} failed; rank {rank}: {text}\n{stacks}"
        super().__init__(text)


class RankPool:
    def __init__(self, world_size: int, env: dict | None = None):
        import torch.distributed as dist
        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, timeout=timedelta(seconds=120),
                                   wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        self.dump_dir = tempfile.mkdtemp(prefix="commlib-ranks-")
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, world_size, self.store.port, list(sys.path), child,
                                                  dict(env or {}), self._dump_path(rank)), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.broken = False

    def _dump_path(self, rank: int) -> str:
        return os.path.join(self.dump_dir, f"rank{rank}.txt")

    def stacks(self, silent: list) -> str:
        """The Python stacks of the silent ranks' threads, as each rank's faulthandler writes them."""
        alive = [rank for rank in silent if self.procs[rank].is_alive()]
        for rank in alive:
            os.kill(self.procs[rank].pid, signal.SIGUSR1)
        if alive:
            time.sleep(1.0)  # faulthandler writes from the signal handler
        out = []
        for rank in silent:
            try:
                with open(self._dump_path(rank)) as f:
                    text = f.read()
            except OSError as e:
                text = f"(no stacks: {e})"
            out.append(f"--- rank {rank}'s threads when it did not answer ---\n{text[-6000:]}")
        return "\n".join(out)

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs):
        """Runs fn(ctx, *args, **kwargs) on every rank; returns the results in rank order."""
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self.collect(timeout)

    def run_on(self, per_rank_args: list, fn, timeout: float = DEFAULT_TIMEOUT_S):
        """Like run, with different positional arguments per rank."""
        for conn, args in zip(self.conns, per_rank_args):
            conn.send((fn, tuple(args), {}))
        return self.collect(timeout)

    def collect(self, timeout: float):
        """Waits for every rank's answer. Once one rank has failed, the others get ERROR_GRACE_S more
        (they are often stuck in a collective the failed rank never joined), so the failure is
        reported promptly instead of after the whole timeout; such a pool is replaced."""
        results, errors, silent = [None] * self.world_size, {}, []
        conn_rank = {id(conn): rank for rank, conn in enumerate(self.conns)}
        pending = list(self.conns)
        deadline = time.monotonic() + timeout
        while pending:
            ready = mp_connection.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.broken = True
                silent = sorted(conn_rank[id(c)] for c in pending)
                if errors:
                    break  # reported with the failure that came first (RankFailure.silent)
                raise TimeoutError(f"ranks {silent} did not answer within {timeout} s\n{self.stacks(silent)}")
            for conn in ready:
                pending.remove(conn)
                rank = conn_rank[id(conn)]
                try:
                    msg = conn.recv()
                except EOFError:
                    self.broken = True
                    errors[rank] = ("EOFError", f"rank {rank} exited")
                    continue
                if msg[0] == "ok":
                    results[rank] = msg[1]
                else:
                    errors[rank] = (msg[2], msg[1])
            if errors:
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if errors:
            raise RankFailure(errors, silent, self.stacks(silent) if silent else "")
        return results

    def kill(self, rank: int):
        self.procs[rank].kill()
        self.procs[rank].join()
        self.broken = True

    def close(self):
        if self.broken:  # a rank may be stuck in a collective: do not wait for it
            for p in self.procs:
                if p.is_alive():
                    p.kill()
        for conn, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        self.broken = True  # a closed pool is never handed out again by ranks()
        shutil.rmtree(self.dump_dir, ignore_errors=True)


_pools: dict = {}


@pytest.fixture(scope="session")
def ranks():
    """ranks(n, env=None) -> a RankPool of n processes (reused while healthy)."""
    def get(world_size: int, env: dict | None = None) -> RankPool:
        key = (world_size, tuple(sorted((env or {}).items())))
        pool = _pools.get(key)
        if pool is None or pool.broken or not all(p.is_alive() for p in pool.procs):
            if pool is not None:
                pool.close()
            pool = _pools[key] = RankPool(world_size, env)
        return pool
    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def shm_segments() -> list:
    return sorted(glob.glob("/dev/shm/commlib-*"))


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm(ranks):
    before = set(shm_segments())
    yield
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()
    leaked = sorted(set(shm_segments()) - before)
    assert not leaked, f"shared-memory segments left behind: {leaked}"
