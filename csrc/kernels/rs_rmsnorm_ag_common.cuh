// Device pieces shared by the fused RS -> RMSNorm -> AG kernels (p2p and multimem): the chunk
// geometry, and the row arithmetic of Note [fused rmsnorm arithmetic] (include/commlib/fused_rmsnorm.hpp)
// with explicit _rn intrinsics, so nvcc cannot contract a multiply and an add into an FMA.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "commlib/device/vec.cuh"
#include "kernels/launch.cuh"
#include "kernels/rs_rmsnorm_ag_params.hpp"

namespace commlib::kernels {
namespace fused_detail {

constexpr int kMaxThreads = 512;
constexpr int kGroup = static_cast<int>(kFusedHiddenAlign);  // elements per 16-byte pack

template <typename T>
using Pack = device::Vec<T, kGroup>;
static_assert(kGroup == 8, "the fused kernels move 16-byte packs of 16-bit elements");

// Chunk geometry shared by the kernel's phases.
struct FusedChunk {
  int64_t offset;      // first row (within each rank's slice) of this call
  int64_t capacity;    // rows per owner in a workspace region
  size_t half_bytes;   // bytes of one workspace half (16-byte multiple)
};

using device::raw_elem;  // Note [raw packs] (include/commlib/device/vec.cuh)

// round_dtype(v[e]) packed two elements per 32-bit word (round to nearest even, as from_float).
template <typename T>
__device__ __forceinline__ uint4 raw_pack(const float (&v)[kGroup]) {
  uint32_t words[kGroup / 2];
#pragma unroll
  for (int e = 0; e < kGroup / 2; ++e) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const __nv_bfloat162 two = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
      words[e] = *reinterpret_cast<const uint32_t*>(&two);
    } else {
      const __half2 two = __floats2half2_rn(v[2 * e], v[2 * e + 1]);
      words[e] = *reinterpret_cast<const uint32_t*>(&two);
    }
  }
  return uint4{words[0], words[1], words[2], words[3]};
}

// round_dtype(v) as float.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return device::to_float<T>(device::from_float<T>(v));
}

// The new residual of one pack (Note [fused rmsnorm arithmetic]): s = round(sum over sources in
// rank order), r = round(residual + s); rf receives r as float. acc holds the fp32 rank-order sum.
template <typename T>
__device__ __forceinline__ uint4 new_residual(const uint4& old, const float (&acc)[kGroup], float (&rf)[kGroup]) {
#pragma unroll
  for (int e = 0; e < kGroup; ++e) rf[e] = __fadd_rn(raw_elem<T>(old, e), round_to<T>(acc[e]));
  const uint4 r = raw_pack<T>(rf);
#pragma unroll
  for (int e = 0; e < kGroup; ++e) rf[e] = raw_elem<T>(r, e);
  return r;
}

// out = round((r * rstd) * w) for one pack.
template <typename T>
__device__ __forceinline__ uint4 normalised(const uint4& r, float rstd, const uint4& w) {
  float y[kGroup];
#pragma unroll
  for (int e = 0; e < kGroup; ++e) y[e] = __fmul_rn(__fmul_rn(raw_elem<T>(r, e), rstd), raw_elem<T>(w, e));
  return raw_pack<T>(y);
}

// rstd = 1 / sqrt(sumsq / hidden + eps).
__device__ __forceinline__ float row_rstd(float sumsq, int64_t hidden, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sumsq, static_cast<float>(hidden)), eps)));
}

// q_k of Note [fused rmsnorm arithmetic]: the squares of one pack, summed left to right.
__device__ __forceinline__ float sum_squares(const float (&r)[kGroup]) {
  float acc = __fmul_rn(r[0], r[0]);
#pragma unroll
  for (int e = 1; e < kGroup; ++e) acc = __fadd_rn(acc, __fmul_rn(r[e], r[e]));
  return acc;
}

// The pairwise tree of Note [fused rmsnorm arithmetic] over q_{t + j * blockDim} (thread t holds
// j < kVecsPerThread): in registers for halves >= blockDim, then shared memory, then shuffles.
// blockDim.x is a power of two >= 32. Returns the row's sum of squares on every thread.
template <int kVecsPerThread>
__device__ __forceinline__ float block_sum_squares(float (&q)[kVecsPerThread], float* scratch) {
#pragma unroll
  for (int h = kVecsPerThread / 2; h >= 1; h /= 2) {
#pragma unroll
    for (int j = 0; j < h; ++j) q[j] = __fadd_rn(q[j], q[j + h]);
  }
  float s = q[0];
  const int t = static_cast<int>(threadIdx.x);
  if (blockDim.x > 32) {
    scratch[t] = s;
    __syncthreads();
    for (int half = static_cast<int>(blockDim.x) / 2; half >= 32; half /= 2) {
      if (t < half) {
        s = __fadd_rn(s, scratch[t + half]);
        scratch[t] = s;
      }
      __syncthreads();
    }
  }
  if (t < 32) {
#pragma unroll
    for (int half = 16; half >= 1; half /= 2) s = __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, half));
    if (t == 0) scratch[kMaxThreads] = s;
  }
  __syncthreads();
  const float total = scratch[kMaxThreads];
  __syncthreads();  // scratch is reused by the next row
  return total;
}

// The same tree for a row held by a group of `group` threads (a power of two, 32..blockDim.x,
// groups aligned in the block; thread `lane` of the group holds q of packs lane + j * group):
// registers, then shared memory for halves >= 32, then a butterfly in the group's first warp
// (xor pairs: lane l and l ^ half add the same two values, so every lane ends with the bits of
// the tree's q_0). Every thread of the block must call it (it synchronises the block), each group
// passing its own slot of `totals`. scratch: blockDim.x floats.
template <int kVecs>
__device__ __forceinline__ float group_sum_squares(float (&q)[kVecs], float* scratch, float* totals, int group) {
#pragma unroll
  for (int h = kVecs / 2; h >= 1; h /= 2) {
#pragma unroll
    for (int j = 0; j < h; ++j) q[j] = __fadd_rn(q[j], q[j + h]);
  }
  float s = q[0];
  const int t = static_cast<int>(threadIdx.x);
  const int lane = t & (group - 1);
  if (group > 32) {
    scratch[t] = s;
    __syncthreads();
    for (int half = group / 2; half >= 32; half /= 2) {
      // Lanes < half read lanes >= half, which do not write in this step.
      if (lane < half) {
        s = __fadd_rn(s, scratch[t + half]);
        scratch[t] = s;
      }
      __syncthreads();
    }
  }
  if (lane < 32) {
#pragma unroll
    for (int half = 16; half >= 1; half /= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, half));
  }
  if (group == 32) return s;
  if (lane == 0) totals[t / group] = s;
  __syncthreads();
  const float total = totals[t / group];
  __syncthreads();  // scratch and totals are reused by the next row
  return total;
}

// Slot of rank `s` in the per-peer regions of rank `owner`'s buffers (s != owner): 0..world-2.
__host__ __device__ __forceinline__ int peer_slot(int s, int owner, int world) {
  return (s - owner - 1 + world) % world;
}

// The row of `residual` that holds token `token` (Note [residual modes]: the slice layout starts at
// this rank's first token).
template <typename T>
__device__ __forceinline__ T* residual_row(const FusedRmsNormArgs& a, int64_t own_begin, int64_t token) {
  const int64_t row = a.residual_layout == ResidualLayout::kSlice ? token - own_begin : token;
  return static_cast<T*>(a.residual) + row * a.hidden;
}

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

inline int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Threads per block for `hidden`: a power of two in [32, 512] (the tree of Note [fused rmsnorm
// arithmetic] is the same for any), and packs per thread (1, 2 or 4).
inline int fused_threads(int64_t hidden) {
  return static_cast<int>(std::clamp<int64_t>(next_pow2(hidden / kGroup), 32, kMaxThreads));
}
inline int64_t fused_packs_per_thread(int64_t hidden) {
  return std::max<int64_t>(1, next_pow2(hidden / kGroup) / fused_threads(hidden));
}

// Rows [first, first + count) of owner d's slice handled by the call at chunk.offset.
__host__ __device__ __forceinline__ TokenSlice chunk_rows(const FusedRmsNormArgs& a, const FusedChunk& chunk,
                                                          int world, int d) {
  const TokenSlice s = token_slice(a.num_tokens, world, d);
  const int64_t first = s.begin + chunk.offset;
  const int64_t count = s.end - first;
  return TokenSlice{first, first + (count < 0 ? 0 : (count < chunk.capacity ? count : chunk.capacity))};
}

// Checks shared by the p2p launchers (LL and barrier): dtype, hidden, world/rank, alignment.
Status check_p2p_args(const char* what, const FusedRmsNormArgs& a, const BarrierDevice& barrier);

}  // namespace fused_detail
}  // namespace commlib::kernels
