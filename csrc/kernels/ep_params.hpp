// Parameters and launchers of the GPU expert-parallel kernels (csrc/kernels/ep_dispatch_combine.cu),
// which implement Note [EP layout] (include/commlib/ep.hpp) on symmetric memory.
// Host-compilable (no nvcc needed); no torch. Launchers validate, choose the grid and return a Status.
//
// Note [EP GPU protocol]
// Each rank's symmetric piece (EPSymmetricLayout) holds landing zones indexed by the *writer*:
//   meta_idx/meta_w[s][t][k], meta_num_tokens[s]  routing of rank s (written by s into every rank)
//   land_x[s][t]                                    token t of rank s (written by s into its owners)
//   land_y[d][t]                                    owner d's partial for this rank's token t
//   overflow[kEPOverflowWords]                      added to by every owner (system-scope atomics)
// dispatch send: write meta rows everywhere and each token once into each owner rank's land_x.
// dispatch recv: flag barrier (publishes the sends: the barrier's release follows them in stream
//   order), then a group of blocks per local expert scans every source's token rows in (s, t)
//   order with a block-wide prefix sum of per-token match counts (deterministic positions), copies
//   rows into expert_x (the group splits the copies) and sets recv_pos.
// combine send: one warp per (s, t) with a local route computes the partial and stores it into
//   rank s's land_y[me][t]. combine recv: flag barrier, then the partials are summed in rank order.
// Why no buffer is overwritten while a peer still reads it: every landing zone written in call
// n + 1 was last read in call n before the reader's next barrier, and the writer only writes after
// passing that barrier (the dispatch send of call n + 1 follows the combine recv of call n, whose
// barrier every peer reaches only after its combine send of call n, its last read of the zones the
// dispatch send writes; likewise for land_y). Nothing is reset: positions come from the routing,
// and meta rows are rewritten every call, so graph replays with new routing just work.
#pragma once

#include <cstddef>
#include <cstdint>

#include "commlib/ep.hpp"
#include "commlib/errors.hpp"
#include "commlib/symmetric_buffer.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;

// Barrier phase ids recorded in DeviceErrorWord::phase (distinct from the all-reduce's).
enum class EPPhaseId : int { kDispatchLanded = 16, kCombineLanded = 17 };
const char* ep_phase_name(int phase);

// Byte offsets of the regions of one rank's symmetric piece.
struct EPSymmetricLayout {
  size_t meta_idx = 0, meta_w = 0, meta_num_tokens = 0, land_x = 0, land_y = 0, overflow = 0, total = 0;
};
EPSymmetricLayout ep_symmetric_layout(const EPConfig& config, int world_size);

struct EPParams {
  EPConfig config{};
  int rank = 0;
  int world_size = 1;
  SymmetricBufferDevice sym{};  // every rank's piece (EPSymmetricLayout)
  EPSymmetricLayout layout{};
  BarrierDevice barrier{};
  // This call's inputs (send phases).
  const void* x = nullptr;             // [num_tokens, hidden]
  const int64_t* topk_idx = nullptr;   // [num_tokens, topk]
  const float* topk_weights = nullptr; // [num_tokens, topk]
  int64_t num_tokens = 0;
  const void* expert_out = nullptr;    // combine send: [L, capacity, hidden]
  void* out = nullptr;                 // combine recv: [num_tokens, hidden]
  // Local registered state.
  void* expert_x = nullptr;            // [L, capacity, hidden]
  int32_t* expert_counts = nullptr;    // [L]
  int32_t* recv_pos = nullptr;         // [world, max_tokens, topk]
};

Status launch_ep_dispatch_send(const EPParams& params, Stream stream);
Status launch_ep_dispatch_recv(const EPParams& params, Stream stream);
Status launch_ep_combine_send(const EPParams& params, Stream stream);
Status launch_ep_combine_recv(const EPParams& params, Stream stream);

}  // namespace commlib::kernels
