// The CPU engine of commlib.kv (csrc/core/kv_agent.hpp): KV caches in host memory, written by the
// sending process directly into the receiver's memory (a memfd both map), the same geometry and
// transforms as the GPU kernel (Note [kv copy geometry] in csrc/kernels/kv_copy_params.hpp).
#pragma once

#include <cstddef>
#include <memory>

#include "core/kv_agent.hpp"
#include "kernels/kv_copy_params.hpp"

namespace commlib {

// Host memory another process can map (Note [kv peers]): `bytes` of a new memfd, zero-filled,
// mapped here. Freed by kv_host_free (peers that mapped it keep their mapping).
void* kv_host_allocate(size_t bytes);
void kv_host_free(void* ptr);

// The engine for CPU caches.
std::unique_ptr<KvEngine> make_host_kv_engine();

// Runs `p` on this thread (host pointers): the rows, then each layer's flags (release).
void kv_copy_host(const kernels::KvCopyParams& p);

}  // namespace commlib
