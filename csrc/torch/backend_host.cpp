// DdaBackend's CPU route: commlib's shared-memory collectives (Note [ddacomm routing]).
#include "torch/backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "torch/backend_internal.hpp"
#include "torch/work.hpp"
#include "host/host_ops.hpp"

namespace commlib::torch_layer {
namespace backend_detail {

// An all-reduce of one CPU tensor on commlib's shared memory (any host_type dtype).
void host_all_reduce(Communicator& comm, at::Tensor& t, DataType dtype, ReduceOp op) {
  with_contiguous(t, [&](at::Tensor& c) {
    comm.all_reduce_host(c.data_ptr(), c.data_ptr(), static_cast<size_t>(c.numel()), dtype, op, Algorithm::kAuto);
  });
}

void host_reduce_scatter(Communicator& comm, at::Tensor& out, const at::Tensor& in, DataType dtype, ReduceOp op) {
  // Called inside run_fast, which raises InvalidArgument / TypeMismatch as ValueError / TypeError.
  const char* what = "reduce_scatter";
  check_same_dtype(out, in, what);
  check_world_multiple(what, "input", in, "output", out, comm.world_size());
  const at::Tensor src = contiguous_bits(in);
  record_host_exchange(comm, CollectiveOp::kReduceScatter, static_cast<size_t>(src.numel()) * src.element_size(), src);
  with_contiguous(out, [&](at::Tensor& c) {
    comm.reduce_scatter_host(c.data_ptr(), src.data_ptr(), static_cast<size_t>(c.numel()), dtype, op);
  });
}

}  // namespace backend_detail

using namespace backend_detail;

c10::intrusive_ptr<c10d::Work> DdaBackend::run_host(c10d::OpType op, const char* what, std::vector<at::Tensor> outputs,
                                                    const std::vector<at::Tensor>& inputs,
                                                    const std::function<void()>& body) {
  fr::Group::Call call = fr_record(op, at::Device(at::kCPU), "host", inputs, outputs);
  call.started();
  run_recorded(call, what, body);
  call.completed();
  return completed(op, std::move(outputs));
}

void DdaBackend::agree_before_inner(const char* what, c10d::OpType kind, const at::Tensor& t, uint32_t reduction) {
  run_fast(what, [&] {
    host::agree(*comm_, what, static_cast<uint32_t>(kind), static_cast<uint32_t>(t.scalar_type()),
                static_cast<uint64_t>(t.numel()), reduction);
  });
}

bool DdaBackend::cpu_movable(const char* what, c10d::OpType kind, const std::vector<at::Tensor>& tensors) {
  if (all_of(tensors, is_movable_type)) return true;
  agree_before_inner(what, kind, tensors[0], 0);
  return false;
}

bool DdaBackend::cpu_fast(const std::vector<at::Tensor>& tensors) const {
  if (!comm_ || shut_down_ || tensors.empty()) return false;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided) return false;
  }
  return true;
}

bool DdaBackend::cpu_reduction(const char* what, c10d::OpType kind, const std::vector<at::Tensor>& tensors,
                               const c10d::ReduceOp& reduce_op) {
  const auto op = to_reduce_op(reduce_op);
  bool handled = op.has_value();
  for (const auto& t : tensors) {
    if (!host_type(t.scalar_type())) {
      handled = false;
    } else if (op) {
      check_reduction(what, t.scalar_type(), *op);
    }
  }
  if (handled) return true;
  agree_before_inner(what, kind, tensors[0], static_cast<uint32_t>(reduce_op.op_));
  return false;
}

c10::intrusive_ptr<c10d::Work> DdaBackend::p2p_work(c10d::OpType op, P2pWork::Item item) {
  auto work = c10::make_intrusive<P2pWork>(getRank(), op, comm_, std::vector<P2pWork::Item>{std::move(item)});
  ++num_fast_calls_;
  if (coalescing_) coalesced_cpu_works_.push_back(work);  // batch_isend_irecv: finished together
  return work;
}
}  // namespace commlib::torch_layer
