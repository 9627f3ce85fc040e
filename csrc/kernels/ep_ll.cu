// Expert-parallel dispatch / combine for decode grids over flag-carrying lines: Note [EP LL
// protocol] (ep_params.hpp). Same grid, layout and results as ep_dispatch_combine.cu; one launch per
// phase (or two, send and receive, for the split-phase API).
#include <cuda_runtime.h>

#include <algorithm>

#include "commlib/device/dispatch.cuh"
#include "commlib/device/ll.cuh"
#include "kernels/ep_common.cuh"
#include "kernels/launch.cuh"

namespace commlib::kernels {
namespace {

// 16-byte packs a lane loads (or polls) together when it pushes or expands a row.
constexpr int kLLExpandPacks = 4;
// Owner ranks whose partial lines a lane polls together in the combine (registers scale with it).
constexpr int kLLOwnersAtOnce = 4;
// Routes of one chunk (shared-memory arrays per source rank).
constexpr int kLLChunkRoutes = static_cast<int>(kEPLLMaxChunkTokens * kEPMaxTopk);

// The flag of the call after `seq` completed pairs: never 0 (zeroed and cleared lines).
__device__ __forceinline__ uint32_t ll_flag(uint64_t seq) { return static_cast<uint32_t>(seq % 0xffffffffull) + 1u; }

// Zone [s][b] of rank r's piece (Note [EP LL protocol]): meta pairs, then the rows.
__device__ __forceinline__ uint4* dispatch_zone(const EPParams& p, int r, int s, int b) {
  return piece<uint4>(p, r, p.layout.ll_dispatch) + slot(p, s, b) * p.ll.zone_lines;
}

// Lines of pack v of chunk token `tl` in a zone.
__device__ __forceinline__ uint4* zone_row(const EPParams& p, uint4* zone, int64_t tl, int64_t v) {
  return zone + 2 * (p.ll.meta_pairs + tl * p.ll.part_packs + v);
}

// Partial rows of owner d for token t in rank r's piece (2 lines a pack).
__device__ __forceinline__ uint4* combine_row(const EPParams& p, int r, int d, int64_t t) {
  return piece<uint4>(p, r, p.layout.ll_combine) +
         (static_cast<size_t>(d) * p.config.max_tokens_per_rank + t) * 2 * p.ll.row_packs;
}

// The sync pair of writer d, block b in rank r's piece (Note [EP LL protocol]).
__device__ __forceinline__ uint4* combine_sync(const EPParams& p, int r, int d, int b) {
  return piece<uint4>(p, r, p.layout.ll_combine_sync) + 2 * slot(p, d, b);
}

__device__ __forceinline__ void clear_pair(uint4* lines) {
  const uint4 zero{0u, 0u, 0u, 0u};
  device::st_v4_u32(lines, zero);
  device::st_v4_u32(lines + 1, zero);
}

template <typename T>
__device__ __forceinline__ uint4 raw_of(const device::Vec<T>& v) {
  return *reinterpret_cast<const uint4*>(&v);
}

template <typename T>
__device__ __forceinline__ device::Vec<T> vec_of(const uint4& raw) {
  return *reinterpret_cast<const device::Vec<T>*>(&raw);
}

// Pack v of a row, whatever the row's alignment (rows are whole packs on this path).
template <typename T>
__device__ __forceinline__ device::Vec<T> load_pack_any(const T* row, int64_t v, bool aligned) {
  constexpr int N = device::Vec<T>::kNumElems;
  return aligned ? device::Vec<T>::load(row + v * N) : device::Vec<T>::load_partial(row + v * N, N);
}

template <typename T>
__device__ __forceinline__ void store_pack_any(T* row, int64_t v, const device::Vec<T>& pack, bool aligned) {
  constexpr int N = device::Vec<T>::kNumElems;
  if (aligned) {
    pack.store(row + v * N);
  } else {
    pack.store_partial(row + v * N, N);
  }
}

// The combine's sums as LL lines when an expert row is not 16-byte aligned: the same arithmetic
// element by element (out of line: it would otherwise cost the aligned path registers).
template <typename T>
__device__ __noinline__ void weighted_sum_lines_unaligned(uint4* dst, const T* const* srcs, const float* ws,
                                                          int num_srcs, Cols cols, uint32_t flag, int lane) {
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  for (int64_t v = cols.begin / N + lane; v < cols.end / N; v += 32) {
    V pack;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float acc = 0.0f;
      for (int r = 0; r < num_srcs; ++r) {
        acc = __fadd_rn(acc, __fmul_rn(ws[r], device::to_float<T>(srcs[r][v * N + i])));
      }
      pack.elems[i] = device::from_float<T>(acc);
    }
    device::ll_store(dst + 2 * v, raw_of(pack), flag);
  }
}

// Waits for the line pair at `lines` (written by `peer`), clears it and returns its payload; on
// timeout records it and sets `failed` (the payload is then garbage).
__device__ __forceinline__ uint4 take_pair(uint4* lines, int peer, uint32_t flag, const EPParams& p, Phase phase,
                                           uint64_t seq, int& failed) {
  const uint4* src[1] = {lines};
  const int peers[1] = {peer};
  uint4 lo[1], hi[1];
  device::ll_wait_all<1>(src, peers, lo, hi, flag, p.barrier, static_cast<int>(phase), seq, failed);
  if (failed) return uint4{0u, 0u, 0u, 0u};
  clear_pair(lines);
  return device::ll_payload(lo[0], hi[0]);
}

// Word k of the meta part that source `me` writes for reader d (Note [EP LL protocol]): token
// count, d's num_local totals, then (expert, j, weight bits) of each of chunk i's routes.
__device__ __forceinline__ uint32_t meta_word(const EPParams& p, int64_t k, int d, const int32_t* totals,
                                              const int32_t* own_e, const int32_t* own_j, int64_t chunk_routes,
                                              int64_t first_route) {
  const int64_t num_local = p.config.num_experts / p.world_size;
  if (k == 0) return static_cast<uint32_t>(p.num_tokens);
  if (k <= num_local) return static_cast<uint32_t>(totals[d * num_local + k - 1]);
  const int64_t r = (k - 1 - num_local) / 3, field = (k - 1 - num_local) % 3;
  if (r >= chunk_routes) return field == 0 ? static_cast<uint32_t>(-1) : 0u;  // no token: no expert
  if (field == 0) return static_cast<uint32_t>(own_e[r]);
  if (field == 1) return static_cast<uint32_t>(own_j[r]);
  return __float_as_uint(p.topk_weights[first_route + r]);
}

// The block's wait for the meta parts: thread `id` of `count` polls line pairs of every peer's zone
// [s][b] and clears them; word k of source s goes to take(s, k, word). Returns true if it timed out.
template <typename Take>
__device__ __forceinline__ bool poll_meta(const EPParams& p, uint32_t flag, uint64_t seq, int id, int count,
                                          Take&& take) {
  const int n = p.world_size, me = p.rank, b = blockIdx.x;
  const int64_t pairs = p.ll.meta_pairs;
  int failed = 0;
  for (int64_t at = id; at < (n - 1) * pairs && !failed; at += count) {
    const int s = static_cast<int>((me + 1 + at / pairs) % n);
    const int64_t q = at % pairs;
    const uint4 words =
        take_pair(dispatch_zone(p, me, s, b) + 2 * q, s, flag, p, Phase::kDispatchMeta, seq, failed);
    if (failed) break;
    const uint32_t w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (4 * q + u < p.ll.meta_words) take(s, 4 * q + u, w[u]);
    }
  }
  return failed != 0;
}

// ---- dispatch ----

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ep_dispatch_ll_kernel(EPParams p, EPMode mode, LaunchOrder order) {
  pdl_begin(order);  // before the first read of seq, lines, x, topk (a previous kernel wrote them)
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  extern __shared__ int32_t counts[];  // [2][num_experts]: before chunk (then running), totals; then tot
  __shared__ int32_t route_e[kMaxDeviceRanks][kLLChunkRoutes], route_j[kMaxDeviceRanks][kLLChunkRoutes];
  __shared__ int32_t chunk_count[kMaxDeviceRanks];  // tokens of chunk i per source
  __shared__ T* lists[kWarps][kEPMaxTopk];
  const EPConfig& c = p.config;
  const bool send = has(mode, EPMode::kSend), recv = has(mode, EPMode::kRecv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = p.world_size, me = p.rank, b = blockIdx.x;
  const BlockRole role = block_role(p);
  const bool is_lead = role.part == 0;
  const int topk = static_cast<int>(c.topk);
  const int64_t num_experts = c.num_experts, num_local = num_experts / n;
  const int64_t tpc = p.grid.tokens_per_chunk;
  const int64_t t_begin = role.chunk * tpc;
  const Cols cols = cols_of<T>(c.hidden, role.part, p.grid.num_parts);  // this block's columns of every row
  const int64_t first_pack = cols.begin / N;
  const T* x = static_cast<const T*>(p.x);
  const EPSeq start = read_ep_seq(p);
  if (start.poisoned) return;
  const uint64_t seq = start.seq;
  const uint32_t flag = ll_flag(seq);
  int32_t* before = counts;
  int32_t* totals = counts + num_experts;
  int32_t* tot = counts;  // [n][num_local] once `before` is done: source s's totals of this rank's experts
  trace(EPTracePoint::kDispatchStart, 0);

  if (send) {
    const int64_t num_tokens = p.num_tokens;
    const int64_t chunk_n = clamp64(num_tokens - t_begin, 0, tpc);
    // 1. Every block counts all of this rank's routes per expert (the lead's work on the flag path).
    count_routes(p, t_begin, before, totals);
    // 2. j of each route of the chunk (Note [EP GPU protocol]); invalid ids counted by the lead only.
    if (warp == 0) {
      rank_routes(p, t_begin, t_begin + chunk_n, before, is_lead, lane, [&](int64_t i, int32_t e, int32_t j) {
        route_e[me][i - t_begin * topk] = e;
        route_j[me][i - t_begin * topk] = j;
        if (is_lead) {  // this rank's own routing, for the combine (and the split receive kernel)
          const size_t at = route(p, me, i);
          piece<int32_t>(p, me, p.layout.meta_idx)[at] = e;
          piece<float>(p, me, p.layout.meta_w)[at] = p.topk_weights[i];
          piece<int32_t>(p, me, p.layout.meta_j)[at] = j;
        }
      });
    }
    if (threadIdx.x == 0) chunk_count[me] = static_cast<int32_t>(chunk_n);
    if (is_lead) {
      if (threadIdx.x == 0) piece<int32_t>(p, me, p.layout.num_tokens)[chunk_slot(p, me, role.chunk)] = num_tokens;
      int32_t* own = totals_of(p, me, me, role.chunk);
      for (int64_t l = threadIdx.x; l < num_local; l += kThreads) own[l] = totals[me * num_local + l];
    }
    __syncthreads();
    // 3. To every peer: the meta part (warps 0-1), then this block's columns of each chunk token with
    // an expert there (all warps; a pack is loaded once and stored to every owner).
    if (warp < 2) {
      const int64_t pairs = p.ll.meta_pairs;
      for (int64_t at = warp * 32 + lane; at < (n - 1) * pairs; at += 64) {
        const int d = static_cast<int>((me + 1 + at / pairs) % n);
        const int64_t q = at % pairs;
        uint32_t w[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          w[u] = meta_word(p, 4 * q + u, d, totals, route_e[me], route_j[me], chunk_n * topk, t_begin * topk);
        }
        device::ll_store(dispatch_zone(p, d, me, b) + 2 * q, uint4{w[0], w[1], w[2], w[3]}, flag);
      }
    }
    const int parts = parts_for<T>(chunk_n, kWarps, cols.size());
    for (int64_t w = warp; w < chunk_n * parts; w += kWarps) {
      const int64_t tl = w / parts, t = t_begin + tl;
      const int32_t e = lane < topk ? route_e[me][tl * topk + lane] : -1;
      const unsigned owners =
          __reduce_or_sync(kFullMask, e >= 0 ? 1u << static_cast<unsigned>(e / num_local) : 0u) & ~self_rank(p);
      if (owners == 0u) continue;
      const T* src = x + t * c.hidden;
      const bool aligned = aligned16(src);
      const Cols sc = sub_cols<T>(cols, static_cast<int>(w % parts), parts);
      for (int64_t v0 = sc.begin / N + lane; v0 < sc.end / N; v0 += 32 * kLLExpandPacks) {
        uint4 raw[kLLExpandPacks];
#pragma unroll
        for (int u = 0; u < kLLExpandPacks; ++u) {
          if (v0 + 32 * u < sc.end / N) raw[u] = raw_of(load_pack_any(src, v0 + 32 * u, aligned));
        }
        for (int d = 0; d < n; ++d) {
          if (((owners >> d) & 1u) == 0u) continue;
          uint4* zone = dispatch_zone(p, d, me, b);
#pragma unroll
          for (int u = 0; u < kLLExpandPacks; ++u) {
            const int64_t v = v0 + 32 * u;
            if (v < sc.end / N) device::ll_store(zone_row(p, zone, tl, v - first_pack), raw[u], flag);
          }
        }
      }
    }
    trace(EPTracePoint::kDispatchRowsPushed, 0);
    trace(EPTracePoint::kDispatchMetaSignalled, 0);
    trace(EPTracePoint::kDispatchDataSignalled, 0);
  }
  if (!recv) return;

  // 4. Receive. This rank's own routing and totals: from the send part (shared memory) or, in a
  // receive-only launch, from its piece (the send kernel's lead wrote them).
  if (!send) {
    const int64_t chunk_n = chunk_tokens(p, me, role.chunk);
    for (int64_t r = threadIdx.x; r < chunk_n * topk; r += kThreads) {
      const size_t at = route(p, me, t_begin * topk + r);
      route_e[me][r] = piece<const int32_t>(p, me, p.layout.meta_idx)[at];
      route_j[me][r] = piece<const int32_t>(p, me, p.layout.meta_j)[at];
    }
    if (threadIdx.x == 0) chunk_count[me] = static_cast<int32_t>(chunk_n);
    const int32_t* own = totals_of(p, me, me, role.chunk);
    for (int64_t l = threadIdx.x; l < num_local; l += kThreads) tot[me * num_local + l] = own[l];
  } else {
    for (int64_t l = threadIdx.x; l < num_local; l += kThreads) tot[me * num_local + l] = totals[me * num_local + l];
  }
  // The peers' meta parts: token count, totals of this rank's experts, the chunk's routes. The
  // lead keeps the routes for the combine (meta_idx, meta_w, meta_j of this rank's piece).
  const bool failed = poll_meta(p, flag, seq, threadIdx.x, kThreads, [&](int s, int64_t k, uint32_t word) {
    if (k == 0) {
      const int64_t chunk_n = clamp64(static_cast<int32_t>(word) - t_begin, 0, tpc);
      chunk_count[s] = static_cast<int32_t>(chunk_n);
      if (is_lead) {
        piece<int32_t>(p, me, p.layout.num_tokens)[chunk_slot(p, s, role.chunk)] = static_cast<int32_t>(word);
      }
    } else if (k <= num_local) {
      tot[s * num_local + k - 1] = static_cast<int32_t>(word);
    } else {
      const int64_t r = (k - 1 - num_local) / 3, field = (k - 1 - num_local) % 3;
      if (r >= kLLChunkRoutes) return;
      if (field == 0) route_e[s][r] = static_cast<int32_t>(word);
      if (field == 1) route_j[s][r] = static_cast<int32_t>(word);
      if (is_lead && r < tpc * topk && t_begin + r / topk < c.max_tokens_per_rank) {
        const size_t at = route(p, s, t_begin * topk + r);
        if (field == 0) piece<int32_t>(p, me, p.layout.meta_idx)[at] = static_cast<int32_t>(word);
        if (field == 1) piece<int32_t>(p, me, p.layout.meta_j)[at] = static_cast<int32_t>(word);
        if (field == 2) piece<float>(p, me, p.layout.meta_w)[at] = __uint_as_float(word);
      }
    }
  });
  if (__syncthreads_or(failed)) return;
  trace(EPTracePoint::kDispatchDataLanded, 0);  // the meta parts, here

  // 5. Every source's tokens of the chunk (rank order) into this rank's expert rows: the own ones
  // from x, the peers' from their lines (polled, then cleared).
  int64_t items = 0;
  for (int s = 0; s < n; ++s) items += chunk_count[s];
  const int parts = parts_for<T>(items, kWarps, cols.size());
  const int busy = static_cast<int>(min64(items * parts, kWarps));
  auto total_of = [&](int s, int64_t l) { return tot[s * num_local + l]; };
  if (b == 0 && busy < kWarps && warp >= busy) write_expert_counts(p, busy * 32, kThreads - busy * 32, total_of);
  int lost = 0;
  for (int64_t w = warp; w < items * parts && !lost; w += kWarps) {
    int s = 0;
    int64_t tl = w / parts;
    while (tl >= chunk_count[s]) tl -= chunk_count[s++];
    const int64_t t = t_begin + tl;
    const int sub = static_cast<int>(w % parts);
    T* dst = nullptr;
    bool local = false, keep = false;
    if (lane < topk) {
      const int32_t e = route_e[s][tl * topk + lane];
      local = e >= 0 && e / num_local == me;
      if (local) {
        const int64_t l = e - me * num_local;
        int64_t pos = route_j[s][tl * topk + lane];
        for (int q = 0; q < s; ++q) pos += tot[q * num_local + l];
        keep = pos < c.capacity;
        if (is_lead && sub == 0) p.recv_pos[route(p, s, t * topk + lane)] = keep ? static_cast<int32_t>(pos) : -1;
        if (keep) dst = static_cast<T*>(p.expert_x) + (l * c.capacity + pos) * c.hidden;
      }
    }
    if (!__any_sync(kFullMask, local)) continue;  // no lines were sent for this token
    const int num_dsts = warp_list(lists[warp], keep, dst, lane);
    const Cols sc = sub_cols<T>(cols, sub, parts);
    if (s == me) {
      copy_row(lists[warp], num_dsts, x + t * c.hidden, c.hidden, sc, lane);
    } else {  // kLLExpandPacks packs a lane polled together, then stored to every expert row
      uint4* zone = dispatch_zone(p, me, s, b);
      for (int64_t v0 = sc.begin / N + lane; v0 < sc.end / N; v0 += 32 * kLLExpandPacks) {
        const uint4* src[kLLExpandPacks];
        int peer[kLLExpandPacks];
        uint4 lo[kLLExpandPacks], hi[kLLExpandPacks];
#pragma unroll
        for (int u = 0; u < kLLExpandPacks; ++u) {
          const int64_t v = v0 + 32 * u;
          src[u] = v < sc.end / N ? zone_row(p, zone, tl, v - first_pack) : nullptr;
          peer[u] = s;
        }
        device::ll_wait_all<kLLExpandPacks>(src, peer, lo, hi, flag, p.barrier,
                                            static_cast<int>(Phase::kDispatchLanded), seq, lost);
        if (lost) break;
#pragma unroll
        for (int u = 0; u < kLLExpandPacks; ++u) {
          if (src[u] == nullptr) continue;
          clear_pair(const_cast<uint4*>(src[u]));
          const V pack = vec_of<T>(device::ll_payload(lo[u], hi[u]));
          for (int d = 0; d < num_dsts; ++d) pack.store(lists[warp][d] + (v0 + 32 * u) * N);  // rows are aligned
        }
      }
    }
    lost = __any_sync(kFullMask, lost);
    __syncwarp();  // the list is rewritten by the next token
  }
  if (b == 0 && busy == kWarps) write_expert_counts(p, 0, kThreads, total_of);
  trace(EPTracePoint::kDispatchOwnExpanded, 0);
  trace(EPTracePoint::kDispatchEnd, 0);
}

// ---- combine ----

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ep_combine_ll_kernel(EPParams p, EPMode mode, LaunchOrder order) {
  pdl_begin(order);  // before the first read of seq, lines, expert_out (a previous kernel wrote them)
  using V = device::Vec<T>;
  constexpr int N = V::kNumElems;
  __shared__ const T* srcs[kWarps][kEPMaxTopk];
  __shared__ float weights[kWarps][kEPMaxTopk];
  const EPConfig& c = p.config;
  const bool send = has(mode, EPMode::kSend), recv = has(mode, EPMode::kRecv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = p.world_size, me = p.rank;
  const BlockRole role = block_role(p);
  const int topk = static_cast<int>(c.topk);
  const int64_t num_local = c.num_experts / n;
  const int64_t t_begin = role.chunk * p.grid.tokens_per_chunk;
  const Cols cols = cols_of<T>(c.hidden, role.part, p.grid.num_parts);  // this block's columns of every row
  const EPSeq start = read_ep_seq(p);
  if (start.poisoned) return;
  const uint64_t seq = start.seq;
  const uint32_t flag = ll_flag(seq);
  trace(EPTracePoint::kCombineStart, 0);
  // Meta and recv_pos of every source were written in the dispatch kernel, by this rank.
  const int32_t* meta_idx = piece<const int32_t>(p, me, p.layout.meta_idx);

  if (send) {
    const float* meta_w = piece<const float>(p, me, p.layout.meta_w);
    const int32_t lane_tokens = lane_chunk_tokens(p, role.chunk, -1, lane);
    const int64_t items = chunk_tokens_total(lane_tokens);
    const int parts = parts_for<T>(items, kWarps, cols.size());
    for (int64_t k = warp; k < items * parts; k += kWarps) {
      const auto [s, t] = nth_token(p, role.chunk, lane_tokens, k / parts);
      const LocalRoutes routes = local_routes<T>(p, s, t, meta_idx, meta_w, srcs[warp], weights[warp], lane);
      if (!routes.any) continue;
      uint4* dst = combine_row(p, s, me, t);
      const Cols sc = sub_cols<T>(cols, static_cast<int>(k % parts), parts);
      bool aligned = true;
      for (int r = 0; r < routes.count; ++r) aligned = aligned && aligned16(srcs[warp][r]);
      if (aligned) {
        weighted_sum_packs<T, kRouteSumDecode.unroll, kRouteSumDecode.sources>(
            srcs[warp], weights[warp], routes.count, sc, lane,
            [&](int64_t v, const V& pack) { device::ll_store(dst + 2 * v, raw_of(pack), flag); });
      } else {
        weighted_sum_lines_unaligned(dst, srcs[warp], weights[warp], routes.count, sc, flag, lane);
      }
      __syncwarp();  // the lists are rewritten by the next token
    }
    // Block b of every peer hears from this block whatever the chunk held (Note [EP LL protocol]).
    const int q = static_cast<int>(threadIdx.x);
    if (q < n && q != me) device::ll_store(combine_sync(p, q, me, blockIdx.x), uint4{1u, 1u, 1u, 1u}, flag);
    trace(EPTracePoint::kCombineSignalled, 0);
  }
  if (!recv) return;

  // This part's columns of each own token: the owners' partial lines (polled, cleared), summed in
  // rank order as the flag path does (weights 1).
  const int64_t items = chunk_tokens(p, me, role.chunk);
  const int parts = parts_for<T>(items, kWarps, cols.size());
  T* out = static_cast<T*>(p.out);
  int failed = 0;
  for (int64_t w = warp; w < items * parts && !failed; w += kWarps) {
    const int64_t t = t_begin + w / parts;
    const int32_t e = lane < topk ? meta_idx[route(p, me, t * topk + lane)] : -1;
    const unsigned owners = __reduce_or_sync(kFullMask, e >= 0 ? 1u << static_cast<unsigned>(e / num_local) : 0u);
    T* dst = out + t * c.hidden;
    const bool aligned = aligned16(dst);
    const Cols sc = sub_cols<T>(cols, static_cast<int>(w % parts), parts);
    for (int64_t v = sc.begin / N + lane; v < sc.end / N && !failed; v += 32) {
      device::Acc<N> acc;
#pragma unroll
      for (int i = 0; i < N; ++i) acc.v[i] = 0.0f;
      // kLLOwnersAtOnce ranks' lines polled together, the groups in rank order.
      for (int d0 = 0; d0 < n; d0 += kLLOwnersAtOnce) {
        const uint4* src[kLLOwnersAtOnce];
        int peer[kLLOwnersAtOnce];
        uint4 lo[kLLOwnersAtOnce], hi[kLLOwnersAtOnce];
#pragma unroll
        for (int u = 0; u < kLLOwnersAtOnce; ++u) {
          const int d = d0 + u;
          src[u] = d < n && ((owners >> d) & 1u) ? combine_row(p, me, d, t) + 2 * v : nullptr;
          peer[u] = d;
        }
        device::ll_wait_all<kLLOwnersAtOnce>(src, peer, lo, hi, flag, p.barrier,
                                             static_cast<int>(Phase::kCombineLanded), seq, failed);
        if (failed) break;
#pragma unroll
        for (int u = 0; u < kLLOwnersAtOnce; ++u) {
          if (src[u] == nullptr) continue;
          clear_pair(const_cast<uint4*>(src[u]));
          const V y = vec_of<T>(device::ll_payload(lo[u], hi[u]));
#pragma unroll
          for (int i = 0; i < N; ++i) acc.v[i] = __fadd_rn(acc.v[i], __fmul_rn(1.0f, device::to_float<T>(y.elems[i])));
        }
      }
      if (!failed) store_pack_any(dst, v, device::acc_cast<T, N>(acc), aligned);
    }
    failed = __any_sync(kFullMask, failed);
  }
  // The peers' sync pairs for this block (thread q: rank q).
  const int q = static_cast<int>(threadIdx.x);
  if (q < n && q != me && !failed) {
    take_pair(combine_sync(p, me, q, blockIdx.x), q, flag, p, Phase::kCombineLanded, seq, failed);
  }
  trace(EPTracePoint::kCombineLanded, 0);
  advance_seq(p, seq);
  trace(EPTracePoint::kCombineEnd, 0);
}

}  // namespace

std::vector<int64_t> ep_ll_trace_snapshot() { return read_trace(); }

bool ep_ll_eligible(const EPConfig& c, const EPGrid& grid) {
  return grid.num_parts > 1 && grid.tokens_per_chunk <= kEPLLMaxChunkTokens &&
         (c.hidden * static_cast<int64_t>(dtype_size(c.dtype))) % 16 == 0;
}

EPLLGeometry ep_ll_geometry(const EPConfig& c, int world_size, const EPGrid& grid, EPPath path) {
  EPLLGeometry g;
  if (path != EPPath::kLL) return g;
  const int64_t pack_elems = 16 / static_cast<int64_t>(dtype_size(c.dtype));
  g.row_packs = (c.hidden + pack_elems - 1) / pack_elems;
  g.part_packs = (g.row_packs + grid.num_parts - 1) / grid.num_parts;
  g.meta_words = 1 + c.num_experts / world_size + 3 * grid.tokens_per_chunk * c.topk;
  g.meta_pairs = (g.meta_words + 3) / 4;
  g.zone_lines = 2 * (g.meta_pairs + grid.tokens_per_chunk * g.part_packs);
  return g;
}

template <typename T>
EPKernel ep_ll_kernel(EPOp op) {
  return op == EPOp::kDispatch ? ep_dispatch_ll_kernel<T> : ep_combine_ll_kernel<T>;
}
template EPKernel ep_ll_kernel<float>(EPOp);
template EPKernel ep_ll_kernel<__half>(EPOp);
template EPKernel ep_ll_kernel<__nv_bfloat16>(EPOp);

}  // namespace commlib::kernels
