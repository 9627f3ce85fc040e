// Pieces shared by the all-reduce kernels: element-exact loads/stores of one Vec at index v of a
// user tensor (full 16-byte access when aligned and complete, element by element otherwise),
// the ordered fp32 reduction of one Vec over the ranks, and argument checks.
#pragma once

#include <cuda_runtime.h>

#include "commlib/device/ll.cuh"
#include "commlib/device/vec.cuh"
#include "kernels/all_reduce_params.hpp"
#include "kernels/launch.cuh"

namespace commlib::kernels {

template <typename T>
using Pack = device::Vec<T>;

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* base, size_t v, size_t count, bool aligned) {
  constexpr int N = Pack<T>::kNumElems;
  const size_t first = v * N;
  const int n = count - first >= static_cast<size_t>(N) ? N : static_cast<int>(count - first);
  if (aligned && n == N) return Pack<T>::load(base + first);
  return Pack<T>::load_partial(base + first, n);
}

template <typename T>
__device__ __forceinline__ void store_pack(T* base, size_t v, size_t count, bool aligned, const Pack<T>& x) {
  constexpr int N = Pack<T>::kNumElems;
  const size_t first = v * N;
  const int n = count - first >= static_cast<size_t>(N) ? N : static_cast<int>(count - first);
  if (aligned && n == N) {
    x.store(base + first);
  } else {
    x.store_partial(base + first, n);
  }
}

// Reduces xs[0..world) (rank r's values in xs[r]) in rank order (Note [reduction order]): the
// one place that fixes the order, so every kernel that loads its own way rounds the same.
template <typename T, int kWorldSize, ReduceOp kOp>
__device__ __forceinline__ Pack<T> reduce_loaded(const Pack<T> (&xs)[kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks],
                                                 int world) {
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  auto acc = device::acc_init(xs[0]);
#pragma unroll
  for (int r = 1; r < kCap; ++r) {
    if (kWorldSize > 0 || r < world) device::acc_add(acc, xs[r]);
  }
  if constexpr (kOp == ReduceOp::kAvg) device::acc_div(acc, static_cast<float>(world));
  return device::acc_cast<T>(acc);
}

// Note [loads before use]
// A Vec of 16-bit elements is unpacked into one register per element where it is assigned (Note
// [raw packs] in include/commlib/device/vec.cuh), and a branch between the whole 16-byte load and the element-wise one (load_pack) makes the compiler do
// that right after the load, before the next rank's load: the compiled code (cuobjdump -sass,
// sm_90a) waited for rank 0's pack before it loaded rank 1's, one memory round trip per rank. So
// where every rank's pack is whole, the packs are loaded as raw words first (plain loads, which the
// compiler may issue together; the barrier before them is a compiler barrier too) and unpacked
// after: one round trip for all ranks. For the same reason the LL kernels poll every peer's lines
// at once (ll_wait_all in include/commlib/device/ll.cuh), not one peer after another. Measured
// only as compiled code so far (sm_90a SASS: the loads of every rank issue back to back).
template <typename T, int kWorldSize>
__device__ __forceinline__ void load_whole_packs(const void* const (&src)[kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks],
                                                 int world, Pack<T> (&xs)[kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks]) {
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  uint4 raw[kCap];
#pragma unroll
  for (int r = 0; r < kCap; ++r) {
    if (kWorldSize > 0 || r < world) raw[r] = *static_cast<const uint4*>(src[r]);
  }
#pragma unroll
  for (int r = 0; r < kCap; ++r) {
    if (kWorldSize > 0 || r < world) xs[r] = *reinterpret_cast<const Pack<T>*>(&raw[r]);
  }
}

// Reduces pack v of srcs[0..world) in rank order. All loads are issued before the first add so the
// peers' latencies overlap (Note [loads before use]).
template <typename T, int kWorldSize, ReduceOp kOp>
__device__ __forceinline__ Pack<T> reduce_pack(const T* const* srcs, int world, size_t v, size_t count,
                                               bool full_width) {
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  constexpr int N = Pack<T>::kNumElems;
  Pack<T> xs[kCap];
  if (full_width && count - v * N >= static_cast<size_t>(N)) {
    const void* src[kCap];
#pragma unroll
    for (int r = 0; r < kCap; ++r) src[r] = (kWorldSize > 0 || r < world) ? srcs[r] + v * N : nullptr;
    load_whole_packs<T, kWorldSize>(src, world, xs);
  } else {
#pragma unroll
    for (int r = 0; r < kCap; ++r) {
      if (kWorldSize > 0 || r < world) xs[r] = load_pack(srcs[r], v, count, full_width);
    }
  }
  return reduce_loaded<T, kWorldSize, kOp>(xs, world);
}

// Polls pack v's two lines of every peer r (slot r of `lines`, slot_bytes apart; not this rank's)
// at once, for an LL reduction (Note [loads before use]); leaves them in lo[r], hi[r]
// (device::ll_payload). On timeout records it and sets `failed`.
template <int kWorldSize>
__device__ __forceinline__ void ll_wait_ranks(const uint8_t* lines, size_t slot_bytes, size_t v, int rank, int world,
                                              uint32_t flag, const BarrierDevice& bar, uint64_t call, int& failed,
                                              uint4 (&lo)[kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks],
                                              uint4 (&hi)[kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks]) {
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  const uint4* src[kCap];
  int peer[kCap];
#pragma unroll
  for (int r = 0; r < kCap; ++r) {
    peer[r] = r;
    src[r] = ((kWorldSize > 0 || r < world) && r != rank) ? reinterpret_cast<const uint4*>(lines + r * slot_bytes) + 2 * v
                                                          : nullptr;
  }
  device::ll_wait_all<kCap>(src, peer, lo, hi, flag, bar, static_cast<int>(Phase::kLLData), call, failed);
}

// The peer's pack of lines lo, hi (ll_wait_ranks) as a Pack<T>.
template <typename T>
__device__ __forceinline__ Pack<T> ll_pack(const uint4& lo, const uint4& hi) {
  const uint4 raw = device::ll_payload(lo, hi);
  return *reinterpret_cast<const Pack<T>*>(&raw);
}

inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline Status check_barrier(const char* what, const BarrierDevice& bar) {
  if (bar.world_size < 1 || bar.world_size > kMaxDeviceRanks || bar.rank < 0 || bar.rank >= bar.world_size) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": world_size ", bar.world_size, " / rank ",
                                                               bar.rank, " invalid; supported world sizes: 1..",
                                                               kMaxDeviceRanks));
  }
  return Status::ok();
}

inline Status check_common(const char* what, DataType dtype, ReduceOp op, const BarrierDevice& bar) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": op ", reduce_op_name(op),
                                                               " not supported on GPU; supported: sum, avg"));
  }
  if (!is_reducible(dtype)) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": dtype ", dtype_name(dtype),
                                                               " not supported; supported: float32, float16, bfloat16"));
  }
  return check_barrier(what, bar);
}

}  // namespace commlib::kernels
