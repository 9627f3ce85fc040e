"""EPBuffer's transport argument without a GPU: the clear errors when NVSHMEM is not available
(no CUDA build, no NVSHMEM kernels, no nvshmem4py), bad values, and "auto" choosing peer memory on
one host and NVSHMEM across hosts (python/commlib/ep.py, python/commlib/_nvshmem.py)."""
import sys

import pytest
import torch
import torch.distributed as dist

import commlib
from commlib import _C, _nvshmem, ep


class _FakeComm:
    """What transport resolution reads of a communicator: rank, world_size, num_hosts and the store."""

    def __init__(self, rank, world_size, store, num_hosts=1):
        self.rank, self.world_size, self._store, self.num_hosts = rank, world_size, store, num_hosts


def _store():
    return dist.HashStore()


def test_bad_transport_names_the_allowed_set():
    with pytest.raises(ValueError, match="transport 'ucx' not supported; supported: auto, peer, nvshmem"):
        ep._resolve_transport(_FakeComm(0, 1, _store()), "ucx", torch.device("cpu"))


def test_nvshmem_on_cpu_tensors_is_refused(ranks):
    ranks(1).run(_nvshmem_on_cpu)


def _nvshmem_on_cpu(ctx):
    with pytest.raises(ValueError, match="transport 'nvshmem' not supported on cpu; supported: auto, peer"):
        commlib.EPBuffer(ctx.comm, 4, 16, 4, 2, torch.float32, device="cpu", transport="nvshmem")
    buf = commlib.EPBuffer(ctx.comm, 4, 16, 4, 2, torch.float32, device="cpu")  # still usable
    assert buf.transport == "peer" and buf.kernels == "host"
    return True


def test_auto_picks_peer_memory_on_one_host():
    comm = _FakeComm(0, 2, _store())
    assert ep._resolve_transport(comm, "auto", torch.device("cuda", 0)) == "peer"
    assert ep._resolve_transport(comm, "auto", torch.device("cpu")) == "peer"


def test_auto_picks_nvshmem_across_hosts(monkeypatch):
    attached = []
    monkeypatch.setattr(_nvshmem, "attach", lambda comm, device: attached.append((comm.rank, device)))
    comm = _FakeComm(0, 4, _store(), num_hosts=2)
    assert ep._resolve_transport(comm, "auto", torch.device("cuda", 3)) == "nvshmem"
    assert attached == [(0, 3)]


def test_peer_memory_and_cpu_across_hosts_are_refused(monkeypatch):
    monkeypatch.setattr(_nvshmem, "attach", lambda comm, device: pytest.fail("attach must not run"))
    comm = _FakeComm(1, 4, _store(), num_hosts=2)
    with pytest.raises(ValueError, match="transport 'peer' needs every rank on one host .* span 2 hosts; "
                                         "supported here: auto, nvshmem"):
        ep._resolve_transport(comm, "peer", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="device cpu needs every rank on one host .* span 2 hosts"):
        ep._resolve_transport(comm, "auto", torch.device("cpu"))


def test_nvshmem_without_cuda_build_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(_C, "ep_nvshmem_attach", raising=False)
    with pytest.raises(ValueError, match="transport 'nvshmem' not available: this commlib build has no CUDA"):
        _nvshmem.attach(_FakeComm(0, 1, _store()), 0)
    assert not _nvshmem.available()


def test_nvshmem_without_kernels_library_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(_C, "ep_nvshmem_attach", lambda path, device: (0, 1), raising=False)
    monkeypatch.setattr(_nvshmem, "_LIBRARY", tmp_path / "libcommlib_nvshmem.so")
    with pytest.raises(ValueError, match="commlib was built without NVSHMEM"):
        _nvshmem.attach(_FakeComm(0, 1, _store()), 0)
    assert not _nvshmem.available()


def test_nvshmem_without_nvshmem4py_is_a_clear_error(monkeypatch, tmp_path):
    lib = tmp_path / "libcommlib_nvshmem.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(_C, "ep_nvshmem_attach", lambda path, device: (0, 1), raising=False)
    monkeypatch.setattr(_nvshmem, "_LIBRARY", lib)
    monkeypatch.setitem(sys.modules, "nvshmem", None)  # import nvshmem raises ImportError
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(ValueError, match=r"nvshmem4py is not installed \(pip install 'commlib\[nvshmem\]'\)"):
        _nvshmem.attach(_FakeComm(0, 1, _store()), 0)
    assert not _nvshmem.available()


def test_attach_sets_nvls_off_and_never_unsets_it(monkeypatch, tmp_path):
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    monkeypatch.delattr(_C, "ep_nvshmem_attach", raising=False)
    with pytest.raises(ValueError):
        _nvshmem.attach(_FakeComm(0, 1, _store()), 0)
    import os
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")
    with pytest.raises(ValueError):
        _nvshmem.attach(_FakeComm(0, 1, _store()), 0)
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
