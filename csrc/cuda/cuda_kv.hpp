// The GPU engine of commlib.kv: CUDA caches, the copy kernel (Note [kv memory] in
// csrc/cuda/cuda_kv.cc). Without CUDA (csrc/cuda/cuda_kv_stub.cc) it raises InvalidArgument.
#pragma once

#include <memory>

#include "core/kv_agent.hpp"

namespace commlib {

// The engine for caches on CUDA device `device` (its state is created here, not collectively).
std::unique_ptr<KvEngine> make_cuda_kv_engine(int device);

}  // namespace commlib
