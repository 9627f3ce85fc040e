// Parameters and launchers of the GPU expert-parallel kernels (csrc/kernels/ep_dispatch_combine.cu),
// which implement Note [EP layout] (include/commlib/ep.hpp) on symmetric memory.
// Host-compilable (no nvcc needed); no torch. Launchers validate, choose the grid and return a Status.
//
// Note [EP GPU protocol]
// One kernel per phase: dispatch (send + receive) and combine (send + receive); the split-phase
// API runs the same kernel twice, once per mode. Both kernels launch the same grid of G blocks on
// every rank (G from the config and the smallest SM count of the ranks), and block b of every
// rank owns token chunk b: tokens [b * c, (b + 1) * c), c = tokens_per_block. Block b only ever
// waits for block b of the peers, through per-(writer rank, block) flags in the reader's piece:
// no grid-wide barrier, no cross-block wait inside a rank, no memset.
// Flags carry seq + 1, where seq (EPControl, this rank's piece) counts completed
// dispatch/combine pairs: every block reads it at kernel start and the last block of the
// combine's receive part advances it, so flags only grow and nothing is ever reset.
//
// dispatch, block b of source rank s:
//   1. counts: every block scans all of s's routes (topk_idx, 4-8 bytes a route, L2-resident)
//      and counts routes per expert: totals[e], and before[e] (tokens before chunk b) into shared
//      memory, order-free (shared atomics on counts).
//   2. meta: warp 0 walks chunk b's routes in (t, k) order, 32 at a time; __match_any_sync gives
//      each route its rank among equal experts in the step, so j(t, k) = before[e] + earlier
//      routes to e: the route's rank among all of s's routes to e (deterministic). It writes
//      idx, weight and j of every route of the chunk, s's token count and the totals of d's
//      experts into every rank d; then flag meta[s][b] on every peer (release).
//   3. rows: each token of the chunk is stored once into land_x[s][t] of every *remote* rank
//      owning one of its experts (one warp per token, 16-byte packs, 8 in flight per lane);
//      then flag data[s][b] (release; cumulative: covers the meta too).
// dispatch, block b of receiving rank d (from the same kernel, or a second one with mode kRecv):
//   the route (s, t, k) to local expert l lands at row base(s, l) + j(s, t, k) of expert_x[l],
//   base(s, l) = sum over s' < s of totals[s'][l]: exactly Note [EP layout]'s position, computed
//   with no scan. The own chunk (s = d) is expanded from x directly by the warps that do not
//   push (they wait only for the meta flags of ranks < d), remote chunks from land_x after the
//   data flags. Each warp loads a row once and stores it to all its expert rows. recv_pos
//   records every position (-1: dropped by capacity); block 0 writes expert_counts and raises
//   the overflow word on every rank.
// combine, block b of owner rank d: for every source s (d included) and token t of chunk b with a
//   route to d, one warp sums w * y over those routes (k ascending, fp32, no FMA), rounds to the
//   dtype and stores the partial into s's land_y[d][t]; then flag combine[d][b] on every peer.
//   Block b of source s waits for combine[*][b] and sums the partials of t's owner ranks in rank
//   order into out[t].
// Why no landing zone is overwritten while a peer still reads it: rank s writes rank d's meta,
//   totals and land_x in dispatch n + 1 only after its combine n has passed the combine flags of
//   every block of d, which d raises after its dispatch n and its combine-n reads of s's meta;
//   d writes s's land_y in combine n + 1 only after its dispatch n + 1 passed s's dispatch flags,
//   raised after s's combine n (its last read of land_y) finished.
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
  size_t num_tokens = 0;     // int32 [world][blocks]: source s's token count (every block writes its slot)
  size_t totals = 0;         // int32 [world][blocks][L]: routes of s to each of this rank's experts
  size_t meta_idx = 0;       // int32 [world][max_tokens][topk] (-1: none or invalid)
  size_t meta_w = 0;         // float [world][max_tokens][topk]
  size_t meta_j = 0;         // int32 [world][max_tokens][topk]: rank among s's routes to that expert
  size_t land_x = 0;         // dtype [world][max_tokens][hidden]
  size_t land_y = 0;         // dtype [world][max_tokens][hidden]
  size_t control_end = 0;    // [0, control_end) must be zero at creation (the flags)
  size_t total = 0;
};
EPSymmetricLayout ep_symmetric_layout(const EPConfig& config, int world_size, int num_blocks);

// Blocks of both kernels: the same on every rank for the same config and max_blocks.
int ep_num_blocks(const EPConfig& config, int max_blocks);
// Threads per block of both kernels (for the caller's occupancy bound).
int ep_threads_per_block();

struct EPParams {
  EPConfig config{};
  int rank = 0;
  int world_size = 1;
  int num_blocks = 1;
  int64_t tokens_per_block = 1;
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
