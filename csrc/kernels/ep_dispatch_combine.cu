// Expert-parallel dispatch / combine on symmetric memory: Note [EP GPU protocol] (ep_params.hpp)
// implementing Note [EP layout] (include/commlib/ep.hpp). Two kernels, each one launch per phase
// (or two, send and receive, for the split-phase API).
#include <cuda_runtime.h>

#include <algorithm>

#include "commlib/device/dispatch.cuh"
#include "kernels/ep_common.cuh"
#include "kernels/launch.cuh"

namespace commlib::kernels {
namespace {

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
  const EPSeq start = read_ep_seq(p);
  if (start.poisoned) return;
  const uint64_t seq = start.seq, value = seq + 1;
  trace(EPTracePoint::kDispatchStart, 0);

  if (send && is_lead) {
    const int64_t num_tokens = p.num_tokens;
    const int64_t t_end = min64(num_tokens, t_begin + p.grid.tokens_per_chunk);
    int32_t* before = counts;
    int32_t* totals = counts + num_experts;
    count_routes(p, t_begin, before, totals);  // 1. per-expert counts of all this rank's routes
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
      rank_routes(p, t_begin, t_end, before, true, lane, [&](int64_t i, int32_t e, int32_t j) {
        const float w = p.topk_weights[i];
        const size_t at = route(p, me, i);
        for (int d = 0; d < n; ++d) {
          piece<int32_t>(p, d, p.layout.meta_idx)[at] = e;
          piece<float>(p, d, p.layout.meta_w)[at] = w;
          piece<int32_t>(p, d, p.layout.meta_j)[at] = j;
        }
      });
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
                       Phase::kDispatchMeta};
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
  const FlagSet data{p.layout.data_flags, b, other_ranks(p), Phase::kDispatchLanded};
  const FlagSet meta{p.layout.meta_flags, role.lead, is_lead ? 0u : all_ranks(p), Phase::kDispatchMeta};
  if (wait_block(p, data, meta, value, seq)) return;
  trace(EPTracePoint::kDispatchDataLanded, 0);
  const int32_t lane_tokens = lane_chunk_tokens(p, role.chunk, me, lane);
  const int64_t items = chunk_tokens_total(lane_tokens);
  const int parts = parts_for<T>(items, kWarps, cols.size());
  // Block 0 writes expert_counts with the warps the expansion leaves idle (decode sizes), else
  // with every thread after it.
  const int busy = static_cast<int>(min64(items * parts, kWarps));
  if (b == 0 && busy < kWarps && warp >= busy) {
    write_expert_counts(p, busy * 32, kThreads - busy * 32, totals_in_piece(p));
  }
  for (int64_t w = warp; w < items * parts; w += kWarps) {
    const auto [s, t] = nth_token(p, role.chunk, lane_tokens, w / parts);
    const int sub = static_cast<int>(w % parts);
    expand_token<T>(p, s, t, role.chunk, piece<const T>(p, me, p.layout.land_x) + row(p, s, t), lists[warp],
                    sub_cols<T>(cols, sub, parts), is_lead && sub == 0, lane);
  }
  if (b == 0 && busy == kWarps) write_expert_counts(p, 0, kThreads, totals_in_piece(p));
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
  const EPSeq start = read_ep_seq(p);
  if (start.poisoned) return;
  const uint64_t seq = start.seq, value = seq + 1;
  trace(EPTracePoint::kCombineStart, 0);
  // Meta and recv_pos of every source were written, or acquired, in the dispatch kernel.
  const int32_t* meta_idx = piece<const int32_t>(p, me, p.layout.meta_idx);

  if (send) {
    // This block's columns of the partials of this rank's routes for every source's tokens of the
    // chunk (the own ones too).
    const float* meta_w = piece<const float>(p, me, p.layout.meta_w);
    const int32_t lane_tokens = lane_chunk_tokens(p, role.chunk, -1, lane);
    const int64_t items = chunk_tokens_total(lane_tokens);
    const int parts = parts_for<T>(items, kWarps, cols.size());
    for (int64_t k = warp; k < items * parts; k += kWarps) {
      // One column part per row (large batches): items in zigzag order, so that the block's warps
      // work on the first source's tokens and the last one's at the same time; one of them is this
      // rank (HBM-bound partials), the other a peer (partials stored over NVLink): the link and
      // HBM stay busy together instead of one after the other.
      const int64_t item = parts == 1 ? zigzag(k, items) : k;
      const auto [s, t] = nth_token(p, role.chunk, lane_tokens, item / parts);
      const LocalRoutes routes = local_routes<T>(p, s, t, meta_idx, meta_w, srcs[warp], weights[warp], lane);
      if (!routes.any) continue;
      T* dst = piece<T>(p, s, p.layout.land_y) + row(p, me, t);
      constexpr SumShape shape = kDecodeGrid ? kRouteSumDecode : kSumLarge;
      weighted_sum_row<T, shape.unroll, shape.sources>(dst, srcs[warp], weights[warp], routes.count, c.hidden,
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
  const FlagSet partials{p.layout.combine_flags, b, other_ranks(p), Phase::kCombineLanded};
  const FlagSet none{p.layout.combine_flags, b, 0u, Phase::kCombineLanded};
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
  advance_seq(p, seq);
  trace(EPTracePoint::kCombineEnd, 0);
}


}  // namespace

Status check_ep_params(const EPParams& p, const char* what) {
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

std::vector<int64_t> ep_trace_snapshot() {
  // The kernels of the last call: the flag path's or the LL path's (the later dispatch start).
  std::vector<int64_t> mine = read_trace(), ll = ep_ll_trace_snapshot();
  const int start = static_cast<int>(EPTracePoint::kDispatchStart);
  return !ll.empty() && (mine.empty() || ll[start] > mine[start]) ? ll : mine;
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

EPSymmetricLayout ep_symmetric_layout(const EPConfig& c, int world_size, const EPGrid& grid, const EPLLGeometry& ll) {
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
  // LL lines start at zero too (flag 0 is never valid).
  take(l.ll_dispatch, slots * static_cast<size_t>(ll.zone_lines) * 16);
  take(l.ll_combine, static_cast<size_t>(world_size) * c.max_tokens_per_rank * ll.row_packs * 2 * 16);
  take(l.ll_combine_sync, ll.zone_lines > 0 ? slots * 2 * 16 : 0);
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

template <typename T>
EPKernel ep_flags_kernel(EPOp op, bool column_parts) {
  // Rows split into column parts (decode sizes): a combine lane holds about one pack of a row.
  if (op == EPOp::kDispatch) return ep_dispatch_kernel<T>;
  return column_parts ? ep_combine_kernel<T, true> : ep_combine_kernel<T, false>;
}

Status launch_ep(const EPParams& p, EPOp op, EPMode mode, Stream stream) {
  const bool send = has(mode, EPMode::kSend);
  const char* what = op == EPOp::kDispatch ? (send ? "EPBuffer.dispatch" : "EPBuffer.dispatch_recv")
                                           : (send ? "EPBuffer.combine" : "EPBuffer.combine_recv");
  Status status = check_ep_params(p, what);
  if (!status.is_ok()) return status;
  // Dispatch keeps two per-expert counters in shared memory.
  const size_t smem = op == EPOp::kDispatch ? 2 * static_cast<size_t>(p.config.num_experts) * sizeof(int32_t) : 0;
  COMMLIB_DISPATCH_FLOAT_DTYPE(p.config.dtype, T, what, [&] {
    const EPKernel kernel = p.path == EPPath::kLL ? ep_ll_kernel<T>(op) : ep_flags_kernel<T>(op, p.grid.num_parts > 1);
    status = launch_kernel(what, kernel, {dim3(p.grid.num_blocks()), dim3(kThreads), smem}, stream, p.order, p, mode,
                           p.order);
  });
  return status;
}

}  // namespace commlib::kernels
