"""The NVSHMEM EP transport's host-side logic at every world size up to nvshmem_ep::kMaxRanks (64),
without a GPU or NVSHMEM: tests/cpp/ep_nvshmem_params_check.cc, built with the host compiler against
csrc/kernels/ep_nvshmem_params.hpp, checks the 64-bit rank sets the kernels use (every world 1..64,
every rank, against sets built bit by bit), the launchers' parameter check (every valid world
accepted, each bad field refused with a message naming the operation, the value and the valid
range) and the buffer layout (aligned, disjoint regions, each as large as its contents)."""
from host_check import run_host_check


def test_ep_nvshmem_params_at_every_world_size(tmp_path):
    run_host_check("ep_nvshmem_params_check", tmp_path, includes=("include", "csrc"))
