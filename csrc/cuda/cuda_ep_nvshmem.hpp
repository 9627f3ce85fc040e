// The NVSHMEM side of EPBufferGpu (csrc/cuda/cuda_ep_nvshmem.cc; Note [EP NVSHMEM protocol]).
#pragma once

#include <cstddef>
#include <memory>

#include "commlib/communicator.hpp"
#include "kernels/ep_nvshmem_params.hpp"

namespace commlib {

// The entry table of libcommlib_nvshmem.so; throws InvalidArgument naming `what` when it was not
// attached (ep_nvshmem_attach in include/commlib/gpu.hpp).
const nvshmem_ep::Api& ep_nvshmem_api(const char* what);

// A block of `bytes` on the NVSHMEM symmetric heap at the same address on every rank (Note [NVSHMEM
// heap blocks]). Collective.
std::shared_ptr<void> ep_nvshmem_allocate(Communicator& comm, size_t bytes, const char* what);

}  // namespace commlib
