// Merge of partial attention states (commlib.cp.merge_attention_states on CUDA; ring attention's
// merge of each block's result into its running accumulator).
//
// Note [merge of attention states]
// Partial s of a query row saw key set K_s: O_s = sum_{k in K_s} e^{x_k - LSE_s} v_k, LSE_s = log
// sum_{k in K_s} e^{x_k}. Over the union, LSE = m + log sum_s e^{LSE_s - m} and O = sum_s w_s O_s
// with w_s = e^{LSE_s - m} / sum_r e^{LSE_r - m}, for any m; m = max_s LSE_s keeps every exponent
// <= 0 (no overflow for any LSE magnitude, the largest term is exactly 1). A partial that saw no key
// has LSE -inf and weight 0 and its O is not read (it may hold anything); when every partial is
// empty, O = 0 and LSE = -inf, as on the CPU (commlib/cp/merge.py, _merge2). Arithmetic is fp32 (expf,
// logf, IEEE division; the build has no fast-math); the result is rounded to its dtype once. A NaN
// LSE in any state makes the row's O and LSE NaN (a poisoned input is never merged away).
//
// Work split: a row (token, head) of head_dim elements is handled by `lanes` threads of one warp
// (a power of two <= 32), each holding kPack consecutive elements per step. Rows are taken in
// memory order of O (token-major: the heads of one token, then the next token), so a block streams
// contiguous O bytes; the LSE loads ([heads, tokens]) are then strided, but they are 1/64 of the
// bytes at head_dim 128 (bf16) and their sectors are shared through L2 by the blocks of the
// neighbouring tokens. Every load of a row step (each state's LSE and O pack, the accumulator's) is
// issued before any arithmetic that uses one, so a step waits for memory once, not once per state
// (an empty partial's O is loaded but never used: it is multiplied by nothing). The packs are
// plain loads kept as raw words (RawPack) and converted where the arithmetic reads them: with
// volatile vector loads converted on the spot, the compiled code (cuobjdump -sass, sm_90a) waited
// for state 0's O before it issued state 1's LSE and O loads, two memory round trips per row step
// (the kernel measured at 0.61 of torch.add's bandwidth in bench/results/cp.md). Raw words rather
// than Vec<T> (Note [raw packs]), and the row's (token, head) by a FastDiv instead of a called
// 64-bit division (which stays for 2^31 rows and more): 43 registers instead of 54 for two bf16
// states, 48 instead of 64 accumulating (ptxas -v, sm_90a), so five blocks of kThreads fit an SM
// instead of four. On one H200 the earlier order (consecutive tokens of one head per warp, one
// state's O loaded after the other) reached 0.53 of torch.add's bandwidth over the same bytes
// (bench/results/cp.md). kCap bounds the states held in registers: 2 when a launch has at most
// two (a ring step's accumulate, a merge of two), kMaxMergeStates otherwise. In kAccumulate the
// accumulator's LSE is read by every lane of the row and rewritten by lane 0 after a __syncwarp;
// the loop over rows is warp-uniform so the __syncwarp is reached by every lane.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "commlib/device/dispatch.cuh"
#include "commlib/device/fast_div.cuh"
#include "commlib/device/vec.cuh"
#include "kernels/launch.cuh"
#include "kernels/merge_attn_states_params.hpp"

namespace commlib::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;
constexpr int kVectorPack = 8;  // elements per thread and step on the 16-byte path

// kPack elements of T as loaded (whole 16-byte vectors, or one element), kept as raw words and
// converted to fp32 only where the arithmetic uses them (Note [raw packs] in
// include/commlib/device/vec.cuh), with plain loads the compiler may issue together (Note [merge of
// attention states], loads first).
template <typename T, int kPack>
struct RawPack {
  static constexpr int kWords = kPack * static_cast<int>(sizeof(T)) / 4;
  static_assert(kWords % 4 == 0, "a pack is whole 16-byte vectors");
  uint4 raw[kWords / 4];
  __device__ __forceinline__ void load(const T* src) {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) raw[i] = reinterpret_cast<const uint4*>(src)[i];
  }
  __device__ __forceinline__ float at(int i) const {
    if constexpr (sizeof(T) == 4) {
      const uint4& q = raw[i / 4];
      const int w = i % 4;
      return __uint_as_float(w == 0 ? q.x : w == 1 ? q.y : w == 2 ? q.z : q.w);
    } else {
      return device::raw_elem<T>(raw[i / 8], i % 8);
    }
  }
};

template <typename T>
struct RawPack<T, 1> {
  T x;
  __device__ __forceinline__ void load(const T* src) { x = *src; }
  __device__ __forceinline__ float at(int) const { return device::to_float<T>(x); }
};

template <typename T, int kPack>
__device__ __forceinline__ void store_pack(T* dst, const float (&x)[kPack]) {
  if constexpr (kPack == 1) {
    *dst = device::from_float<T>(x[0]);
  } else {
    constexpr int kPerVec = 16 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int i = 0; i < kPack / kPerVec; ++i) {
      device::Vec<T> v;
#pragma unroll
      for (int j = 0; j < kPerVec; ++j) v.elems[j] = device::from_float<T>(x[i * kPerVec + j]);
      v.store(dst + i * kPerVec);
    }
  }
}

template <typename TIn, typename TOut, int kPack, MergeTarget kTarget, int kCap>
__global__ void __launch_bounds__(kThreads) merge_attn_states_kernel(MergeAttnStatesParams p, int lanes,
                                                                       device::FastDiv heads) {
  const int64_t num_rows = p.num_tokens * p.num_heads;
  const bool narrow = num_rows < (int64_t{1} << 31);  // FastDiv's range (the launcher's `heads`)
  const int rows_per_warp = 32 / lanes;
  const int lane = threadIdx.x % 32;
  const int row_in_warp = lane / lanes;
  const int lane_in_row = lane % lanes;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int num_states = p.num_states;
  const int64_t step = static_cast<int64_t>(lanes) * kPack;
  constexpr bool kAcc = kTarget == MergeTarget::kAccumulate;

  for (int64_t base = warp * rows_per_warp; base < num_rows; base += num_warps * rows_per_warp) {
    const int64_t row = base + row_in_warp;
    const bool active = row < num_rows;
    // Token-major rows: O's memory order.
    const int64_t token = !active ? 0 : narrow ? heads.div(static_cast<uint32_t>(row)) : row / p.num_heads;
    const int64_t head = active ? row - token * p.num_heads : 0;
    const int64_t out_row = (kAcc && p.rows != nullptr && active) ? p.rows[token] : token;
    TOut* out_ptr = static_cast<TOut*>(p.out) + out_row * p.out_stride_token + head * p.out_stride_head;
    const int64_t d0 = static_cast<int64_t>(lane_in_row) * kPack;
    const bool has = active && d0 < p.head_dim;

    // Every load of the row's first step, before any arithmetic.
    float lse[kCap];
    RawPack<TIn, kPack> x[kCap];
    RawPack<TOut, kPack> acc;
    float acc_lse = -INFINITY;
#pragma unroll
    for (int s = 0; s < kCap; ++s) {
      lse[s] = (active && s < num_states) ? p.states[s].lse[head * p.states[s].lse_stride_head + token] : -INFINITY;
      if (has && s < num_states) {
        x[s].load(static_cast<const TIn*>(p.states[s].out) + token * p.states[s].out_stride_token +
                  head * p.states[s].out_stride_head + d0);
      }
    }
    if constexpr (kAcc) {
      if (active) acc_lse = p.out_lse[head * p.out_lse_stride_head + out_row];
      if (has) acc.load(out_ptr + d0);
    }

    // Weights (Note [merge of attention states]); m == -inf: every partial is empty.
    float m = acc_lse;
    bool poisoned = isnan(acc_lse);  // a NaN LSE (e.g. a ring slot the watchdog filled) makes the row NaN
#pragma unroll
    for (int s = 0; s < kCap; ++s) {
      m = fmaxf(m, lse[s]);
      poisoned = poisoned || isnan(lse[s]);
    }
    if (poisoned) m = NAN;
    const bool empty = m == -INFINITY;
    float sum = 0.f;
    float w[kCap];
#pragma unroll
    for (int s = 0; s < kCap; ++s) {
      w[s] = (s < num_states && !empty) ? expf(lse[s] - m) : 0.f;
      sum += w[s];
    }
    float w_acc = 0.f;
    if constexpr (kAcc) {
      w_acc = empty ? 0.f : expf(acc_lse - m);
      sum += w_acc;
    }
    const float inv = empty ? 0.f : __frcp_rn(sum);
#pragma unroll
    for (int s = 0; s < kCap; ++s) w[s] *= inv;
    w_acc *= inv;

    for (int64_t d = d0; has && d < p.head_dim; d += step) {
      if (d != d0) {  // head_dim > lanes * kPack: the later steps load here
#pragma unroll
        for (int s = 0; s < kCap; ++s) {
          if (s < num_states) {
            x[s].load(static_cast<const TIn*>(p.states[s].out) + token * p.states[s].out_stride_token +
                      head * p.states[s].out_stride_head + d);
          }
        }
        if constexpr (kAcc) acc.load(out_ptr + d);
      }
      float r[kPack];
#pragma unroll
      for (int i = 0; i < kPack; ++i) r[i] = (kAcc && w_acc != 0.f) ? acc.at(i) * w_acc : 0.f;
#pragma unroll
      for (int s = 0; s < kCap; ++s) {
        if (s < num_states && w[s] != 0.f) {  // an empty partial's O is never used
#pragma unroll
          for (int i = 0; i < kPack; ++i) r[i] = fmaf(w[s], x[s].at(i), r[i]);
        }
      }
      store_pack<TOut, kPack>(out_ptr + d, r);
    }
    // Every lane of the row has read the accumulator's LSE before lane 0 rewrites it.
    if constexpr (kAcc) __syncwarp();
    if (active && lane_in_row == 0) {
      p.out_lse[head * p.out_lse_stride_head + out_row] = empty ? -INFINITY : m + logf(sum);
    }
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

bool vector_path_ok(const MergeAttnStatesParams& p) {
  if (p.head_dim % kVectorPack != 0) return false;
  const int64_t in_size = static_cast<int64_t>(dtype_size(p.in_dtype));
  const int64_t out_size = static_cast<int64_t>(dtype_size(p.out_dtype));
  bool ok = aligned16(p.out) && (p.out_stride_token * out_size) % 16 == 0 && (p.out_stride_head * out_size) % 16 == 0;
  for (int s = 0; s < p.num_states; ++s) {
    const MergeStateView& v = p.states[s];
    ok = ok && aligned16(v.out) && (v.out_stride_token * in_size) % 16 == 0 && (v.out_stride_head * in_size) % 16 == 0;
  }
  return ok;
}

int lanes_per_row(int64_t chunks) {
  int lanes = 1;
  while (lanes < 32 && lanes < chunks) lanes *= 2;
  return lanes;
}

template <typename TIn, typename TOut, int kPack>
Status launch_typed(const MergeAttnStatesParams& p, Stream stream) {
  const int lanes = lanes_per_row((p.head_dim + kPack - 1) / kPack);
  const int64_t rows_per_block = kThreads / lanes;
  const int64_t num_rows = p.num_tokens * p.num_heads;
  LaunchShape shape;
  shape.grid = dim3(static_cast<unsigned>(std::min<int64_t>((num_rows + rows_per_block - 1) / rows_per_block, kMaxBlocks)));
  shape.block = dim3(kThreads);
  const bool accumulate = p.target == MergeTarget::kAccumulate;
  // A row index over the head count: a multiply and a shift below 2^31 rows, a 64-bit division above.
  const device::FastDiv heads(num_rows < (int64_t{1} << 31) ? static_cast<uint32_t>(p.num_heads) : 1u);
  if (p.num_states <= 2) {
    auto kernel = accumulate ? merge_attn_states_kernel<TIn, TOut, kPack, MergeTarget::kAccumulate, 2>
                             : merge_attn_states_kernel<TIn, TOut, kPack, MergeTarget::kOverwrite, 2>;
    return launch_kernel("merge_attention_states", kernel, shape, stream, LaunchOrder::kStream, p, lanes, heads);
  }
  auto kernel = accumulate ? merge_attn_states_kernel<TIn, TOut, kPack, MergeTarget::kAccumulate, kMaxMergeStates>
                           : merge_attn_states_kernel<TIn, TOut, kPack, MergeTarget::kOverwrite, kMaxMergeStates>;
  return launch_kernel("merge_attention_states", kernel, shape, stream, LaunchOrder::kStream, p, lanes, heads);
}

template <typename TIn>
Status launch_for_input(const MergeAttnStatesParams& p, Stream stream, bool vector) {
  Status status;
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.out_dtype, TOut, "merge_attention_states", [&] {
    status = vector ? launch_typed<TIn, TOut, kVectorPack>(p, stream) : launch_typed<TIn, TOut, 1>(p, stream);
  });
  return status;
}

}  // namespace

Status launch_merge_attn_states(const MergeAttnStatesParams& p, Stream stream) {
  const char* what = "merge_attention_states";
  if (p.num_states < 1 || p.num_states > kMaxMergeStates) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": ", p.num_states, " states per launch not supported; supported: 1 to ",
                                                               kMaxMergeStates));
  }
  if (p.num_tokens < 0 || p.num_heads < 0 || p.head_dim < 1) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": bad shape [", p.num_tokens, ", ", p.num_heads, ", ",
                                                               p.head_dim, "]"));
  }
  if (p.num_tokens == 0 || p.num_heads == 0) return Status::ok();
  const bool vector = vector_path_ok(p);
  Status status;
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.in_dtype, TIn, what, [&] { status = launch_for_input<TIn>(p, stream, vector); });
  return status;
}

}  // namespace commlib::kernels
