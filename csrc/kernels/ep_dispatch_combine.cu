// Expert-parallel dispatch / combine on symmetric memory: Note [EP GPU protocol] (ep_params.hpp)
// implementing Note [EP layout] (include/commlib/ep.hpp). Four kernels: dispatch send / recv,
// combine send / recv; the recv kernels carry the flag barrier (call_begin ... call_end).
#include <cuda_runtime.h>

#include <algorithm>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "commlib/device/vec.cuh"
#include "kernels/ep_params.hpp"

namespace commlib::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxSendBlocks = 264;  // two per SM on H200; the send kernels use no barrier

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

__device__ __forceinline__ char* region(const EPParams& p, int r, size_t offset) {
  return p.sym.peer<char>(r) + offset;
}

__device__ __forceinline__ bool aligned16(const void* a, const void* b, size_t bytes) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | bytes) & 15u) == 0;
}

// Copies one row with the lanes of a warp: 16-byte packs when everything is aligned, else elements.
template <typename T>
__device__ __forceinline__ void copy_row(T* dst, const T* src, int64_t hidden, int lane) {
  using V = device::Vec<T>;
  if (aligned16(dst, src, hidden * sizeof(T))) {
    const int64_t num_packs = hidden / V::kNumElems;
    for (int64_t v = lane; v < num_packs; v += 32) V::load(src + v * V::kNumElems).store(dst + v * V::kNumElems);
  } else {
    for (int64_t i = lane; i < hidden; i += 32) dst[i] = src[i];
  }
}

__device__ __forceinline__ uint32_t owner_bit(int32_t e, int64_t num_local) {
  return e >= 0 ? (1u << static_cast<uint32_t>(e / num_local)) : 0u;
}

// ---- dispatch send: meta rows to every rank, each token once to each of its owner ranks ----
template <typename T>
__global__ void __launch_bounds__(kThreads) ep_dispatch_send_kernel(EPParams p) {
  const EPConfig& c = p.config;
  const int lane = threadIdx.x & 31;
  const int64_t num_local = c.num_experts / p.world_size;
  const size_t meta_row = static_cast<size_t>(c.topk);
  if (blockIdx.x == 0 && threadIdx.x < p.world_size) {
    reinterpret_cast<int32_t*>(region(p, threadIdx.x, p.layout.meta_num_tokens))[p.rank] =
        static_cast<int32_t>(p.num_tokens);
  }
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = blockIdx.x * kWarps + (threadIdx.x >> 5); t < p.num_tokens; t += num_warps) {
    int32_t e = -1;
    float w = 0.0f;
    if (lane < c.topk) {
      int64_t v = p.topk_idx[t * c.topk + lane];
      w = p.topk_weights[t * c.topk + lane];
      if (v < -1 || v >= c.num_experts) {
        // An invalid id is counted on this rank (EPBuffer.check raises) and treated as -1.
        atomicAdd(reinterpret_cast<unsigned long long*>(region(p, p.rank, p.layout.overflow)) + 2, 1ull);
        v = -1;
      }
      e = static_cast<int32_t>(v);
    }
    const uint32_t owners = __reduce_or_sync(kFullMask, owner_bit(e, num_local));
    const size_t meta_at = (static_cast<size_t>(p.rank) * c.max_tokens_per_rank + t) * meta_row;
    for (int d = 0; d < p.world_size; ++d) {
      if (lane < c.topk) {
        reinterpret_cast<int32_t*>(region(p, d, p.layout.meta_idx))[meta_at + lane] = e;
        reinterpret_cast<float*>(region(p, d, p.layout.meta_w))[meta_at + lane] = w;
      }
      if (owners & (1u << d)) {
        T* dst = reinterpret_cast<T*>(region(p, d, p.layout.land_x)) +
                 (static_cast<size_t>(p.rank) * c.max_tokens_per_rank + t) * c.hidden;
        copy_row(dst, static_cast<const T*>(p.x) + t * c.hidden, c.hidden, lane);
      }
    }
  }
  // Makes this thread's peer stores performed system-wide before the kernel completes; the recv
  // kernel's barrier release, later in stream order, then covers them.
  device::fence_acq_rel_sys();
}

// ---- dispatch recv: barrier, then positions by a block-wide ordered scan, rows into expert_x ----
// The scan runs over token rows (each thread one token of one source, its topk ids): a block-wide
// exclusive prefix sum of the per-token match counts gives the (s, t, k) order of Note [EP layout].
// Blocks [l * split, (l + 1) * split) all scan expert l's routes (4 bytes per route) and each copies
// every split-th matching token; block l * split alone writes recv_pos, counts and overflow.
template <typename T>
__global__ void __launch_bounds__(kThreads) ep_dispatch_recv_kernel(EPParams p, int split) {
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(EPPhaseId::kDispatchLanded))) return;
  __shared__ int warp_routes[kWarps];
  __shared__ int warp_tokens[kWarps];
  __shared__ int32_t list_token[kThreads];
  __shared__ int32_t list_pos[kThreads];
  __shared__ int32_t list_count[kThreads];
  const EPConfig& c = p.config;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int topk = static_cast<int>(c.topk);
  const int64_t num_local = c.num_experts / p.world_size;
  const int64_t cap = c.capacity;
  const size_t meta_per_rank = static_cast<size_t>(c.max_tokens_per_rank) * topk;
  const int32_t* meta_idx = reinterpret_cast<const int32_t*>(region(p, p.rank, p.layout.meta_idx));
  const int32_t* num_tokens_of = reinterpret_cast<const int32_t*>(region(p, p.rank, p.layout.meta_num_tokens));
  const T* land_x = reinterpret_cast<const T*>(region(p, p.rank, p.layout.land_x));
  T* expert_x = static_cast<T*>(p.expert_x);
  const int part = blockIdx.x % split;
  for (int64_t l = blockIdx.x / split; l < num_local; l += gridDim.x / split) {
    const int32_t e = static_cast<int32_t>(p.rank * num_local + l);
    int64_t running = 0;  // routes to e so far: the next position
    int64_t seen = 0;     // matching tokens so far, for the every-split-th assignment
    for (int s = 0; s < p.world_size; ++s) {
      const int64_t num_tokens = num_tokens_of[s];
      const int32_t* idx = meta_idx + s * meta_per_rank;
      for (int64_t base = 0; base < num_tokens; base += kThreads) {
        const int64_t t = base + threadIdx.x;
        int m = 0;
        if (t < num_tokens) {
          for (int k = 0; k < topk; ++k) m += idx[t * topk + k] == e ? 1 : 0;
        }
        int incl = m;  // warp inclusive scan of the match counts
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const int y = __shfl_up_sync(kFullMask, incl, off);
          if (lane >= off) incl += y;
        }
        const unsigned has = __ballot_sync(kFullMask, m > 0);
        if (lane == 31) {
          warp_routes[warp] = incl;
          warp_tokens[warp] = __popc(has);
        }
        __syncthreads();
        int routes_before = 0, tokens_before = 0, routes_total = 0, tokens_total = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          routes_before += w < warp ? warp_routes[w] : 0;
          tokens_before += w < warp ? warp_tokens[w] : 0;
          routes_total += warp_routes[w];
          tokens_total += warp_tokens[w];
        }
        if (m > 0) {
          const int64_t first = running + routes_before + incl - m;
          const int j = tokens_before + __popc(has & ((1u << lane) - 1u));
          list_token[j] = static_cast<int32_t>(t);
          list_pos[j] = static_cast<int32_t>(first);
          list_count[j] = m;
          if (part == 0) {
            int64_t pos = first;
            for (int k = 0; k < topk; ++k) {
              if (idx[t * topk + k] != e) continue;
              p.recv_pos[s * meta_per_rank + t * topk + k] = pos < cap ? static_cast<int32_t>(pos) : -1;
              ++pos;
            }
          }
        }
        __syncthreads();
        for (int j = warp; j < tokens_total; j += kWarps) {
          if ((seen + j) % split != part) continue;
          const T* src = land_x + (static_cast<size_t>(s) * c.max_tokens_per_rank + list_token[j]) * c.hidden;
          for (int r = 0; r < list_count[j] && list_pos[j] + r < cap; ++r) {
            copy_row(expert_x + (l * cap + list_pos[j] + r) * c.hidden, src, c.hidden, lane);
          }
        }
        running += routes_total;
        seen += tokens_total;
        __syncthreads();  // the lists are rewritten next iteration
      }
    }
    if (part == 0 && threadIdx.x == 0) {
      p.expert_counts[l] = static_cast<int32_t>(running < cap ? running : cap);
      if (running > cap) {
        // Every rank's overflow word learns of it (native peer atomics over NVLink).
        for (int d = 0; d < p.world_size; ++d) {
          auto* word = reinterpret_cast<unsigned long long*>(region(p, d, p.layout.overflow));
          atomicAdd_system(word, static_cast<unsigned long long>(running - cap));
          atomicMax_system(word + 1, (static_cast<unsigned long long>(running) << 24) | static_cast<unsigned>(e));
        }
      }
    }
  }
  device::call_end(p.barrier);
}

// ---- combine send: one warp per (source, token) with a local route: the owner's partial ----
template <typename T>
__global__ void __launch_bounds__(kThreads) ep_combine_send_kernel(EPParams p) {
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  const EPConfig& c = p.config;
  const int lane = threadIdx.x & 31;
  const int64_t num_local = c.num_experts / p.world_size;
  const int64_t max_tokens = c.max_tokens_per_rank;
  const size_t meta_per_rank = static_cast<size_t>(max_tokens) * c.topk;
  const int32_t* meta_idx = reinterpret_cast<const int32_t*>(region(p, p.rank, p.layout.meta_idx));
  const float* meta_w = reinterpret_cast<const float*>(region(p, p.rank, p.layout.meta_w));
  const int32_t* num_tokens_of = reinterpret_cast<const int32_t*>(region(p, p.rank, p.layout.meta_num_tokens));
  const T* expert_out = static_cast<const T*>(p.expert_out);
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t pair = blockIdx.x * kWarps + (threadIdx.x >> 5); pair < p.world_size * max_tokens; pair += num_warps) {
    const int s = static_cast<int>(pair / max_tokens);
    const int64_t t = pair % max_tokens;
    if (t >= num_tokens_of[s]) continue;
    const size_t at = s * meta_per_rank + t * c.topk;
    int32_t pos = -1, l = 0;
    float w = 0.0f;
    bool local = false;
    if (lane < c.topk) {
      const int32_t e = meta_idx[at + lane];
      local = e >= 0 && e / num_local == p.rank;
      if (local) {
        pos = p.recv_pos[at + lane];
        l = static_cast<int32_t>(e - p.rank * num_local);
        w = meta_w[at + lane];
      }
    }
    if (!__any_sync(kFullMask, local)) continue;
    T* dst = reinterpret_cast<T*>(region(p, s, p.layout.land_y)) + (static_cast<size_t>(p.rank) * max_tokens + t) * c.hidden;
    const bool vec = (c.hidden * sizeof(T)) % 16 == 0 && (reinterpret_cast<uintptr_t>(expert_out) & 15u) == 0;
    const int64_t num_packs = (c.hidden + N - 1) / N;
    // Broadcast the routes once, before the lane-strided loop (whose trip count differs per lane).
    int32_t route_pos[kEPMaxTopk], route_l[kEPMaxTopk];
    float route_w[kEPMaxTopk];
#pragma unroll
    for (int k = 0; k < kEPMaxTopk; ++k) {
      route_pos[k] = __shfl_sync(kFullMask, pos, k);
      route_l[k] = __shfl_sync(kFullMask, l, k);
      route_w[k] = __shfl_sync(kFullMask, w, k);
    }
    for (int64_t v = lane; v < num_packs; v += 32) {
      const int n = static_cast<int>(c.hidden - v * N < N ? c.hidden - v * N : N);
      device::Acc<N> acc;
#pragma unroll
      for (int i = 0; i < N; ++i) acc.v[i] = 0.0f;
#pragma unroll
      for (int k = 0; k < kEPMaxTopk; ++k) {
        if (k >= c.topk || route_pos[k] < 0) continue;
        const T* y = expert_out + (route_l[k] * c.capacity + route_pos[k]) * c.hidden + v * N;
        const V yv = vec ? V::load(y) : V::load_partial(y, n);
#pragma unroll
        for (int i = 0; i < N; ++i) {
          // Separate rounding of product and sum (Note [EP layout]): no fused multiply-add.
          acc.v[i] = __fadd_rn(acc.v[i], __fmul_rn(route_w[k], device::to_float<T>(yv.elems[i])));
        }
      }
      const V out = device::acc_cast<T, N>(acc);
      if (vec) {
        out.store(dst + v * N);
      } else {
        out.store_partial(dst + v * N, n);
      }
    }
  }
  device::fence_acq_rel_sys();  // as in dispatch send: the peer stores, before the recv barrier
}

// ---- combine recv: barrier, then the partials of the owner ranks summed in rank order ----
template <typename T>
__global__ void __launch_bounds__(kThreads) ep_combine_recv_kernel(EPParams p) {
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(EPPhaseId::kCombineLanded))) return;
  const EPConfig& c = p.config;
  const int lane = threadIdx.x & 31;
  const int64_t num_local = c.num_experts / p.world_size;
  const int64_t max_tokens = c.max_tokens_per_rank;
  const int32_t* meta_idx = reinterpret_cast<const int32_t*>(region(p, p.rank, p.layout.meta_idx)) +
                            static_cast<size_t>(p.rank) * max_tokens * c.topk;
  const T* land_y = reinterpret_cast<const T*>(region(p, p.rank, p.layout.land_y));
  T* out = static_cast<T*>(p.out);
  const bool vec = (c.hidden * sizeof(T)) % 16 == 0 && (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  const int64_t num_packs = (c.hidden + N - 1) / N;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = blockIdx.x * kWarps + (threadIdx.x >> 5); t < p.num_tokens; t += num_warps) {
    const int32_t e = lane < c.topk ? meta_idx[t * c.topk + lane] : -1;
    const uint32_t owners = __reduce_or_sync(kFullMask, owner_bit(e, num_local));
    for (int64_t v = lane; v < num_packs; v += 32) {
      const int n = static_cast<int>(c.hidden - v * N < N ? c.hidden - v * N : N);
      device::Acc<N> acc;
#pragma unroll
      for (int i = 0; i < N; ++i) acc.v[i] = 0.0f;
      for (int d = 0; d < p.world_size; ++d) {
        if (!(owners & (1u << d))) continue;
        const T* y = land_y + (static_cast<size_t>(d) * max_tokens + t) * c.hidden + v * N;
        device::acc_add(acc, vec ? V::load(y) : V::load_partial(y, n));
      }
      const V r = device::acc_cast<T, N>(acc);
      if (vec) {
        r.store(out + t * c.hidden + v * N);
      } else {
        r.store_partial(out + t * c.hidden + v * N, n);
      }
    }
  }
  device::call_end(p.barrier);
}

Status cuda_status(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::ok();
  return Status(StatusCode::kCudaError, detail::concat(what, ": kernel launch failed: ", cudaGetErrorString(err)));
}

Status check_params(const EPParams& p, const char* what) {
  if (p.world_size < 1 || p.world_size > kMaxDeviceRanks || p.world_size > 32) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": world_size ", p.world_size, " not supported; valid: 1..", kMaxDeviceRanks));
  }
  if (p.config.topk < 1 || p.config.topk > kEPMaxTopk) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": topk ", p.config.topk, " out of range 1..", kEPMaxTopk));
  }
  if (p.num_tokens < 0 || p.num_tokens > p.config.max_tokens_per_rank) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": num_tokens ", p.num_tokens, " out of range"));
  }
  return Status::ok();
}

int send_blocks(int64_t work_items) {
  return static_cast<int>(std::clamp<int64_t>((work_items + kWarps - 1) / kWarps, 1, kMaxSendBlocks));
}

// Blocks per local expert in dispatch recv (the grid must be the same on every rank: config only).
int recv_split(int64_t num_local) {
  return static_cast<int>(std::clamp<int64_t>(kMaxBarrierBlocks / std::max<int64_t>(num_local, 1), 1, 32));
}

}  // namespace

const char* ep_phase_name(int phase) {
  switch (static_cast<EPPhaseId>(phase)) {
    case EPPhaseId::kDispatchLanded: return "EP dispatch: tokens landed";
    case EPPhaseId::kCombineLanded: return "EP combine: partials landed";
  }
  return "unknown phase";
}

EPSymmetricLayout ep_symmetric_layout(const EPConfig& c, int world_size) {
  constexpr size_t kAlign = 256;
  const size_t meta = static_cast<size_t>(world_size) * c.max_tokens_per_rank * c.topk;
  const size_t rows = static_cast<size_t>(world_size) * c.max_tokens_per_rank * c.hidden * dtype_size(c.dtype);
  EPSymmetricLayout l;
  size_t at = 0;
  l.overflow = at;
  at = align_up(at + kEPOverflowWords * sizeof(int64_t), kAlign);
  l.meta_num_tokens = at;
  at = align_up(at + world_size * sizeof(int32_t), kAlign);
  l.meta_idx = at;
  at = align_up(at + meta * sizeof(int32_t), kAlign);
  l.meta_w = at;
  at = align_up(at + meta * sizeof(float), kAlign);
  l.land_x = at;
  at = align_up(at + rows, kAlign);
  l.land_y = at;
  at = align_up(at + rows, kAlign);
  l.total = at;
  return l;
}

Status launch_ep_dispatch_send(const EPParams& p, Stream stream) {
  const char* what = "EPBuffer.dispatch(send)";
  Status status = check_params(p, what);
  if (!status.is_ok()) return status;
  const int blocks = send_blocks(p.num_tokens);
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.config.dtype, T, return Status(StatusCode::kInvalidArgument, what),
                               [&] { ep_dispatch_send_kernel<T><<<blocks, kThreads, 0, stream>>>(p); });
  return cuda_status(what);
}

Status launch_ep_dispatch_recv(const EPParams& p, Stream stream) {
  const char* what = "EPBuffer.dispatch(recv)";
  Status status = check_params(p, what);
  if (!status.is_ok()) return status;
  const int64_t num_local = p.config.num_experts / p.world_size;
  const int split = recv_split(num_local);
  const int blocks = static_cast<int>(std::min<int64_t>(num_local * split, kMaxBarrierBlocks / split * split));
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.config.dtype, T, return Status(StatusCode::kInvalidArgument, what),
                               [&] { ep_dispatch_recv_kernel<T><<<blocks, kThreads, 0, stream>>>(p, split); });
  return cuda_status(what);
}

Status launch_ep_combine_send(const EPParams& p, Stream stream) {
  const char* what = "EPBuffer.combine(send)";
  Status status = check_params(p, what);
  if (!status.is_ok()) return status;
  const int blocks = send_blocks(static_cast<int64_t>(p.world_size) * p.config.max_tokens_per_rank);
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.config.dtype, T, return Status(StatusCode::kInvalidArgument, what),
                               [&] { ep_combine_send_kernel<T><<<blocks, kThreads, 0, stream>>>(p); });
  return cuda_status(what);
}

Status launch_ep_combine_recv(const EPParams& p, Stream stream) {
  const char* what = "EPBuffer.combine(recv)";
  Status status = check_params(p, what);
  if (!status.is_ok()) return status;
  // Fixed by the configuration, so every rank launches the same grid (Note [flag barrier]).
  const int blocks = static_cast<int>(
      std::clamp<int64_t>((p.config.max_tokens_per_rank + kWarps - 1) / kWarps, 1, kMaxBarrierBlocks));
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.config.dtype, T, return Status(StatusCode::kInvalidArgument, what),
                               [&] { ep_combine_recv_kernel<T><<<blocks, kThreads, 0, stream>>>(p); });
  return cuda_status(what);
}

}  // namespace commlib::kernels
