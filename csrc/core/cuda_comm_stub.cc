// Built only without CUDA: GPU operations raise a clear error.
#include "commlib/communicator.hpp"
#include "commlib/errors.hpp"

namespace commlib {

CudaComm* create_cuda_comm(Communicator&, int) {
  throw InvalidArgument("commlib was built without CUDA (nvcc was not found at build time); GPU tensors are not supported");
}
void destroy_cuda_comm(CudaComm*) {}

}  // namespace commlib
