// Fused reduce-scatter -> residual add + RMSNorm -> all-gather without barriers, for the smallest
// token counts (decode), where two barrier round trips cost more than the data. The data flow is
// rs_rmsnorm_ag_p2p.cu's, but every transfer is a flag-carrying LL line (Note [LL lines]) in the
// communicator's LL buffer (Note [fused LL layout]), so each consumer waits only for the bytes it
// needs, and one kernel call does the whole op:
//   1. push: every thread stores packs of the x rows each peer d owns into d's region X (slot of
//      this rank) as LL lines, several packs loaded before their stores.
//   2. own rows: a row belongs to a cluster of C CTAs (Note [fused LL row split]); cluster m takes
//      rows m, m + clusters, ... of this rank's slice. Each CTA loads its packs of x, the residual
//      and the weight, waits for the peers' lines of those packs (all polled at once), reduces in
//      rank order, adds the residual, sums the squares (Note [fused rmsnorm arithmetic]: threads,
//      then warps, then the cluster's CTAs), normalises and pushes its packs of the normalised row
//      (and, replicated, of the residual row) into every peer's region O (R) as LL lines.
//   3. gather: every thread waits for several packs of the other owners' rows at once in its own
//      regions O (R) and stores them to out (residual).
// Every CTA pushes before it waits, so waits only depend on other ranks (and, for the cluster
// barrier, on CTAs that are co-scheduled with it). Waits are bounded (COMMLIB timeout); a timeout
// records rank, peer and phase, and nothing is pushed from a row a wait failed on. Single call: the
// plan only picks this kernel when every rank's slice fits one region (plan_fused, csrc/core/plan.cc).
// Call parity and flag = call + 1 come from the shared call counter, so the kernel is graph-replay
// safe like every other.
//
// Note [fused one-shot]
// At a few tokens the op is two NVLink latencies (x slice to its owner, normalised row back), not
// bytes. The one-shot variant of this kernel (kOneShot; up to COMMLIB_FUSED_ONESHOT_MAX_TOKENS
// tokens) crosses once: every rank pushes all of its x rows to every peer (a slot's three regions
// hold them as one run of lines, row t at lines 2 t P), and every rank reduces and normalises
// every row itself, storing all of out; no gather. The residual: replicated, every rank holds the
// whole (identical) residual and updates all of it; sharded, a rank holds only its slice, so the
// owner pushes the old residual of its rows to every peer (after the slot's x lines, at
// geo.r_offset) right after its x rows, before any wait, and only the owner stores the new one.
// Those pushes are made by the threads that later update the same packs (the step-2 mapping of
// rows to clusters and packs to threads), so program order keeps each push before the update;
// and since nothing is pushed after a wait, waits depend only on other ranks. (Pushing a row's
// residual only when its cluster reached the row made 32 tokens sharded a chain of round trips:
// 17.8 µs against 13.9 replicated on 2x H200.) Each row is computed by
// the code of the two-shot kernel (same tree, same rank order), so out and residual are bitwise
// those of the two-shot kernel and the unfused reference; a rank merely normalises rows it does
// not own, which at 2 ranks moves no more NVLink bytes than the two-shot (the whole x once,
// against half of x and half of out). Reuse of the LL halves: Note [LL lines] (a rank finishes a
// call only after reading lines of every peer's call).
//
// Note [fused LL row split]
// One CTA per row pushes the whole normalised row from one SM (~45 GB/s per SM: ~0.7 us for the
// 32 KiB of lines of a hidden-8192 row), and its block-wide reduction is a chain of barriers. So a
// row is split over a cluster of C CTAs (C = 1, 2, 4 or 8; COMMLIB_FUSED_LL_ROW_CTAS, 0: as many
// as the CTA budget allows for the slice's rows). The bits of the sum of squares must stay those of
// the documented zero-padded pairwise tree, whose node at the level with N nodes covers the packs
// k = m (mod N). With t threads per CTA (W = t / 32 warps), thread `lane` of warp `w` of CTA c owns
// node m = lane * (W * C) + w * C + c of the level N = t * C, i.e. packs k = m + j * N, j < V:
//   - its V packs are summed pairwise in registers (levels above N),
//   - the xor butterfly across the lanes of a warp adds nodes N / 2 apart, then N / 4, ... down to
//     W * C apart (lane bits are the node's high bits): every lane holds node w * C + c,
//   - the W warp roots (shared memory, one block barrier) are added as a tree (w, w + W / 2), ...:
//     node c of the level C,
//   - the C CTA roots (distributed shared memory, one cluster barrier) are added as a tree: the
//     root. Every thread of the cluster evaluates the last two stages itself, in the same order.
// Missing leaves (k >= hidden / 8, or a power of two beyond P) are exact zeros: a larger
// zero-padded tree has the same root. C and t change only who adds, never what is added.
// With one CTA per row (C = 1) the nodes are lane-major instead, m = w * 32 + lane, so adjacent
// lanes touch adjacent packs (coalesced loads of x, residual, weight and lines; lane-high nodes put
// adjacent lanes W packs apart). The levels below N then pair different warps first (same lane:
// each thread adds its lane's column of the W values in shared memory as a tree, one block
// barrier) and lanes of a warp last (xor shuffles): the same pairs, so the same bits.
// Each CTA reads and writes only its own packs of the residual, so no CTA can see another's new
// residual. The warp roots and CTA roots are double-buffered by row parity: a CTA overwrites the
// buffer of row n + 2 only after the barrier of row n + 1, which every reader of row n passed after
// reading it. A final cluster barrier keeps every CTA's shared memory alive until the cluster's
// last read. Failures travel with the roots (a failed flag per CTA), so the whole cluster skips
// the pushes of a row any of its CTAs could not reduce, and every CTA still meets every barrier.
#include <algorithm>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "commlib/device/ll.cuh"
#include "kernels/launch.cuh"
#include "kernels/rs_rmsnorm_ag_common.cuh"

namespace commlib::kernels {
namespace {
using namespace fused_detail;

constexpr int kLLMaxWarps = kLLMaxThreads / 32;
constexpr int kLLPushUnroll = 4;     // packs loaded before their stores, per thread, in phase 1
constexpr int kLLGatherPacks = 4;    // packs polled at once per thread in phase 3

enum LLRegion : int { kLLRegionX = 0, kLLRegionO = 1, kLLRegionR = 2 };

struct LLGeometry {
  size_t region_bytes;  // fused_ll_region_bytes
  int row_ctas;         // C of Note [fused LL row split]; the launch's cluster size when > 1
  size_t r_offset;      // one-shot: bytes from a slot's region X to its residual lines (Note [fused one-shot])
};

// Root of the pairwise tree over v (pairs (i, i + kN / 2) first): levels of Note [fused rmsnorm
// arithmetic]. v is overwritten.
// Recursion on the level (a loop over h /= 2 is not always unrolled, which puts v in local memory).
template <int kN>
__device__ __forceinline__ float pairwise_root(float (&v)[kN]) {
  static_assert(kN >= 1 && (kN & (kN - 1)) == 0, "a power of two");
  if constexpr (kN == 1) {
    return v[0];
  } else {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) v[i] = __fadd_rn(v[i], v[i + kN / 2]);
    return pairwise_root<kN / 2>(reinterpret_cast<float(&)[kN / 2]>(v));
  }
}

template <typename T, int kWorldSize, int kVecs, bool kOneShot>
__global__ void __launch_bounds__(kLLMaxThreads)
    rs_rmsnorm_ag_p2p_ll_kernel(RsRmsNormAgP2pParams p, LLGeometry geo, LaunchOrder order) {
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  __shared__ float warp_roots[2][kLLMaxWarps];  // by row parity (Note [fused LL row split])
  __shared__ float node_values[2][kLLMaxThreads];  // one CTA per row: level N, by row parity
  __shared__ float cta_root[2];
  __shared__ uint32_t cta_failed[2];
  pdl_begin(order);  // before call_begin reads the counter the previous kernel advanced, and x
  const device::CallInfo call = device::call_begin(p.barrier);
  // A poisoned communicator: no pushes and no waits, but every cluster barrier is still met.
  int failed = call.ok ? 0 : 1;
  const FusedRmsNormArgs& a = p.args;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const int num_packs = static_cast<int>(a.hidden / kGroup);
  const uint32_t flag = static_cast<uint32_t>(call.call + 1);
  const size_t half = (call.call & 1) * (p.lines.bytes / 2);
  const bool replicated = a.mode == ResidualMode::kReplicated;
  const char* x = static_cast<const char*>(a.x);
  const size_t row_bytes = static_cast<size_t>(a.hidden) * sizeof(T);
  // Lines of rank s's slot, region `which`, in rank `owner`'s LL buffer: row i, pack k at 2 (i P + k).
  auto region = [&](int owner, int which, int s) {
    return reinterpret_cast<uint4*>(p.lines.peer<char>(owner) + half +
                                    (peer_slot(s, owner, world) * 3 + which) * geo.region_bytes);
  };
  // One-shot: the residual lines of rank s's slice, after s's x lines in its slot.
  auto residual_lines = [&](int owner, int s) {
    return reinterpret_cast<uint4*>(reinterpret_cast<char*>(region(owner, kLLRegionX, s)) + geo.r_offset);
  };
  const int64_t num_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const TokenSlice all_rows{0, a.num_tokens};
  // Who works on which packs of which rows in step 2 (and, one-shot, the residual pushes of step 1).
  const int row_ctas = geo.row_ctas;
  const int c = row_ctas > 1 ? static_cast<int>(device::cluster_ctarank()) : 0;
  const int64_t cluster = blockIdx.x / row_ctas;
  const int64_t num_clusters = gridDim.x / row_ctas;
  const int warps = static_cast<int>(blockDim.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  // One CTA per row: lane-major nodes (adjacent lanes, adjacent packs: coalesced accesses); a split
  // row: lane-high nodes, so that the shuffles come first (Note [fused LL row split]).
  const bool lane_major = row_ctas == 1;
  const int node = lane_major ? warp * 32 + lane : lane * warps * row_ctas + warp * row_ctas + c;
  const int nodes = static_cast<int>(blockDim.x) * row_ctas;  // N: packs k = node + j * N
  const TokenSlice mine = token_slice(a.num_tokens, world, rank);

  // 1. Push the x rows every peer owns (one-shot: every row) (rows are contiguous in x and in the
  //    region: flat packs).
  if (!failed) {
    for (int step = 1; step < world; ++step) {
      const int d = (rank + step) % world;
      const TokenSlice rows = kOneShot ? all_rows : token_slice(a.num_tokens, world, d);
      const int64_t total = rows.size() * num_packs;
      const char* src = x + rows.begin * row_bytes;
      uint4* dst = region(d, kLLRegionX, rank);
      for (int64_t base = first; base < total; base += kLLPushUnroll * num_threads) {
        uint4 v[kLLPushUnroll] = {};
#pragma unroll
        for (int u = 0; u < kLLPushUnroll; ++u) {
          const int64_t idx = base + u * num_threads;
          if (idx < total) v[u] = device::ld_v4_u32(src + idx * 16);
        }
#pragma unroll
        for (int u = 0; u < kLLPushUnroll; ++u) {
          const int64_t idx = base + u * num_threads;
          if (idx < total) device::ll_store(dst + 2 * idx, v[u], flag);
        }
      }
    }
  }
  // Sharded one-shot: the old residual of the rows this rank owns, pushed to every peer by the
  // threads that update the same packs in step 2 (program order keeps each push before the update).
  if (kOneShot && !replicated && !failed) {
    for (int64_t i = cluster; i < a.num_tokens; i += num_clusters) {
      if (i < mine.begin || i >= mine.end) continue;
      const char* res_row = reinterpret_cast<const char*>(residual_row<T>(a, mine.begin, i));
      const int64_t line0 = 2 * (i - mine.begin) * num_packs;
      uint4 v[kVecs] = {};
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {  // every load before the stores
        const int k = node + j * nodes;
        if (k < num_packs) v[j] = device::ld_v4_u32(res_row + k * 16);
      }
      for (int step = 1; step < world; ++step) {
        uint4* dst = residual_lines((rank + step) % world, rank) + line0;
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          const int k = node + j * nodes;
          if (k < num_packs) device::ll_store(dst + 2 * k, v[j], flag);
        }
      }
    }
  }

  // 2. This rank's rows, one per cluster at a time (Note [fused LL row split]). Packs stay raw
  //    (Note [raw packs]).
  const TokenSlice rows = kOneShot ? all_rows : mine;  // the rows this rank normalises
  const int64_t per_rank = (a.num_tokens + world - 1) / world;
  const char* weight = static_cast<const char*>(a.weight);
  int parity = 0;
  for (int64_t i = cluster; i < rows.size(); i += num_clusters, parity ^= 1) {  // cluster-uniform
    const int64_t token = rows.begin + i;
    // Whether this rank holds (reads and writes) the row's residual: always but for the other
    // owners' rows of a sharded one-shot call, whose residual arrives from the owner.
    const bool res_local = !kOneShot || replicated || (token >= mine.begin && token < mine.end);
    const int owner = static_cast<int>(token / per_rank);
    char* res_row = res_local ? reinterpret_cast<char*>(residual_row<T>(a, mine.begin, token)) : nullptr;
    const int64_t line0 = 2 * i * num_packs;  // row i's first line in a region
    uint4 own[kVecs], res[kVecs], w[kVecs];
    float acc[kVecs][kGroup];
    float q[kVecs];
    // Local loads first: their latency overlaps the wait for the peers' lines. The weight is
    // loaded after the wait, when fewer registers are live (its latency overlaps the reduction),
    // and so are x and the residual with 4 packs per thread (registers again).
    constexpr bool kPreload = kVecs <= 2;
    auto load_local = [&](uint4(&dst)[kVecs], const char* row) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int k = node + j * nodes;
        dst[j] = uint4{0u, 0u, 0u, 0u};
        if (k < num_packs) dst[j] = device::ld_v4_u32(row + k * 16);
      }
    };
    if constexpr (kPreload) {
      load_local(own, x + token * row_bytes);
      if (res_local) load_local(res, res_row);
    }
    if constexpr (kVecs == 1) {
      // One pack: every source's lines polled at once; slot s holds rank s (own x at s == rank).
      const int k = node;
      const uint4* src[kCap];
      int peer[kCap];
#pragma unroll
      for (int s = 0; s < kCap; ++s) {
        peer[s] = s;
        const bool wanted = k < num_packs && s != rank && (kWorldSize > 0 || s < world);
        src[s] = wanted ? region(rank, kLLRegionX, s) + line0 + 2 * k : nullptr;
      }
      uint4 lo[kCap], hi[kCap];
      device::ll_wait_all<kCap>(src, peer, lo, hi, flag, p.barrier, static_cast<int>(Phase::kFusedLLInputs),
                                  call.call, failed);
#pragma unroll
      for (int s = 0; s < kCap; ++s) {  // rank order (Note [reduction order])
        if (kWorldSize == 0 && s >= world) continue;
        const uint4 xs = s == rank ? own[0] : device::ll_payload(lo[s], hi[s]);
#pragma unroll
        for (int e = 0; e < kGroup; ++e) acc[0][e] = s == 0 ? raw_elem<T>(xs, e) : __fadd_rn(acc[0][e], raw_elem<T>(xs, e));
      }
    } else {
      // Several packs: per source in rank order, that source's lines of all packs polled at once.
#pragma unroll 1
      for (int s = 0; s < world; ++s) {
        uint4 lo[kVecs], hi[kVecs];
        if (s == rank && !kPreload) load_local(own, x + token * row_bytes);
        if (s != rank) {
          const uint4* src[kVecs];
          int peer[kVecs];
#pragma unroll
          for (int j = 0; j < kVecs; ++j) {
            const int k = node + j * nodes;
            peer[j] = s;
            src[j] = k < num_packs ? region(rank, kLLRegionX, s) + line0 + 2 * k : nullptr;
          }
          device::ll_wait_all<kVecs>(src, peer, lo, hi, flag, p.barrier, static_cast<int>(Phase::kFusedLLInputs),
                                      call.call, failed);
        }
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          const uint4 xs = s == rank ? own[j] : device::ll_payload(lo[j], hi[j]);
#pragma unroll
          for (int e = 0; e < kGroup; ++e) acc[j][e] = s == 0 ? raw_elem<T>(xs, e) : __fadd_rn(acc[j][e], raw_elem<T>(xs, e));
        }
      }
    }
    if (!res_local) {
      // Sharded one-shot, another owner's row: its old residual from the owner's lines.
      const uint4* src[kVecs];
      int peer[kVecs];
      const int64_t res_line0 = 2 * (token - owner * per_rank) * num_packs;
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int k = node + j * nodes;
        peer[j] = owner;
        src[j] = k < num_packs ? residual_lines(rank, owner) + res_line0 + 2 * k : nullptr;
      }
      uint4 lo[kVecs], hi[kVecs];
      device::ll_wait_all<kVecs>(src, peer, lo, hi, flag, p.barrier, static_cast<int>(Phase::kFusedLLInputs),
                                  call.call, failed);
#pragma unroll
      for (int j = 0; j < kVecs; ++j) res[j] = device::ll_payload(lo[j], hi[j]);
    } else if constexpr (!kPreload) {
      load_local(res, res_row);
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      q[j] = 0.0f;
      if (node + j * nodes >= num_packs) continue;
      float rf[kGroup];
      res[j] = new_residual<T>(res[j], acc[j], rf);  // old residual in, new residual out
      q[j] = sum_squares(rf);
    }
    load_local(w, weight);
    // The row's sum of squares (Note [fused LL row split]): registers first (levels above N).
    float node_sum = pairwise_root(q);
    uint32_t row_failed = 0;
    float sumsq = 0.0f;
    if (lane_major) {
      // Level N in shared memory, then the levels whose pairs lie in different warps (same lane),
      // then those within a warp (xor shuffles).
      node_values[parity][threadIdx.x] = node_sum;
      // Makes the node values visible to the block; and whether any thread's wait failed.
      row_failed = __syncthreads_or(failed) != 0 ? 1u : 0u;
      float column[kLLMaxWarps];
#pragma unroll
      for (int v = 0; v < kLLMaxWarps; ++v) column[v] = v < warps ? node_values[parity][v * 32 + lane] : 0.0f;
      sumsq = pairwise_root(column);
#pragma unroll
      for (int h = 16; h >= 1; h /= 2) sumsq = __fadd_rn(sumsq, __shfl_xor_sync(0xffffffffu, sumsq, h));
    } else {
      // The warp's lanes (xor shuffles), then the warps.
#pragma unroll
      for (int h = 16; h >= 1; h /= 2) node_sum = __fadd_rn(node_sum, __shfl_xor_sync(0xffffffffu, node_sum, h));
      if (lane == 0) warp_roots[parity][warp] = node_sum;
      // Makes the warp roots visible to the block; and whether any thread's wait failed.
      row_failed = __syncthreads_or(failed) != 0 ? 1u : 0u;
      float roots[kLLMaxWarps];
#pragma unroll
      for (int v = 0; v < kLLMaxWarps; ++v) roots[v] = v < warps ? warp_roots[parity][v] : 0.0f;
      sumsq = pairwise_root(roots);
    }
    if (row_ctas > 1) {
      if (threadIdx.x == 0) {
        cta_root[parity] = sumsq;
        cta_failed[parity] = row_failed;
      }
      // Publishes this CTA's root and failure to the cluster; acquires the other CTAs'.
      device::barrier_cluster_arrive_release();
      device::barrier_cluster_wait_acquire();
      const uint32_t root_at = static_cast<uint32_t>(__cvta_generic_to_shared(&cta_root[parity]));
      const uint32_t failed_at = static_cast<uint32_t>(__cvta_generic_to_shared(&cta_failed[parity]));
      float parts[kLLMaxRowCtas];
#pragma unroll
      for (int cc = 0; cc < kLLMaxRowCtas; ++cc) {
        parts[cc] = 0.0f;
        if (cc < row_ctas) {
          parts[cc] = device::ld_shared_cluster_f32(device::mapa_shared_cluster_u32(root_at, cc));
          row_failed |= device::ld_shared_cluster_u32(device::mapa_shared_cluster_u32(failed_at, cc));
        }
      }
      sumsq = pairwise_root(parts);
    }
    // Nothing is pushed from garbage: the whole cluster skips a row any of its waits failed on
    // (row_failed is the same on every thread of the cluster), and waits no more.
    if (row_failed) {
      failed = 1;
      continue;
    }
    const float rstd = row_rstd(sumsq, a.hidden, a.eps);
    char* out_row = static_cast<char*>(a.out) + token * row_bytes;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int k = node + j * nodes;
      if (k >= num_packs) continue;
      const uint4 y = normalised<T>(res[j], rstd, w[j]);
      // The peers' lines first: they are on the critical path, the local stores are not.
      if constexpr (!kOneShot) {
        for (int step = 1; step < world; ++step) {
          const int d = (rank + step) % world;
          device::ll_store(region(d, kLLRegionO, rank) + line0 + 2 * k, y, flag);
          if (replicated) device::ll_store(region(d, kLLRegionR, rank) + line0 + 2 * k, res[j], flag);
        }
      }
      device::st_v4_u32(out_row + k * 16, y);
      if (res_local) device::st_v4_u32(res_row + k * 16, res[j]);
    }
  }
  if (row_ctas > 1) {
    // No CTA leaves (its shared memory with it) while another CTA of the cluster may still read
    // its roots of the last row.
    device::barrier_cluster_arrive_release();
    device::barrier_cluster_wait_acquire();
  }

  // 3. Gather the other owners' rows from this rank's own regions O (and R), several packs at once
  //    (one-shot: nothing to gather).
  char* out = static_cast<char*>(a.out);
  char* residual = static_cast<char*>(a.residual);  // full layout whenever replicated
  for (int step = 1; step < world && !failed && !kOneShot; ++step) {
    const int d = (rank + step) % world;
    const TokenSlice rows = token_slice(a.num_tokens, world, d);
    const int64_t total = rows.size() * num_packs;
    const uint4* o_lines = region(rank, kLLRegionO, d);
    const uint4* r_lines = region(rank, kLLRegionR, d);
    const size_t base_offset = rows.begin * row_bytes;
    for (int64_t base = first; base < total && !failed; base += kLLGatherPacks * num_threads) {
      constexpr int kN = 2 * kLLGatherPacks;  // [u]: pack u of out; [kLLGatherPacks + u]: of the residual
      const uint4* src[kN];
      int peer[kN];
#pragma unroll
      for (int u = 0; u < kLLGatherPacks; ++u) {
        const int64_t idx = base + u * num_threads;
        const bool in = idx < total;
        src[u] = in ? o_lines + 2 * idx : nullptr;
        src[kLLGatherPacks + u] = in && replicated ? r_lines + 2 * idx : nullptr;
        peer[u] = peer[kLLGatherPacks + u] = d;
      }
      uint4 lo[kN], hi[kN];
      device::ll_wait_all<kN>(src, peer, lo, hi, flag, p.barrier, static_cast<int>(Phase::kFusedLLRows),
                                  call.call, failed);
      if (failed) break;
#pragma unroll
      for (int u = 0; u < kLLGatherPacks; ++u) {
        const int64_t idx = base + u * num_threads;
        if (idx >= total) continue;
        device::st_v4_u32(out + base_offset + idx * 16, device::ll_payload(lo[u], hi[u]));
        if (replicated) {
          device::st_v4_u32(residual + base_offset + idx * 16,
                            device::ll_payload(lo[kLLGatherPacks + u], hi[kLLGatherPacks + u]));
        }
      }
    }
  }
  if (__syncthreads_or(failed)) return;
  device::call_end(p.barrier);
}

}  // namespace

Status launch_rs_rmsnorm_ag_p2p_ll(const RsRmsNormAgP2pParams& params, Stream stream) {
  const char* what = "fused_allreduce_rmsnorm(p2p, LL)";
  const FusedRmsNormArgs& a = params.args;
  const int world = params.barrier.world_size;
  Status status = check_p2p_args(what, a, params.barrier);
  if (!status.is_ok() || a.num_tokens == 0) return status;
  const size_t region_bytes = fused_ll_region_bytes(params.lines.bytes, world);
  const int64_t per_rank = (a.num_tokens + world - 1) / world;
  const size_t slice_bytes = static_cast<size_t>(per_rank * a.hidden) * dtype_size(a.dtype);
  const bool one_shot = params.shot == FusedShot::kOneShot;
  if (world < 2 || (!one_shot && 2 * slice_bytes > region_bytes)) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": a slice of ", slice_bytes, " bytes needs ", 2 * slice_bytes,
                                 " bytes of LL region; the LL buffer has ", region_bytes, " per region (world ", world,
                                 ")"));
  }
  // The grid is the plan's (plan_fused); only the layout offsets are computed here.
  const FusedLLGrid& grid = params.ll_grid;
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtype_size(a.dtype);
  const LLGeometry geo{region_bytes, grid.row_ctas, one_shot ? fused_oneshot_residual_offset(a.num_tokens, row_bytes) : 0};
  const LaunchOrder order = params.config.order;
  const LaunchShape shape{dim3(static_cast<unsigned>(grid.blocks)), dim3(static_cast<unsigned>(grid.threads)), 0,
                          static_cast<unsigned>(grid.row_ctas)};
  auto go = [&](auto kernel) {
    return launch_kernel(what, kernel, shape, reinterpret_cast<cudaStream_t>(stream), order, params, geo, order);
  };
  const auto by_shape = [&]<typename T, bool kOneShot>() {
    return COMMLIB_DISPATCH_WORLD_SIZE(world, kWorldSize, [&] {
      switch (grid.packs_per_thread) {
        case 1: return go(rs_rmsnorm_ag_p2p_ll_kernel<T, kWorldSize, 1, kOneShot>);
        case 2: return go(rs_rmsnorm_ag_p2p_ll_kernel<T, kWorldSize, 2, kOneShot>);
        default: return go(rs_rmsnorm_ag_p2p_ll_kernel<T, kWorldSize, 4, kOneShot>);
      }
    });
  };
  const auto launch = [&]<typename T>() {
    return one_shot ? by_shape.template operator()<T, true>() : by_shape.template operator()<T, false>();
  };
  return a.dtype == DataType::kBFloat16 ? launch.template operator()<__nv_bfloat16>()
                                        : launch.template operator()<__half>();
}

}  // namespace commlib::kernels
