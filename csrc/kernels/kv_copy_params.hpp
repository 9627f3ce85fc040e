// Parameters of the KV-cache block copy (csrc/kernels/kv_copy.cu on the GPU; the CPU engine runs
// the same parameters in csrc/host/kv_host.cc). Host-compilable; no CUDA, no torch.
//
// Note [kv copy geometry]
// One side's cache, one layer, one plane (K, V, or MLA's single latent plane) is addressed as
//   plane_base + block * block_stride + token * token_stride + head * head_stride + byte
// with `row_bytes` contiguous bytes per (token, head) row (head_dim x element size): every engine
// layout is a choice of the three strides (NHD [B, T, H, D], HND [B, H, T, D], FlashInfer's
// [B, 2, ...] and vLLM's [2, B, ...] planes, MLA's [B, T, D] with one head). A request moves
// `num_tokens` tokens: token i of the request is token i % block_size of block
// blocks[i / block_size] on each side, so different block sizes on the two sides are a change of
// this index only. Heads: destination j receives `num_heads` heads, source head src_head0[j] + h
// into destination head dst_head0[j] + h (the TP slice; Note [kv tensor parallelism] in
// csrc/core/kv_agent.hpp). The copy is bitwise: dtype matters only through row_bytes.
// Work is cut into units, one per (destination, plane, destination block) of a layer; the units of
// every layer of the launch, layer after layer, are split evenly over the CTAs, so a CTA does part
// of one layer or of a few neighbouring ones (an 80-layer request runs its layers side by side).
// Completion (Note [kv protocol]): after its last unit of a layer each CTA makes its stores visible
// at system scope and adds its count of that layer's units to tile_counters[layer]; the CTA whose
// count completes the layer stores flag_value[j] into flags[j][layer] with release semantics
// (system scope: the consumer is another process, on the host or another GPU) for every
// destination j, and resets the counter for the next launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "commlib/device/host_device.hpp"
#include "commlib/errors.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;

constexpr int kKvMaxDests = 8;     // destination ranks of one launch (TP ratio up to 1:8)
constexpr int kKvMaxLayers = 256;  // layers of a registered cache (the notification record's size)

// One side's addressing (Note [kv copy geometry]); strides in bytes.
struct KvSide {
  int64_t block_stride = 0;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
  int32_t block_size = 0;
};

struct KvCopyParams {
  // Plane base addresses: src_planes[layer * num_planes + plane] (this process), and
  // dst_planes[(dest * num_layers_total + layer) * num_planes + plane] (mapped peer memory).
  const uint64_t* src_planes = nullptr;
  const uint64_t* dst_planes = nullptr;
  const int32_t* src_blocks = nullptr;  // block ids of the request, in token order
  const int32_t* dst_blocks = nullptr;
  int64_t num_dst_blocks = 0;           // ceil(num_tokens / dst.block_size)
  int64_t num_tokens = 0;
  KvSide src;
  KvSide dst;
  int32_t row_bytes = 0;    // contiguous bytes of one (token, head) row on both sides
  int32_t num_heads = 0;    // heads each destination receives
  int32_t num_planes = 0;   // 2 (K, V) or 1 (MLA)
  int32_t num_dests = 0;
  int32_t src_head0[kKvMaxDests] = {};
  int32_t dst_head0[kKvMaxDests] = {};
  int32_t layer_begin = 0;  // this launch copies layers [layer_begin, layer_begin + num_layers)
  int32_t num_layers = 0;
  int32_t num_layers_total = 0;
  // Completion: flags[j][layer] = flag_value[j] once layer `layer` of destination j landed.
  uint32_t* flags[kKvMaxDests] = {};
  uint32_t flag_value[kKvMaxDests] = {};
  uint32_t* tile_counters = nullptr;  // [kKvMaxLayers] zeros (device memory); left zero
  int32_t num_ctas = 0;               // grid size (the SM budget)
  int32_t threads = 512;
  int32_t vector_bytes = 1;  // width of every access (kv_vector_bytes)
};

// Bytes of the widest access (16, 8, 4, 2 or 1) that keeps every address of a copy aligned: the
// largest power of two up to 16 dividing `gcd_bytes` (the gcd of row_bytes, every stride and every
// plane base of both sides).
inline int kv_vector_bytes(uint64_t gcd_bytes) {
  int v = 16;
  while (v > 1 && gcd_bytes % static_cast<uint64_t>(v) != 0) v /= 2;
  return v;
}

// Note [kv copy geometry]'s split of a launch: CTA `cta` of `ctas` owns the units
// [units * layers * cta / ctas, units * layers * (cta + 1) / ctas) of the launch, counted layer
// after layer; KvCtaLayer is its part of one layer: units [first, last) of layer `li` (empty when
// first >= last). A CTA's layers run from kv_cta_first_layer up to the first empty part.
struct KvCtaLayer {
  int64_t first;
  int64_t last;
};

COMMLIB_HD int kv_cta_first_layer(int64_t units, int layers, int64_t cta, int64_t ctas) {
  return static_cast<int>(units * layers * cta / ctas / units);
}

COMMLIB_HD KvCtaLayer kv_cta_layer(int64_t units, int layers, int64_t cta, int64_t ctas, int li) {
  const int64_t begin = units * layers * cta / ctas;
  const int64_t end = units * layers * (cta + 1) / ctas;
  const int64_t lo = li * units;
  const int64_t hi = lo + units;
  return {(begin > lo ? begin : lo) - lo, (end < hi ? end : hi) - lo};
}

// Launches the copy of `p` on `stream` (one kernel). The pointers are device pointers (flags may be
// host-mapped memory).
Status launch_kv_copy(const KvCopyParams& p, Stream stream);

}  // namespace commlib::kernels
