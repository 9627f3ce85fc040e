// GPU entry of the fused all-reduce + residual add + RMSNorm: runs the P2P kernels
// (csrc/kernels/rs_rmsnorm_ag_p2p.cu, or its LL variant for small token counts, chosen by the
// launcher) or, for algo 'multimem' where the multicast guard allows it, the multimem kernel
// (rs_rmsnorm_ag_multimem.cu) on the current stream of x's device. Capturable: no host
// synchronisation, no allocation after the communicator's first GPU use (first multimem use).
#include "torch/fused_ops.hpp"

#if defined(COMMLIB_FUSED_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/cuda_comm.hpp"
#include "transport/cuda_multicast.hpp"
#include "kernels/rs_rmsnorm_ag_params.hpp"
#include "torch/torch_common.hpp"

namespace commlib::torch_layer {

void fused_allreduce_rmsnorm_cuda(Communicator& comm, const FusedRmsNormArgs& args, const at::Tensor& x,
                                  at::Tensor& residual, const at::Tensor& weight, at::Tensor& out, int num_sms,
                                  FusedAlgo algo) {
  const char* what = "fused_allreduce_rmsnorm";
  COMMLIB_CHECK(args.dtype == DataType::kBFloat16 || args.dtype == DataType::kFloat16, TypeMismatch, what,
                ": dtype ", dtype_name(args.dtype), " not supported for CUDA tensors; supported: bfloat16, float16");
  const int index = x.device().index();
  c10::cuda::CUDAGuard guard(x.device());
  CudaComm& cuda = comm.cuda(index);
  COMMLIB_CHECK(cuda.device() == index, InvalidArgument, what, ": tensor is on cuda:", index,
                " but this communicator's GPU state lives on cuda:", cuda.device(), "; use one device per communicator");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(index).stream();
  // The fields both kernels' params share, then one launch between begin_op and end_op.
  auto run = [&](auto p, auto launch) {
    p.args = args;
    p.barrier = cuda.barrier_handle();
    p.num_blocks = num_sms;
    cuda.begin_op(stream, what);
    throw_if_error(launch(p, stream));
    cuda.end_op(stream, what);
  };
  if (algo == FusedAlgo::kMultimem) {
    // SAFETY: Communicator::multicast refuses (before any CUDA call) unless the guard allows it.
    const MulticastWorkspace& mc = comm.multicast(index);
    kernels::RsRmsNormAgMultimemParams p;
    p.workspace = mc.unicast().device_handle();
    p.multicast_workspace = mc.address();
    return run(p, kernels::launch_rs_rmsnorm_ag_multimem);
  }
  kernels::RsRmsNormAgP2pParams p;
  p.workspace = cuda.workspace().device_handle();
  p.lines = cuda.ll_lines_handle();
  p.tuned_max_blocks = cuda.fused_tuned_blocks();
  run(p, kernels::launch_rs_rmsnorm_ag_p2p);
}

}  // namespace commlib::torch_layer
#endif
