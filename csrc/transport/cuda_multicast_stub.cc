// Built only without CUDA: the multimem path raises a clear error (after the guard, which refuses first).
#include "commlib/errors.hpp"
#include "core/multicast_guard.hpp"
#include "transport/cuda_multicast.hpp"

namespace commlib {

MulticastWorkspace* create_multicast_workspace(Communicator&, int) {
  require_multicast("multicast workspace");
  throw InvalidArgument("multicast workspace: commlib was built without CUDA (nvcc was not found at build time)");
}
void destroy_multicast_workspace(MulticastWorkspace*) {}
int64_t multicast_objects_created() { return 0; }

}  // namespace commlib
