// DdaBackend's route for groups spanning several hosts: two-level collectives
// (Note [hierarchical collectives]).
#include "torch/backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "torch/backend_internal.hpp"
#include "torch/work.hpp"

#if defined(COMMLIB_TORCH_CUDA)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace commlib::torch_layer {
void DdaBackend::attach_hierarchy(std::unique_ptr<Hierarchy> hierarchy) {
  TORCH_CHECK_VALUE(!comm_ && !hier_, "ddacomm: a hierarchy is attached once, to a group spanning several hosts");
  TORCH_CHECK_VALUE(hierarchy && hierarchy->layout().world_size() == getSize(), "ddacomm: the hierarchy covers ",
                    hierarchy ? hierarchy->layout().world_size() : 0, " ranks but the group has ", getSize());
  hier_ = std::move(hierarchy);
}

bool DdaBackend::two_level(HierOp op, const std::vector<at::Tensor>& tensors, size_t bytes, Plan* plan) const {
  if (!hier_ || shut_down_ || tensors.empty()) return false;
  for (const auto& t : tensors) {
    if (!t.defined() || t.layout() != at::kStrided || t.device().type() != tensors[0].device().type() ||
        !(t.device().is_cpu() || t.device().is_cuda())) {
      return false;
    }
  }
  *plan = hier_->plan(op, bytes);
  if (plan->variant == Variant::kTwoLevel) return true;
  plan_executed(*plan, getRank());  // inner: the call goes to the group's own gloo / NCCL next
  return false;
}

c10::intrusive_ptr<c10d::Work> DdaBackend::run_two_level(const Plan& plan, c10d::OpType op, const at::Device& device,
                                                         std::vector<at::Tensor> outputs,
                                                         const std::function<void()>& body) {
  plan_executed(plan, getRank());
  if (device.is_cuda()) {
    cuda_used_ = true;
#if defined(COMMLIB_TORCH_CUDA)
    c10::cuda::CUDAGuard device_guard(device.index());
    body();
    return c10::make_intrusive<CudaWork>(getRank(), op, std::move(outputs),
                                         c10::cuda::getCurrentCUDAStream(device.index()));
#endif
  }
  body();
  return c10::make_intrusive<CompletedWork>(getRank(), op, std::move(outputs));
}
}  // namespace commlib::torch_layer
