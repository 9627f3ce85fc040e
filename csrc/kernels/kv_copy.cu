// The KV-cache block copy: scattered source blocks to scattered destination blocks, layout, TP
// head slice and block size transformed on the way (Note [kv copy geometry] in
// csrc/kernels/kv_copy_params.hpp), per-layer completion flags after the data.
#include <cuda_runtime.h>

#include <algorithm>

#include "commlib/device/fast_div.cuh"
#include "commlib/device/ptx.cuh"
#include "kernels/kv_copy_params.hpp"
#include "kernels/launch.cuh"

namespace commlib::kernels {
namespace {

constexpr int kUnroll = 8;  // accesses in flight per thread: loads of a batch issue before its stores

using device::FastDiv;

template <int kBytes>
struct Pack;
template <>
struct Pack<16> { using T = uint4; };
template <>
struct Pack<8> { using T = uint2; };
template <>
struct Pack<4> { using T = uint32_t; };
template <>
struct Pack<2> { using T = uint16_t; };
template <>
struct Pack<1> { using T = uint8_t; };

struct KvDivisors {
  FastDiv unit;          // vectors of one unit: dst block_size x heads x vecs_per_row
  FastDiv dst_blocks;    // destination blocks of the request
  FastDiv planes;
  FastDiv vecs_per_row;  // row_bytes / vector bytes
  FastDiv inner;         // rows of the inner loop: heads (token-major destination) or block_size (head-major)
  FastDiv src_block;     // source block size
};

template <int kBytes>
__global__ void __launch_bounds__(512) kv_copy_kernel(const KvCopyParams p, const KvDivisors div) {
  using T = typename Pack<kBytes>::T;
  const uint32_t vecs = div.vecs_per_row.divisor;
  const uint32_t unit_vectors = div.unit.divisor;
  const bool head_major = p.dst.head_stride > p.dst.token_stride;  // HND destination: heads outer
  // Each CTA owns a contiguous span of the launch's units, layer after layer, so every thread has
  // kUnroll accesses in flight whatever the block size (small blocks are small units), and the
  // layers of a many-layer request run side by side on different CTAs, not one after the other
  // on all of them.
  const int64_t units = static_cast<int64_t>(p.num_dests) * p.num_planes * p.num_dst_blocks;  // per layer
  for (int li = kv_cta_first_layer(units, p.num_layers, blockIdx.x, gridDim.x); li < p.num_layers; ++li) {
    const KvCtaLayer part = kv_cta_layer(units, p.num_layers, blockIdx.x, gridDim.x, li);
    if (part.first >= part.last) break;
    const int layer = p.layer_begin + li;
    const int64_t first_unit = part.first;
    const uint32_t span = static_cast<uint32_t>((part.last - part.first) * unit_vectors);
    for (uint32_t base = threadIdx.x; base < span; base += blockDim.x * kUnroll) {
      T values[kUnroll];
      char* dst_at[kUnroll];
#pragma unroll
      for (int x = 0; x < kUnroll; ++x) {
        dst_at[x] = nullptr;
        const uint32_t local = base + x * blockDim.x;
        if (local >= span) continue;
        const uint32_t unit_in_span = div.unit.div(local);
        const uint32_t e = local - unit_in_span * unit_vectors;
        const int64_t u = first_unit + unit_in_span;
        const uint32_t dp = div.dst_blocks.div(static_cast<uint32_t>(u));  // (dest, plane) of the unit
        const uint32_t k = static_cast<uint32_t>(u) - dp * div.dst_blocks.divisor;  // destination block
        const uint32_t j = div.planes.div(dp);
        const uint32_t plane = dp - j * div.planes.divisor;
        const uint32_t row = div.vecs_per_row.div(e);
        const uint32_t v = e - row * vecs;
        const uint32_t outer = div.inner.div(row);
        const uint32_t inner = row - outer * div.inner.divisor;
        const uint32_t t = head_major ? inner : outer;
        const uint32_t h = head_major ? outer : inner;
        const uint32_t i = k * static_cast<uint32_t>(p.dst.block_size) + t;  // token of the request
        if (i >= static_cast<uint64_t>(p.num_tokens)) continue;             // past its last token
        const uint32_t sb = div.src_block.div(i);
        const uint32_t st = i - sb * div.src_block.divisor;
        const char* s = reinterpret_cast<const char*>(p.src_planes[layer * p.num_planes + plane]) +
                        static_cast<int64_t>(p.src_blocks[sb]) * p.src.block_stride +
                        static_cast<int64_t>(st) * p.src.token_stride +
                        static_cast<int64_t>(p.src_head0[j] + static_cast<int32_t>(h)) * p.src.head_stride +
                        static_cast<int64_t>(v) * kBytes;
        values[x] = *reinterpret_cast<const T*>(s);
        dst_at[x] = reinterpret_cast<char*>(
                        p.dst_planes[(static_cast<int64_t>(j) * p.num_layers_total + layer) * p.num_planes + plane]) +
                    static_cast<int64_t>(p.dst_blocks[k]) * p.dst.block_stride +
                    static_cast<int64_t>(t) * p.dst.token_stride +
                    static_cast<int64_t>(p.dst_head0[j] + static_cast<int32_t>(h)) * p.dst.head_stride +
                    static_cast<int64_t>(v) * kBytes;
      }
#pragma unroll
      for (int x = 0; x < kUnroll; ++x) {
        if (dst_at[x] != nullptr) *reinterpret_cast<T*>(dst_at[x]) = values[x];
      }
    }
    __syncthreads();  // every thread's stores of this layer issued before thread 0 publishes
    if (threadIdx.x == 0) {
      // Makes this CTA's stores (every thread's, ordered before by the barrier) visible at system
      // scope before its count of the layer's units; the CTA whose count completes the layer
      // fences again, which orders every counted CTA's stores before its flag stores (cumulativity).
      device::fence_acq_rel_sys();
      const uint32_t mine = static_cast<uint32_t>(part.last - part.first);
      const uint32_t done = atomicAdd(p.tile_counters + li, mine) + mine;
      if (done == static_cast<uint32_t>(units)) {
        device::fence_acq_rel_sys();
        for (int d = 0; d < p.num_dests; ++d) device::st_release_sys_u32(p.flags[d] + layer, p.flag_value[d]);
        p.tile_counters[li] = 0u;  // every unit is counted: the next launch finds it zero
      }
    }
  }
}

template <int kBytes>
Status launch_with(const KvCopyParams& p, const KvDivisors& div, Stream stream) {
  LaunchShape shape;
  shape.grid = dim3(static_cast<unsigned>(p.num_ctas));
  shape.block = dim3(static_cast<unsigned>(p.threads));
  return launch_kernel("kv copy", kv_copy_kernel<kBytes>, shape, stream, LaunchOrder::kStream, p, div);
}

}  // namespace

Status launch_kv_copy(const KvCopyParams& p, Stream stream) {
  const int vector_bytes = p.vector_bytes;
  if (p.num_ctas < 1 || p.threads < 32 || p.threads > 512 || p.row_bytes % vector_bytes != 0 ||
      p.num_dests < 1 || p.num_dests > kKvMaxDests || p.num_layers < 1 || p.num_layers > kKvMaxLayers ||
      p.num_dst_blocks < 1) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat("kv copy: bad launch geometry (", p.num_ctas, " CTAs of ", p.threads, " threads, row ",
                                 p.row_bytes, " bytes, vector ", vector_bytes, ", ", p.num_dests, " destinations, ",
                                 p.num_layers, " layers, ", p.num_dst_blocks, " blocks)"));
  }
  const uint64_t unit_vectors =
      static_cast<uint64_t>(p.dst.block_size) * p.num_heads * static_cast<uint64_t>(p.row_bytes / vector_bytes);
  const uint64_t units = static_cast<uint64_t>(p.num_dests) * p.num_planes * p.num_dst_blocks;
  const uint64_t span_units = std::min<uint64_t>(units, units * p.num_layers / static_cast<uint64_t>(p.num_ctas) + 1);
  // Indices are 32-bit: a CTA's span within a layer, and every unit and token index, below 2^31.
  if (span_units * unit_vectors >= (1ull << 31) || units >= (1ull << 31) ||
      static_cast<uint64_t>(p.num_tokens) >= (1ull << 31)) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat("kv copy: ", units, " units of ", unit_vectors, " vectors over ", p.num_ctas,
                                 " CTAs exceed 32-bit indexing; send fewer blocks per request"));
  }
  KvDivisors div;
  div.unit = FastDiv(static_cast<uint32_t>(unit_vectors));
  div.dst_blocks = FastDiv(static_cast<uint32_t>(p.num_dst_blocks));
  div.planes = FastDiv(static_cast<uint32_t>(p.num_planes));
  div.vecs_per_row = FastDiv(static_cast<uint32_t>(p.row_bytes / vector_bytes));
  const bool head_major = p.dst.head_stride > p.dst.token_stride;
  div.inner = FastDiv(static_cast<uint32_t>(head_major ? p.dst.block_size : p.num_heads));
  div.src_block = FastDiv(static_cast<uint32_t>(p.src.block_size));
  switch (vector_bytes) {
    case 16: return launch_with<16>(p, div, stream);
    case 8: return launch_with<8>(p, div, stream);
    case 4: return launch_with<4>(p, div, stream);
    case 2: return launch_with<2>(p, div, stream);
    case 1: return launch_with<1>(p, div, stream);
  }
  return Status(StatusCode::kInvalidArgument, detail::concat("kv copy: vector of ", vector_bytes,
                                                             " bytes; supported: 16, 8, 4, 2, 1"));
}

}  // namespace commlib::kernels
