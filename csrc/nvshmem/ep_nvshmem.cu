// EP dispatch / combine over NVSHMEM (Note [EP NVSHMEM protocol] in csrc/kernels/ep_nvshmem_params.hpp), built into
// libcommlib_nvshmem.so with relocatable device code and NVSHMEM's device library.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "kernels/ep_common.cuh"
#include "kernels/ep_nvshmem_params.hpp"

namespace commlib::nvshmem_ep {
namespace {

using kernels::EPMode;
using kernels::EPParams;
using kernels::has;
using kernels::kFullMask;
using kernels::kThreads;
using kernels::kWarps;

template <typename U>
__device__ __forceinline__ U* at(const Params& q, size_t offset) {
  return reinterpret_cast<U*>(q.heap + offset);
}

// Slot [r][b] of a [world][blocks] signal array; [b][r] of a [blocks][world] count array.
__device__ __forceinline__ size_t signal_slot(const Params& q, int r, int b) {
  return static_cast<size_t>(r) * q.num_blocks + b;
}
__device__ __forceinline__ size_t count_slot(const Params& q, int b, int r) {
  return static_cast<size_t>(b) * q.base.world_size + r;
}

struct TokenRange {
  int64_t begin, end;
};

__device__ __forceinline__ TokenRange token_range(const Params& q, int64_t num_tokens) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * q.tokens_per_block;
  return {kernels::min64(begin, num_tokens), kernels::min64(begin + q.tokens_per_block, num_tokens)};
}

// Where a source's routing is read (Note [EP NVSHMEM protocol]: the own routing of a fused dispatch
// comes from topk_idx, everything else from the meta slots).
struct Routing {
  const Params& q;
  bool own_from_input;

  __device__ __forceinline__ int64_t num_tokens(int s) const {
    if (s == q.base.rank && own_from_input) return q.base.num_tokens;
    return at<const int32_t>(q, q.layout.num_tokens)[s];
  }
  // Expert id of route i = t * topk + k of source s (-1: none or invalid).
  __device__ __forceinline__ int32_t expert(int s, int64_t i) const {
    if (s == q.base.rank && own_from_input) return kernels::sanitize(q.base.topk_idx[i], q.base.config.num_experts);
    return at<const int32_t>(q, q.layout.meta_idx)[kernels::route(q.base, s, i)];
  }
};

// One lane per route (topk <= 32), so that a token's routing loads in one round trip.
static_assert(kEPMaxTopk <= 32);

__device__ __forceinline__ bool in_set(uint64_t ranks, int r) { return ((ranks >> r) & 1u) != 0u; }

// Whole warp: the ranks owning an expert of token t of source s (bit r: rank r). Reduced in 32-bit
// halves; the upper one only in worlds past 32 (n is the same on every lane).
__device__ __forceinline__ uint64_t owner_ranks(const Routing& routing, int s, int64_t t, int lane) {
  const EPConfig& c = routing.q.base.config;
  const int n = routing.q.base.world_size;
  const int64_t num_local = c.num_experts / n;
  uint64_t bit = 0;
  if (lane < c.topk) {
    const int32_t e = routing.expert(s, t * c.topk + lane);
    if (e >= 0) bit = rank_bit(static_cast<int>(e / num_local));
  }
  const uint64_t low = __reduce_or_sync(kFullMask, static_cast<unsigned>(bit));
  if (n <= 32) return low;
  const uint64_t high = __reduce_or_sync(kFullMask, static_cast<unsigned>(bit >> 32));
  return high << 32 | low;
}

// Block-wide: counts[r] = tokens of `range` of source s owned (also) by rank r, for each rank r in
// `ranks` (shared memory, [kMaxRanks], zeroed here).
__device__ __forceinline__ void count_owned_tokens(const Routing& routing, int s, TokenRange range, uint64_t ranks,
                                                   int32_t* counts) {
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int n = routing.q.base.world_size;
  if (threadIdx.x < kMaxRanks) counts[threadIdx.x] = 0;
  __syncthreads();
  for (int64_t t = range.begin + warp; t < range.end; t += kWarps) {
    const uint64_t owners = owner_ranks(routing, s, t, lane) & ranks;
    for (int r = lane; r < n; r += 32) {
      if (in_set(owners, r)) atomicAdd(&counts[r], 1);
    }
  }
  __syncthreads();
}

// Thread r of the block for r in `ranks`: waits until signals[slot(r)] reaches expected[r] +
// counts[r] + extra and advances expected[r]. Block-wide (every thread calls it); true if a wait failed.
template <typename Slot>
__device__ __forceinline__ bool wait_counts(const Params& q, const uint64_t* signals, Slot&& slot, uint64_t* expected,
                                            const int32_t* counts, uint64_t extra, uint64_t ranks, Phase phase,
                                            uint64_t seq) {
  static_assert(kMaxRanks <= kThreads);
  const int r = static_cast<int>(threadIdx.x);
  bool failed = false;
  if (r < q.base.world_size && in_set(ranks, r)) {
    const uint64_t target = expected[r] + static_cast<uint64_t>(counts[r]) + extra;
    failed = !device::wait_flag(q.base.barrier, signals + slot(r), target, r, static_cast<int>(phase), seq);
    if (!failed) expected[r] = target;
  }
  return __syncthreads_or(failed) != 0;
}

__device__ __forceinline__ uint64_t read_seq(const Params& q, bool* poisoned) {
  const uint64_t seq = device::ld_volatile_u64(at<uint64_t>(q, q.layout.seq) + blockIdx.x);
  *poisoned = device::ld_volatile_u32(&q.base.barrier.state->poisoned) != 0;
  return seq;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ep_nvshmem_dispatch_kernel(const Params q, EPMode mode) {
  const EPParams& p = q.base;
  const EPConfig& c = p.config;
  const int me = p.rank, n = p.world_size, b = static_cast<int>(blockIdx.x);
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int64_t topk = c.topk, hidden = c.hidden, num_local = c.num_experts / n;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(T);
  bool poisoned = false;
  const uint64_t seq = read_seq(q, &poisoned);
  if (poisoned) return;
  int32_t* meta_idx = at<int32_t>(q, q.layout.meta_idx);
  float* meta_w = at<float>(q, q.layout.meta_w);
  int32_t* num_tokens = at<int32_t>(q, q.layout.num_tokens);
  T* land_x = at<T>(q, q.layout.land_x);
  uint64_t* meta_signal = at<uint64_t>(q, q.layout.meta_signal);
  uint64_t* data_signal = at<uint64_t>(q, q.layout.data_signal);
  const uint64_t others = other_ranks(n, me);
  const Routing routing{q, has(mode, EPMode::kSend)};

  if (has(mode, EPMode::kSend)) {
    if (b == 0) {
      for (int64_t i = threadIdx.x; i < p.num_tokens * topk; i += blockDim.x) {
        const int64_t raw = p.topk_idx[i];
        const int32_t e = kernels::sanitize(raw, c.num_experts);
        if (raw != -1 && e < 0) {
          // Counted on this rank (EPBuffer.check raises) and treated as -1.
          atomicAdd(reinterpret_cast<unsigned long long*>(at<int64_t>(q, q.layout.overflow)) + 2, 1ull);
        }
        meta_idx[kernels::route(p, me, i)] = e;
        meta_w[kernels::route(p, me, i)] = p.topk_weights[i];
      }
      if (threadIdx.x == 0) num_tokens[me] = static_cast<int32_t>(p.num_tokens);
      // The routing is complete in the own slot before any warp puts it.
      __syncthreads();
      // At least one token's worth, so that no message is empty.
      const size_t route_bytes = static_cast<size_t>(kernels::max64(p.num_tokens, 1) * topk) * sizeof(int32_t);
      for (int d = warp; d < n; d += kWarps) {
        if (d == me) continue;
        nvshmemx_putmem_signal_nbi_warp(meta_idx + kernels::route(p, me, 0), meta_idx + kernels::route(p, me, 0),
                                        route_bytes, meta_signal + me, 1, NVSHMEM_SIGNAL_ADD, d);
        nvshmemx_putmem_signal_nbi_warp(meta_w + kernels::route(p, me, 0), meta_w + kernels::route(p, me, 0),
                                        route_bytes, meta_signal + me, 1, NVSHMEM_SIGNAL_ADD, d);
        nvshmemx_putmem_signal_nbi_warp(num_tokens + me, num_tokens + me, sizeof(int32_t), meta_signal + me, 1,
                                        NVSHMEM_SIGNAL_ADD, d);
      }
    }
    const TokenRange range = token_range(q, p.num_tokens);
    const T* x = static_cast<const T*>(p.x);
    for (int64_t t = range.begin + warp; t < range.end; t += kWarps) {
      const uint64_t targets = owner_ranks(routing, me, t, lane) & others;
      if (targets == 0u) continue;
      T* stage = land_x + kernels::row(p, me, t);
      kernels::copy_row<T>(&stage, 1, x + t * hidden, hidden, {0, hidden}, lane);
      // The staged row is complete (every lane's part) before the put reads it.
      __syncwarp();
      for (uint64_t rest = targets; rest != 0u; rest &= rest - 1u) {
        const int d = __ffsll(static_cast<long long>(rest)) - 1;
        nvshmemx_putmem_signal_nbi_warp(stage, stage, row_bytes, data_signal + signal_slot(q, me, b), 1,
                                        NVSHMEM_SIGNAL_ADD, d);
      }
    }
  }
  if (!has(mode, EPMode::kRecv)) return;

  extern __shared__ int32_t smem[];
  int32_t* base = smem;                   // [num_local]: routes of the sources before s, per local expert
  int32_t* run = smem + num_local;        // [max(num_local, num_experts)]: scratch counts
  __shared__ int32_t counts[kMaxRanks];
  __shared__ T* dsts[kWarps][kEPMaxTopk];

  // Every peer's routing (thread s).
  {
    bool failed = false;
    if (threadIdx.x < n && static_cast<int>(threadIdx.x) != me) {
      failed = !device::wait_flag(p.barrier, meta_signal + threadIdx.x, kMetaMessages * (seq + 1), threadIdx.x,
                                  static_cast<int>(Phase::kDispatchMeta), seq);
    }
    if (__syncthreads_or(failed)) return;
  }

  // Positions (Note [EP layout]): base(s, l) + j(s, t, k), sources in rank order.
  for (int64_t l = threadIdx.x; l < num_local; l += blockDim.x) base[l] = 0;
  for (int s = 0; s < n; ++s) {
    const int64_t ns = routing.num_tokens(s);
    const TokenRange range = token_range(q, ns);
    for (int64_t l = threadIdx.x; l < num_local; l += blockDim.x) run[l] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < range.begin * topk; i += blockDim.x) {
      const int32_t e = routing.expert(s, i);
      if (e >= 0 && e / num_local == me) atomicAdd(&run[e - me * num_local], 1);
    }
    __syncthreads();
    if (warp == 0) {
      for (int64_t first = range.begin * topk; first < range.end * topk; first += 32) {
        const int64_t i = first + lane;
        const bool active = i < range.end * topk;
        int32_t key = -1;
        if (active) {
          const int32_t e = routing.expert(s, i);
          if (e >= 0 && e / num_local == me) key = static_cast<int32_t>(e - me * num_local);
        }
        const unsigned same = __match_any_sync(kFullMask, key);
        int64_t pos = -1;
        if (key >= 0) pos = base[key] + run[key] + __popc(same & kernels::lanemask_lt());
        __syncwarp();
        if (key >= 0 && lane == __ffs(same) - 1) run[key] += __popc(same);
        __syncwarp();
        if (active) p.recv_pos[kernels::route(p, s, i)] = static_cast<int32_t>(pos >= 0 && pos < c.capacity ? pos : -1);
      }
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < ns * topk; i += blockDim.x) {
      const int32_t e = routing.expert(s, i);
      if (e >= 0 && e / num_local == me) atomicAdd(&base[e - me * num_local], 1);
    }
    __syncthreads();
  }

  // The peers' rows of this block's tokens.
  uint64_t* expected = at<uint64_t>(q, q.layout.data_expected) + count_slot(q, b, 0);
  for (int s = 0; s < n; ++s) {
    if (s == me) continue;
    count_owned_tokens(routing, s, token_range(q, routing.num_tokens(s)), rank_bit(me), counts);
    bool failed = false;
    if (threadIdx.x == 0) {
      const uint64_t target = expected[s] + static_cast<uint64_t>(counts[me]);
      failed = !device::wait_flag(p.barrier, data_signal + signal_slot(q, s, b), target, s,
                                  static_cast<int>(Phase::kDispatchLanded), seq);
      if (!failed) expected[s] = target;
    }
    if (__syncthreads_or(failed)) return;
  }

  // Expansion: each token row once from its source to all its kept expert rows here.
  for (int s = 0; s < n; ++s) {
    const TokenRange range = token_range(q, routing.num_tokens(s));
    for (int64_t t = range.begin + warp; t < range.end; t += kWarps) {
      bool keep = false;
      T* dst = nullptr;
      if (lane < topk) {
        const int64_t i = t * topk + lane;
        const int32_t e = routing.expert(s, i);
        const int32_t pos = p.recv_pos[kernels::route(p, s, i)];
        keep = e >= 0 && e / num_local == me && pos >= 0;
        if (keep) dst = static_cast<T*>(p.expert_x) + ((e - me * num_local) * c.capacity + pos) * hidden;
      }
      const int count = kernels::warp_list(dsts[warp], keep, dst, lane);
      if (count == 0) continue;
      const T* src = s == me ? static_cast<const T*>(p.x) + t * hidden : land_x + kernels::row(p, s, t);
      kernels::copy_row<T>(dsts[warp], count, src, hidden, {0, hidden}, lane);
      __syncwarp();
    }
  }

  if (b != 0) return;
  // expert_counts (base now holds every source's routes per local expert) and the overflow word
  // for every expert from every source's routing.
  __syncthreads();
  for (int64_t l = threadIdx.x; l < num_local; l += blockDim.x) {
    p.expert_counts[l] = static_cast<int32_t>(kernels::min64(base[l], c.capacity));
  }
  for (int64_t e = threadIdx.x; e < c.num_experts; e += blockDim.x) run[e] = 0;
  __syncthreads();
  for (int s = 0; s < n; ++s) {
    const int64_t ns = routing.num_tokens(s);
    for (int64_t i = threadIdx.x; i < ns * topk; i += blockDim.x) {
      const int32_t e = routing.expert(s, i);
      if (e >= 0) atomicAdd(&run[e], 1);
    }
  }
  __syncthreads();
  auto* word = reinterpret_cast<unsigned long long*>(at<int64_t>(q, q.layout.overflow));
  for (int64_t e = threadIdx.x; e < c.num_experts; e += blockDim.x) {
    const int64_t total = run[e];
    if (total > c.capacity) {
      atomicAdd(word, static_cast<unsigned long long>(total - c.capacity));
      atomicMax(word + 1, (static_cast<unsigned long long>(total) << 24) | static_cast<unsigned long long>(e));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ep_nvshmem_combine_kernel(const Params q, EPMode mode) {
  const EPParams& p = q.base;
  const EPConfig& c = p.config;
  const int me = p.rank, n = p.world_size, b = static_cast<int>(blockIdx.x);
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int64_t hidden = c.hidden;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(T);
  bool poisoned = false;
  const uint64_t seq = read_seq(q, &poisoned);
  if (poisoned) return;
  const int32_t* meta_idx = at<const int32_t>(q, q.layout.meta_idx);
  const float* meta_w = at<const float>(q, q.layout.meta_w);
  T* land_y = at<T>(q, q.layout.land_y);
  T* send_y = at<T>(q, q.layout.send_y);
  uint64_t* combine_signal = at<uint64_t>(q, q.layout.combine_signal);
  const uint64_t others = other_ranks(n, me);
  const Routing routing{q, false};
  // Per warp: a token's local routes (local_routes), then its owner ranks' partials; at most topk
  // of either.
  __shared__ const T* srcs[kWarps][32];
  __shared__ float weights[kWarps][32];
  __shared__ int32_t counts[kMaxRanks];

  if (has(mode, EPMode::kSend)) {
    for (int s = 0; s < n; ++s) {
      const TokenRange range = token_range(q, routing.num_tokens(s));
      for (int64_t t = range.begin + warp; t < range.end; t += kWarps) {
        const kernels::LocalRoutes r =
            kernels::local_routes<T>(p, s, t, meta_idx, meta_w, srcs[warp], weights[warp], lane);
        if (!r.any) continue;
        T* dst = (s == me ? land_y + kernels::row(p, me, t) : send_y + kernels::row(p, s, t));
        kernels::weighted_sum_row<T, kernels::kSumLarge.unroll, kernels::kSumLarge.sources>(
            dst, srcs[warp], weights[warp], r.count, hidden, {0, hidden}, lane);
        if (s == me) continue;
        // The staged partial is complete (every lane's part) before the put reads it.
        __syncwarp();
        nvshmemx_putmem_signal_nbi_warp(land_y + kernels::row(p, me, t), dst, row_bytes,
                                        combine_signal + signal_slot(q, me, b), 1, NVSHMEM_SIGNAL_ADD, s);
      }
    }
    // This block has read all it will of the peers' routing in this call (Note [EP NVSHMEM protocol]).
    __syncthreads();
    if (threadIdx.x < n && static_cast<int>(threadIdx.x) != me) {
      nvshmemx_signal_op(combine_signal + signal_slot(q, me, b), 1, NVSHMEM_SIGNAL_ADD, threadIdx.x);
    }
  }
  if (!has(mode, EPMode::kRecv)) return;

  const TokenRange range = token_range(q, routing.num_tokens(me));
  count_owned_tokens(routing, me, range, others, counts);
  uint64_t* expected = at<uint64_t>(q, q.layout.combine_expected) + count_slot(q, b, 0);
  if (wait_counts(q, combine_signal, [&](int d) { return signal_slot(q, d, b); }, expected, counts, 1, others,
                  Phase::kCombineLanded, seq)) {
    return;
  }
  T* out = static_cast<T*>(p.out);
  for (int64_t t = range.begin + warp; t < range.end; t += kWarps) {
    const uint64_t owners = owner_ranks(routing, me, t, lane);
    // The owners' partials in rank order (the sum's order, Note [EP layout]), 32 ranks at a time.
    int count = 0;
    for (int first = 0; first < n; first += 32) {
      const int r = first + lane;
      const bool keep = r < n && in_set(owners, r);
      const T* partial = keep ? land_y + kernels::row(p, r, t) : nullptr;
      count += kernels::warp_list(srcs[warp] + count, keep, partial, lane);
    }
    kernels::weighted_sum_row<T, kernels::kSumLarge.unroll, kernels::kSumLarge.sources>(
        out + t * hidden, srcs[warp], nullptr, count, hidden, {0, hidden}, lane);
    __syncwarp();
  }
  __syncthreads();
  if (threadIdx.x == 0) at<uint64_t>(q, q.layout.seq)[b] = seq + 1;
}

int fail(char* message, size_t len, const char* text) {
  if (message != nullptr && len > 0) std::snprintf(message, len, "%s", text);
  return 1;
}

int cuda_fail(char* message, size_t len, const char* what, cudaError_t e) {
  if (message != nullptr && len > 0) std::snprintf(message, len, "%s: %s", what, cudaGetErrorString(e));
  return 1;
}

__global__ void probe_kernel(int* out) {
  out[0] = nvshmem_my_pe();
  out[1] = nvshmem_n_pes();
}

int attach(int device, int* my_pe, int* n_pes, char* message, size_t len) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return cuda_fail(message, len, "cudaSetDevice", e);
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED) {
    return fail(message, len, "NVSHMEM is not initialised in this process (nvshmem.core.init first)");
  }
  // Already initialised: this registers this library's device state with the host library and
  // fills it in (a refcount-free registration; this library never finalises NVSHMEM).
  int provided = 0;
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  if (nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, version) != 0) {
    return fail(message, len, "nvshmemi_init_thread failed registering the EP kernels' device state");
  }
  int* d_out = nullptr;
  e = cudaMalloc(&d_out, 2 * sizeof(int));
  if (e != cudaSuccess) return cuda_fail(message, len, "cudaMalloc", e);
  probe_kernel<<<1, 1>>>(d_out);
  int h_out[2] = {-1, -1};
  e = cudaMemcpy(h_out, d_out, sizeof(h_out), cudaMemcpyDeviceToHost);
  cudaFree(d_out);
  if (e != cudaSuccess) return cuda_fail(message, len, "NVSHMEM probe kernel", e);
  *my_pe = h_out[0];
  *n_pes = h_out[1];
  return 0;
}

void* heap_malloc(size_t bytes) { return nvshmem_malloc(bytes); }
void heap_free(void* ptr) { nvshmem_free(ptr); }

template <bool kDispatch, typename T>
cudaError_t launch_typed(const Params& q, EPMode mode, cudaStream_t stream, size_t smem) {
  auto* kernel = kDispatch ? ep_nvshmem_dispatch_kernel<T> : ep_nvshmem_combine_kernel<T>;
  kernel<<<q.num_blocks, kThreads, smem, stream>>>(q, mode);
  return cudaGetLastError();
}

template <bool kDispatch>
int launch(const Params* q, int mode_in, void* stream_in, char* message, size_t len) {
  const EPMode mode = static_cast<EPMode>(mode_in);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_in);
  const EPConfig& c = q->base.config;
  const char* what = kDispatch ? "EPBuffer.dispatch (nvshmem)" : "EPBuffer.combine (nvshmem)";
  if (!check_params(*q, what, message, len)) return 1;
  const int64_t num_local = c.num_experts / q->base.world_size;
  const size_t smem =
      kDispatch ? static_cast<size_t>(num_local + std::max(num_local, c.num_experts)) * sizeof(int32_t) : 0;
  cudaError_t e = cudaSuccess;
  switch (c.dtype) {
    case DataType::kFloat32: e = launch_typed<kDispatch, float>(*q, mode, stream, smem); break;
    case DataType::kFloat16: e = launch_typed<kDispatch, __half>(*q, mode, stream, smem); break;
    case DataType::kBFloat16: e = launch_typed<kDispatch, __nv_bfloat16>(*q, mode, stream, smem); break;
    default:
      return fail(message, len, "EPBuffer (nvshmem): dtype not supported; supported: float32, float16, bfloat16");
  }
  if (e != cudaSuccess) return cuda_fail(message, len, what, e);
  return 0;
}

const Api kApi{kApiVersion, attach, heap_malloc, heap_free, launch<true>, launch<false>};

}  // namespace
}  // namespace commlib::nvshmem_ep

extern "C" __attribute__((visibility("default"))) const commlib::nvshmem_ep::Api* commlib_nvshmem_ep_api() {
  return &commlib::nvshmem_ep::kApi;
}
