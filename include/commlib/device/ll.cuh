// Flag-carrying 16-byte lines ("LL", Note [LL lines] in csrc/kernels/all_reduce_params.hpp): a
// 16-byte pack travels as two lines {word 0, flag, word 1, flag}, {word 2, flag, word 3, flag}; the
// reader polls the lines themselves, so no release fence or separate flag is needed. flag is never 0
// (the value of a zeroed buffer). Every LL kernel stores and receives through these functions (one
// protocol; a receive is bounded and names rank, peer and phase on timeout).
#pragma once

#include <cstdint>

#include "commlib/device/barrier.cuh"
#include "commlib/device/ptx.cuh"

namespace commlib::device {

// Stores a raw pack as the two LL lines at dst: {word 0, flag, word 1, flag}, {word 2, flag, ...}.
__device__ __forceinline__ void ll_store(uint4* dst, const uint4& raw, uint32_t flag) {
  st_volatile_v4_u32(dst, uint4{raw.x, flag, raw.y, flag});
  st_volatile_v4_u32(dst + 1, uint4{raw.z, flag, raw.w, flag});
}

__device__ __forceinline__ bool ll_ready(const uint4& lo, const uint4& hi, uint32_t flag) {
  return lo.y == flag && lo.w == flag && hi.y == flag && hi.w == flag;
}

// The payload (a raw pack) of the two lines lo, hi.
__device__ __forceinline__ uint4 ll_payload(const uint4& lo, const uint4& hi) { return uint4{lo.x, lo.z, hi.x, hi.z}; }

// Waits until the two lines at src[u] carry `flag`, for every u with src[u] != nullptr, polling
// all of them at once (one round trip when they have all landed, not one per pack), and leaves
// them in lo[u], hi[u] (ll_payload). Entries without a source read as zeros. On timeout it records
// (rank, the peer of a missing entry, phase) in the error word and sets `failed`; so it does when
// the state is poisoned meanwhile (another wait's timeout, or abort()), without a record. A thread
// that has failed does not wait again (its lines are then garbage, never pushed).
template <int kN>
__device__ __forceinline__ void ll_wait_all(const uint4* const (&src)[kN], const int (&peer)[kN], uint4 (&lo)[kN],
                                            uint4 (&hi)[kN], uint32_t flag, const BarrierDevice& bar, int phase,
                                            uint64_t call, int& failed) {
  uint32_t pending = 0;
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    lo[u] = hi[u] = uint4{0u, 0u, 0u, 0u};
    if (src[u] != nullptr && !failed) {
      lo[u] = ld_volatile_v4_u32(src[u]);
      hi[u] = ld_volatile_v4_u32(src[u] + 1);
    }
  }
#pragma unroll
  for (int u = 0; u < kN; ++u) {
    if (src[u] != nullptr && !failed && !ll_ready(lo[u], hi[u], flag)) pending |= 1u << u;
  }
  if (pending == 0) return;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (true) {
#pragma unroll
    for (int u = 0; u < kN; ++u) {
      if ((pending >> u) & 1u) {
        lo[u] = ld_volatile_v4_u32(src[u]);
        hi[u] = ld_volatile_v4_u32(src[u] + 1);
      }
    }
#pragma unroll
    for (int u = 0; u < kN; ++u) {
      if (((pending >> u) & 1u) && ll_ready(lo[u], hi[u], flag)) pending &= ~(1u << u);
    }
    if (pending == 0) return;
    // Another wait of this rank failed, or abort() poisoned the state: give up at once, as
    // wait_flag does (Note [flag barrier]), instead of polling until this wait's own timeout.
    if ((++spins & 63u) == 0u && ld_volatile_u32(&bar.state->poisoned) != 0) {
      failed = 1;
      return;
    }
    const uint64_t elapsed = globaltimer_ns() - start;
    if (elapsed > bar.timeout_ns) {
      int who = -1;
#pragma unroll
      for (int u = 0; u < kN; ++u) {
        if (who < 0 && ((pending >> u) & 1u)) who = peer[u];
      }
      record_timeout(bar, who, phase, elapsed, call);
      failed = 1;
      return;
    }
  }
}

}  // namespace commlib::device
