// Built only without CUDA: a KV agent for CUDA caches raises a clear error.
#include "commlib/errors.hpp"
#include "cuda/cuda_kv.hpp"

namespace commlib {

std::unique_ptr<KvEngine> make_cuda_kv_engine(int) {
  throw InvalidArgument("KVAgent: commlib was built without CUDA (nvcc was not found at build time); CUDA KV caches "
                        "are not supported");
}

}  // namespace commlib
