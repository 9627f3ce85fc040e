// DdaBackend's c10d overrides: each picks one route (two-level, CPU, CUDA, else gloo / NCCL;
// Note [ddacomm routing]).
#include "torch/backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "torch/backend_internal.hpp"
#include "torch/work.hpp"
#include "host/host_ops.hpp"
#include "torch/p2p.hpp"

#if defined(COMMLIB_TORCH_CUDA)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace commlib::torch_layer {
using namespace backend_detail;

// ---- all-reduce family ----

c10::intrusive_ptr<c10d::Work> DdaBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  Plan plan;  // two_level or inner (Note [plan])
  if (tensors.size() == 1 && Hierarchy::splits(opts.reduceOp, tensors[0].scalar_type()) &&
      two_level(HierOp::kAllReduce, tensors, tensors[0].numel() * tensors[0].element_size(), &plan)) {
    if (auto op = to_reduce_op(opts.reduceOp)) check_reduction("allreduce", tensors[0].scalar_type(), *op);
    return run_two_level(plan, c10d::OpType::ALLREDUCE, tensors[0].device(), tensors,
                         [&] { hier_->all_reduce(tensors[0], opts.reduceOp); });
  }
  if (plan.variant == Variant::kInner) {  // counted by two_level: the group's own gloo / NCCL
    return fallback(inner(device_of(tensors, "allreduce"), "allreduce").allreduce(tensors, opts));
  }
  if (tensors.size() == 1 && cpu_fast(tensors) &&
      cpu_reduction("allreduce", c10d::OpType::ALLREDUCE, tensors, opts.reduceOp)) {
    at::Tensor& t = tensors[0];
    return run_host(c10d::OpType::ALLREDUCE, "allreduce", tensors, tensors, [&] { host_all_reduce(*comm_, t, *host_type(t.scalar_type()), *to_reduce_op(opts.reduceOp)); });
  }
  const at::Device device = device_of(tensors, "allreduce");
  if (device.is_cuda() && tensors.size() == 1) return route_cuda_all_reduce(tensors, opts);
  return fallback(inner(device, "allreduce").allreduce(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  return fallback(inner(device_of(tensors, "allreduce_sparse"), "allreduce_sparse").allreduce_sparse(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceCoalescedOptions& opts) {
  if (cpu_fast(tensors) && cpu_reduction("allreduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors,
                                         opts.reduceOp)) {
    const ReduceOp op = *to_reduce_op(opts.reduceOp);
    return run_host(c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors, tensors, [&] {
      for (auto& t : tensors) host_all_reduce(*comm_, t, *host_type(t.scalar_type()), op);
    });
  }
  const at::Device device = device_of(tensors, "allreduce_coalesced");
  return fallback(inner(device, "allreduce_coalesced").allreduce_coalesced(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  if (tensors.size() == 1 && cpu_fast(tensors)) {
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < getSize(), "reduce: root rank ", opts.rootRank,
                      " out of range; valid: 0..", getSize() - 1);
  }
  if (tensors.size() == 1 && cpu_fast(tensors) && cpu_reduction("reduce", c10d::OpType::REDUCE, tensors, opts.reduceOp)) {
    const ReduceOp op = *to_reduce_op(opts.reduceOp);
    const DataType dtype = *host_type(tensors[0].scalar_type());
    // An all-reduce: the root keeps the result; the other ranks' tensors stay unchanged.
    return run_host(c10d::OpType::REDUCE, "reduce", tensors, tensors, [&] {
      if (opts.rootRank == getRank()) {
        host_all_reduce(*comm_, tensors[0], dtype, op);
      } else {
        at::Tensor scratch = tensors[0].clone(at::MemoryFormat::Contiguous);
        host_all_reduce(*comm_, scratch, dtype, op);
      }
    });
  }
  return fallback(inner(device_of(tensors, "reduce"), "reduce").reduce(tensors, opts));
}

// ---- broadcast / all-gather ----

c10::intrusive_ptr<c10d::Work> DdaBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  Plan plan;  // two_level or inner (Note [plan])
  if (tensors.size() == 1 && two_level(HierOp::kBroadcast, tensors, tensors[0].numel() * tensors[0].element_size(), &plan)) {
    return run_two_level(plan, c10d::OpType::BROADCAST, tensors[0].device(), tensors,
                         [&] { hier_->broadcast(tensors[0], static_cast<int>(opts.rootRank)); });
  }
  if (tensors.size() == 1 && cpu_fast(tensors) && cpu_movable("broadcast", c10d::OpType::BROADCAST, tensors)) {
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < getSize(), "broadcast: root rank ", opts.rootRank,
                      " out of range; valid: 0..", getSize() - 1);
    return run_host(c10d::OpType::BROADCAST, "broadcast", tensors, tensors, [&] { torch_layer::broadcast(*comm_, tensors[0], static_cast<int>(opts.rootRank)); });
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (tensors.size() == 1 && all_of(tensors, is_movable_type) &&
      cuda_collective(CollectiveOp::kBroadcast, tensors, nbytes_of(tensors[0]))) {
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < getSize(), "broadcast: root rank ", opts.rootRank,
                      " out of range; valid: 0..", getSize() - 1);
    at::Tensor& t = tensors[0];
    return run_cuda("broadcast", c10d::OpType::BROADCAST, tensors, {}, opts.asyncOp,
                    [&] { broadcast_cuda(*comm_, t, static_cast<int>(opts.rootRank)); });
  }
#endif
  return fallback(inner(device_of(tensors, "broadcast"), "broadcast").broadcast(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  Plan plan;  // two_level or inner (Note [plan])
  if (inputs.size() == 1 && outputs.size() == 1 &&
      two_level(HierOp::kAllGather, inputs, inputs[0].numel() * inputs[0].element_size(), &plan)) {
    std::vector<at::Tensor>& outs = outputs[0];
    check_gather_list("allgather", outs, inputs[0]);
    return run_two_level(plan, c10d::OpType::ALLGATHER, inputs[0].device(), outs, [&] {
      at::Tensor flat = at::empty({getSize(), inputs[0].numel()}, inputs[0].options());
      hier_->all_gather(flat, inputs[0]);
      copy_rows(flat, outs);
    });
  }
  if (inputs.size() == 1 && outputs.size() == 1 && cpu_fast(inputs) && cpu_fast(outputs[0]) &&
      cpu_movable("allgather", c10d::OpType::ALLGATHER, inputs)) {
    const at::Tensor& in = inputs[0];
    std::vector<at::Tensor>& outs = outputs[0];
    TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == getSize(), "allgather: got ", outs.size(),
                      " output tensors; expected world_size = ", getSize());
    for (size_t r = 0; r < outs.size(); ++r) {
      TORCH_CHECK_TYPE(outs[r].scalar_type() == in.scalar_type(), "allgather: output ", r, " is ",
                       dtype_str(outs[r].scalar_type()), " but input is ", dtype_str(in.scalar_type()));
      TORCH_CHECK_VALUE(outs[r].numel() == in.numel(), "allgather: output ", r, " has ", outs[r].numel(),
                        " elements but input has ", in.numel(), "; they must match");
    }
    return run_host(c10d::OpType::ALLGATHER, "all_gather", outputs[0], inputs, [&] {
      at::Tensor flat = at::empty({getSize(), in.numel()}, in.options());
      all_gather(*comm_, flat, in);
      copy_rows(flat, outs);
    });
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (inputs.size() == 1 && outputs.size() == 1 && all_of(inputs, is_movable_type) &&
      cuda_collective(CollectiveOp::kAllGather, {inputs[0]}, nbytes_of(inputs[0]) * getSize())) {
    const at::Tensor& in = inputs[0];
    std::vector<at::Tensor>& outs = outputs[0];
    check_gather_list("allgather", outs, in);
    for (const auto& o : outs) {
      TORCH_CHECK_TYPE(o.is_cuda() && o.device() == in.device(), "allgather: every output must be on ",
                       in.device().str(), "; got ", o.device().str());
    }
    return run_cuda("all_gather", c10d::OpType::ALLGATHER, outs, inputs, opts.asyncOp, [&] {
      at::Tensor flat = at::empty({getSize(), in.numel()}, in.options());
      all_gather_cuda(*comm_, flat, in);
      copy_rows(flat, outs);
    });
  }
#endif
  return fallback(inner(device_of(inputs, "allgather"), "allgather").allgather(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> both{output, input};
  Plan plan;  // two_level or inner (Note [plan])
  if (two_level(HierOp::kAllGather, both, input.numel() * input.element_size(), &plan)) {
    return run_two_level(plan, c10d::OpType::_ALLGATHER_BASE, input.device(), {output},
                         [&] { hier_->all_gather(output, input); });
  }
  if (cpu_fast(both) && cpu_movable("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, both)) {
    return run_host(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {output}, {input}, [&] { all_gather(*comm_, output, input); });
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (all_of(both, is_movable_type) && cuda_collective(CollectiveOp::kAllGather, both, nbytes_of(output))) {
    return run_cuda("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {output}, {input}, opts.asyncOp,
                    [&] { all_gather_cuda(*comm_, output, input); });
  }
#endif
  return fallback(inner(input.device(), "all_gather_into_tensor")._allgather_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  // outputs[r][i] receives rank r's inputs[i] (gloo's layout).
  bool fast = cpu_fast(inputs) && cpu_movable("allgather_coalesced", c10d::OpType::ALLGATHER_COALESCED, inputs);
  for (size_t r = 0; fast && r < outputs.size(); ++r) fast = cpu_fast(outputs[r]);
  if (fast) {
    TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == getSize(), "allgather_coalesced: got ", outputs.size(),
                      " output lists; expected world_size = ", getSize());
    for (int r = 0; r < getSize(); ++r) {
      TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), "allgather_coalesced: output list ", r, " has ",
                        outputs[r].size(), " tensors; expected one per input (", inputs.size(), ")");
      for (size_t i = 0; i < inputs.size(); ++i) {
        TORCH_CHECK_TYPE(outputs[r][i].scalar_type() == inputs[i].scalar_type(), "allgather_coalesced: output ", r,
                         "/", i, " is ", dtype_str(outputs[r][i].scalar_type()), " but input ", i, " is ",
                         dtype_str(inputs[i].scalar_type()));
        TORCH_CHECK_VALUE(outputs[r][i].numel() == inputs[i].numel(), "allgather_coalesced: output ", r, "/", i,
                          " has ", outputs[r][i].numel(), " elements but input ", i, " has ", inputs[i].numel());
      }
    }
    std::vector<at::Tensor> all;
    for (auto& list : outputs) all.insert(all.end(), list.begin(), list.end());
    return run_host(c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced", std::move(all), inputs, [&] {
      for (size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor& in = inputs[i];
        at::Tensor flat = at::empty({getSize(), in.numel()}, in.options());
        all_gather(*comm_, flat, in);
        for (int r = 0; r < getSize(); ++r) copy_bits(outputs[r][i], flat[r].view(outputs[r][i].sizes()));
      }
    });
  }
  return fallback(inner(device_of(inputs, "allgather_coalesced"), "allgather_coalesced")
                      .allgather_coalesced(outputs, inputs, opts));
}

void DdaBackend::check_gather_list(const char* what, const std::vector<at::Tensor>& list, const at::Tensor& one) const {
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == getSize(), what, ": got ", list.size(),
                    " tensors in the list; expected world_size = ", getSize());
  for (size_t r = 0; r < list.size(); ++r) {
    TORCH_CHECK_TYPE(list[r].scalar_type() == one.scalar_type(), what, ": list tensor ", r, " is ",
                     dtype_str(list[r].scalar_type()), " but the tensor is ", dtype_str(one.scalar_type()));
    TORCH_CHECK_VALUE(list[r].numel() == one.numel(), what, ": list tensor ", r, " has ", list[r].numel(),
                      " elements but the tensor has ", one.numel(), "; they must match");
  }
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::AllgatherOptions& opts) {
  if (outputs.size() == inputs.size() && cpu_fast(inputs) && cpu_fast(outputs) &&
      cpu_movable("allgather_into_tensor_coalesced", c10d::OpType::COALESCED, inputs) &&
      all_of(outputs, is_movable_type)) {
    return run_host(c10d::OpType::COALESCED, "allgather_into_tensor_coalesced", outputs, inputs, [&] {
      for (size_t i = 0; i < inputs.size(); ++i) all_gather(*comm_, outputs[i], inputs[i]);
    });
  }
  return fallback(inner(device_of(inputs, "all_gather_into_tensor_coalesced"), "all_gather_into_tensor_coalesced")
                      .allgather_into_tensor_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  // Only the root passes an output list; the route depends on the input alone, which every rank has.
  if (inputs.size() == 1 && cpu_fast(inputs) && cpu_movable("gather", c10d::OpType::GATHER, inputs)) {
    const int root = static_cast<int>(opts.rootRank);
    TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "gather: dst ", root, " out of range; valid: 0..", getSize() - 1);
    const at::Tensor in = contiguous_bits(inputs[0]);
    const bool is_root = root == getRank();
    if (is_root) {
      TORCH_CHECK_VALUE(outputs.size() == 1, "gather: the root needs one output list; got ", outputs.size());
      TORCH_CHECK_TYPE(cpu_fast(outputs[0]), "gather: the root's output list must hold dense cpu tensors");
      check_gather_list("gather", outputs[0], in);
    }
    const size_t bytes = static_cast<size_t>(in.numel()) * in.element_size();
    return run_host(c10d::OpType::GATHER, "gather", is_root ? outputs[0] : std::vector<at::Tensor>{}, inputs, [&] {
      at::Tensor flat = is_root ? at::empty({getSize(), in.numel()}, in.options()) : at::Tensor();
      host::gather(*comm_, is_root ? flat.data_ptr() : nullptr, in.data_ptr(), bytes, root);
      if (is_root) copy_rows(flat, outputs[0]);
    });
  }
  return fallback(inner(device_of(inputs, "gather"), "gather").gather(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  if (outputs.size() == 1 && cpu_fast(outputs) && cpu_movable("scatter", c10d::OpType::SCATTER, outputs)) {
    const int root = static_cast<int>(opts.rootRank);
    TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "scatter: src ", root, " out of range; valid: 0..", getSize() - 1);
    at::Tensor& out = outputs[0];
    const bool is_root = root == getRank();
    at::Tensor packed;
    if (is_root) {
      TORCH_CHECK_VALUE(inputs.size() == 1, "scatter: the root needs one input list; got ", inputs.size());
      TORCH_CHECK_TYPE(cpu_fast(inputs[0]), "scatter: the root's input list must hold dense cpu tensors");
      check_gather_list("scatter", inputs[0], out);
      packed = cat_flat(inputs[0]);
    }
    const size_t bytes = static_cast<size_t>(out.numel()) * out.element_size();
    return run_host(c10d::OpType::SCATTER, "scatter", outputs, is_root ? inputs[0] : std::vector<at::Tensor>{}, [&] {
      with_contiguous(out, [&](at::Tensor& c) {
        host::scatter(*comm_, c.data_ptr(), is_root ? packed.data_ptr() : nullptr, bytes, root);
      });
    });
  }
  return fallback(inner(device_of(outputs, "scatter"), "scatter").scatter(outputs, inputs, opts));
}

// ---- reduce-scatter ----

c10::intrusive_ptr<c10d::Work> DdaBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ReduceScatterOptions& opts) {
  Plan plan;  // two_level or inner (Note [plan])
  if (outputs.size() == 1 && inputs.size() == 1 && Hierarchy::splits(opts.reduceOp, outputs[0].scalar_type()) &&
      two_level(HierOp::kReduceScatter, outputs, outputs[0].numel() * outputs[0].element_size(), &plan)) {
    at::Tensor& out = outputs[0];
    check_gather_list("reduce_scatter", inputs[0], out);
    if (auto op = to_reduce_op(opts.reduceOp)) check_reduction("reduce_scatter", out.scalar_type(), *op);
    return run_two_level(plan, c10d::OpType::REDUCE_SCATTER, out.device(), outputs, [&] {
      hier_->reduce_scatter(out, cat_flat(inputs[0]), opts.reduceOp);
    });
  }
  if (outputs.size() == 1 && inputs.size() == 1 && cpu_fast(outputs) && cpu_fast(inputs[0]) &&
      cpu_reduction("reduce_scatter", c10d::OpType::REDUCE_SCATTER, outputs, opts.reduceOp)) {
    at::Tensor& out = outputs[0];
    const std::vector<at::Tensor>& ins = inputs[0];
    TORCH_CHECK_VALUE(static_cast<int>(ins.size()) == getSize(), "reduce_scatter: got ", ins.size(),
                      " input tensors; expected world_size = ", getSize());
    for (size_t r = 0; r < ins.size(); ++r) {
      TORCH_CHECK_TYPE(ins[r].scalar_type() == out.scalar_type(), "reduce_scatter: input ", r, " is ",
                       dtype_str(ins[r].scalar_type()), " but output is ", dtype_str(out.scalar_type()));
      TORCH_CHECK_VALUE(ins[r].numel() == out.numel(), "reduce_scatter: input ", r, " has ", ins[r].numel(),
                        " elements but output has ", out.numel(), "; they must match");
    }
    return run_host(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", outputs, ins, [&] {
      host_reduce_scatter(*comm_, out, cat_flat(ins), *host_type(out.scalar_type()),
                          *to_reduce_op(opts.reduceOp));
    });
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (outputs.size() == 1 && inputs.size() == 1 && cuda_reducible(opts.reduceOp, outputs[0].scalar_type()) &&
      cuda_collective(CollectiveOp::kReduceScatter, outputs, nbytes_of(outputs[0]) * getSize())) {
    at::Tensor& out = outputs[0];
    const std::vector<at::Tensor>& ins = inputs[0];
    check_gather_list("reduce_scatter", ins, out);
    for (const auto& t : ins) {
      TORCH_CHECK_TYPE(t.is_cuda() && t.device() == out.device(), "reduce_scatter: every input must be on ",
                       out.device().str(), "; got ", t.device().str());
    }
    return run_cuda("reduce_scatter", c10d::OpType::REDUCE_SCATTER, outputs, ins, opts.asyncOp, [&] {
      reduce_scatter_cuda(*comm_, out, cat_flat(ins), *to_reduce_op(opts.reduceOp));
    });
  }
#endif
  return fallback(
      inner(device_of(outputs, "reduce_scatter"), "reduce_scatter").reduce_scatter(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> both{output, input};
  Plan plan;  // two_level or inner (Note [plan])
  if (Hierarchy::splits(opts.reduceOp, output.scalar_type()) &&
      two_level(HierOp::kReduceScatter, both, output.numel() * output.element_size(), &plan)) {
    if (auto op = to_reduce_op(opts.reduceOp)) check_reduction("reduce_scatter_tensor", output.scalar_type(), *op);
    return run_two_level(plan, c10d::OpType::_REDUCE_SCATTER_BASE, input.device(), {output},
                         [&] { hier_->reduce_scatter(output, input, opts.reduceOp); });
  }
  if (cpu_fast(both) &&
      cpu_reduction("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, both, opts.reduceOp)) {
    return run_host(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", {output}, {input}, [&] {
      host_reduce_scatter(*comm_, output, input, *host_type(output.scalar_type()), *to_reduce_op(opts.reduceOp));
    });
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (cuda_reducible(opts.reduceOp, input.scalar_type()) &&
      cuda_collective(CollectiveOp::kReduceScatter, both, nbytes_of(input))) {
    return run_cuda("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, {output}, {input}, opts.asyncOp,
                    [&] { reduce_scatter_cuda(*comm_, output, input, *to_reduce_op(opts.reduceOp)); });
  }
#endif
  return fallback(inner(input.device(), "reduce_scatter_tensor")._reduce_scatter_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::ReduceScatterOptions& opts) {
  if (outputs.size() == inputs.size() && cpu_fast(outputs) && cpu_fast(inputs) &&
      cpu_reduction("reduce_scatter_tensor_coalesced", c10d::OpType::COALESCED, inputs, opts.reduceOp)) {
    const ReduceOp op = *to_reduce_op(opts.reduceOp);
    return run_host(c10d::OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs, inputs, [&] {
      for (size_t i = 0; i < inputs.size(); ++i) {
        host_reduce_scatter(*comm_, outputs[i], inputs[i], *host_type(inputs[i].scalar_type()), op);
      }
    });
  }
  return fallback(inner(device_of(inputs, "reduce_scatter_tensor_coalesced"), "reduce_scatter_tensor_coalesced")
                      .reduce_scatter_tensor_coalesced(outputs, inputs, opts));
}

// ---- all-to-all ----

c10::intrusive_ptr<c10d::Work> DdaBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_split_sizes,
                                                         std::vector<int64_t>& input_split_sizes,
                                                         const c10d::AllToAllOptions& opts) {
  std::vector<at::Tensor> both{output, input};
  if (cpu_fast(both) && cpu_movable("all_to_all_single", c10d::OpType::ALLTOALL_BASE, both)) {
    return run_host(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", {output}, {input}, [&] { all_to_all_v(*comm_, output, input, output_split_sizes, input_split_sizes); });
  }
#if defined(COMMLIB_TORCH_CUDA)
  // Equal splits only (empty split lists: every rank passes the same form for one call).
  if (output_split_sizes.empty() && input_split_sizes.empty() && all_of(both, is_movable_type) &&
      cuda_collective(CollectiveOp::kAllToAll, both, nbytes_of(input))) {
    return run_cuda("all_to_all_single", c10d::OpType::ALLTOALL_BASE, {output}, {input}, opts.asyncOp,
                    [&] { all_to_all_cuda(*comm_, output, input); });
  }
#endif
  return fallback(inner(input.device(), "all_to_all_single")
                      .alltoall_base(output, input, output_split_sizes, input_split_sizes, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  if (cpu_fast(outputs) && cpu_fast(inputs) && cpu_movable("all_to_all", c10d::OpType::ALLTOALL, inputs) &&
      all_of(outputs, is_movable_type)) {
    const int n = getSize();
    TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == n && static_cast<int>(outputs.size()) == n,
                      "all_to_all: got ", inputs.size(), " inputs and ", outputs.size(),
                      " outputs; expected world_size = ", n, " of each");
    // Every block travels as bytes: one packed buffer each way, split by byte counts.
    std::vector<at::Tensor> in_bytes;
    std::vector<int64_t> in_splits(n), out_splits(n);
    for (int r = 0; r < n; ++r) {
      TORCH_CHECK_TYPE(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                           outputs[r].scalar_type() == inputs[0].scalar_type(),
                       "all_to_all: every input and output must have the same dtype; input 0 is ",
                       dtype_str(inputs[0].scalar_type()), ", input ", r, " is ", dtype_str(inputs[r].scalar_type()),
                       ", output ", r, " is ", dtype_str(outputs[r].scalar_type()));
      in_bytes.push_back(bytes_of(inputs[r]).contiguous().reshape({-1}).view(at::kByte));
      in_splits[r] = in_bytes.back().numel();
      out_splits[r] = outputs[r].numel() * outputs[r].element_size();
    }
    return run_host(c10d::OpType::ALLTOALL, "all_to_all", outputs, inputs, [&] {
      at::Tensor packed_in = at::cat(in_bytes);
      int64_t total_out = 0;
      for (int64_t s : out_splits) total_out += s;
      at::Tensor packed_out = at::empty({total_out}, packed_in.options());
      all_to_all_v(*comm_, packed_out, packed_in, out_splits, in_splits);
      int64_t offset = 0;
      for (int r = 0; r < n; ++r) {
        at::Tensor block = packed_out.narrow(0, offset, out_splits[r]).view(outputs[r].scalar_type());
        copy_bits(outputs[r], block.view(outputs[r].sizes()));
        offset += out_splits[r];
      }
    });
  }
  return fallback(inner(device_of(inputs, "all_to_all"), "all_to_all").alltoall(outputs, inputs, opts));
}

// ---- point-to-point (Note [host p2p]) and synchronisation ----

c10::intrusive_ptr<c10d::Work> DdaBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  if (tensors.size() == 1 && cpu_fast(tensors)) {
    return p2p_work(c10d::OpType::SEND, post_send(*comm_, tensors[0], dst_rank, tag));
  }
  if (auto work = cuda_p2p(c10d::OpType::SEND, P2pRequest::Kind::kSend, tensors, dst_rank, tag)) return work;
  return fallback(inner(device_of(tensors, "send"), "send").send(tensors, dst_rank, tag));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  if (tensors.size() == 1 && cpu_fast(tensors)) {
    return p2p_work(c10d::OpType::RECV, post_recv(*comm_, tensors[0], src_rank, tag));
  }
  if (auto work = cuda_p2p(c10d::OpType::RECV, P2pRequest::Kind::kRecv, tensors, src_rank, tag)) return work;
  return fallback(inner(device_of(tensors, "recv"), "recv").recv(tensors, src_rank, tag));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  // On commlib's path too: a sender cannot know that its receiver takes any source, so both ends
  // must be on the same path whatever the receiver posts.
  if (tensors.size() == 1 && cpu_fast(tensors)) {
    return p2p_work(c10d::OpType::RECVANYSOURCE, post_recv(*comm_, tensors[0], HostP2p::kAnySource, tag));
  }
  return fallback(inner(device_of(tensors, "recv"), "recv").recvAnysource(tensors, tag));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::barrier(const c10d::BarrierOptions& opts) {
  TORCH_CHECK(!shut_down_, "barrier: the ddacomm process group was shut down");
  if (hier_) {
    const Plan plan = hier_->plan(HierOp::kBarrier, 0);
    plan_executed(plan, getRank());
    if (plan.variant == Variant::kTwoLevel) {
#if defined(COMMLIB_TORCH_CUDA)
      if (cuda_used_) c10::cuda::device_synchronize();  // as below: queued GPU work is done after it
#endif
      hier_->barrier();
      return c10::make_intrusive<CompletedWork>(getRank(), c10d::OpType::BARRIER, std::vector<at::Tensor>{});
    }
  }
  if (!comm_) return fallback(gloo_->barrier(opts));
#if defined(COMMLIB_TORCH_CUDA)
  // Like NCCL's barrier, the GPU work this rank queued before the barrier is finished after it.
  if (cuda_used_) c10::cuda::device_synchronize();
#endif
  return run_host(c10d::OpType::BARRIER, "barrier", {}, {}, [&] { comm_->barrier_host(); });
}

void DdaBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  gloo_->monitoredBarrier(opts, wait_all_ranks);
}

uint64_t DdaBackend::getSequenceNumberForGroup() { return gloo_->getSequenceNumberForGroup(); }
}  // namespace commlib::torch_layer
