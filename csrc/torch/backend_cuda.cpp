// DdaBackend's CUDA route: commlib's GPU kernels on the caller's or an internal stream
// (Note [ddacomm routing]).
#include "torch/backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "torch/backend_internal.hpp"
#include "torch/work.hpp"
#include "torch/p2p.hpp"

#if defined(COMMLIB_TORCH_CUDA)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/cuda_comm.hpp"
#endif

namespace commlib::torch_layer {
using namespace backend_detail;

c10::intrusive_ptr<c10d::Work> DdaBackend::route_cuda_all_reduce(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceOptions& opts) {
  cuda_used_ = true;
#if defined(COMMLIB_TORCH_CUDA)
  at::Tensor& t = tensors[0];
  const auto op = to_reduce_op(opts.reduceOp);
  // Every rank sees the same dtype, op and byte count (a matching collective), so this decision
  // is the same everywhere (Note [ddacomm routing]).
  const bool candidate = comm_ && !shut_down_ && op && (*op == ReduceOp::kSum || *op == ReduceOp::kAvg) &&
                         is_reducible_type(t.scalar_type()) && t.layout() == at::kStrided;
  // The plan (Note [plan]), as for the Python and C++ APIs, with this backend's NCCL attached.
  Plan plan;
  if (candidate) {
    AllReduceShape shape;
    shape.bytes = static_cast<size_t>(t.numel()) * t.element_size();
    shape.dtype = to_data_type(t.scalar_type(), "allreduce");
    shape.placement = Placement::kCuda;
    shape.nccl = NcclEngine::kAttached;
    shape.residence = comm_->has_cuda() ? comm_->cuda().residence(t.data_ptr(), t.data_ptr(), shape.bytes)
                                        : Residence::kPlain;
    plan = plan_all_reduce(comm_->config(), shape);
  }
  if (candidate && plan.variant != Variant::kNccl && t.is_contiguous()) {
    const int device = t.device().index();
    c10::cuda::CUDAGuard device_guard(device);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
    fr::Group::Call call = fr_records_cuda() ? fr_record(c10d::OpType::ALLREDUCE, t.device(), variant_name(plan.variant),
                                                         tensors, tensors)
                                             : fr::Group::Call();
    if (!opts.asyncOp) {
      run_recorded(call, "allreduce", [&] { torch_layer::all_reduce_cuda(*comm_, t, *op, plan); });
      fr_->issued(std::move(call), current);
      ++num_fast_calls_;
      return c10::make_intrusive<CudaWork>(getRank(), c10d::OpType::ALLREDUCE, tensors, current);
    }
    // async_op: the internal stream starts after the caller's pending work, and the caller's
    // allocator must not reuse `t` before the internal stream is done with it.
    c10::cuda::CUDAStream internal = cuda_state_->stream_for(device);
    StreamEvent start(device);
    start.record(current);
    start.block(internal);
    {
      c10::cuda::CUDAStreamGuard stream_guard(internal);
      run_recorded(call, "allreduce", [&] { torch_layer::all_reduce_cuda(*comm_, t, *op, plan); });
    }
    fr_->issued(std::move(call), internal);
    t.record_stream(internal);
    ++num_fast_calls_;
    return c10::make_intrusive<CudaWork>(getRank(), c10d::OpType::ALLREDUCE, tensors, internal);
  }
  // What NCCL takes is counted as its plan: the planned nccl, or a call commlib's kernels do not take.
  if (plan.variant != Variant::kNccl) {
    plan = Plan{};
    plan.variant = Variant::kNccl;
    plan.op = "all_reduce";
    plan.rule = "an op, dtype, layout or stride commlib's CUDA all-reduce does not take";
  }
  plan_executed(plan, getRank());
#endif
  return fallback(nccl("allreduce").allreduce(tensors, opts));
}

#if defined(COMMLIB_TORCH_CUDA)
bool DdaBackend::cuda_collective(CollectiveOp op, const std::vector<at::Tensor>& tensors, size_t bytes) const {
  if (!comm_ || shut_down_ || tensors.empty()) return false;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.is_cuda() || t.layout() != at::kStrided || t.device() != tensors[0].device()) return false;
  }
  // The plan (Note [plan]) with this backend's NCCL attached; a planned nccl is counted here, the
  // caller hands the call on.
  ExchangeShape shape;
  shape.op = op;
  shape.message_bytes = bytes;
  shape.placement = Placement::kCuda;
  shape.nccl = NcclEngine::kAttached;
  const Plan plan = plan_exchange(comm_->config(), shape);
  if (plan.variant != Variant::kNccl) return true;
  plan_executed(plan, comm_->rank());
  return false;
}

c10::intrusive_ptr<c10d::Work> DdaBackend::run_cuda(const char* what, c10d::OpType op, std::vector<at::Tensor> outputs,
                                                    const std::vector<at::Tensor>& inputs, bool async_op,
                                                    const std::function<void()>& body) {
  cuda_used_ = true;
  const int device = outputs[0].device().index();
  c10::cuda::CUDAGuard device_guard(device);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
  fr::Group::Call call =
      fr_records_cuda() ? fr_record(op, outputs[0].device(), "push", inputs, outputs) : fr::Group::Call();
  if (!async_op) {
    run_recorded(call, what, body);
    fr_->issued(std::move(call), current);
    ++num_fast_calls_;
    return c10::make_intrusive<CudaWork>(getRank(), op, std::move(outputs), current);
  }
  // async_op: as route_cuda_all_reduce (the internal stream starts after the caller's pending work;
  // the caller's allocator must not reuse the tensors before it is done with them).
  c10::cuda::CUDAStream internal = cuda_state_->stream_for(device);
  StreamEvent start(device);
  start.record(current);
  start.block(internal);
  {
    c10::cuda::CUDAStreamGuard stream_guard(internal);
    run_recorded(call, what, body);
  }
  fr_->issued(std::move(call), internal);
  for (const auto& t : outputs) t.record_stream(internal);
  for (const auto& t : inputs) t.record_stream(internal);
  ++num_fast_calls_;
  return c10::make_intrusive<CudaWork>(getRank(), op, std::move(outputs), internal);
}
#endif

c10::intrusive_ptr<c10d::Work> DdaBackend::cuda_p2p(c10d::OpType op, P2pRequest::Kind kind,
                                                    std::vector<at::Tensor>& tensors, int peer, int tag) {
#if defined(COMMLIB_TORCH_CUDA)
  if (!comm_ || shut_down_ || tensors.size() != 1 || !tensors[0].is_cuda()) return {};
  cuda_used_ = true;
  if (!cuda_p2p_available(*comm_, tensors[0])) return {};
  fr::Group::Call call = fr_records_cuda() ? fr_record(op, tensors[0].device(), "", tensors, tensors, peer)
                                           : fr::Group::Call();
  c10::intrusive_ptr<c10d::Work> work;
  run_recorded(call, op == c10d::OpType::SEND ? "send" : "recv",
               [&] { work = post_cuda_p2p(comm_, op, {{kind, tensors[0], peer, tag}}); });
  fr_->issued(std::move(call), c10::cuda::getCurrentCUDAStream(tensors[0].device().index()));
  ++num_fast_calls_;
  if (coalescing_) coalesced_cpu_works_.push_back(work);  // batch_isend_irecv: one work for the region
  return work;
#else
  return {};
#endif
}
}  // namespace commlib::torch_layer
