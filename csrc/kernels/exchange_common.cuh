// Pieces shared by the push-exchange kernels (Note [push exchange], exchange_params.hpp): the grid
// they agree on, byte-exact pack copies between user tensors and workspace slots, the staggered
// peer order.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "commlib/device/vec.cuh"
#include "kernels/all_reduce_common.cuh"
#include "kernels/exchange_params.hpp"
#include "kernels/launch.cuh"

namespace commlib::kernels {

using BytePack = device::Vec<uint8_t>;

// Threads per CTA; at least 2 CTAs fit an SM, so the grids of two ranks that share one GPU (tests) are
// resident together (every CTA spins on its peers' flags: all must be placed).
constexpr int kExchangeThreads = 256;
constexpr int kExchangeMinBlocksPerSm = 2;
// Default grid cap, the same on every rank (not the SM count: block b must meet block b).
constexpr int kExchangeMaxBlocks = 128;
// Fewer packs of a slot per CTA than this and a CTA's barrier costs more than its data.
constexpr size_t kExchangeMinPacksPerBlock = 64;
// Packs in flight per thread in a copy (all loads before the first store).
constexpr int kExchangeUnroll = 4;

// Grid of one call: CTA b owns packs [b * per_block, (b + 1) * per_block) of every slot.
struct ExchangeGeometry {
  size_t per_block = 0;
  int blocks = 1;
  int threads = 32;
};

inline ExchangeGeometry exchange_geometry(size_t slot_packs, int max_blocks_param) {
  const size_t cap = static_cast<size_t>(
      std::clamp(max_blocks_param > 0 ? max_blocks_param : kExchangeMaxBlocks, 1, kMaxBarrierBlocks));
  ExchangeGeometry g;
  const size_t blocks = std::clamp<size_t>((slot_packs + kExchangeMinPacksPerBlock - 1) / kExchangeMinPacksPerBlock,
                                           1, cap);
  g.per_block = (slot_packs + blocks - 1) / blocks;
  g.blocks = static_cast<int>(std::max<size_t>(1, (slot_packs + g.per_block - 1) / std::max<size_t>(1, g.per_block)));
  g.threads = static_cast<int>(std::clamp<size_t>((g.per_block + 31) / 32 * 32, 32, kExchangeThreads));
  return g;
}

__device__ __forceinline__ int exchange_peer_after(int rank, int i, int world) {
  return rank + i < world ? rank + i : rank + i - world;  // staggered: the ranks start on different peers
}

// The packs [begin, end) this block owns, each thread kExchangeUnroll at a time: every load of a
// round is issued before its first store.
template <typename P, typename Load, typename Store>
__device__ __forceinline__ void exchange_copy(size_t begin, size_t end, Load load, Store store) {
  const size_t stride = blockDim.x;
  for (size_t base = begin + threadIdx.x; base < end; base += kExchangeUnroll * stride) {
    P xs[kExchangeUnroll];
#pragma unroll
    for (int u = 0; u < kExchangeUnroll; ++u) {
      if (base + u * stride < end) xs[u] = load(base + u * stride);
    }
#pragma unroll
    for (int u = 0; u < kExchangeUnroll; ++u) {
      if (base + u * stride < end) store(base + u * stride, xs[u]);
    }
  }
}

// Pack v of a user byte range of `n` bytes: whole 16 bytes when aligned and complete, else byte by
// byte (the rest of the pack zero).
__device__ __forceinline__ BytePack load_bytes(const uint8_t* base, size_t v, size_t n, bool aligned) {
  return load_pack(base, v, n, aligned);
}

__device__ __forceinline__ void store_bytes(uint8_t* base, size_t v, size_t n, bool aligned, const BytePack& x) {
  store_pack(base, v, n, aligned, x);
}

// Which part of the block's range [begin, end) of a slot of `num_packs` packs.
__device__ __forceinline__ void block_range(size_t num_packs, size_t per_block, size_t* begin, size_t* end) {
  *begin = min(per_block * blockIdx.x, num_packs);
  *end = min(*begin + per_block, num_packs);
}

__host__ __device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace commlib::kernels
