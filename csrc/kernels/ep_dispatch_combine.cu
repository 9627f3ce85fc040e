// Expert-parallel dispatch / combine on symmetric memory: Note [EP GPU protocol] (ep_params.hpp)
// implementing Note [EP layout] (include/commlib/ep.hpp). Two kernels, each one launch per phase
// (or two, send and receive, for the split-phase API).
//
// Latency discipline (decode sizes are a chain of dependent memory round trips, ~0.5-1 us each):
// loads that do not depend on each other are issued together before the first use of any of them
// (routing, row packs and staged counts; every source of a weighted sum), routing data reused by a
// block is staged once in shared memory, and the two system-scope releases of the dispatch are
// issued by different warps so that neither waits for the other.
#include <cuda_runtime.h>

#include <algorithm>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "commlib/device/vec.cuh"
#include "kernels/ep_params.hpp"

namespace commlib::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Warps [0, kPushWarps) of a dispatch send push rows to peers from the first instruction; the
// others (the meta warps) count routes, write the meta, and in the fused kernel then expand the
// own chunk.
constexpr int kPushWarps = kWarps / 2;
constexpr int kMetaThreads = kThreads - kPushWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;
// 16-byte packs in flight per lane in a row copy.
constexpr int kCopyUnroll = 8;
// Routes loaded per thread before their shared-memory counts are added.
constexpr int kCountBatch = 8;
// Smallest chunk of tokens per block (more blocks than this only add flag traffic).
constexpr int64_t kMinTokensPerBlock = 2;
// Named barriers (0 is __syncthreads): among the meta warps; push warps wait for the meta warps.
constexpr int kMetaBarrier = 1;
constexpr int kDataBarrier = 2;

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Opt-in timing trace, for finding where a call's time goes (build with -DCOMMLIB_EP_TRACE, e.g.
// `CUDAFLAGS=-DCOMMLIB_EP_TRACE make build`; bench/ep_trace.py reads it): thread `who` of block 0
// records %globaltimer at each EPTracePoint; ep_trace_snapshot() returns the last call's values.
#if defined(COMMLIB_EP_TRACE)
__device__ unsigned long long g_ep_trace[kEPTracePoints];
__device__ __forceinline__ void trace(EPTracePoint point, int who) {
  if (blockIdx.x != 0 || static_cast<int>(threadIdx.x) != who) return;
  if (point == EPTracePoint::kDispatchStart) {  // keep the previous call's end: the gap between calls
    g_ep_trace[static_cast<int>(EPTracePoint::kPrevCombineEnd)] = g_ep_trace[static_cast<int>(EPTracePoint::kCombineEnd)];
  }
  g_ep_trace[static_cast<int>(point)] = device::globaltimer_ns();
}
#else
__device__ __forceinline__ void trace(EPTracePoint, int) {}
#endif

__host__ __device__ constexpr bool has(EPMode mode, EPMode part) { return (static_cast<int>(mode) & static_cast<int>(part)) != 0; }

// By value (std::min/max/clamp return references, which can put their operands in local memory).
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return min64(max64(v, lo), hi); }

// ---- addressing of a rank's piece (Note [EP GPU protocol]) ----

template <typename U>
__device__ __forceinline__ U* piece(const EPParams& p, int r, size_t offset) {
  return reinterpret_cast<U*>(p.sym.peer<char>(r) + offset);
}

// Slot of writer s, block b in a [world][blocks] array.
__device__ __forceinline__ size_t slot(const EPParams& p, int s, int b) {
  return static_cast<size_t>(s) * p.num_blocks + b;
}

// Route i = t * topk + k of source s in a [world][max_tokens][topk] array.
__device__ __forceinline__ size_t route(const EPParams& p, int s, int64_t i) {
  return static_cast<size_t>(s) * p.config.max_tokens_per_rank * p.config.topk + i;
}

// Row t of writer s in a [world][max_tokens][hidden] array (elements).
__device__ __forceinline__ size_t row(const EPParams& p, int s, int64_t t) {
  return (static_cast<size_t>(s) * p.config.max_tokens_per_rank + t) * p.config.hidden;
}

// This block's sequence number: dispatch/combine pairs it completed (Note [EP GPU protocol]).
__device__ __forceinline__ uint64_t* seq_of(const EPParams& p, int b) {
  return piece<uint64_t>(p, p.rank, p.layout.seq) + b;
}

// Tokens of source s in chunk b (s's token count comes from its slot in this rank's piece).
__device__ __forceinline__ int32_t chunk_tokens(const EPParams& p, int s, int b) {
  const int64_t num_tokens = piece<const int32_t>(p, p.rank, p.layout.num_tokens)[slot(p, s, b)];
  return static_cast<int32_t>(clamp64(num_tokens - b * p.tokens_per_block, 0, p.tokens_per_block));
}

struct SourceToken {
  int s;
  int64_t t;
};

// The r-th token of chunk b over the sources in rank order (skipping `skip`, -1 for none), from
// the chunk sizes staged in shared memory.
__device__ __forceinline__ SourceToken nth_token(const int32_t* sizes, int n, int64_t t_begin, int skip, int64_t r) {
  int s = 0;
  for (; s < n; ++s) {
    if (s == skip) continue;
    if (r < sizes[s]) break;
    r -= sizes[s];
  }
  return {s, t_begin + r};
}

__device__ __forceinline__ int64_t total_tokens(const int32_t* sizes, int n, int skip) {
  int64_t total = 0;
  for (int s = 0; s < n; ++s) total += s == skip ? 0 : sizes[s];
  return total;
}

__device__ __forceinline__ int32_t* totals_of(const EPParams& p, int r, int s, int b) {
  const int64_t num_local = p.config.num_experts / p.world_size;
  return piece<int32_t>(p, r, p.layout.totals) + slot(p, s, b) * num_local;
}

// An expert id as the kernels use it: out-of-range ids become -1 (counted by the sender).
__device__ __forceinline__ int32_t sanitize(int64_t e, int64_t num_experts) {
  return e >= 0 && e < num_experts ? static_cast<int32_t>(e) : -1;
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// bar.sync on a named barrier among `count` threads (whole warps): orders their memory accesses
// like __syncthreads does, for the participating threads only.
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// bar.arrive: counts this warp in for a bar.sync of other warps without waiting. Its earlier
// memory accesses happen-before everything the waiting threads do after their bar.sync.
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// ---- bounded flag waits (Note [flag barrier]'s discipline: bounded, recorded, poison-aware) ----

// Spins until *flag >= value (acquire, system scope: makes the writer's stores before its release
// visible to this thread). Returns true if it gave up (timeout recorded, or another wait failed).
__device__ __forceinline__ bool wait_flag(const uint64_t* flag, uint64_t value, const BarrierDevice& bar, int peer,
                                          EPPhaseId phase, uint64_t seq) {
  if (device::ld_acquire_sys_u64(flag) >= value) return false;
  const uint64_t start = device::globaltimer_ns();
  uint32_t spins = 0;
  while (device::ld_acquire_sys_u64(flag) < value) {
    if ((++spins & 255u) == 0u) {
      if (device::ld_volatile_u32(&bar.state->poisoned) != 0) return true;
      const uint64_t elapsed = device::globaltimer_ns() - start;
      if (elapsed > bar.timeout_ns) {
        device::record_timeout(bar.state, bar.error, bar.rank, peer, static_cast<int>(phase), elapsed, seq);
        return true;
      }
    }
  }
  return false;
}

// Thread q < num_peers (q != rank) waits for flags[q][b] of this rank's piece. Block-wide: every
// thread calls it; the __syncthreads_or makes the acquired writes visible to the whole block.
// Returns true on every thread if a wait failed.
__device__ __forceinline__ bool wait_block(const EPParams& p, size_t flags, uint64_t value, EPPhaseId phase,
                                           uint64_t seq, int num_peers) {
  const int q = static_cast<int>(threadIdx.x);
  bool failed = false;
  if (q < num_peers && q != p.rank) {
    failed = wait_flag(piece<uint64_t>(p, p.rank, flags) + slot(p, q, blockIdx.x), value, p.barrier, q, phase, seq);
  }
  return __syncthreads_or(failed) != 0;
}

// The same for one warp (lane q waits for rank q < num_peers); __syncwarp shares the visibility.
__device__ __forceinline__ bool wait_warp(const EPParams& p, size_t flags, uint64_t value, EPPhaseId phase,
                                          uint64_t seq, int num_peers, int lane) {
  bool failed = false;
  if (lane < num_peers && lane != p.rank) {
    failed = wait_flag(piece<uint64_t>(p, p.rank, flags) + slot(p, lane, blockIdx.x), value, p.barrier, lane, phase,
                       seq);
  }
  failed = __any_sync(kFullMask, failed);
  __syncwarp();
  return failed;
}

// The caller's thread number q (within the group that just passed a barrier) raises flags[rank][b]
// in rank q's piece, for q < world, q != rank (release, system scope: publishes every write this
// block made before the preceding barrier, cumulatively).
__device__ __forceinline__ void signal_peers(const EPParams& p, size_t flags, uint64_t value, int q) {
  if (q < p.world_size && q != p.rank) {
    device::st_release_sys_u64(piece<uint64_t>(p, q, flags) + slot(p, p.rank, blockIdx.x), value);
  }
}

// ---- warp-wide row operations ----

__device__ __forceinline__ bool aligned16(const void* a) { return (reinterpret_cast<uintptr_t>(a) & 15u) == 0; }

// Appends this lane's item to a warp list in lane order (lanes with keep == false skip); returns
// the list length. The list is in shared memory; the trailing __syncwarp publishes it to the warp.
template <typename U>
__device__ __forceinline__ int warp_list(U* list, bool keep, const U& item) {
  const unsigned mask = __ballot_sync(kFullMask, keep);
  if (keep) list[__popc(mask & lanemask_lt())] = item;
  __syncwarp();
  return __popc(mask);
}

// A row is split into `parts` column ranges of whole packs when there are fewer rows than warps
// (decode sizes), so that several warps share one row.
struct Cols {
  int64_t begin, end;  // elements
};

template <typename T>
__device__ __forceinline__ Cols cols_of(int64_t hidden, int part, int parts) {
  constexpr int N = device::Vec<T>::kNumElems;
  const int64_t per = ((hidden + N - 1) / N + parts - 1) / parts * N;
  return {min64(part * per, hidden), min64((part + 1) * per, hidden)};
}

// Parts per row for `items` rows shared by `workers` warps (at least 64 packs a part).
template <typename T>
__device__ __forceinline__ int parts_for(int64_t items, int workers, int64_t hidden) {
  constexpr int N = device::Vec<T>::kNumElems;
  if (items <= 0 || items >= workers) return 1;
  const int64_t most = max64(1, (hidden + 64 * N - 1) / (64 * N));
  return static_cast<int>(min64(workers / items, most));
}

template <typename T>
__device__ __forceinline__ void load_packs(device::Vec<T> (&buf)[kCopyUnroll], const T* src, int64_t base,
                                           int64_t num_packs, int lane) {
  constexpr int N = device::Vec<T>::kNumElems;
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t v = base + u * 32 + lane;
    if (v < num_packs) buf[u] = device::Vec<T>::load(src + v * N);
  }
}

// Copies columns [cols.begin, cols.end) of one row to the rows that `resolve()` lists with the
// lanes of a warp: the source is read once. The first packs are loaded before `resolve` runs, so
// its own loads (the routing that decides the destinations) overlap them. `resolve` fills `list`
// and returns its length (warp-uniform, after a __syncwarp).
template <typename T, typename Resolve>
__device__ __forceinline__ void copy_row(T** list, const T* src, int64_t hidden, Cols cols, int lane,
                                         Resolve&& resolve) {
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  bool vec = aligned16(src) && (hidden * sizeof(T)) % 16 == 0;
  const int64_t first = cols.begin / N, num_packs = cols.end / N;
  V buf[kCopyUnroll];
  if (vec) load_packs(buf, src, first, num_packs, lane);
  const int num_dsts = resolve();
  for (int i = 0; i < num_dsts; ++i) vec = vec && aligned16(list[i]);
  if (vec) {
    for (int64_t base = first; base < num_packs; base += 32 * kCopyUnroll) {
      if (base != first) load_packs(buf, src, base, num_packs, lane);
      for (int i = 0; i < num_dsts; ++i) {
        T* dst = list[i];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int64_t v = base + u * 32 + lane;
          if (v < num_packs) buf[u].store(dst + v * N);
        }
      }
    }
  } else {
    for (int64_t e = cols.begin + lane; e < cols.end; e += 32) {
      const T value = src[e];
      for (int i = 0; i < num_dsts; ++i) list[i][e] = value;
    }
  }
}

// Packs [first, num_packs) of dst = round(sum over r ascending of fp32(w[r]) * fp32(src[r])),
// kPacks packs per lane at a time. The packs of up to kBatch sources are all loaded before any is
// accumulated (one memory latency per kBatch sources, not one per source); the accumulation
// order, and so every rounding, is the same as one source after the other.
template <typename T, int kBatch, int kPacks>
__device__ __forceinline__ void weighted_sum_packs(T* dst, const T* const* srcs, const float* ws, int num_srcs,
                                                   int64_t first, int64_t num_packs, int lane) {
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  for (int64_t base = first; base < num_packs; base += 32 * kPacks) {
    device::Acc<N> acc[kPacks];
#pragma unroll
    for (int u = 0; u < kPacks; ++u) {
#pragma unroll
      for (int i = 0; i < N; ++i) acc[u].v[i] = 0.0f;
    }
    for (int r0 = 0; r0 < num_srcs; r0 += kBatch) {
      // The pointers first, then plain 16-byte loads that the compiler may schedule freely
      // (Vec::load is an asm with a memory clobber, which here made ptxas spill).
      const T* src[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) src[i] = r0 + i < num_srcs ? srcs[r0 + i] : nullptr;
      V y[kBatch][kPacks];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (r0 + i < num_srcs) {
#pragma unroll
          for (int u = 0; u < kPacks; ++u) {
            const int64_t v = base + u * 32 + lane;
            if (v < num_packs) *reinterpret_cast<uint4*>(&y[i][u]) = *reinterpret_cast<const uint4*>(src[i] + v * N);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (r0 + i < num_srcs) {
          const float w = ws != nullptr ? ws[r0 + i] : 1.0f;
#pragma unroll
          for (int u = 0; u < kPacks; ++u) {
#pragma unroll
            for (int k = 0; k < N; ++k) {
              acc[u].v[k] = __fadd_rn(acc[u].v[k], __fmul_rn(w, device::to_float<T>(y[i][u].elems[k])));
            }
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kPacks; ++u) {
      const int64_t v = base + u * 32 + lane;
      if (v < num_packs) device::acc_cast<T, N>(acc[u]).store(dst + v * N);
    }
  }
}

// dst = round(sum over r ascending of fp32(w[r]) * fp32(src[r])) with separate rounding of every
// product and sum (Note [EP layout]: no fused multiply-add); no sources gives zeros; ws == nullptr
// means every weight is 1. srcs and ws are the warp's lists in shared memory.
template <typename T>
__device__ __forceinline__ void weighted_sum_row(T* dst, const T* const* srcs, const float* ws, int num_srcs,
                                                 int64_t hidden, Cols cols, int lane) {
  constexpr int N = device::Vec<T>::kNumElems;
  bool vec = aligned16(dst) && (hidden * sizeof(T)) % 16 == 0;
  for (int r = 0; r < num_srcs; ++r) vec = vec && aligned16(srcs[r]);
  if (vec) {
    // Registers: kBatch * kPacks packs of sources plus kPacks fp32 accumulators per lane.
    const int64_t first = cols.begin / N, num_packs = cols.end / N;
    if (num_srcs <= 1) {
      weighted_sum_packs<T, 1, 4>(dst, srcs, ws, num_srcs, first, num_packs, lane);
    } else if (num_srcs <= 2) {
      weighted_sum_packs<T, 2, 2>(dst, srcs, ws, num_srcs, first, num_packs, lane);
    } else {
      weighted_sum_packs<T, 4, 2>(dst, srcs, ws, num_srcs, first, num_packs, lane);
    }
  } else {
    for (int64_t e = cols.begin + lane; e < cols.end; e += 32) {
      float acc = 0.0f;
      for (int r = 0; r < num_srcs; ++r) {
        acc = __fadd_rn(acc, __fmul_rn(ws != nullptr ? ws[r] : 1.0f, device::to_float<T>(srcs[r][e])));
      }
      dst[e] = device::from_float<T>(acc);
    }
  }
}

// dst = round(sum over r ascending of fp32(src[r])); no sources gives zeros. The same arithmetic
// as weighted_sum_row with every weight 1 (a product by 1.0f is exact).
template <typename T>
__device__ __forceinline__ void sum_rows(T* dst, const T* const* srcs, int num_srcs, int64_t hidden, Cols cols,
                                         int lane) {
  weighted_sum_row(dst, srcs, nullptr, num_srcs, hidden, cols, lane);
}

// ---- dispatch ----

// sum over q < s of totals[q][b][l] in this rank's piece, the loads all in flight together.
__device__ __forceinline__ int64_t lower_totals(const EPParams& p, int s, int64_t l) {
  int32_t v[kMaxDeviceRanks];
#pragma unroll
  for (int q = 0; q < kMaxDeviceRanks; ++q) v[q] = q < s ? totals_of(p, p.rank, q, blockIdx.x)[l] : 0;
  int64_t sum = 0;
#pragma unroll
  for (int q = 0; q < kMaxDeviceRanks; ++q) sum += v[q];
  return sum;
}

// Token t of source s (chunk of this block) into this rank's expert rows: route (s, t, k) to local
// expert l lands at base(s, l) + j (Note [EP GPU protocol]); recv_pos records it (-1: dropped).
// base(s, l) is base[l] (staged in shared memory), or with base == nullptr the lower ranks' totals
// (the own chunk, expanded before the data flags). The row's first packs, the route's expert and
// its j are loaded together.
template <typename T>
__device__ __forceinline__ void expand_token(const EPParams& p, int s, int64_t t, const T* src, const int32_t* base,
                                             T** list, Cols cols, int lane) {
  const EPConfig& c = p.config;
  const int me = p.rank;
  const int64_t num_local = c.num_experts / p.world_size;
  copy_row(list, src, c.hidden, cols, lane, [&] {
    T* dst = nullptr;
    bool keep = false;
    if (lane < c.topk) {
      const size_t at = route(p, s, t * c.topk + lane);
      const int32_t e = piece<const int32_t>(p, me, p.layout.meta_idx)[at];
      const int32_t j = piece<const int32_t>(p, me, p.layout.meta_j)[at];
      if (e >= 0 && e / num_local == me) {
        const int64_t l = e - me * num_local;
        const int64_t pos = j + (base != nullptr ? static_cast<int64_t>(base[l]) : lower_totals(p, s, l));
        keep = pos < c.capacity;
        p.recv_pos[at] = keep ? static_cast<int32_t>(pos) : -1;
        if (keep) dst = static_cast<T*>(p.expert_x) + (l * c.capacity + pos) * c.hidden;
      }
    }
    return warp_list(list, keep, dst);
  });
  __syncwarp();  // the list is rewritten by the next token
}

// kCountBatch routes of this rank, kMetaThreads apart from `first` (-1: none or invalid).
__device__ __forceinline__ void load_routes(int32_t (&e)[kCountBatch], const int64_t* topk_idx, int64_t first,
                                            int64_t num_routes, int64_t num_experts) {
#pragma unroll
  for (int u = 0; u < kCountBatch; ++u) {
    const int64_t i = first + static_cast<int64_t>(u) * kMetaThreads;
    e[u] = i < num_routes ? sanitize(topk_idx[i], num_experts) : -1;
  }
}

// Steps 1-2 of the dispatch send (Note [EP GPU protocol]) on the meta warps: counts, then the meta
// of chunk b to every rank. Ends with the arrival at the push warps' data barrier and the meta
// flags. `counts` is the block's [2][num_experts] shared array.
template <typename T>
__device__ __forceinline__ void send_meta(const EPParams& p, int32_t* counts, uint64_t value, int warp, int lane) {
  const EPConfig& c = p.config;
  const int n = p.world_size, me = p.rank, b = blockIdx.x;
  const int topk = static_cast<int>(c.topk);
  const int64_t num_experts = c.num_experts, num_local = num_experts / n;
  const int tid = static_cast<int>(threadIdx.x) - kPushWarps * 32;
  const bool walker = warp == kPushWarps;  // the warp that walks chunk b's routes in (t, k) order
  const int64_t num_tokens = p.num_tokens;
  const int64_t num_routes = num_tokens * topk;
  const int64_t t_begin = b * p.tokens_per_block;
  const int64_t chunk_first = t_begin * topk;
  const int64_t chunk_end = min64(num_tokens, t_begin + p.tokens_per_block) * topk;
  int32_t* before = counts;  // routes to e before chunk b (then running, during the walk)
  int32_t* totals = counts + num_experts;

  // The walker's first routes and every thread's first count batch: in flight together.
  int64_t raw = -1;
  float weight = 0.0f;
  if (walker && chunk_first + lane < chunk_end) {
    raw = p.topk_idx[chunk_first + lane];
    weight = p.topk_weights[chunk_first + lane];
  }
  int32_t batch[kCountBatch];
  load_routes(batch, p.topk_idx, tid, num_routes, num_experts);
  for (int64_t e = tid; e < 2 * num_experts; e += kMetaThreads) counts[e] = 0;
  named_barrier(kMetaBarrier, kMetaThreads);

  // 1. Per-expert counts of all this rank's routes (order-free: shared atomics).
  for (int64_t first = tid; first < num_routes; first += static_cast<int64_t>(kCountBatch) * kMetaThreads) {
    if (first != tid) load_routes(batch, p.topk_idx, first, num_routes, num_experts);
#pragma unroll
    for (int u = 0; u < kCountBatch; ++u) {
      if (batch[u] < 0) continue;
      atomicAdd(&totals[batch[u]], 1);
      if (first + static_cast<int64_t>(u) * kMetaThreads < chunk_first) atomicAdd(&before[batch[u]], 1);
    }
  }
  named_barrier(kMetaBarrier, kMetaThreads);

  // 2. Meta of this chunk to every rank: token count, the totals of its experts, idx / w / j.
  for (int d = 0; d < n; ++d) {
    int32_t* dst = totals_of(p, d, me, b);
    for (int64_t l = tid; l < num_local; l += kMetaThreads) dst[l] = totals[d * num_local + l];
  }
  if (tid < n) piece<int32_t>(p, tid, p.layout.num_tokens)[slot(p, me, b)] = static_cast<int32_t>(num_tokens);
  if (walker) {
    for (int64_t first = chunk_first; first < chunk_end; first += 32) {
      const int64_t i = first + lane;
      const bool active = i < chunk_end;
      // The next step's routes, in flight while this step is written.
      int64_t next_raw = -1;
      float next_weight = 0.0f;
      if (i + 32 < chunk_end) {
        next_raw = p.topk_idx[i + 32];
        next_weight = p.topk_weights[i + 32];
      }
      const int32_t e = sanitize(raw, num_experts);
      if (active && raw != -1 && e < 0) {
        // Counted on this rank (EPBuffer.check raises) and treated as -1.
        atomicAdd(reinterpret_cast<unsigned long long*>(piece<int64_t>(p, me, p.layout.overflow)) + 2, 1ull);
      }
      const unsigned same = __match_any_sync(kFullMask, e);
      int32_t j = -1;
      if (e >= 0) j = before[e] + __popc(same & lanemask_lt());
      __syncwarp();
      if (e >= 0 && lane == __ffs(same) - 1) before[e] += __popc(same);
      __syncwarp();
      if (active) {
        const size_t at = route(p, me, i);
        for (int d = 0; d < n; ++d) {
          piece<int32_t>(p, d, p.layout.meta_idx)[at] = e;
          piece<float>(p, d, p.layout.meta_w)[at] = weight;
          piece<int32_t>(p, d, p.layout.meta_j)[at] = j;
        }
      }
      raw = next_raw;
      weight = next_weight;
    }
  }
  // This thread's meta writes happen-before the push warps' data release (which covers the meta
  // too), without waiting for them; then every meta write of the block before the meta release.
  named_barrier_arrive(kDataBarrier, kThreads);
  named_barrier(kMetaBarrier, kMetaThreads);
  signal_peers(p, p.layout.meta_flags, value, tid);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ep_dispatch_kernel(EPParams p, EPMode mode) {
  // Send: [2][num_experts] route counts (send_meta). Receive, once the data flags are in (the
  // counts are dead by then): base[s][l] = sum over s' < s of totals[s'][b][l], s in [0, world].
  extern __shared__ int32_t counts[];
  __shared__ T* lists[kWarps][kEPMaxTopk];
  __shared__ int32_t chunk_sizes[kMaxDeviceRanks];
  const EPConfig& c = p.config;
  const bool send = has(mode, EPMode::kSend), recv = has(mode, EPMode::kRecv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = p.world_size, me = p.rank, b = blockIdx.x;
  const int topk = static_cast<int>(c.topk);
  const int64_t num_experts = c.num_experts, num_local = num_experts / n;
  const int64_t t_begin = b * p.tokens_per_block;
  // Both in flight at once (the sequence number is only used when not poisoned).
  const uint32_t poisoned = device::ld_volatile_u32(&p.barrier.state->poisoned);
  const uint64_t seq = device::ld_volatile_u64(seq_of(p, b));
  if (poisoned != 0) return;
  const uint64_t value = seq + 1;
  bool failed = false;
  trace(EPTracePoint::kDispatchStart, 0);

  if (send) {
    const int64_t items = clamp64(p.num_tokens - t_begin, 0, p.tokens_per_block);
    if (warp < kPushWarps) {
      // 3. Rows (they need only x and topk_idx, so they start at once): each token of the chunk is
      // stored once into land_x[me][t] of every remote rank owning one of its experts.
      const int parts = parts_for<T>(items, kPushWarps, c.hidden);
      for (int64_t w = warp; w < items * parts; w += kPushWarps) {
        const int64_t t = t_begin + w / parts;
        copy_row(lists[warp], static_cast<const T*>(p.x) + t * c.hidden, c.hidden,
                 cols_of<T>(c.hidden, static_cast<int>(w % parts), parts), lane, [&] {
                   const int32_t e = lane < topk ? sanitize(p.topk_idx[t * topk + lane], num_experts) : -1;
                   const unsigned owners =
                       __reduce_or_sync(kFullMask, e >= 0 ? 1u << static_cast<unsigned>(e / num_local) : 0u);
                   const bool keep = lane < n && lane != me && ((owners >> lane) & 1u);
                   return warp_list(lists[warp], keep, keep ? piece<T>(p, lane, p.layout.land_x) + row(p, me, t) : nullptr);
                 });
        __syncwarp();  // the list is rewritten by the next token
      }
      // The rows of this group and (bar.arrive) the meta warps' writes, then one release per peer.
      trace(EPTracePoint::kDispatchRowsPushed, 0);
      named_barrier(kDataBarrier, kThreads);
      signal_peers(p, p.layout.data_flags, value, static_cast<int>(threadIdx.x));
      trace(EPTracePoint::kDispatchDataSignalled, 0);
    } else {
      send_meta<T>(p, counts, value, warp, lane);
      trace(EPTracePoint::kDispatchMetaSignalled, kPushWarps * 32);
      if (recv) {
        // Fused kernel: the own chunk from x meanwhile. Its positions need the totals of the ranks
        // below this one: their meta flags only.
        failed = wait_warp(p, p.layout.meta_flags, value, EPPhaseId::kDispatchMeta, seq, me, lane);
        if (!failed) {
          constexpr int kWorkers = kWarps - kPushWarps;
          const int parts = parts_for<T>(items, kWorkers, c.hidden);
          for (int64_t w = warp - kPushWarps; w < items * parts; w += kWorkers) {
            const int64_t t = t_begin + w / parts;
            expand_token<T>(p, me, t, static_cast<const T*>(p.x) + t * c.hidden, nullptr, lists[warp],
                            cols_of<T>(c.hidden, static_cast<int>(w % parts), parts), lane);
          }
        }
        trace(EPTracePoint::kDispatchOwnExpanded, kPushWarps * 32);
      }
    }
    if (!recv) return;
  }

  // 4. Peers' chunks (and in a receive-only launch the own one), once their rows and, cumulatively,
  // their meta have landed.
  if (__syncthreads_or(failed)) return;
  if (wait_block(p, p.layout.data_flags, value, EPPhaseId::kDispatchLanded, seq, n)) return;
  trace(EPTracePoint::kDispatchDataLanded, 0);
  // Stage the chunk sizes and the prefix of the totals (all loads in flight together; registers
  // first, so no shared store sits between two of them).
  int32_t* base = counts;
  const int32_t my_size = static_cast<int>(threadIdx.x) < n ? chunk_tokens(p, static_cast<int>(threadIdx.x), b) : 0;
  for (int64_t l = threadIdx.x; l < num_local; l += kThreads) {
    int32_t tot[kMaxDeviceRanks];
#pragma unroll
    for (int q = 0; q < kMaxDeviceRanks; ++q) tot[q] = q < n ? totals_of(p, me, q, b)[l] : 0;
    int32_t run = 0;
#pragma unroll
    for (int q = 0; q < kMaxDeviceRanks; ++q) {
      if (q < n) {
        base[q * num_local + l] = run;
        run += tot[q];
      }
    }
    base[n * num_local + l] = run;
  }
  if (static_cast<int>(threadIdx.x) < n) chunk_sizes[threadIdx.x] = my_size;
  __syncthreads();
  if (b == 0) {
    // Every owner raises the overflow word of every rank for its own experts.
    for (int64_t l = threadIdx.x; l < num_local; l += kThreads) {
      const int64_t total = base[n * num_local + l];
      p.expert_counts[l] = static_cast<int32_t>(min64(total, c.capacity));
      if (total > c.capacity) {
        const int64_t e = me * num_local + l;
        for (int d = 0; d < n; ++d) {
          auto* word = reinterpret_cast<unsigned long long*>(piece<int64_t>(p, d, p.layout.overflow));
          atomicAdd_system(word, static_cast<unsigned long long>(total - c.capacity));
          atomicMax_system(word + 1, (static_cast<unsigned long long>(total) << 24) | static_cast<unsigned long long>(e));
        }
      }
    }
  }
  const int skip = send ? me : -1;  // the fused kernel expanded the own chunk already
  const int64_t items = total_tokens(chunk_sizes, n, skip);
  const int parts = parts_for<T>(items, kWarps, c.hidden);
  for (int64_t w = warp; w < items * parts; w += kWarps) {
    const auto [s, t] = nth_token(chunk_sizes, n, t_begin, skip, w / parts);
    const T* src = s == me ? static_cast<const T*>(p.x) + t * c.hidden : piece<const T>(p, me, p.layout.land_x) + row(p, s, t);
    expand_token<T>(p, s, t, src, base + s * num_local, lists[warp],
                    cols_of<T>(c.hidden, static_cast<int>(w % parts), parts), lane);
  }
  trace(EPTracePoint::kDispatchEnd, 0);
}

// ---- combine ----

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ep_combine_kernel(EPParams p, EPMode mode) {
  __shared__ const T* srcs[kWarps][kEPMaxTopk];
  __shared__ float weights[kWarps][kEPMaxTopk];
  __shared__ int32_t chunk_sizes[kMaxDeviceRanks];
  const EPConfig& c = p.config;
  const bool send = has(mode, EPMode::kSend), recv = has(mode, EPMode::kRecv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = p.world_size, me = p.rank, b = blockIdx.x;
  const int topk = static_cast<int>(c.topk);
  const int64_t num_local = c.num_experts / n;
  const int64_t t_begin = b * p.tokens_per_block;
  // The poison word, this block's sequence number and every source's token count of chunk b (its
  // dispatch slot in this piece): in flight together.
  const uint32_t poisoned = device::ld_volatile_u32(&p.barrier.state->poisoned);
  const uint64_t seq = device::ld_volatile_u64(seq_of(p, b));
  const int32_t my_size = static_cast<int>(threadIdx.x) < n ? chunk_tokens(p, static_cast<int>(threadIdx.x), b) : 0;
  if (poisoned != 0) return;
  const uint64_t value = seq + 1;
  trace(EPTracePoint::kCombineStart, 0);
  if (static_cast<int>(threadIdx.x) < n) chunk_sizes[threadIdx.x] = my_size;
  __syncthreads();
  const int32_t* meta_idx = piece<const int32_t>(p, me, p.layout.meta_idx);
  // Receive part: this warp's first own token's experts (written by this rank's dispatch), loaded
  // now so that they are in registers when the partials land.
  const int64_t own_items = chunk_sizes[me];
  const int own_parts = parts_for<T>(own_items, kWarps, c.hidden);
  int32_t first_e = -1;
  if (recv && warp < own_items * own_parts && lane < topk) {
    first_e = meta_idx[route(p, me, (t_begin + warp / own_parts) * topk + lane)];
  }

  if (send) {
    // Partials of this rank's routes for every source's tokens of chunk b (the own ones too).
    const float* meta_w = piece<const float>(p, me, p.layout.meta_w);
    const T* expert_out = static_cast<const T*>(p.expert_out);
    const int64_t items = total_tokens(chunk_sizes, n, -1);
    const int parts = parts_for<T>(items, kWarps, c.hidden);
    for (int64_t item = warp; item < items * parts; item += kWarps) {
      const auto [s, t] = nth_token(chunk_sizes, n, t_begin, -1, item / parts);
      bool local = false, keep = false;
      const T* y = nullptr;
      float w = 0.0f;
      if (lane < topk) {
        // Three independent loads in flight together (pos and w only matter for local routes).
        const size_t at = route(p, s, t * topk + lane);
        const int32_t e = meta_idx[at];
        const int32_t pos = p.recv_pos[at];
        w = meta_w[at];
        local = e >= 0 && e / num_local == me;
        keep = local && pos >= 0;
        if (keep) y = expert_out + ((e - me * num_local) * c.capacity + pos) * c.hidden;
      }
      if (!__any_sync(kFullMask, local)) continue;
      const unsigned mask = __ballot_sync(kFullMask, keep);
      if (keep) {
        const int at = __popc(mask & lanemask_lt());
        srcs[warp][at] = y;
        weights[warp][at] = w;
      }
      __syncwarp();
      T* dst = piece<T>(p, s, p.layout.land_y) + row(p, me, t);
      weighted_sum_row(dst, srcs[warp], weights[warp], __popc(mask), c.hidden,
                       cols_of<T>(c.hidden, static_cast<int>(item % parts), parts), lane);
      __syncwarp();  // the lists are rewritten by the next token
    }
    __syncthreads();
    signal_peers(p, p.layout.combine_flags, value, static_cast<int>(threadIdx.x));
    trace(EPTracePoint::kCombineSignalled, 0);
  }
  if (!recv) return;

  if (wait_block(p, p.layout.combine_flags, value, EPPhaseId::kCombineLanded, seq, n)) return;
  trace(EPTracePoint::kCombineLanded, 0);
  const T* land_y = piece<const T>(p, me, p.layout.land_y);
  for (int64_t w = warp; w < own_items * own_parts; w += kWarps) {
    const int64_t t = t_begin + w / own_parts;
    const int32_t e = w == warp ? first_e : (lane < topk ? meta_idx[route(p, me, t * topk + lane)] : -1);
    const unsigned owners = __reduce_or_sync(kFullMask, e >= 0 ? 1u << static_cast<unsigned>(e / num_local) : 0u);
    const bool keep = lane < n && ((owners >> lane) & 1u);
    const int num_srcs = warp_list(srcs[warp], keep, keep ? land_y + row(p, lane, t) : nullptr);
    sum_rows(static_cast<T*>(p.out) + t * c.hidden, srcs[warp], num_srcs, c.hidden,
             cols_of<T>(c.hidden, static_cast<int>(w % own_parts), own_parts), lane);
    __syncwarp();
  }
  // Block b's pair is complete: the next dispatch's block b (stream order) reads seq + 1. Every
  // thread of the block read seq before the barrier in wait_block, so none reads the new value.
  if (threadIdx.x == 0) *seq_of(p, b) = seq + 1;
  trace(EPTracePoint::kCombineEnd, 0);
}

Status cuda_status(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::ok();
  return Status(StatusCode::kCudaError, detail::concat(what, ": kernel launch failed: ", cudaGetErrorString(err)));
}

Status check_params(const EPParams& p, const char* what) {
  if (p.world_size < 1 || p.world_size > kMaxDeviceRanks) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": world_size ", p.world_size, " not supported; valid: 1..", kMaxDeviceRanks));
  }
  if (p.config.topk < 1 || p.config.topk > kEPMaxTopk) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": topk ", p.config.topk, " out of range 1..", kEPMaxTopk));
  }
  if (p.config.num_experts > kEPMaxExpertsCuda) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": num_experts ", p.config.num_experts,
                                                               " not supported on CUDA; valid: up to ", kEPMaxExpertsCuda));
  }
  if (p.num_tokens < 0 || p.num_tokens > p.config.max_tokens_per_rank) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": num_tokens ", p.num_tokens, " out of range"));
  }
  if (p.num_blocks < 1 || p.num_blocks > kEPMaxBlocks ||
      p.tokens_per_block * p.num_blocks < p.config.max_tokens_per_rank) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": grid of ", p.num_blocks, " blocks x ", p.tokens_per_block,
                                 " tokens does not cover max_tokens_per_rank ", p.config.max_tokens_per_rank));
  }
  return Status::ok();
}

}  // namespace

std::vector<int64_t> ep_trace_snapshot() {
#if defined(COMMLIB_EP_TRACE)
  unsigned long long values[kEPTracePoints] = {};
  if (cudaMemcpyFromSymbol(values, g_ep_trace, sizeof(values)) != cudaSuccess) return {};
  return std::vector<int64_t>(values, values + kEPTracePoints);
#else
  return {};
#endif
}

const char* ep_phase_name(int phase) {
  switch (static_cast<EPPhaseId>(phase)) {
    case EPPhaseId::kDispatchLanded: return "EP dispatch: tokens landed";
    case EPPhaseId::kCombineLanded: return "EP combine: partials landed";
    case EPPhaseId::kDispatchMeta: return "EP dispatch: routing counts landed";
  }
  return "unknown phase";
}

int ep_threads_per_block() { return kThreads; }

int ep_num_blocks(const EPConfig& c, int max_blocks) {
  const int64_t wanted = (c.max_tokens_per_rank + kMinTokensPerBlock - 1) / kMinTokensPerBlock;
  return static_cast<int>(std::clamp<int64_t>(wanted, 1, std::clamp(max_blocks, 1, kEPMaxBlocks)));
}

EPSymmetricLayout ep_symmetric_layout(const EPConfig& c, int world_size, int num_blocks) {
  constexpr size_t kAlign = 256;
  const size_t slots = static_cast<size_t>(world_size) * num_blocks;
  const size_t meta = static_cast<size_t>(world_size) * c.max_tokens_per_rank * c.topk;
  const size_t rows = static_cast<size_t>(world_size) * c.max_tokens_per_rank * c.hidden * dtype_size(c.dtype);
  const size_t num_local = static_cast<size_t>(c.num_experts / world_size);
  EPSymmetricLayout l;
  size_t at = 0;
  auto take = [&](size_t& field, size_t bytes) {
    field = at;
    at = align_up(at + bytes, kAlign);
  };
  take(l.seq, static_cast<size_t>(num_blocks) * sizeof(uint64_t));
  take(l.overflow, kEPOverflowWords * sizeof(int64_t));
  take(l.meta_flags, slots * sizeof(uint64_t));
  take(l.data_flags, slots * sizeof(uint64_t));
  take(l.combine_flags, slots * sizeof(uint64_t));
  l.control_end = at;
  take(l.num_tokens, slots * sizeof(int32_t));
  take(l.totals, slots * num_local * sizeof(int32_t));
  take(l.meta_idx, meta * sizeof(int32_t));
  take(l.meta_w, meta * sizeof(float));
  take(l.meta_j, meta * sizeof(int32_t));
  take(l.land_x, rows);
  take(l.land_y, rows);
  l.total = at;
  return l;
}

Status launch_ep_dispatch(const EPParams& p, EPMode mode, Stream stream) {
  const char* what = has(mode, EPMode::kSend) ? "EPBuffer.dispatch" : "EPBuffer.dispatch_recv";
  Status status = check_params(p, what);
  if (!status.is_ok()) return status;
  const size_t smem = 2 * static_cast<size_t>(p.config.num_experts) * sizeof(int32_t);
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.config.dtype, T, return Status(StatusCode::kInvalidArgument, what), [&] {
    ep_dispatch_kernel<T><<<p.num_blocks, kThreads, smem, stream>>>(p, mode);
  });
  return cuda_status(what);
}

Status launch_ep_combine(const EPParams& p, EPMode mode, Stream stream) {
  const char* what = has(mode, EPMode::kSend) ? "EPBuffer.combine" : "EPBuffer.combine_recv";
  Status status = check_params(p, what);
  if (!status.is_ok()) return status;
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.config.dtype, T, return Status(StatusCode::kInvalidArgument, what), [&] {
    ep_combine_kernel<T><<<p.num_blocks, kThreads, 0, stream>>>(p, mode);
  });
  return cuda_status(what);
}

}  // namespace commlib::kernels
