// NVLink multicast (NVLS) workspace of the multimem kernels: a symmetric allocation whose pieces
// are bound to one multicast object, which every rank maps at one more address.
//
// SAFETY (docs/architecture.md, Safety): this is the only code in commlib that creates a multicast object.
// Its constructor calls require_multicast() first: unless the guard allows multicast (the explicit
// opt-in COMMLIB_ENABLE_MULTICAST set to 1 and no kill switch, csrc/common/multicast_guard.hpp) it
// throws InvalidArgument before any CUDA runtime or driver call. The multicast entry points are
// resolved here, after the guard, never with the driver table of csrc/transport/cuda_driver.cc. It has
// never been constructed on the lent machines: no opt-in is set there (and bench/gpu_suite.sh adds
// every kill switch).
//
// Note [multicast workspace]
// Collective, created on first multimem use (Communicator::multicast), outside graph capture:
//  1. every rank checks CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED and the ranks agree through the
//     store (all raise together when one GPU lacks it);
//  2. the size is rounded to the multicast granularity (minimum; the recommended one can be
//     hundreds of MiB) and a fresh symmetric allocation of that size and alignment is made;
//  3. rank 0 creates the object (one device per rank, POSIX-fd handle); its outcome reaches every
//     rank through the store (a failure raises PeerError everywhere at once), then its descriptor
//     over the sockets (CudaIpc::broadcast_fd); every rank imports it and adds its own device;
//  4. a store barrier (bounded: the driver's bind would wait without limit for a device that never
//     joins); every rank binds its own piece at offset 0 and maps the object read/write at a
//     reserved range; a store barrier ends the set-up.
// Then a multimem load at address() + off reduces byte range off of every rank's piece, and a
// multimem store writes it in every piece. Unicast and multicast accesses to the same bytes are
// ordered only with fence.proxy.alias between them (the kernel's business,
// csrc/kernels/rs_rmsnorm_ag_multimem.cu). Destruction is local: unmap, unbind this device, release
// the object's handle, then the unicast pieces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "commlib/symmetric_buffer.hpp"

namespace commlib {

class CudaIpc;
class Store;

class MulticastWorkspace {
 public:
  // Collective (see the Note); `bytes` is rounded up to the multicast granularity; `prefix`: store
  // keys of this workspace alone; `ipc`: the communicator's peer-memory transport on `device`.
  MulticastWorkspace(CudaIpc& ipc, int rank, int world_size, int device, Store& store, const std::string& prefix,
                     size_t bytes);
  ~MulticastWorkspace();
  MulticastWorkspace(const MulticastWorkspace&) = delete;
  MulticastWorkspace& operator=(const MulticastWorkspace&) = delete;

  // Every rank's piece, unicast (this rank's copy-in and reads of what multimem stores wrote).
  const SymmetricBuffer& unicast() const { return *unicast_; }
  // This rank's multicast mapping of the pieces: as many bytes as each piece.
  void* address() const { return reinterpret_cast<void*>(static_cast<uintptr_t>(mc_ptr_)); }
  size_t bytes() const { return bytes_; }

 private:
  void release() noexcept;  // undoes whatever the constructor got to, in reverse order

  int device_ = -1;
  size_t bytes_ = 0;
  std::shared_ptr<SymmetricBuffer> unicast_;
  unsigned long long mc_handle_ = 0;  // CUmemGenericAllocationHandle
  unsigned long long mc_ptr_ = 0;     // CUdeviceptr
  bool bound_ = false;
};

// Deletes a workspace (Communicator::multicast's deleter; a no-op stub without CUDA). The maker
// is the GPU engine (Communicator::multicast in csrc/cuda/fused_cuda.cc).
void destroy_multicast_workspace(MulticastWorkspace* workspace);

// Multicast objects this process has created (cuMulticastCreate calls that succeeded): the GPU
// tests check that it stays 0 where the guard refuses.
int64_t multicast_objects_created();

}  // namespace commlib
