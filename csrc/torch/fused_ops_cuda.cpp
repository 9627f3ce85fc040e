// GPU entry of the fused all-reduce + residual add + RMSNorm: tensors to the core's call
// (CudaComm::fused_allreduce_rmsnorm: the kernel choice, grid and launch), on the current stream
// of x's device. Capturable: no host synchronisation, no allocation after the communicator's first
// GPU use (first multimem use).
#include "torch/fused_ops.hpp"

#if defined(COMMLIB_FUSED_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/cuda_comm.hpp"
#include "torch/torch_common.hpp"

namespace commlib::torch_layer {

void fused_allreduce_rmsnorm_cuda(Communicator& comm, const FusedRmsNormArgs& args, const at::Tensor& x,
                                  at::Tensor& residual, const at::Tensor& weight, at::Tensor& out, int num_sms,
                                  FusedAlgo algo) {
  const int index = x.device().index();
  c10::cuda::CUDAGuard guard(x.device());
  CudaComm& cuda = comm.cuda(index);
  cuda.fused_allreduce_rmsnorm(args, num_sms, algo, c10::cuda::getCurrentCUDAStream(index).stream());
}

}  // namespace commlib::torch_layer
#endif
