// CUDA tensor operations (replaced by the GPU all-reduce implementation).
#include "torch/torch_common.hpp"

namespace commlib::torch_layer {

void all_reduce_cuda(Communicator& comm, at::Tensor& t, ReduceOp op, Algorithm algo) {
  comm.cuda(t.get_device());
}

}  // namespace commlib::torch_layer
