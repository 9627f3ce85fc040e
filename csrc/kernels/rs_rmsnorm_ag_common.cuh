// Device pieces shared by the fused RS -> RMSNorm -> AG kernels (p2p and multimem): the chunk
// geometry, and the row arithmetic of Note [fused rmsnorm arithmetic] (include/commlib/fused_rmsnorm.hpp)
// with explicit _rn intrinsics, so nvcc cannot contract a multiply and an add into an FMA.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "commlib/device/vec.cuh"
#include "kernels/rs_rmsnorm_ag_params.hpp"

namespace commlib::kernels {
namespace fused_detail {

constexpr int kMaxThreads = 512;
constexpr int kGroup = static_cast<int>(kFusedHiddenAlign);  // elements per 16-byte pack

template <typename T>
using Pack = device::Vec<T, kGroup>;

// Chunk geometry shared by the kernel's phases.
struct FusedChunk {
  int64_t offset;      // first row (within each rank's slice) of this call
  int64_t capacity;    // rows per owner in a workspace region
  size_t half_bytes;   // bytes of one workspace half (16-byte multiple)
};

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

}  // namespace fused_detail
}  // namespace commlib::kernels
