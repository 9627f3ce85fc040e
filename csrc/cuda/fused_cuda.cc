// CudaComm's fused all-reduce + RMSNorm (include/commlib/gpu.hpp): the kernel plan_fused chose
// (one-shot or two-shot LL, the barrier P2P kernel; the multicast kernel for FusedAlgo::kMultimem,
// behind the guard) and the multicast workspace's factory. Kept apart from cuda_comm.cc, whose all-reduce path never
// touches multicast (docs/architecture.md, Safety).
#include <cuda_runtime.h>

#include <string>

#include "commlib/env.hpp"
#include "commlib/errors.hpp"
#include "commlib/gpu.hpp"
#include "core/plan.hpp"
#include "cuda/cuda_comm.hpp"
#include "kernels/rs_rmsnorm_ag_params.hpp"
#include "transport/cuda_ipc.hpp"
#include "transport/cuda_multicast.hpp"
#include "common/multicast_guard.hpp"

namespace commlib {

void CudaComm::fused_allreduce_rmsnorm(const FusedRmsNormArgs& args, int num_sms, FusedAlgo algo,
                                       cudaStream_t stream) {
  const char* what = "fused_allreduce_rmsnorm";
  // SAFETY: refused before any CUDA call unless the multicast guard allows it.
  if (algo == FusedAlgo::kMultimem) require_multicast(what);
  COMMLIB_CHECK(args.dtype == DataType::kBFloat16 || args.dtype == DataType::kFloat16, TypeMismatch, what, ": dtype ",
                dtype_name(args.dtype), " not supported for CUDA tensors; supported: bfloat16, float16");
  COMMLIB_CHECK(num_sms >= 0, InvalidArgument, what, ": num_sms ", num_sms, " must be >= 0");
  FusedShape shape;
  shape.num_tokens = args.num_tokens;
  shape.hidden = args.hidden;
  shape.dtype = args.dtype;
  shape.mode = args.mode;
  shape.num_sms = num_sms;
  shape.algo = algo;
  shape.placement = Placement::kCuda;
  const Plan plan = plan_fused(config_, shape);
  DeviceGuard guard(device_);
  if (plan.variant == Variant::kFusedMultimem) {
    const MulticastWorkspace& mc = comm_.multicast(device_);  // collective on first use
    kernels::RsRmsNormAgMultimemParams p;
    p.args = args;
    p.barrier = barrier_handle();
    p.num_blocks = plan.geometry.grid;
    p.workspace = mc.unicast().device_handle();
    p.multicast_workspace = mc.address();
    begin_op(stream, what);
    plan_executed(plan, rank_);
    throw_if_error(kernels::launch_rs_rmsnorm_ag_multimem(p, stream));
    end_op(stream, what);
    return;
  }
  kernels::RsRmsNormAgP2pParams p;
  p.args = args;
  p.barrier = barrier_handle();
  p.num_blocks = plan.geometry.grid;
  p.workspace = workspace_->device_handle();
  p.lines = ll_lines_handle();
  p.config = config_.fused.kernel;
  begin_op(stream, what);
  plan_executed(plan, rank_);
  if (plan.variant == Variant::kFusedP2p) {
    throw_if_error(kernels::launch_rs_rmsnorm_ag_p2p(p, stream));
  } else {
    p.shot = plan.variant == Variant::kFusedOneShot ? kernels::FusedShot::kOneShot : kernels::FusedShot::kTwoShot;
    p.ll_grid.row_ctas = plan.geometry.row_ctas;
    p.ll_grid.blocks = plan.geometry.grid;
    p.ll_grid.threads = plan.geometry.block;
    p.ll_grid.packs_per_thread = plan.geometry.packs_per_thread;
    throw_if_error(kernels::launch_rs_rmsnorm_ag_p2p_ll(p, stream));
  }
  end_op(stream, what);
}

// The GPU engine makes the communicator's multicast workspace (the core only holds it).
MulticastWorkspace& Communicator::multicast(int device) {
  check_open("multicast transport");
  require_multicast("multicast transport");  // SAFETY: before any CUDA call, on every use
  if (!multicast_) {
    CudaComm& gpu = cuda(device);
    const int64_t ws = env::get_int("COMMLIB_GPU_WORKSPACE_BYTES");
    // Store keys of their own for each attempt (a failed one, e.g. a GPU without multicast, may be
    // retried): ranks attempt in the same order, so the communicator's count agrees across them.
    const std::string prefix = prefix_ + "/multicast/" + std::to_string(multicast_attempts_++);
    multicast_ = decltype(multicast_)(new MulticastWorkspace(gpu.ipc(), gpu.rank(), gpu.world_size(), gpu.device(),
                                                             *store_, prefix, static_cast<size_t>(ws)),
                                      destroy_multicast_workspace);
  }
  return *multicast_;
}

void fused_allreduce_rmsnorm_gpu(Communicator& comm, int device, const FusedRmsNormArgs& args, int num_sms,
                                 FusedAlgo algo, GpuStream stream) {
  if (algo == FusedAlgo::kMultimem) require_multicast("fused_allreduce_rmsnorm");  // before any CUDA call
  check_fused_rmsnorm_args(args, comm.world_size(), comm.rank());
  comm.cuda(device).fused_allreduce_rmsnorm(args, num_sms, algo, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace commlib
