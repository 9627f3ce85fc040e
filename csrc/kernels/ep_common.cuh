// Device helpers shared by the EP kernels (ep_dispatch_combine.cu: the flag protocol of Note [EP GPU
// protocol]; ep_ll.cu: the flag-carrying-line decode path of Note [EP LL protocol]). Included by
// .cu files only; everything is in an unnamed namespace (one copy per kernel file).
//
// Note [EP decode step cost]
// At decode sizes an EP step is a chain of short dependent steps, and its time is the number of
// memory round trips in that chain, not instruction fetch, TLB misses or kernel parameters.
// Measured on one H200 (world 1, CUDA-graph replay): a graph step of 1 / 2 / 3 one-element kernels
// takes 0.87 / 1.72 / 2.54 µs; a chain of K dependent 8-byte loads 1.00 / 2.18 / 6.42 µs for
// K = 1 / 8 / 32 (~0.18 µs per L2 round trip), the same with a new 2 MiB page per load (no TLB
// cost); 512-8192 dependent FMAs (8-128 KiB of code) run as fast alternating between two kernels as
// repeating one (the EP kernels are 77-108 KiB of SASS); a 64-byte parameter line costs ~0.03 µs
// (EPParams is 8 lines). So the kernels save round trips: words needed together load together
// (seq and the poisoned word in one), one seq per block.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "commlib/device/barrier.cuh"
#include "commlib/device/vec.cuh"
#include "kernels/ep_params.hpp"

namespace commlib::kernels {

// Validates the params of launch_ep (ep_dispatch_combine.cu).
Status check_ep_params(const EPParams& p, const char* what);

// Every peer-memory EP kernel has this signature; launch_ep picks one by path, op, element type T
// (float, __half, __nv_bfloat16) and, on the flag path, the grid's column split.
using EPKernel = void (*)(EPParams, EPMode, LaunchOrder);
template <typename T>
EPKernel ep_flags_kernel(EPOp op, bool column_parts);  // ep_dispatch_combine.cu
template <typename T>
EPKernel ep_ll_kernel(EPOp op);  // ep_ll.cu

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Warps of a fused dispatch block that push rows to peers in decode grids (rows split into column
// parts); the others expand the own chunk meanwhile. 4 was slower at 32-128 tokens.
constexpr int kPushWarps = kWarps / 2;
// The same for large grids (one column part a row): the pushes are bound by the link, the own
// chunk's expansion by the warps doing it; of 2, 4, 6, 8 and 12, 4 was fastest. Both measured at
// world 2 (docs/ep.md).
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
// world 1 (docs/ep.md, Decode); larger shapes spill (512 threads leave 128
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
// The last call's values of this kernel file's trace (empty without COMMLIB_EP_TRACE).
std::vector<int64_t> read_trace() {
  unsigned long long values[kEPTracePoints] = {};
  if (cudaMemcpyFromSymbol(values, g_ep_trace, sizeof(values)) != cudaSuccess) return {};
  return std::vector<int64_t>(values, values + kEPTracePoints);
}
#else
__device__ __forceinline__ void trace(EPTracePoint, int) {}
std::vector<int64_t> read_trace() { return {}; }
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

// The start of an EP call in block b (not the flag barrier's call_begin: EP kernels count calls in
// their own seq): its seq (Note [EP GPU protocol]) and whether the communicator is
// poisoned (a wait of this rank gave up: return at once). The two words load together, one memory
// round trip.
struct EPSeq {
  uint64_t seq;
  bool poisoned;
};

__device__ __forceinline__ EPSeq read_ep_seq(const EPParams& p) {
  const uint64_t seq = device::ld_volatile_u64(&piece<EPControl>(p, p.rank, p.layout.control)->seq[blockIdx.x]);
  const uint32_t poisoned = device::ld_volatile_u32(&p.barrier.state->poisoned);
  return {seq, poisoned != 0};
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

// Chunk i's token counts of the sources over a warp's lanes: lane s holds source s's (0 for lanes
// past the world and for `skip`; -1 skips none), so the warp loads them in one memory round trip.
__device__ __forceinline__ int32_t lane_chunk_tokens(const EPParams& p, int i, int skip, int lane) {
  return lane < p.world_size && lane != skip ? static_cast<int32_t>(chunk_tokens(p, lane, i)) : 0;
}

// Whole warp: the sum of the lanes' counts (lane_chunk_tokens).
__device__ __forceinline__ int64_t chunk_tokens_total(int32_t lane_count) {
  return __reduce_add_sync(kFullMask, static_cast<unsigned>(lane_count));
}

// Whole warp: the r-th token of chunk i over the sources in rank order (lane_chunk_tokens).
__device__ __forceinline__ SourceToken nth_token(const EPParams& p, int i, int32_t lane_count, int64_t r) {
  int s = 0;
  for (; s < p.world_size; ++s) {
    const int64_t count = __shfl_sync(kFullMask, lane_count, s);
    if (r < count) break;
    r -= count;
  }
  return {s, i * p.grid.tokens_per_chunk + r};
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
  Phase phase;
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
// Each finished pack v (pack index in the row) goes to sink(v, pack).
template <typename T, int kUnroll, int kRoutes, typename Sink>
__device__ __forceinline__ void weighted_sum_packs(const T* const* srcs, const float* ws, int num_srcs, Cols cols,
                                                   int lane, Sink&& sink) {
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
      if (v < num_packs) sink(v, device::acc_cast<T, N>(acc[u]));
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
    constexpr int N = device::Vec<T>::kNumElems;
    weighted_sum_packs<T, kUnroll, kRoutes>(srcs, ws, num_srcs, cols, lane,
                                            [dst](int64_t v, const device::Vec<T>& pack) { pack.store(dst + v * N); });
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

// Block-wide, at the end of a combine's receive: block b advances its seq (Note [EP GPU protocol];
// every thread of the block read it at its start, before this barrier).
__device__ __forceinline__ void advance_seq(const EPParams& p, uint64_t seq) {
  __syncthreads();
  if (threadIdx.x == 0) piece<EPControl>(p, p.rank, p.layout.control)->seq[blockIdx.x] = seq + 1;
}

// Block-wide: counts all of this rank's routes per expert into totals[e] and, for the tokens
// before t_begin, before[e] (shared memory, [num_experts] each; order-free atomics).
__device__ __forceinline__ void count_routes(const EPParams& p, int64_t t_begin, int32_t* before, int32_t* totals) {
  const int64_t num_experts = p.config.num_experts, topk = p.config.topk;
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) before[e] = totals[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < p.num_tokens * topk; i += blockDim.x) {
    const int32_t e = sanitize(p.topk_idx[i], num_experts);
    if (e < 0) continue;
    atomicAdd(&totals[e], 1);
    if (i < t_begin * topk) atomicAdd(&before[e], 1);
  }
  __syncthreads();
}

// One warp: j of each route i of tokens [t_begin, t_end), walked in (t, k) order 32 at a time
// (__match_any_sync ranks equal experts within a step; before[] then counts on), and
// visit(i, e, j) for each, e = -1 for none or an invalid id (those are counted in the overflow
// word when count_invalid, so each is counted once per rank).
template <typename Visit>
__device__ __forceinline__ void rank_routes(const EPParams& p, int64_t t_begin, int64_t t_end, int32_t* before,
                                            bool count_invalid, int lane, Visit&& visit) {
  const int64_t topk = p.config.topk;
  for (int64_t first = t_begin * topk; first < t_end * topk; first += 32) {
    const int64_t i = first + lane;
    const bool active = i < t_end * topk;
    int32_t e = -1;
    if (active) {
      const int64_t raw = p.topk_idx[i];
      e = sanitize(raw, p.config.num_experts);
      if (raw != -1 && e < 0 && count_invalid) {
        // Counted on this rank (EPBuffer.check raises) and treated as -1.
        atomicAdd(reinterpret_cast<unsigned long long*>(piece<int64_t>(p, p.rank, p.layout.overflow)) + 2, 1ull);
      }
    }
    const unsigned same = __match_any_sync(kFullMask, e);
    int32_t j = -1;
    if (e >= 0) j = before[e] + __popc(same & lanemask_lt());
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) before[e] += __popc(same);
    __syncwarp();
    if (active) visit(i, e, j);
  }
}

// This rank's routes of token t of source s, as the warp's list (k order, routes dropped by the
// capacity left out): expert row y and weight w of each in srcs / weights (shared memory). Every
// lane gets whether any route is local (the owner's partial is due even when all were dropped)
// and the list length.
struct LocalRoutes {
  bool any;
  int count;
};

template <typename T>
__device__ __forceinline__ LocalRoutes local_routes(const EPParams& p, int s, int64_t t, const int32_t* meta_idx,
                                                    const float* meta_w, const T** srcs, float* weights, int lane) {
  const EPConfig& c = p.config;
  const int64_t num_local = c.num_experts / p.world_size;
  const int me = p.rank;
  bool local = false, keep = false;
  const T* y = nullptr;
  float w = 0.0f;
  if (lane < c.topk) {
    // The three words load together (one memory round trip); pos and weight matter only for a
    // local route.
    const size_t at = route(p, s, t * c.topk + lane);
    const int32_t e = meta_idx[at];
    const int32_t pos = p.recv_pos[at];
    const float route_w = meta_w[at];
    local = e >= 0 && e / num_local == me;
    if (local) {
      keep = pos >= 0;
      y = static_cast<const T*>(p.expert_out) + ((e - me * num_local) * c.capacity + pos) * c.hidden;
      w = route_w;
    }
  }
  if (!__any_sync(kFullMask, local)) return {false, 0};
  const unsigned mask = __ballot_sync(kFullMask, keep);
  if (keep) {
    const int at = __popc(mask & lanemask_lt());
    srcs[at] = y;
    weights[at] = w;
  }
  __syncwarp();
  return {true, __popc(mask)};
}

// expert_counts of this rank's experts, and the overflow word of every rank for them, written by
// threads [first, first + count) of the block (chunk 0's lead: every owner raises the overflow
// word of every rank for its own experts). total(s, l): source s's routes to local expert l.
template <typename Total>
__device__ __forceinline__ void write_expert_counts(const EPParams& p, int first, int count, Total&& total_of) {
  const EPConfig& c = p.config;
  const int n = p.world_size, me = p.rank;
  const int64_t num_local = c.num_experts / n;
  for (int64_t l = static_cast<int>(threadIdx.x) - first; l < num_local; l += count) {
    int64_t total = 0;
    for (int s = 0; s < n; ++s) total += total_of(s, l);
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

// The totals as the flag path keeps them: each source's, in this rank's piece (chunk 0's slot).
__device__ __forceinline__ auto totals_in_piece(const EPParams& p) {
  return [&p](int s, int64_t l) { return totals_of(p, p.rank, s, 0)[l]; };
}

}  // namespace
}  // namespace commlib::kernels
