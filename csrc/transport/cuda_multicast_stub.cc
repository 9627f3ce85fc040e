// Built only without CUDA: the multimem path raises a clear error (after the guard, which refuses first).
#include "commlib/errors.hpp"
#include "common/multicast_guard.hpp"
#include "transport/cuda_multicast.hpp"

namespace commlib {

void destroy_multicast_workspace(MulticastWorkspace*) {}
int64_t multicast_objects_created() { return 0; }

}  // namespace commlib
