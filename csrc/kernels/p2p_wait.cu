// The one kernel of CUDA point-to-point: a bounded wait on a slot's flag (Note [cuda p2p] in
// csrc/cuda/cuda_p2p.hpp). One thread; the data itself moves by copy engine.
#include <cuda_runtime.h>

#include "commlib/device/ptx.cuh"
#include "kernels/p2p_params.hpp"

namespace commlib::kernels {
namespace {

__device__ __noinline__ void record_failure(const P2pWaitParams& p, P2pFailure failure, uint64_t elapsed,
                                            const P2pSlotHeader* got) {
  // The first failure of this rank claims the record (device memory: no atomics on host-mapped words).
  if (atomicCAS(p.poisoned, 0u, 1u) != 0u) return;
  P2pErrorWord* e = p.error;
  e->failure = static_cast<uint32_t>(failure);
  e->role = static_cast<uint32_t>(p.role);
  e->rank = p.rank;
  e->peer = p.peer;
  e->lane = p.lane;
  e->expected_tag = p.tag;
  e->expected_dtype = p.dtype;
  e->expected_bytes = p.bytes;
  e->elapsed_ns = elapsed;
  if (got != nullptr) {
    e->got_tag = got->tag;
    e->got_dtype = got->dtype;
    e->got_bytes = (static_cast<uint64_t>(got->bytes_hi) << 32) | got->bytes_lo;
  }
  // Publishes the fields above to the host before `failed`.
  device::st_release_sys_u32(&e->failed, 1u);
}

__global__ void p2p_wait_kernel(const P2pWaitParams p) {
  if (device::ld_volatile_u32(p.poisoned) != 0u) return;
  const uint64_t start = device::globaltimer_ns();
  uint32_t spins = 0;
  // Acquire (system scope): what the peer wrote before its flag (the chunk, the header, or its
  // reads of the slot it frees) is ordered before this kernel's completion and so before the
  // copy that follows on the stream.
  while (device::ld_acquire_sys_u32(p.flag) != p.expected) {
    if ((++spins & 31u) == 0u) {
      if (device::ld_volatile_u32(p.poisoned) != 0u) return;  // another wait failed: give up at once
      const uint64_t elapsed = device::globaltimer_ns() - start;
      if (elapsed > p.timeout_ns) {
        record_failure(p, P2pFailure::kTimeout, elapsed, nullptr);
        return;
      }
    }
    __nanosleep(128);
  }
  if (p.header != nullptr) {
    // Ordered after the flag by its acquire.
    const volatile P2pSlotHeader* v = p.header;
    P2pSlotHeader h{};
    h.tag = v->tag;
    h.dtype = v->dtype;
    h.bytes_lo = v->bytes_lo;
    h.bytes_hi = v->bytes_hi;
    const uint64_t bytes = (static_cast<uint64_t>(h.bytes_hi) << 32) | h.bytes_lo;
    if (h.tag != p.tag || h.dtype != p.dtype || bytes != p.bytes) {
      record_failure(p, P2pFailure::kMismatch, device::globaltimer_ns() - start, &h);
      return;
    }
  }
  if (p.fill != nullptr) {
    // The slot is free (the receiver has read the previous header); the ready word that follows on
    // the stream is written with a memory barrier, and this fence orders these stores before it too.
    volatile P2pSlotHeader* h = p.fill;
    h->tag = p.tag;
    h->dtype = p.dtype;
    h->bytes_lo = static_cast<uint32_t>(p.bytes);
    h->bytes_hi = static_cast<uint32_t>(p.bytes >> 32);
    __threadfence_system();
  }
  // Only this rank writes the word now (the peer waits for the handshake that follows on the
  // stream, which is ordered after this kernel's completion).
  *static_cast<volatile uint32_t*>(p.flag) = p.next;
}

}  // namespace

Status launch_p2p_wait(const P2pWaitParams& params, Stream stream) {
  p2p_wait_kernel<<<1, 1, 0, stream>>>(params);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return Status(StatusCode::kCudaError, std::string("p2p wait: kernel launch failed: ") + cudaGetErrorString(err));
  }
  return Status::ok();
}

}  // namespace commlib::kernels
