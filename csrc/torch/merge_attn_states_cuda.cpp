// torch.ops.commlib.merge_attention_states / merge_attention_states_: the fused merge of partial
// attention states on CUDA (csrc/kernels/merge_attn_states.cu, Note [merge of attention states]).
// On the caller's current stream; no host synchronisation and no allocation in the in-place
// variant, so ring attention's merges are CUDA-graph capturable. commlib.cp validates arguments
// with Python errors first and runs the same arithmetic on CPU tensors.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "kernels/merge_attn_states_params.hpp"
#include "torch/torch_common.hpp"

namespace commlib::torch_layer {
namespace {

constexpr const char* kWhat = "merge_attention_states";

DataType float_type(at::ScalarType type, const char* name) {
  switch (type) {
    case at::kFloat: return DataType::kFloat32;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    default: break;
  }
  TORCH_CHECK_TYPE(false, kWhat, ": ", name, " has dtype ", c10::toString(type),
                   "; supported: float32, float16, bfloat16");
  return DataType::kFloat32;
}

void check_out(const at::Tensor& o, const at::Tensor& ref, const std::string& name) {
  TORCH_CHECK_VALUE(o.dim() == 3, kWhat, ": ", name, " must be [tokens, heads, head_dim], got ", o.sizes());
  TORCH_CHECK_VALUE(o.sizes() == ref.sizes(), kWhat, ": ", name, " has shape ", o.sizes(), ", expected ", ref.sizes());
  TORCH_CHECK_TYPE(o.device() == ref.device(), kWhat, ": ", name, " is on ", o.device(), ", expected ", ref.device());
  TORCH_CHECK_VALUE(o.size(2) <= 1 || o.stride(2) == 1, kWhat, ": ", name, " must have a contiguous last dimension");
}

void check_lse(const at::Tensor& lse, const at::Tensor& o, const std::string& name) {
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, kWhat, ": ", name, " has dtype ", lse.scalar_type(),
                   "; supported: float32");
  TORCH_CHECK_VALUE(lse.dim() == 2 && lse.size(0) == o.size(1) && lse.size(1) == o.size(0), kWhat, ": ", name,
                    " has shape ", lse.sizes(), "; expected [heads, tokens] = [", o.size(1), ", ", o.size(0), "]");
  TORCH_CHECK_TYPE(lse.device() == o.device(), kWhat, ": ", name, " is on ", lse.device(), ", expected ", o.device());
  TORCH_CHECK_VALUE(lse.size(1) <= 1 || lse.stride(1) == 1, kWhat, ": ", name, " must have contiguous tokens");
}

kernels::MergeStateView state_view(const at::Tensor& o, const at::Tensor& lse) {
  kernels::MergeStateView v;
  v.out = o.data_ptr();
  v.lse = lse.data_ptr<float>();
  v.out_stride_token = o.stride(0);
  v.out_stride_head = o.stride(1);
  v.lse_stride_head = lse.stride(0);
  return v;
}

// Merges states [begin, end) into (out, out_lse) with `target`, one launch per kMaxMergeStates.
void launch(const at::Tensor& out, const at::Tensor& out_lse, const at::TensorList& outs, const at::TensorList& lses, size_t begin,
            size_t end, kernels::MergeTarget target, const int64_t* rows) {
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(out.device().index());
  while (begin < end) {
    kernels::MergeAttnStatesParams p;
    const size_t n = std::min<size_t>(end - begin, kernels::kMaxMergeStates);
    p.num_states = static_cast<int>(n);
    for (size_t s = 0; s < n; ++s) p.states[s] = state_view(outs[begin + s], lses[begin + s]);
    p.in_dtype = float_type(outs[begin].scalar_type(), "outs");
    p.out = out.data_ptr();
    p.out_lse = out_lse.data_ptr<float>();
    p.out_dtype = float_type(out.scalar_type(), "out");
    p.out_stride_token = out.stride(0);
    p.out_stride_head = out.stride(1);
    p.out_lse_stride_head = out_lse.stride(0);
    p.rows = rows;
    p.target = target;
    p.num_tokens = outs[begin].size(0);
    p.num_heads = outs[begin].size(1);
    p.head_dim = outs[begin].size(2);
    const Status status = kernels::launch_merge_attn_states(p, stream.stream());
    TORCH_CHECK(status.is_ok(), status.message());
    begin += n;
    target = kernels::MergeTarget::kAccumulate;  // later launches merge into what the first wrote
  }
}

void check_states(const at::TensorList& outs, const at::TensorList& lses) {
  TORCH_CHECK_VALUE(!outs.empty() && outs.size() == lses.size(), kWhat, ": need as many outs as lses, at least one; got ",
                    outs.size(), " outs and ", lses.size(), " lses");
  for (size_t s = 0; s < outs.size(); ++s) {
    check_out(outs[s], outs[0], "outs[" + std::to_string(s) + "]");
    TORCH_CHECK_TYPE(outs[s].scalar_type() == outs[0].scalar_type(), kWhat, ": outs[", s, "] has dtype ",
                     outs[s].scalar_type(), " but outs[0] ", outs[0].scalar_type(), "; every partial has one dtype");
    check_lse(lses[s], outs[0], "lses[" + std::to_string(s) + "]");
  }
  float_type(outs[0].scalar_type(), "outs[0]");
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cuda(at::TensorList outs, at::TensorList lses,
                                                               std::optional<at::ScalarType> out_dtype) {
  check_states(outs, lses);
  const at::Tensor& o0 = outs[0];
  c10::cuda::CUDAGuard guard(o0.device());
  const at::ScalarType dtype = out_dtype.value_or(o0.scalar_type());
  float_type(dtype, "out_dtype");
  at::Tensor out = at::empty(o0.sizes(), o0.options().dtype(dtype));
  at::Tensor lse = at::empty({o0.size(1), o0.size(0)}, o0.options().dtype(at::kFloat));
  if (outs.size() <= static_cast<size_t>(kernels::kMaxMergeStates) || dtype == at::kFloat) {
    launch(out, lse, outs, lses, 0, outs.size(), kernels::MergeTarget::kOverwrite, nullptr);
    return {out, lse};
  }
  // More partials than one launch takes: accumulate in fp32, round once.
  at::Tensor acc = at::empty(o0.sizes(), o0.options().dtype(at::kFloat));
  launch(acc, lse, outs, lses, 0, outs.size(), kernels::MergeTarget::kOverwrite, nullptr);
  out.copy_(acc);
  return {out, lse};
}

void merge_attention_states_inplace_cuda(const at::Tensor& out, const at::Tensor& lse, at::TensorList outs, at::TensorList lses,
                                         const std::optional<at::Tensor>& rows) {
  check_states(outs, lses);
  TORCH_CHECK_VALUE(out.dim() == 3 && out.size(1) == outs[0].size(1) && out.size(2) == outs[0].size(2), kWhat,
                    "_: out has shape ", out.sizes(), "; expected [rows, ", outs[0].size(1), ", ", outs[0].size(2), "]");
  TORCH_CHECK_TYPE(out.device() == outs[0].device(), kWhat, "_: out is on ", out.device(), ", expected ",
                   outs[0].device());
  TORCH_CHECK_VALUE(out.size(2) <= 1 || out.stride(2) == 1, kWhat, "_: out must have a contiguous last dimension");
  check_lse(lse, out, "lse");
  float_type(out.scalar_type(), "out");
  const int64_t* row_ptr = nullptr;
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK_TYPE(rows->scalar_type() == at::kLong && rows->device() == out.device(), kWhat,
                     "_: rows must be an int64 tensor on ", out.device(), ", got ", rows->scalar_type(), " on ",
                     rows->device());
    TORCH_CHECK_VALUE(rows->dim() == 1 && rows->size(0) == outs[0].size(0) && rows->is_contiguous(), kWhat,
                      "_: rows must be a contiguous [tokens] = [", outs[0].size(0), "] index, got ", rows->sizes());
    row_ptr = rows->data_ptr<int64_t>();
  } else {
    TORCH_CHECK_VALUE(out.size(0) == outs[0].size(0), kWhat, "_: out has ", out.size(0), " rows but the partials ",
                      outs[0].size(0), " tokens; pass rows to merge into a subset");
  }
  c10::cuda::CUDAGuard guard(out.device());
  launch(out, lse, outs, lses, 0, outs.size(), kernels::MergeTarget::kAccumulate, row_ptr);
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_meta(at::TensorList outs, at::TensorList lses,
                                                               std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK_VALUE(!outs.empty(), kWhat, ": need at least one partial");
  const at::Tensor& o0 = outs[0];
  return {at::empty(o0.sizes(), o0.options().dtype(out_dtype.value_or(o0.scalar_type()))),
          at::empty({o0.size(1), o0.size(0)}, o0.options().dtype(at::kFloat))};
}

void merge_attention_states_inplace_meta(const at::Tensor&, const at::Tensor&, at::TensorList, at::TensorList,
                                         const std::optional<at::Tensor>&) {}

}  // namespace
}  // namespace commlib::torch_layer

using namespace commlib::torch_layer;  // NOLINT: the op table below names this file's functions

TORCH_LIBRARY_FRAGMENT(commlib, m) {
  const at::Tag pt2 = at::Tag::pt2_compliant_tag;
  m.def("merge_attention_states(Tensor[] outs, Tensor[] lses, ScalarType? out_dtype=None) -> (Tensor, Tensor)", {pt2});
  m.def("merge_attention_states_(Tensor(a!) out, Tensor(b!) lse, Tensor[] outs, Tensor[] lses, Tensor? rows=None) "
        "-> ()",
        {pt2});
}

TORCH_LIBRARY_IMPL(commlib, CUDA, m) {
  m.impl("merge_attention_states", &merge_attention_states_cuda);
  m.impl("merge_attention_states_", &merge_attention_states_inplace_cuda);
}

TORCH_LIBRARY_IMPL(commlib, Meta, m) {
  m.impl("merge_attention_states", &merge_attention_states_meta);
  m.impl("merge_attention_states_", &merge_attention_states_inplace_meta);
}
