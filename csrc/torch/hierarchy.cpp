// Hierarchy (csrc/torch/hierarchy.hpp): the legs of the two-level collectives, each a call on an
// inner c10d backend (Note [hierarchical collectives]).
#include "torch/hierarchy.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>

#include "torch/torch_common.hpp"

namespace commlib::torch_layer {
namespace {

// Waits for a leg: a CPU leg has finished after it; a CUDA leg's stream precedes the current one.
void finish(const c10::intrusive_ptr<c10d::Work>& work) {
  if (work) work->wait();
}

c10d::ReduceOp leg_op(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::AVG ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
}

template <typename Options>
Options leg_options(std::chrono::milliseconds timeout) {
  Options o;
  o.timeout = timeout;
  o.asyncOp = false;
  return o;
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> create_nccl(const InnerFactory& factory, const char* what, const char* which) {
  TORCH_CHECK_TYPE(static_cast<bool>(factory), what,
                   ": CUDA tensors need the NCCL backend, which this torch build or machine lacks; "
                   "supported here: cpu tensors");
  c10::intrusive_ptr<c10d::Backend> backend = factory();
  TORCH_CHECK(backend, what, ": creating the ", which, " NCCL backend failed");
  return backend;
}

Hierarchy::Hierarchy(HostLayout layout, c10::intrusive_ptr<c10d::Backend> intra,
                     c10::intrusive_ptr<c10d::Backend> inter_gloo, InnerFactory inter_nccl_factory,
                     std::chrono::milliseconds timeout, InterCuda inter_cuda)
    : layout_(std::move(layout)),
      intra_(std::move(intra)),
      inter_gloo_(std::move(inter_gloo)),
      inter_nccl_factory_(std::move(inter_nccl_factory)),
      timeout_(timeout),
      inter_cuda_(inter_cuda),
      selector_(layout_.num_hosts, layout_.local_size) {
  const HostLayout& l = layout_;
  TORCH_CHECK_VALUE(l.num_hosts >= 1 && l.local_size >= 1 && l.host_index >= 0 && l.host_index < l.num_hosts &&
                        l.local_rank >= 0 && l.local_rank < l.local_size &&
                        static_cast<int>(l.rank_of.size()) == l.world_size(),
                    "ddacomm hierarchy: inconsistent layout: ", l.num_hosts, " hosts x ", l.local_size,
                    " ranks, host ", l.host_index, ", local rank ", l.local_rank, ", ", l.rank_of.size(), " ranks");
  TORCH_CHECK_VALUE(intra_ && intra_->getSize() == l.local_size && intra_->getRank() == l.local_rank,
                    "ddacomm hierarchy: the intra-host backend must be rank ", l.local_rank, " of ", l.local_size);
  TORCH_CHECK_VALUE(inter_gloo_ && inter_gloo_->getSize() == l.num_hosts && inter_gloo_->getRank() == l.host_index,
                    "ddacomm hierarchy: the inter-host backend must be rank ", l.host_index, " of ", l.num_hosts);
}

bool Hierarchy::splits(const c10d::ReduceOp& op, at::ScalarType dtype) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: case c10d::ReduceOp::PRODUCT: case c10d::ReduceOp::MIN: case c10d::ReduceOp::MAX:
    case c10d::ReduceOp::BAND: case c10d::ReduceOp::BOR: case c10d::ReduceOp::BXOR:
      return true;
    case c10d::ReduceOp::AVG:  // SUM in the legs, one division at the end: floating types only
      return at::isFloatingType(dtype);
    default:
      return false;
  }
}

const c10::intrusive_ptr<c10d::Backend>& Hierarchy::inter(const at::Device& device, const char* what) {
  if (device.is_cpu() || (device.is_cuda() && inter_cuda_ == InterCuda::kGlooViaHost)) return inter_gloo_;
  TORCH_CHECK_TYPE(device.is_cuda(), what, ": tensors on device ", device.str(),
                   " are not supported; supported: cpu, cuda");
  std::lock_guard<std::mutex> lock(nccl_mutex_);
  if (!inter_nccl_) {
    inter_nccl_ = create_nccl(inter_nccl_factory_, what, "inter-host");
  }
  return inter_nccl_;
}

at::Tensor Hierarchy::local_major_ranks(const at::Device& device) const {
  const int H = layout_.num_hosts, L = layout_.local_size;
  std::vector<int64_t> ranks(static_cast<size_t>(H) * L);
  for (int l = 0; l < L; ++l) {
    for (int h = 0; h < H; ++h) ranks[static_cast<size_t>(l) * H + h] = layout_.rank_of[static_cast<size_t>(h) * L + l];
  }
  return at::tensor(ranks, at::TensorOptions().dtype(at::kLong)).to(device);
}

template <typename F>
void Hierarchy::inter_leg(const char* what, at::Tensor& out, const at::Tensor& in, F&& call) {
  if (in.is_cuda() && inter_cuda_ == InterCuda::kGlooViaHost) {
    at::Tensor host_in = in.cpu();
    at::Tensor host_out = out.is_same(in) ? host_in : at::empty(out.sizes(), host_in.options());
    call(*inter_gloo_, host_in, host_out);
    copy_bits(out, host_out);
    return;
  }
  call(*inter(in.device(), what), const_cast<at::Tensor&>(in), out);
}

void Hierarchy::inter_all_reduce(at::Tensor& tensor, const c10d::ReduceOp& op) {
  auto o = leg_options<c10d::AllreduceOptions>(timeout_);
  o.reduceOp = op;
  inter_leg("allreduce", tensor, tensor, [&](c10d::Backend& b, at::Tensor& in, at::Tensor&) {
    std::vector<at::Tensor> one{in};
    finish(b.allreduce(one, o));
  });
}

void Hierarchy::all_reduce(at::Tensor& tensor, const c10d::ReduceOp& op) {
  ++num_calls_;
  const int64_t n = tensor.numel();
  if (n == 0) return;
  const int L = layout_.local_size;
  const c10d::ReduceOp legs = leg_op(op);
  const int64_t shard_numel = (n + L - 1) / L;
  // In place when the tensor splits evenly; else a zero-padded copy (its extra results are dropped,
  // and every reduction is defined on zeros).
  const bool in_place = tensor.is_contiguous() && n % L == 0;
  at::Tensor padded = in_place ? tensor.view({-1}) : at::zeros({shard_numel * L}, tensor.options());
  if (!in_place) copy_bits(padded.narrow(0, 0, n).view(tensor.sizes()), tensor);
  at::Tensor shard = L == 1 ? padded : at::empty({shard_numel}, padded.options());
  if (L > 1) {
    auto o = leg_options<c10d::ReduceScatterOptions>(timeout_);
    o.reduceOp = legs;
    finish(intra_->_reduce_scatter_base(shard, padded, o));
  }
  inter_all_reduce(shard, legs);
  if (op.op_ == c10d::ReduceOp::AVG) shard.div_(layout_.world_size());
  if (L > 1) finish(intra_->_allgather_base(padded, shard, leg_options<c10d::AllgatherOptions>(timeout_)));
  if (!in_place) copy_bits(tensor, padded.narrow(0, 0, n).view(tensor.sizes()));
}

void Hierarchy::reduce_scatter(at::Tensor& output, const at::Tensor& input, const c10d::ReduceOp& op) {
  ++num_calls_;
  const int W = layout_.world_size(), H = layout_.num_hosts, L = layout_.local_size;
  TORCH_CHECK_TYPE(input.scalar_type() == output.scalar_type(), "reduce_scatter_tensor: input is ",
                   input.scalar_type(), " but output is ", output.scalar_type(), "; both must have the same dtype");
  translate_errors([&] { check_world_multiple("reduce_scatter_tensor", "input", input, "output", output, W); });
  const int64_t n = output.numel();
  if (n == 0) return;
  const c10d::ReduceOp legs = leg_op(op);
  // Blocks in [local index][host] order: the intra leg hands local index l the blocks of the ranks
  // with local index l, one per host, in host order (the inter leg's rank order).
  at::Tensor arranged = bytes_of(input).reshape({W, n}).index_select(0, local_major_ranks(input.device()))
                           .reshape({-1}).view(input.scalar_type());  // Note [bool bytes]
  at::Tensor mine = L == 1 ? arranged : at::empty({static_cast<int64_t>(H) * n}, arranged.options());
  if (L > 1) {
    auto o = leg_options<c10d::ReduceScatterOptions>(timeout_);
    o.reduceOp = legs;
    finish(intra_->_reduce_scatter_base(mine, arranged, o));
  }
  at::Tensor result = at::empty({n}, mine.options());
  {
    auto o = leg_options<c10d::ReduceScatterOptions>(timeout_);
    o.reduceOp = legs;
    inter_leg("reduce_scatter_tensor", result, mine, [&](c10d::Backend& b, at::Tensor& in, at::Tensor& out) {
      finish(b._reduce_scatter_base(out, in, o));
    });
  }
  if (op.op_ == c10d::ReduceOp::AVG) result.div_(W);
  copy_bits(output, result.view(output.sizes()));
}

void Hierarchy::all_gather(at::Tensor& output, const at::Tensor& input) {
  ++num_calls_;
  const int W = layout_.world_size(), H = layout_.num_hosts, L = layout_.local_size;
  TORCH_CHECK_TYPE(input.scalar_type() == output.scalar_type(), "all_gather_into_tensor: input is ",
                   input.scalar_type(), " but output is ", output.scalar_type(), "; both must have the same dtype");
  translate_errors([&] { check_world_multiple("all_gather_into_tensor", "output", output, "input", input, W); });
  const int64_t n = input.numel();
  if (n == 0) return;
  const at::Tensor in = contiguous_bits(input).reshape({-1});
  at::Tensor per_host = at::empty({static_cast<int64_t>(H) * n}, in.options());
  inter_leg("all_gather_into_tensor", per_host, in, [&](c10d::Backend& b, at::Tensor& i, at::Tensor& out) {
    finish(b._allgather_base(out, i, leg_options<c10d::AllgatherOptions>(timeout_)));
  });
  at::Tensor gathered = L == 1 ? per_host : at::empty({static_cast<int64_t>(W) * n}, in.options());
  if (L > 1) finish(intra_->_allgather_base(gathered, per_host, leg_options<c10d::AllgatherOptions>(timeout_)));
  // gathered is in [local index][host] order; the output is in group-rank order.
  at::Tensor ordered = at::empty({W, n}, in.options());
  bytes_of(ordered).index_copy_(0, local_major_ranks(input.device()), bytes_of(gathered).view({W, n}));
  copy_bits(output, ordered.view(output.sizes()));
}

void Hierarchy::broadcast(at::Tensor& tensor, int root) {
  ++num_calls_;
  const int W = layout_.world_size(), L = layout_.local_size;
  TORCH_CHECK_VALUE(root >= 0 && root < W, "broadcast: root rank ", root, " out of range; valid: 0..", W - 1);
  const auto at = std::find(layout_.rank_of.begin(), layout_.rank_of.end(), root) - layout_.rank_of.begin();
  const int root_host = static_cast<int>(at / L), root_local = static_cast<int>(at % L);
  std::vector<at::Tensor> one{contiguous_bits(tensor)};
  if (layout_.local_rank == root_local) {
    auto o = leg_options<c10d::BroadcastOptions>(timeout_);
    o.rootRank = root_host;
    inter_leg("broadcast", one[0], one[0], [&](c10d::Backend& b, at::Tensor& in, at::Tensor&) {
      std::vector<at::Tensor> v{in};
      finish(b.broadcast(v, o));
    });
  }
  if (L > 1) {
    auto o = leg_options<c10d::BroadcastOptions>(timeout_);
    o.rootRank = root_local;
    finish(intra_->broadcast(one, o));
  }
  if (!one[0].is_same(tensor)) copy_bits(tensor, one[0]);
}

void Hierarchy::barrier() {
  ++num_calls_;
  // Every rank of this host has arrived; then every host's; then every rank leaves together.
  if (layout_.local_size > 1) finish(intra_->barrier(leg_options<c10d::BarrierOptions>(timeout_)));
  finish(inter_gloo_->barrier(leg_options<c10d::BarrierOptions>(timeout_)));
  if (layout_.local_size > 1) finish(intra_->barrier(leg_options<c10d::BarrierOptions>(timeout_)));
}

void Hierarchy::set_timeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  intra_->setTimeout(timeout);
  inter_gloo_->setTimeout(timeout);
  if (inter_nccl_) inter_nccl_->setTimeout(timeout);
}

void Hierarchy::shutdown() {
  intra_->shutdown();
  if (inter_nccl_) inter_nccl_->shutdown();
  inter_gloo_->shutdown();
}

void Hierarchy::abort() {
  intra_->abort();
  if (inter_nccl_) inter_nccl_->abort();
  inter_gloo_->abort();
}

}  // namespace commlib::torch_layer
