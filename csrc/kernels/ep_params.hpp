// Parameters and launchers of the GPU expert-parallel kernels (csrc/kernels/ep_dispatch_combine.cu),
// which implement Note [EP layout] (include/commlib/ep.hpp) on symmetric memory.
// Host-compilable (no nvcc needed); no torch. Launchers validate, choose the grid and return a Status.
//
// Note [EP GPU protocol]
// One kernel per phase: dispatch (send + receive) and combine (send + receive); the split-phase
// API runs the same kernel twice, once per mode. Both kernels launch the same grid on every rank
// (EPGrid: C token chunks x P column parts, fixed at buffer creation from the config and the
// smallest SM count of the ranks). Block b is (chunk b / P, part b % P): chunk i is tokens
// [i * c, (i + 1) * c), c = tokens_per_chunk, and part p is the hidden columns cols_of(hidden, p, P)
// (whole 16-byte packs; the last part ends at hidden). A block moves only its part's columns of its
// chunk's rows, in every phase; its warps split that range further at decode sizes. P > 1 only at
// small batches (C small), so that one token's row is spread over several SMs; at large batches
// P = 1 and block b is simply chunk b. Block (i, 0), the chunk's *lead*, also does all of the
// chunk's routing work (counts, meta); the other parts only move columns.
// Block b only waits for block b, or its lead, of the peers (and, for parts > 0, its own rank's
// lead), through per-(writer rank, block) flags in the reader's piece: no grid-wide barrier, no
// memset. Flags carry seq + 1, where seq (EPControl, this rank's piece) counts completed
// dispatch/combine pairs: every block reads it at kernel start and the last block of the
// combine's receive part advances it, so flags only grow and nothing is ever reset.
//
// dispatch, block b = (i, p) of source rank s:
//   1. counts (lead only): scans all of s's routes (topk_idx, L2-resident) and counts routes per
//      expert: totals[e], and before[e] (tokens before chunk i) into shared memory, order-free.
//   2. meta (lead only): warp 0 walks chunk i's routes in (t, k) order, 32 at a time;
//      __match_any_sync gives each route its rank among equal experts in the step, so
//      j(t, k) = before[e] + earlier routes to e: the route's rank among all of s's routes to e
//      (deterministic). It writes idx, weight and j of every route of the chunk, s's token count
//      and the totals of d's experts (slots [s][i]) into every rank d; then flag meta[s][b] on
//      every peer (release), and on s itself when P > 1 (its other parts read s's own meta).
//      No other block writes these words.
//   3. rows: part p of each token of the chunk is stored once into land_x[s][t] of every *remote*
//      rank owning one of its experts (16-byte packs, 8 in flight per lane); then flag data[s][b]
//      (release; cumulative: for the lead it covers the meta too).
// dispatch, block b = (i, p) of receiving rank d (from the same kernel, or a second one with mode
//   kRecv): the route (s, t, k) to local expert l lands at row base(s, l) + j(s, t, k) of
//   expert_x[l], base(s, l) = sum over s' < s of totals[s'][l]: exactly Note [EP layout]'s
//   position, computed with no scan. Reads of a rank's chunk-i meta (idx, j, token count, totals)
//   follow an acquire of that rank's lead flags: meta[q][(i, 0)] (or data[q][b] when b is the
//   lead itself, which covers it); d's own meta is ordered for d's lead (same block, or the send
//   kernel before) and needs meta[d][(i, 0)] for d's other parts. The own chunk (s = d) is
//   expanded from x directly by the warps that do not push (they wait only for the meta flags of
//   ranks < d, and d's own when p > 0); remote chunks from land_x after data[s][b] (this part's
//   columns) and meta[s][(i, 0)]. Each warp loads a row once and stores it to all its expert
//   rows. recv_pos records every position (-1: dropped by capacity), written by the lead only;
//   block 0 (chunk 0's lead) writes expert_counts and raises the overflow word on every rank.
// combine, block b = (i, p) of owner rank d: for every source s (d included) and token t of
//   chunk i with a route to d, one warp (or several, splitting part p) sums w * y over those
//   routes (k ascending, fp32, no FMA), rounds to the dtype and stores part p of the partial into
//   s's land_y[d][t] (with one part per row the warps take the chunk's tokens in zigzag order,
//   first source's and last source's at once, so HBM-bound own partials and NVLink-bound remote
//   ones overlap); then flag combine[d][b] on every peer. Block b of source s waits for
//   combine[*][b] and sums part p of the partials of t's owner ranks in rank order into out[t].
//   Meta and recv_pos were written in the dispatch kernel (any part reads them after the kernel
//   boundary; remote meta was acquired there by every block through meta/data flags).
// Why no landing zone is overwritten while a peer still reads it (every block b of a rank waits
//   for block b of every peer in each receive, whatever its chunk holds, so finishing a receive
//   kernel means every block of every peer raised that phase's flag):
//   - meta, token counts, totals and land_x written by s into d's piece in dispatch n + 1: s
//     starts it only after its combine n finished, which passed combine[d][b] for every b; d
//     raises those after its whole dispatch n kernel (every part's reads of s's meta and land_x)
//     and after its combine-n send reads of s's meta (same block, before the flag). d's combine-n
//     receive reads only d's own meta (written by d) and land_y.
//   - land_y written by d into s's piece in combine n + 1: d starts it only after its dispatch
//     n + 1 finished, which passed data[s][b] for every b, raised after s's combine n (its last
//     read of land_y) finished.
//   - d's own meta (d's lead rewrites it in dispatch n + 1): read by d's dispatch n and combine n,
//     both finished (stream order), and, within dispatch n + 1, by d's other parts only after
//     meta[d][(i, 0)] = n + 1.
// Residency: blocks spin on flags of other blocks (of peers, and of their own rank's lead), so the
//   grid is at most one block per SM of the smallest GPU and all blocks run at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "commlib/ep.hpp"
#include "commlib/errors.hpp"
#include "commlib/symmetric_buffer.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;

// Barrier phase ids recorded in DeviceErrorWord::phase (distinct from the all-reduce's).
enum class EPPhaseId : int { kDispatchLanded = 16, kCombineLanded = 17, kDispatchMeta = 18 };
const char* ep_phase_name(int phase);

// Which part of a phase a launch runs (bit flags; kBoth is the fused single kernel).
enum class EPMode : int { kSend = 1, kRecv = 2, kBoth = 3 };

// Largest number of experts the CUDA kernels support (two int32 counters per expert in shared memory).
constexpr int64_t kEPMaxExpertsCuda = 4096;
// Largest grid (the flag arrays have one slot per (rank, block)).
constexpr int kEPMaxBlocks = 256;
// Largest number of column parts per token chunk.
constexpr int kEPMaxParts = 8;

// The grid of both kernels (Note [EP GPU protocol]): block b is chunk b / num_parts, part
// b % num_parts. The same on every rank for the same config and max_blocks.
struct EPGrid {
  int num_chunks = 1;
  int num_parts = 1;
  int64_t tokens_per_chunk = 1;

  // constexpr: kernels call it too (nvcc --expt-relaxed-constexpr).
  constexpr int num_blocks() const { return num_chunks * num_parts; }
};

// Local bookkeeping at the start of each rank's piece (only its own rank touches it).
struct EPControl {
  uint64_t seq;          // dispatch/combine pairs completed on this rank
  uint32_t blocks_done;  // blocks of the current combine receive that finished
  uint32_t reserved;
};

// Byte offsets of the regions of one rank's piece (Note [EP GPU protocol]); [s] is the writer.
struct EPSymmetricLayout {
  size_t control = 0;        // EPControl
  size_t overflow = 0;       // int64 [kEPOverflowWords]
  size_t meta_flags = 0;     // uint64 [world][blocks]
  size_t data_flags = 0;     // uint64 [world][blocks]
  size_t combine_flags = 0;  // uint64 [world][blocks]
  size_t num_tokens = 0;     // int32 [world][chunks]: source s's token count (each chunk's lead writes its slot)
  size_t totals = 0;         // int32 [world][chunks][L]: routes of s to each of this rank's experts
  size_t meta_idx = 0;       // int32 [world][max_tokens][topk] (-1: none or invalid)
  size_t meta_w = 0;         // float [world][max_tokens][topk]
  size_t meta_j = 0;         // int32 [world][max_tokens][topk]: rank among s's routes to that expert
  size_t land_x = 0;         // dtype [world][max_tokens][hidden]
  size_t land_y = 0;         // dtype [world][max_tokens][hidden]
  size_t control_end = 0;    // [0, control_end) must be zero at creation (the flags)
  size_t total = 0;
};
EPSymmetricLayout ep_symmetric_layout(const EPConfig& config, int world_size, const EPGrid& grid);

// The grid of both kernels for at most max_blocks blocks (one per SM of the smallest GPU): chunks
// of at least 2 tokens, then column parts while the grid has fewer than ~128 blocks.
EPGrid ep_grid(const EPConfig& config, int max_blocks);
// Threads per block of both kernels (for the caller's occupancy bound).
int ep_threads_per_block();

struct EPParams {
  EPConfig config{};
  int rank = 0;
  int world_size = 1;
  EPGrid grid{};
  SymmetricBufferDevice sym{};  // every rank's piece (EPSymmetricLayout)
  EPSymmetricLayout layout{};
  BarrierDevice barrier{};      // only its state (poisoned), error word and timeout are used
  // This call's inputs.
  const void* x = nullptr;              // [num_tokens, hidden]: dispatch (both modes: own rows)
  const int64_t* topk_idx = nullptr;    // [num_tokens, topk]: dispatch send
  const float* topk_weights = nullptr;  // [num_tokens, topk]: dispatch send
  int64_t num_tokens = 0;               // dispatch send
  const void* expert_out = nullptr;     // combine send: [L, capacity, hidden]
  void* out = nullptr;                  // combine recv: [num_tokens, hidden]
  // Local registered state.
  void* expert_x = nullptr;             // [L, capacity, hidden]
  int32_t* expert_counts = nullptr;     // [L]
  int32_t* recv_pos = nullptr;          // [world, max_tokens, topk]
};

// Points of the opt-in timing trace (ep_dispatch_combine.cu, -DCOMMLIB_EP_TRACE), in call order.
enum class EPTracePoint : int {
  kDispatchStart, kDispatchRowsPushed, kDispatchDataSignalled, kDispatchMetaSignalled, kDispatchOwnExpanded,
  kDispatchDataLanded, kDispatchEnd, kCombineStart, kCombineSignalled, kCombineLanded, kCombineEnd,
  kPrevCombineEnd  // the previous call's kCombineEnd
};
constexpr int kEPTracePoints = 12;
// The last call's %globaltimer values (ns) per point on the current device; empty unless built
// with COMMLIB_EP_TRACE.
std::vector<int64_t> ep_trace_snapshot();

Status launch_ep_dispatch(const EPParams& params, EPMode mode, Stream stream);
Status launch_ep_combine(const EPParams& params, EPMode mode, Stream stream);

}  // namespace commlib::kernels
