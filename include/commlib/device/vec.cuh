// Vec<T, N>: the one pack type for wide memory access (docs/architecture.md, Conventions).
//
// A Vec holds N elements of T in 16 bytes (N = 16 / sizeof(T)): load/store move it with one
// 16-byte instruction (addresses must be 16-byte aligned); load_partial/store_partial move the
// first `n` elements one by one (tails and unaligned tensors). Arithmetic is done in fp32 through
// to_float/from_float (round to nearest even), the accumulation type of every reduction
// (Note [reduction order] in csrc/host/reduce.hpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "commlib/device/ptx.cuh"

namespace commlib::device {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, int N = 16 / static_cast<int>(sizeof(T))>
struct alignas(16) Vec {
  static_assert(sizeof(T) * N == 16, "Vec is a 16-byte pack");
  static constexpr int kNumElems = N;
  T elems[N];

  __device__ __forceinline__ static Vec load(const void* addr) {
    Vec v;
    *reinterpret_cast<uint4*>(&v) = ld_v4_u32(addr);
    return v;
  }
  // Coherent load that bypasses nothing special: used for peer memory written before a barrier.
  __device__ __forceinline__ static Vec load_partial(const T* addr, int n) {
    Vec v;
#pragma unroll
    for (int i = 0; i < N; ++i) v.elems[i] = i < n ? addr[i] : T{};
    return v;
  }
  __device__ __forceinline__ void store(void* addr) const { st_v4_u32(addr, *reinterpret_cast<const uint4*>(this)); }
  __device__ __forceinline__ void store_partial(T* addr, int n) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (i < n) addr[i] = elems[i];
    }
  }
};

// Note [raw packs]
// Kernels that hold packs across loads, waits and a reduction (the fused row kernels, the
// attention-state merge) keep them as raw uint4 (two 16-bit elements per register) and convert
// elements on use: a Vec<T, 8> is split by the compiler into eight 16-bit registers where it is
// assigned, which doubles the register count (the fused kernels spilled) and, right after a load,
// makes the warp wait for that load before it issues the next (Note [loads before use] in
// csrc/kernels/all_reduce_common.cuh).

// Element e of a raw pack of T as float (exact: both formats widen to fp32 without rounding).
template <typename T>
__device__ __forceinline__ float raw_elem(const uint4& raw, int e) {
  const uint32_t word = e < 4 ? (e < 2 ? raw.x : raw.y) : (e < 6 ? raw.z : raw.w);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float((e & 1) ? (word & 0xffff0000u) : (word << 16));
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>((e & 1) ? (word >> 16) : (word & 0xffffu))));
  }
}

// fp32 accumulator of one Vec's worth of elements.
template <int N>
struct Acc {
  float v[N];
};

template <typename T, int N>
__device__ __forceinline__ Acc<N> acc_init(const Vec<T, N>& x) {
  Acc<N> a;
#pragma unroll
  for (int i = 0; i < N; ++i) a.v[i] = to_float<T>(x.elems[i]);
  return a;
}

// a += x, element-wise in fp32 (one add per element: no contraction is possible).
template <typename T, int N>
__device__ __forceinline__ void acc_add(Acc<N>& a, const Vec<T, N>& x) {
#pragma unroll
  for (int i = 0; i < N; ++i) a.v[i] = a.v[i] + to_float<T>(x.elems[i]);
}

// a /= divisor with IEEE division (the build never uses fast-math).
template <int N>
__device__ __forceinline__ void acc_div(Acc<N>& a, float divisor) {
#pragma unroll
  for (int i = 0; i < N; ++i) a.v[i] = __fdiv_rn(a.v[i], divisor);
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> acc_cast(const Acc<N>& a) {
  Vec<T, N> x;
#pragma unroll
  for (int i = 0; i < N; ++i) x.elems[i] = from_float<T>(a.v[i]);
  return x;
}

}  // namespace commlib::device
