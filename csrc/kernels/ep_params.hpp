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
// memset. Flags carry seq + 1, where seq (EPControl, this rank's piece, one per block) counts the
// dispatch/combine pairs block b completed: block b reads its own at kernel start and advances it at
// the end of the combine's receive part (no atomic, no fence: only block b touches it, and the next
// kernel of the stream sees it), so flags only grow and nothing is ever reset. Every block of every
// call runs, so all blocks of a rank hold the same seq (one that gave up poisoned the communicator).
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
//
// Note [EP LL protocol]
// Decode grids (P > 1 column parts, at most kEPLLMaxChunkTokens tokens a chunk, rows a whole number
// of 16-byte packs) can run both phases over flag-carrying lines instead (ep_ll.cu; Note [LL lines]
// for the line format): no release fence, no separate flag, no meta round; the routing travels in
// the same kind of lines as the rows. Same grid, same results bit for bit (same positions, same
// sums in the same order). flag = seq mod (2^32 - 1) + 1, never 0.
// dispatch, block b = (i, p) of source s: every block (not only the lead) counts s's routes per
//   expert and computes j for chunk i's routes (as the lead does above; the chunk's routes live in
//   shared memory). To every peer d it writes, into d's zone [s][b]: a meta part (s's token count,
//   s's totals of d's experts, then (expert, j, weight) of each route of chunk i; fixed length, so
//   the reader knows what to poll) and part p of each chunk-i token with an expert on d.
// dispatch, block b of receiver d: polls the meta part of every peer's zone [s][b] (and clears
//   it), then expands every source's tokens of chunk i (its own from x, the peers' by polling and
//   clearing their lines) into expert rows at base(s, l) + j. Part 0 writes meta_idx, meta_w,
//   meta_j, the token counts and recv_pos of the chunk into d's own piece for the combine; block
//   0 writes expert_counts and the overflow words. In split mode the send kernel's part 0 also
//   stores s's own routing and totals there, which the receive kernel reads back.
// combine, block b of owner d: the partials of chunk i (as above) go into the source's line rows
//   [d][t] instead of land_y; block b of source s polls the lines of t's owners, clears them and
//   sums them in rank order. Tokens with no route to d get no lines from d (s knows the owners).
// Every block b also hears from block b of every peer in each receive, whatever its chunk holds,
//   as on the flag path: the dispatch's meta part always goes out, and in the combine block b of
//   every rank sends a sync pair to every peer (ll_combine_sync), which block b of the peer polls.
//   Without it a rank whose tokens of a chunk have no expert on a peer would finish its combine
//   without waiting for that peer, and its next dispatch could overwrite lines the peer has not
//   read yet (found by back-to-back eager calls after a skewed routing).
// Reuse without a reset: a reader clears every line it consumed, before the writer can write that
//   line again (the same argument as for land_x and land_y above, with the meta parts and sync
//   pairs for the flags: the next write of a zone comes after a kernel boundary of the reader and
//   a line that the reader sent after it). The flag is checked too, so a line is never taken from
//   an earlier call even without the clear.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "commlib/ep.hpp"
#include "commlib/errors.hpp"
#include "commlib/phase.hpp"
#include "commlib/symmetric_buffer.hpp"
#include "kernels/launch.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;


// Largest chunk (tokens) of the LL path (Note [EP LL protocol]).
constexpr int64_t kEPLLMaxChunkTokens = 4;

// Which kernels run a buffer's calls (fixed at creation, the same on every rank).
enum class EPPath : int { kFlags = 0, kLL = 1 };

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
  uint64_t seq[kEPMaxBlocks];  // dispatch/combine pairs block b completed on this rank
};

// Byte offsets of the regions of one rank's piece (Note [EP GPU protocol]); [s] is the writer.
struct EPSymmetricLayout {
  size_t control = 0;        // EPControl
  size_t overflow = 0;       // int64 [kEPOverflowWords]
  size_t meta_flags = 0;     // uint64 [world][blocks]
  size_t data_flags = 0;     // uint64 [world][blocks]
  size_t combine_flags = 0;  // uint64 [world][blocks]
  size_t ll_dispatch = 0;    // LL path: 16-byte lines [world][blocks][EPLLGeometry::zone_lines]
  size_t ll_combine = 0;     // LL path: 16-byte lines [world][max_tokens][2 * EPLLGeometry::row_packs]
  size_t ll_combine_sync = 0;  // LL path: line pairs [world][blocks]: block b of rank d is in this combine
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
// Sizes of the LL path's line zones (Note [EP LL protocol]); all zero on the flag path.
struct EPLLGeometry {
  int64_t meta_words = 0;  // words of a zone's meta part: token count, totals of the reader's experts, routes
  int64_t meta_pairs = 0;  // line pairs (4 words each) of the meta part
  int64_t part_packs = 0;  // 16-byte packs of the widest column part
  int64_t zone_lines = 0;  // lines of one zone [s][b]: meta, then tokens_per_chunk rows of part_packs packs
  int64_t row_packs = 0;   // 16-byte packs of a whole row (combine lines)
};
// Whether the LL path can run this config and grid: a decode grid (P > 1), chunks of at most
// kEPLLMaxChunkTokens tokens, rows a whole number of 16-byte packs.
bool ep_ll_eligible(const EPConfig& config, const EPGrid& grid);
EPLLGeometry ep_ll_geometry(const EPConfig& config, int world_size, const EPGrid& grid, EPPath path);
EPSymmetricLayout ep_symmetric_layout(const EPConfig& config, int world_size, const EPGrid& grid,
                                      const EPLLGeometry& ll);

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
  EPPath path = EPPath::kFlags;  // which kernels launch_ep runs: the flag ones or the LL ones
  LaunchOrder order = LaunchOrder::kStream;  // COMMLIB_PDL, resolved by the core
  EPLLGeometry ll{};
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
std::vector<int64_t> ep_ll_trace_snapshot();  // the LL kernels' (ep_trace_snapshot picks the later call)

enum class EPOp : int { kDispatch, kCombine };
// The one launcher of the peer-memory EP kernels: `op` on the path params.path names (the flag
// kernels or the LL ones), with the params' grid and launch order. The NVSHMEM kernels have their
// own (csrc/nvshmem).
Status launch_ep(const EPParams& params, EPOp op, EPMode mode, Stream stream);

}  // namespace commlib::kernels
