// Parameters and launcher of the merge of partial attention states (csrc/kernels/merge_attn_states.cu):
// S partial results (O_s [tokens, heads, head_dim], LSE_s [heads, tokens] fp32) of one set of
// queries over disjoint key sets become one (O, LSE), in a single pass with fp32 arithmetic.
// Host-compilable; no torch, no communicator (a local operation on the caller's stream).
#pragma once

#include <cstdint>

#include "commlib/errors.hpp"
#include "commlib/types.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;

constexpr int kMaxMergeStates = 8;

enum class MergeTarget : int {
  kOverwrite = 0,   // (out, out_lse) = merge(states)
  kAccumulate = 1,  // (out, out_lse) = merge((out, out_lse), states), in place
};

// One partial state: element strides of O (head_dim is contiguous) and of LSE (tokens contiguous).
struct MergeStateView {
  const void* out = nullptr;
  const float* lse = nullptr;
  int64_t out_stride_token = 0;
  int64_t out_stride_head = 0;
  int64_t lse_stride_head = 0;
};

struct MergeAttnStatesParams {
  int num_states = 0;  // 1..kMaxMergeStates partials, all of dtype `in_dtype` (the accumulator not counted)
  MergeStateView states[kMaxMergeStates];
  DataType in_dtype = DataType::kFloat32;
  // The result; in kAccumulate also the first state (its O in `out_dtype`, its LSE in out_lse).
  void* out = nullptr;
  float* out_lse = nullptr;
  DataType out_dtype = DataType::kFloat32;
  int64_t out_stride_token = 0;
  int64_t out_stride_head = 0;
  int64_t out_lse_stride_head = 0;
  // kAccumulate only: the result row of partial token t is rows[t] (null: t). Rows must be distinct.
  const int64_t* rows = nullptr;
  MergeTarget target = MergeTarget::kOverwrite;
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t head_dim = 0;
};

// Launches the merge on `stream` (nothing for zero tokens or heads). Returns InvalidArgument for an
// unsupported dtype or state count and CudaError for a failed launch. 16-byte loads and stores when
// head_dim is a multiple of 8 and every pointer and stride is 16-byte aligned; element-wise otherwise
// (any head_dim).
Status launch_merge_attn_states(const MergeAttnStatesParams& params, Stream stream);

}  // namespace commlib::kernels
