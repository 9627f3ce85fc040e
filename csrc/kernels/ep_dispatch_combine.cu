// Expert-parallel dispatch / combine on symmetric memory: Note [EP GPU protocol] (ep_params.hpp)
// implementing Note [EP layout] (include/commlib/ep.hpp). Two kernels, each one launch per phase
// (or two, send and receive, for the split-phase API).
#include <cuda_runtime.h>

#include <algorithm>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "commlib/device/vec.cuh"
#include "kernels/ep_params.hpp"
#include "kernels/pdl.cuh"

namespace commlib::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Warps of a fused dispatch block that push rows to peers in decode grids (rows split into column
// parts); the others expand the own chunk meanwhile. 4 was slower at 32-128 tokens.
constexpr int kPushWarps = kWarps / 2;
// The same for large grids (one column part a row): the pushes are bound by the link, the own
// chunk's expansion by the warps doing it; of 2, 4, 6, 8 and 12, 4 was fastest. Both measured at
// world 2 (bench/results/ep-dispatch-combine-2026-11-30-j.md, -k.md).
constexpr int kPushWarpsLarge = 4;
constexpr unsigned kFullMask = 0xffffffffu;
// 16-byte packs in flight per lane in a row copy, and those an expansion loads before it reads the
// routing (Note [EP GPU protocol]: one per lane covers a decode row's part).
constexpr int kCopyUnroll = 8;
constexpr int kExpandFirstUnroll = 1;
// Packs in flight per lane in the combine's sums, as (packs a lane per source, sources loaded
// together) (weighted_sum_packs). Grids whose rows are split into column parts (decode sizes: a
// lane holds about one pack of a row) load the routes of a token together, and the owner ranks'
// partials two at a time; others load 4 packs a lane of one source after another. Measured at
// world 1 (bench/results/ep-local-2026-11-30.md); larger shapes spill (512 threads leave 128
// registers a thread).
struct SumShape {
  int unroll, sources;
};
constexpr SumShape kRouteSumDecode{1, 8}, kRankSumDecode{2, 2}, kSumLarge{4, 1};
// Smallest chunk of tokens (more chunks than this only add flag traffic).
constexpr int64_t kMinTokensPerChunk = 2;
// Blocks the grid aims for when chunks are few (decode): chunks x column parts (Note [EP GPU protocol]).
constexpr int kTargetBlocks = 128;
// Smallest column range of one warp when several warps share a row: one 16-byte pack per lane.
constexpr int64_t kMinPacksPerWarp = 32;
// Named barrier id of the pushing warps (0 is __syncthreads).
constexpr int kPushBarrier = 1;

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

// Slot of writer s, block b in a [world][blocks] array (the flags).
__device__ __forceinline__ size_t slot(const EPParams& p, int s, int b) {
  return static_cast<size_t>(s) * p.grid.num_blocks() + b;
}

// Slot of writer s, chunk i in a [world][chunks] array (token counts, totals).
__device__ __forceinline__ size_t chunk_slot(const EPParams& p, int s, int i) {
  return static_cast<size_t>(s) * p.grid.num_chunks + i;
}

// This block's place in the grid: block (chunk, part); lead is the block index of (chunk, 0).
struct BlockRole {
  int chunk, part, lead;
};

__device__ __forceinline__ BlockRole block_role(const EPParams& p) {
  const int b = static_cast<int>(blockIdx.x);
  return {b / p.grid.num_parts, b % p.grid.num_parts, b - b % p.grid.num_parts};
}

// Rank sets as bit masks (bit q: rank q).
__device__ __forceinline__ unsigned all_ranks(const EPParams& p) { return (1u << p.world_size) - 1u; }
__device__ __forceinline__ unsigned self_rank(const EPParams& p) { return 1u << p.rank; }
__device__ __forceinline__ unsigned other_ranks(const EPParams& p) { return all_ranks(p) & ~self_rank(p); }
__device__ __forceinline__ unsigned ranks_below(const EPParams& p) { return self_rank(p) - 1u; }

// Route i = t * topk + k of source s in a [world][max_tokens][topk] array.
__device__ __forceinline__ size_t route(const EPParams& p, int s, int64_t i) {
  return static_cast<size_t>(s) * p.config.max_tokens_per_rank * p.config.topk + i;
}

// Row t of writer s in a [world][max_tokens][hidden] array (elements).
__device__ __forceinline__ size_t row(const EPParams& p, int s, int64_t t) {
  return (static_cast<size_t>(s) * p.config.max_tokens_per_rank + t) * p.config.hidden;
}

// Tokens of source s in chunk i (s's token count comes from its slot in this rank's piece).
__device__ __forceinline__ int64_t chunk_tokens(const EPParams& p, int s, int i) {
  const int64_t num_tokens = piece<const int32_t>(p, p.rank, p.layout.num_tokens)[chunk_slot(p, s, i)];
  return clamp64(num_tokens - i * p.grid.tokens_per_chunk, 0, p.grid.tokens_per_chunk);
}

struct SourceToken {
  int s;
  int64_t t;
};

// The r-th token of chunk i over the sources in rank order (skipping `skip`, -1 for none).
__device__ __forceinline__ SourceToken nth_token(const EPParams& p, int i, int skip, int64_t r) {
  int s = 0;
  for (; s < p.world_size; ++s) {
    if (s == skip) continue;
    const int64_t count = chunk_tokens(p, s, i);
    if (r < count) break;
    r -= count;
  }
  return {s, i * p.grid.tokens_per_chunk + r};
}

__device__ __forceinline__ int64_t chunk_tokens_total(const EPParams& p, int i, int skip) {
  int64_t total = 0;
  for (int s = 0; s < p.world_size; ++s) total += s == skip ? 0 : chunk_tokens(p, s, i);
  return total;
}

// Source s's routes to each of rank r's experts, as s's lead of chunk i wrote them into r's piece.
__device__ __forceinline__ int32_t* totals_of(const EPParams& p, int r, int s, int i) {
  const int64_t num_local = p.config.num_experts / p.world_size;
  return piece<int32_t>(p, r, p.layout.totals) + chunk_slot(p, s, i) * num_local;
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

// ---- bounded flag waits (device::wait_flag: bounded, recorded, poison-aware) ----

// The flags one wait covers: flags[q][block] of this rank's piece for every rank q in `ranks`.
struct FlagSet {
  size_t flags;
  int block;
  unsigned ranks;
  EPPhaseId phase;
};

// Lane q of a waiting warp waits for rank q's flag of `set` (if q is in it); true if it gave up.
__device__ __forceinline__ bool wait_lane(const EPParams& p, const FlagSet& set, uint64_t value, uint64_t seq, int q) {
  if (q >= p.world_size || ((set.ranks >> q) & 1u) == 0u) return false;
  return !device::wait_flag(p.barrier, piece<uint64_t>(p, p.rank, set.flags) + slot(p, q, set.block), value, q,
                            static_cast<int>(set.phase), seq);
}

// Block-wide (every thread calls it): warp 0 waits for `first`, warp 1 for `second` at the same
// time; the __syncthreads_or makes the acquired writes visible to the whole block. Returns true on
// every thread if a wait failed.
__device__ __forceinline__ bool wait_block(const EPParams& p, const FlagSet& first, const FlagSet& second,
                                           uint64_t value, uint64_t seq) {
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  bool failed = false;
  if (warp == 0) failed = wait_lane(p, first, value, seq, lane);
  if (warp == 1) failed = wait_lane(p, second, value, seq, lane);
  return __syncthreads_or(failed) != 0;
}

// The same for one warp; __syncwarp shares the visibility.
__device__ __forceinline__ bool wait_warp(const EPParams& p, const FlagSet& set, uint64_t value, uint64_t seq,
                                          int lane) {
  bool failed = wait_lane(p, set, value, seq, lane);
  failed = __any_sync(kFullMask, failed);
  __syncwarp();
  return failed;
}

// Thread q (rank q in `ranks`) raises flags[rank][b] in rank q's piece (release, system scope:
// publishes every write this block made before the preceding bar.sync, cumulatively).
__device__ __forceinline__ void signal_ranks(const EPParams& p, size_t flags, uint64_t value, unsigned ranks) {
  const int q = static_cast<int>(threadIdx.x);
  if (q < p.world_size && ((ranks >> q) & 1u) != 0u) {
    device::st_release_sys_u64(piece<uint64_t>(p, q, flags) + slot(p, p.rank, blockIdx.x), value);
  }
}

// ---- warp-wide row operations ----

__device__ __forceinline__ bool aligned16(const void* a) { return (reinterpret_cast<uintptr_t>(a) & 15u) == 0; }

// Appends this lane's item to a warp list in lane order (lanes with keep == false skip); returns
// the list length. The list is in shared memory; the trailing __syncwarp publishes it to the warp.
template <typename U>
__device__ __forceinline__ int warp_list(U* list, bool keep, const U& item, int lane) {
  const unsigned mask = __ballot_sync(kFullMask, keep);
  if (keep) list[__popc(mask & lanemask_lt())] = item;
  __syncwarp();
  (void)lane;
  return __popc(mask);
}

// A row is split into column ranges of whole packs: over the blocks of a chunk (its column parts,
// Note [EP GPU protocol]), and within a block when there are fewer rows than warps (decode sizes),
// so that several warps share one row.
struct Cols {
  int64_t begin, end;  // elements

  __device__ __forceinline__ int64_t size() const { return end - begin; }
};

// Part `part` of `parts` of the columns [0, hidden): whole packs; the last non-empty part ends at
// hidden, trailing parts may be empty.
template <typename T>
__device__ __forceinline__ Cols cols_of(int64_t hidden, int part, int parts) {
  constexpr int N = device::Vec<T>::kNumElems;
  const int64_t per = ((hidden + N - 1) / N + parts - 1) / parts * N;
  return {min64(part * per, hidden), min64((part + 1) * per, hidden)};
}

// Part `part` of `parts` of `range`, whose begin is a whole number of packs: its boundaries are
// whole packs again, and it ends at range.end.
template <typename T>
__device__ __forceinline__ Cols sub_cols(Cols range, int part, int parts) {
  const Cols c = cols_of<T>(range.size(), part, parts);
  return {range.begin + c.begin, range.begin + c.end};
}

// Parts per row for `items` rows of `width` columns shared by `workers` warps (at least
// kMinPacksPerWarp packs a part).
template <typename T>
__device__ __forceinline__ int parts_for(int64_t items, int workers, int64_t width) {
  constexpr int N = device::Vec<T>::kNumElems;
  if (items <= 0 || items >= workers) return 1;
  const int64_t most = max64(1, (width + kMinPacksPerWarp * N - 1) / (kMinPacksPerWarp * N));
  return static_cast<int>(min64(workers / items, most));
}

// Copies columns [cols.begin, cols.end) of one row to `num_dsts` rows with the lanes of a warp:
// the source is read once.
template <typename T>
__device__ __forceinline__ void copy_row(T* const* dsts, int num_dsts, const T* src, int64_t hidden, Cols cols,
                                         int lane) {
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  if (num_dsts == 0) return;
  bool vec = aligned16(src) && (hidden * sizeof(T)) % 16 == 0;
  for (int i = 0; i < num_dsts; ++i) vec = vec && aligned16(dsts[i]);
  if (vec) {
    const int64_t num_packs = cols.end / N;
    for (int64_t base = cols.begin / N; base < num_packs; base += 32 * kCopyUnroll) {
      V buf[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t v = base + u * 32 + lane;
        if (v < num_packs) buf[u] = V::load(src + v * N);
      }
      for (int i = 0; i < num_dsts; ++i) {
        T* dst = dsts[i];
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
      for (int i = 0; i < num_dsts; ++i) dsts[i][e] = value;
    }
  }
}

// The vector part of weighted_sum_row: the packs of kRoutes routes are loaded before any is summed
// (in flight together: at decode sizes a lane holds one pack per route and the sum costs one memory
// round trip, not one per route); they are then summed in route order.
template <typename T, int kUnroll, int kRoutes>
__device__ __forceinline__ void weighted_sum_packs(T* dst, const T* const* srcs, const float* ws, int num_srcs,
                                                   Cols cols, int lane) {
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  const int64_t num_packs = cols.end / N;
  for (int64_t base = cols.begin / N; base < num_packs; base += 32 * kUnroll) {
    device::Acc<N> acc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int i = 0; i < N; ++i) acc[u].v[i] = 0.0f;
    }
    for (int r0 = 0; r0 < num_srcs; r0 += kRoutes) {
      V y[kRoutes][kUnroll];
#pragma unroll
      for (int r = 0; r < kRoutes; ++r) {
        if (r0 + r < num_srcs) {
          const T* src = srcs[r0 + r];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = base + u * 32 + lane;
            if (v < num_packs) y[r][u] = V::load(src + v * N);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRoutes; ++r) {
        if (r0 + r < num_srcs) {
          const float w = ws != nullptr ? ws[r0 + r] : 1.0f;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
              acc[u].v[i] = __fadd_rn(acc[u].v[i], __fmul_rn(w, device::to_float<T>(y[r][u].elems[i])));
            }
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = base + u * 32 + lane;
      if (v < num_packs) device::acc_cast<T, N>(acc[u]).store(dst + v * N);
    }
  }
}

// dst = round(sum over r ascending of fp32(w[r]) * fp32(src[r])) with separate rounding of every
// product and sum (Note [EP layout]: no fused multiply-add); no sources gives zeros; ws == nullptr
// means every weight is 1. Loads kRoutes sources' packs together, kUnroll packs a lane each
// (weighted_sum_packs).
template <typename T, int kUnroll, int kRoutes>
__device__ __forceinline__ void weighted_sum_row(T* dst, const T* const* srcs, const float* ws, int num_srcs,
                                                 int64_t hidden, Cols cols, int lane) {
  bool vec = aligned16(dst) && (hidden * sizeof(T)) % 16 == 0;
  for (int r = 0; r < num_srcs; ++r) vec = vec && aligned16(srcs[r]);
  if (vec) {
    weighted_sum_packs<T, kUnroll, kRoutes>(dst, srcs, ws, num_srcs, cols, lane);
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

// ---- dispatch ----

// Columns `cols` of token t of source s (of chunk i) into this rank's expert rows: route (s, t, k)
// to local expert l lands at base(s, l) + j (Note [EP GPU protocol]). If `record`, recv_pos
// records it (-1: dropped); exactly one warp of the grid records each route (the chunk lead's
// warp with the first columns), so no two blocks write the same word. The row's first packs are
// loaded with the routing (a route's expert and j together): at decode sizes (one pack per lane)
// the row, the routing and the totals take two dependent memory round trips instead of three.
template <typename T>
__device__ __forceinline__ void expand_token(const EPParams& p, int s, int64_t t, int i, const T* src, T** list,
                                             Cols cols, bool record, int lane) {
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  const EPConfig& c = p.config;
  const int64_t num_local = c.num_experts / p.world_size;
  const bool vec = aligned16(src) && aligned16(p.expert_x) && (c.hidden * sizeof(T)) % 16 == 0;
  const int64_t first_end = min64(cols.end, cols.begin + 32 * kExpandFirstUnroll * N);  // the packs loaded first
  V first[kExpandFirstUnroll];
  if (vec) {
#pragma unroll
    for (int u = 0; u < kExpandFirstUnroll; ++u) {
      const int64_t v = cols.begin / N + u * 32 + lane;
      if (v < first_end / N) first[u] = V::load(src + v * N);
    }
  }
  T* dst = nullptr;
  bool keep = false;
  if (lane < c.topk) {
    const size_t at = route(p, s, t * c.topk + lane);
    const int32_t e = piece<const int32_t>(p, p.rank, p.layout.meta_idx)[at];
    const int32_t j = piece<const int32_t>(p, p.rank, p.layout.meta_j)[at];
    if (e >= 0 && e / num_local == p.rank) {
      const int64_t l = e - p.rank * num_local;
      int64_t pos = j;
      for (int q = 0; q < s; ++q) pos += totals_of(p, p.rank, q, i)[l];
      keep = pos < c.capacity;
      if (record) p.recv_pos[at] = keep ? static_cast<int32_t>(pos) : -1;
      if (keep) dst = static_cast<T*>(p.expert_x) + (l * c.capacity + pos) * c.hidden;
    }
  }
  const int num_dsts = warp_list(list, keep, dst, lane);
  if (vec) {
    for (int d = 0; d < num_dsts; ++d) {
#pragma unroll
      for (int u = 0; u < kExpandFirstUnroll; ++u) {
        const int64_t v = cols.begin / N + u * 32 + lane;
        if (v < first_end / N) first[u].store(list[d] + v * N);
      }
    }
    copy_row(list, num_dsts, src, c.hidden, Cols{first_end, cols.end}, lane);
  } else {
    copy_row(list, num_dsts, src, c.hidden, cols, lane);
  }
  __syncwarp();  // the list is rewritten by the next token
}

// expert_counts of this rank's experts, and the overflow word of every rank for them, written by
// threads [first, first + count) of the block (chunk 0's lead: every owner raises the overflow
// word of every rank for its own experts).
__device__ __forceinline__ void write_expert_counts(const EPParams& p, int first, int count) {
  const EPConfig& c = p.config;
  const int n = p.world_size, me = p.rank;
  const int64_t num_local = c.num_experts / n;
  for (int64_t l = static_cast<int>(threadIdx.x) - first; l < num_local; l += count) {
    int64_t total = 0;
    for (int s = 0; s < n; ++s) total += totals_of(p, me, s, 0)[l];
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

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ep_dispatch_kernel(EPParams p, EPMode mode, LaunchOrder order) {
  pdl_begin(order);  // before the first read of seq, flags, x, topk (a previous kernel wrote them)
  extern __shared__ int32_t counts[];  // [2][num_experts]: before chunk (then running), totals
  __shared__ T* lists[kWarps][kEPMaxTopk];
  const EPConfig& c = p.config;
  const bool send = has(mode, EPMode::kSend), recv = has(mode, EPMode::kRecv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = p.world_size, me = p.rank, b = blockIdx.x;
  const BlockRole role = block_role(p);
  const bool is_lead = role.part == 0;
  const int topk = static_cast<int>(c.topk);
  const int64_t num_experts = c.num_experts, num_local = num_experts / n;
  const int64_t t_begin = role.chunk * p.grid.tokens_per_chunk;
  const Cols cols = cols_of<T>(c.hidden, role.part, p.grid.num_parts);  // this block's columns of every row
  const T* x = static_cast<const T*>(p.x);
  if (device::ld_volatile_u32(&p.barrier.state->poisoned) != 0) return;
  const uint64_t seq = device::ld_volatile_u64(&piece<EPControl>(p, me, p.layout.control)->seq);
  const uint64_t value = seq + 1;
  trace(EPTracePoint::kDispatchStart, 0);

  if (send && is_lead) {
    const int64_t num_tokens = p.num_tokens;
    const int64_t t_end = min64(num_tokens, t_begin + p.grid.tokens_per_chunk);
    int32_t* before = counts;
    int32_t* totals = counts + num_experts;
    for (int64_t e = threadIdx.x; e < 2 * num_experts; e += kThreads) counts[e] = 0;
    __syncthreads();
    // 1. Per-expert counts of all this rank's routes (order-free: shared atomics).
    for (int64_t i = threadIdx.x; i < num_tokens * topk; i += kThreads) {
      const int32_t e = sanitize(p.topk_idx[i], num_experts);
      if (e < 0) continue;
      atomicAdd(&totals[e], 1);
      if (i < t_begin * topk) atomicAdd(&before[e], 1);
    }
    __syncthreads();
    // 2. Meta of this chunk to every rank: token count, the totals of its experts, idx / w / j.
    for (int d = 0; d < n; ++d) {
      int32_t* dst = totals_of(p, d, me, role.chunk);
      for (int64_t l = threadIdx.x; l < num_local; l += kThreads) dst[l] = totals[d * num_local + l];
    }
    if (threadIdx.x < n) {
      int32_t* dst = piece<int32_t>(p, threadIdx.x, p.layout.num_tokens);
      dst[chunk_slot(p, me, role.chunk)] = static_cast<int32_t>(num_tokens);
    }
    if (warp == 0) {
      for (int64_t first = t_begin * topk; first < t_end * topk; first += 32) {
        const int64_t i = first + lane;
        const bool active = i < t_end * topk;
        int32_t e = -1;
        if (active) {
          const int64_t raw = p.topk_idx[i];
          e = sanitize(raw, num_experts);
          if (raw != -1 && e < 0) {
            // Counted on this rank (EPBuffer.check raises) and treated as -1.
            atomicAdd(reinterpret_cast<unsigned long long*>(piece<int64_t>(p, me, p.layout.overflow)) + 2, 1ull);
          }
        }
        const unsigned same = __match_any_sync(kFullMask, e);
        int32_t j = -1;
        if (e >= 0) j = before[e] + __popc(same & lanemask_lt());
        __syncwarp();
        if (e >= 0 && lane == __ffs(same) - 1) before[e] += __popc(same);
        __syncwarp();
        if (active) {
          const float w = p.topk_weights[i];
          const size_t at = route(p, me, i);
          for (int d = 0; d < n; ++d) {
            piece<int32_t>(p, d, p.layout.meta_idx)[at] = e;
            piece<float>(p, d, p.layout.meta_w)[at] = w;
            piece<int32_t>(p, d, p.layout.meta_j)[at] = j;
          }
        }
      }
    }
    __syncthreads();
    // This rank's other parts of the chunk read its own meta too (they wait for this flag).
    signal_ranks(p, p.layout.meta_flags, value, p.grid.num_parts > 1 ? all_ranks(p) : other_ranks(p));
    trace(EPTracePoint::kDispatchMetaSignalled, 0);
  }

  // 3. Rows: pushing warps store this block's columns of each token of the chunk into its remote
  // owners' land_x, while (fused kernel) the other warps expand the own chunk from x.
  const int num_push_warps = send ? (recv ? (p.grid.num_parts > 1 ? kPushWarps : kPushWarpsLarge) : kWarps) : 0;
  bool failed = false;
  if (warp < num_push_warps) {
    const int64_t items = clamp64(p.num_tokens - t_begin, 0, p.grid.tokens_per_chunk);
    const int parts = parts_for<T>(items, num_push_warps, cols.size());
    for (int64_t w = warp; w < items * parts; w += num_push_warps) {
      const int64_t t = t_begin + w / parts;
      const int32_t e = lane < topk ? sanitize(p.topk_idx[t * topk + lane], num_experts) : -1;
      const unsigned owners = __reduce_or_sync(kFullMask, e >= 0 ? 1u << static_cast<unsigned>(e / num_local) : 0u);
      const bool keep = lane < n && lane != me && ((owners >> lane) & 1u);
      T* dst = keep ? piece<T>(p, lane, p.layout.land_x) + row(p, me, t) : nullptr;
      const int num_dsts = warp_list(lists[warp], keep, dst, lane);
      copy_row(lists[warp], num_dsts, x + t * c.hidden, c.hidden, sub_cols<T>(cols, static_cast<int>(w % parts), parts),
               lane);
      __syncwarp();
    }
    trace(EPTracePoint::kDispatchRowsPushed, 0);
    named_barrier(kPushBarrier, num_push_warps * 32);
    signal_ranks(p, p.layout.data_flags, value, other_ranks(p));
    trace(EPTracePoint::kDispatchDataSignalled, 0);
  } else if (recv) {
    // Own positions need the totals of the ranks below this one (their leads' meta flags) and, in
    // a part other than the lead, this rank's own meta, which its lead writes.
    const FlagSet meta{p.layout.meta_flags, role.lead, ranks_below(p) | (is_lead ? 0u : self_rank(p)),
                       EPPhaseId::kDispatchMeta};
    failed = wait_warp(p, meta, value, seq, lane);
    if (!failed) {
      const int64_t items = chunk_tokens(p, me, role.chunk);
      const int workers = kWarps - num_push_warps;
      const int parts = parts_for<T>(items, workers, cols.size());
      for (int64_t w = warp - num_push_warps; w < items * parts; w += workers) {
        const int64_t t = t_begin + w / parts;
        const int sub = static_cast<int>(w % parts);
        expand_token<T>(p, me, t, role.chunk, x + t * c.hidden, lists[warp], sub_cols<T>(cols, sub, parts),
                        is_lead && sub == 0, lane);
      }
    }
    trace(EPTracePoint::kDispatchOwnExpanded, num_push_warps * 32);
  }
  if (!recv) return;

  // 4. Remote chunks, once this part's columns of their rows (data flags of block b) and their
  // leads' meta have landed: for the lead, data[q][b] covers its own meta; another part waits for
  // meta[q][lead] of every rank, its own included (the totals of this rank are the base of the
  // sources above it).
  if (__syncthreads_or(failed)) return;
  const FlagSet data{p.layout.data_flags, b, other_ranks(p), EPPhaseId::kDispatchLanded};
  const FlagSet meta{p.layout.meta_flags, role.lead, is_lead ? 0u : all_ranks(p), EPPhaseId::kDispatchMeta};
  if (wait_block(p, data, meta, value, seq)) return;
  trace(EPTracePoint::kDispatchDataLanded, 0);
  const int64_t items = chunk_tokens_total(p, role.chunk, me);
  const int parts = parts_for<T>(items, kWarps, cols.size());
  // Block 0 writes expert_counts with the warps the expansion leaves idle (decode sizes), else
  // with every thread after it.
  const int busy = static_cast<int>(min64(items * parts, kWarps));
  if (b == 0 && busy < kWarps && warp >= busy) write_expert_counts(p, busy * 32, kThreads - busy * 32);
  for (int64_t w = warp; w < items * parts; w += kWarps) {
    const auto [s, t] = nth_token(p, role.chunk, me, w / parts);
    const int sub = static_cast<int>(w % parts);
    expand_token<T>(p, s, t, role.chunk, piece<const T>(p, me, p.layout.land_x) + row(p, s, t), lists[warp],
                    sub_cols<T>(cols, sub, parts), is_lead && sub == 0, lane);
  }
  if (b == 0 && busy == kWarps) write_expert_counts(p, 0, kThreads);
  trace(EPTracePoint::kDispatchEnd, 0);
}

// ---- combine ----

// A permutation of [0, n): 0, n - 1, 1, n - 2, ... (k even: k / 2 from the front; k odd: from the back).
__device__ __forceinline__ int64_t zigzag(int64_t k, int64_t n) { return (k & 1) ? n - 1 - (k >> 1) : k >> 1; }

template <typename T, bool kDecodeGrid>
__global__ void __launch_bounds__(kThreads, 1) ep_combine_kernel(EPParams p, EPMode mode, LaunchOrder order) {
  pdl_begin(order);  // before the first read of seq, flags, expert_out (a previous kernel wrote them)
  __shared__ const T* srcs[kWarps][kEPMaxTopk];
  __shared__ float weights[kWarps][kEPMaxTopk];
  const EPConfig& c = p.config;
  const bool send = has(mode, EPMode::kSend), recv = has(mode, EPMode::kRecv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = p.world_size, me = p.rank, b = blockIdx.x;
  const BlockRole role = block_role(p);
  const int topk = static_cast<int>(c.topk);
  const int64_t num_local = c.num_experts / n;
  const int64_t t_begin = role.chunk * p.grid.tokens_per_chunk;
  const Cols cols = cols_of<T>(c.hidden, role.part, p.grid.num_parts);  // this block's columns of every row
  if (device::ld_volatile_u32(&p.barrier.state->poisoned) != 0) return;
  EPControl* control = piece<EPControl>(p, me, p.layout.control);
  const uint64_t seq = device::ld_volatile_u64(&control->seq);
  const uint64_t value = seq + 1;
  trace(EPTracePoint::kCombineStart, 0);
  // Meta and recv_pos of every source were written, or acquired, in the dispatch kernel.
  const int32_t* meta_idx = piece<const int32_t>(p, me, p.layout.meta_idx);

  if (send) {
    // This block's columns of the partials of this rank's routes for every source's tokens of the
    // chunk (the own ones too).
    const float* meta_w = piece<const float>(p, me, p.layout.meta_w);
    const T* expert_out = static_cast<const T*>(p.expert_out);
    const int64_t items = chunk_tokens_total(p, role.chunk, -1);
    const int parts = parts_for<T>(items, kWarps, cols.size());
    for (int64_t k = warp; k < items * parts; k += kWarps) {
      // One column part per row (large batches): items in zigzag order, so that the block's warps
      // work on the first source's tokens and the last one's at the same time; one of them is this
      // rank (HBM-bound partials), the other a peer (partials stored over NVLink): the link and
      // HBM stay busy together instead of one after the other.
      const int64_t item = parts == 1 ? zigzag(k, items) : k;
      const auto [s, t] = nth_token(p, role.chunk, -1, item / parts);
      bool local = false, keep = false;
      const T* y = nullptr;
      float w = 0.0f;
      if (lane < topk) {
        const size_t at = route(p, s, t * topk + lane);
        const int32_t e = meta_idx[at];
        local = e >= 0 && e / num_local == me;
        if (local) {
          const int32_t pos = p.recv_pos[at];
          keep = pos >= 0;
          y = expert_out + ((e - me * num_local) * c.capacity + pos) * c.hidden;
          w = meta_w[at];
        }
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
      constexpr SumShape shape = kDecodeGrid ? kRouteSumDecode : kSumLarge;
      weighted_sum_row<T, shape.unroll, shape.sources>(dst, srcs[warp], weights[warp], __popc(mask), c.hidden,
                                                       sub_cols<T>(cols, static_cast<int>(item % parts), parts), lane);
      __syncwarp();  // the lists are rewritten by the next token
    }
    __syncthreads();
    signal_ranks(p, p.layout.combine_flags, value, other_ranks(p));
    trace(EPTracePoint::kCombineSignalled, 0);
  }
  if (!recv) return;

  // This part's columns of the partials of block b of every peer (the own token count, written in
  // the dispatch kernel, is loaded while they are waited for).
  const int64_t items = chunk_tokens(p, me, role.chunk);
  const int parts = parts_for<T>(items, kWarps, cols.size());
  const FlagSet partials{p.layout.combine_flags, b, other_ranks(p), EPPhaseId::kCombineLanded};
  const FlagSet none{p.layout.combine_flags, b, 0u, EPPhaseId::kCombineLanded};
  if (wait_block(p, partials, none, value, seq)) return;
  trace(EPTracePoint::kCombineLanded, 0);
  const T* land_y = piece<const T>(p, me, p.layout.land_y);
  for (int64_t w = warp; w < items * parts; w += kWarps) {
    const int64_t t = t_begin + w / parts;
    const int32_t e = lane < topk ? meta_idx[route(p, me, t * topk + lane)] : -1;
    const unsigned owners = __reduce_or_sync(kFullMask, e >= 0 ? 1u << static_cast<unsigned>(e / num_local) : 0u);
    const bool keep = lane < n && ((owners >> lane) & 1u);
    const int num_srcs = warp_list(srcs[warp], keep, keep ? land_y + row(p, lane, t) : nullptr, lane);
    // Every weight 1: the plain sum of the partials in rank order (a product by 1.0f is exact).
    constexpr SumShape shape = kDecodeGrid ? kRankSumDecode : kSumLarge;
    weighted_sum_row<T, shape.unroll, shape.sources>(static_cast<T*>(p.out) + t * c.hidden, srcs[warp], nullptr,
                                                     num_srcs, c.hidden,
                                                     sub_cols<T>(cols, static_cast<int>(w % parts), parts), lane);
    __syncwarp();
  }
  // The last block to finish advances seq (every block read it above, before counting itself).
  __syncthreads();
  if (threadIdx.x == 0) {
    device::fence_acq_rel_gpu();  // orders this block's read of seq before its count, for the last block
    const uint32_t done = atomicAdd(&control->blocks_done, 1u);
    if (done == gridDim.x - 1) {
      control->blocks_done = 0;
      control->seq = seq + 1;
    }
  }
  trace(EPTracePoint::kCombineEnd, 0);
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
  const EPGrid& g = p.grid;
  if (g.num_chunks < 1 || g.num_parts < 1 || g.num_parts > kEPMaxParts || g.num_blocks() > kEPMaxBlocks ||
      g.tokens_per_chunk < 1 || g.tokens_per_chunk * g.num_chunks < p.config.max_tokens_per_rank) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": grid of ", g.num_chunks, " chunks x ", g.tokens_per_chunk, " tokens x ",
                                 g.num_parts, " column parts does not cover max_tokens_per_rank ",
                                 p.config.max_tokens_per_rank, " within ", kEPMaxBlocks, " blocks and ", kEPMaxParts,
                                 " parts"));
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

EPGrid ep_grid(const EPConfig& c, int max_blocks) {
  const int most = std::clamp(max_blocks, 1, kEPMaxBlocks);
  const int64_t max_tokens = std::max<int64_t>(c.max_tokens_per_rank, 1);
  const int64_t wanted = (max_tokens + kMinTokensPerChunk - 1) / kMinTokensPerChunk;
  const int64_t chunks = std::min<int64_t>(wanted, most);
  EPGrid g;
  g.tokens_per_chunk = (max_tokens + chunks - 1) / chunks;
  g.num_chunks = static_cast<int>((max_tokens + g.tokens_per_chunk - 1) / g.tokens_per_chunk);  // none empty
  // Few chunks (decode): spread each chunk's columns over several blocks (SMs), up to about
  // kTargetBlocks blocks but never more than `most`; many chunks: P = 1.
  const int wanted_parts = (kTargetBlocks + g.num_chunks - 1) / g.num_chunks;
  g.num_parts = std::clamp(std::min(wanted_parts, most / g.num_chunks), 1, kEPMaxParts);
  return g;
}

EPSymmetricLayout ep_symmetric_layout(const EPConfig& c, int world_size, const EPGrid& grid) {
  constexpr size_t kAlign = 256;
  const size_t slots = static_cast<size_t>(world_size) * grid.num_blocks();
  const size_t chunk_slots = static_cast<size_t>(world_size) * grid.num_chunks;
  const size_t meta = static_cast<size_t>(world_size) * c.max_tokens_per_rank * c.topk;
  const size_t rows = static_cast<size_t>(world_size) * c.max_tokens_per_rank * c.hidden * dtype_size(c.dtype);
  const size_t num_local = static_cast<size_t>(c.num_experts / world_size);
  EPSymmetricLayout l;
  size_t at = 0;
  auto take = [&](size_t& field, size_t bytes) {
    field = at;
    at = align_up(at + bytes, kAlign);
  };
  take(l.control, sizeof(EPControl));
  take(l.overflow, kEPOverflowWords * sizeof(int64_t));
  take(l.meta_flags, slots * sizeof(uint64_t));
  take(l.data_flags, slots * sizeof(uint64_t));
  take(l.combine_flags, slots * sizeof(uint64_t));
  l.control_end = at;
  take(l.num_tokens, chunk_slots * sizeof(int32_t));
  take(l.totals, chunk_slots * num_local * sizeof(int32_t));
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
  LaunchOrder order = LaunchOrder::kStream;
  status = read_launch_order(what, &order);
  if (!status.is_ok()) return status;
  const size_t smem = 2 * static_cast<size_t>(p.config.num_experts) * sizeof(int32_t);
  cudaError_t err = cudaSuccess;
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.config.dtype, T, return Status(StatusCode::kInvalidArgument, what), [&] {
    err = launch_kernel(ep_dispatch_kernel<T>, dim3(p.grid.num_blocks()), dim3(kThreads), smem, stream, order, p, mode,
                        order);
  });
  return cuda_status(what, err);
}

Status launch_ep_combine(const EPParams& p, EPMode mode, Stream stream) {
  const char* what = has(mode, EPMode::kSend) ? "EPBuffer.combine" : "EPBuffer.combine_recv";
  Status status = check_params(p, what);
  if (!status.is_ok()) return status;
  LaunchOrder order = LaunchOrder::kStream;
  status = read_launch_order(what, &order);
  if (!status.is_ok()) return status;
  cudaError_t err = cudaSuccess;
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.config.dtype, T, return Status(StatusCode::kInvalidArgument, what), [&] {
    // Rows split into column parts (decode sizes): a lane holds about one pack of a row.
    auto* kernel = p.grid.num_parts > 1 ? ep_combine_kernel<T, true> : ep_combine_kernel<T, false>;
    err = launch_kernel(kernel, dim3(p.grid.num_blocks()), dim3(kThreads), 0, stream, order, p, mode, order);
  });
  return cuda_status(what, err);
}

}  // namespace commlib::kernels
