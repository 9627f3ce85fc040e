// Expert-parallel dispatch / combine (issue #8): shapes, the layout contract, and the CPU
// implementation over host shared memory. The GPU implementation (csrc/kernels/ep_dispatch_combine.cu)
// follows the same contract, so a CPU run is the reference for a GPU run.
//
// Note [EP layout]
// Experts are split contiguously: rank r owns experts [r * L, (r + 1) * L), L = num_experts / world.
// A route is one (token t, slot k) of a rank's topk_idx; topk_idx[t][k] == -1 means "no expert"
// (skipped; contributes nothing). A token routed twice to one expert is two routes.
// Dispatch sends each token once to every rank that owns one of its experts (not once per route),
// together with every rank's routing (topk_idx, topk_weights, num_tokens): the "meta" rows.
// Rows of expert e (on its owner, expert_x[e - r * L]) hold the routes to e ordered by
// (source rank, token index, k): the route (s, t, k) lands at row
//     pos = #{routes (s', t', k') to e with (s', t', k') < (s, t, k) lexicographically}.
// The owner records it in recv_pos[s][t][k] (entries of routes to other ranks are unspecified).
// Capacity: routes with pos >= capacity are dropped (recv_pos = -1, not written);
// expert_counts[e] = min(total, capacity). The overflow word (kEPOverflowWords int64, sticky until
// cleared) is updated on every rank: [0] += routes dropped, [1] = max over overflowing experts of
// (total << 24 | expert), [2] += invalid expert ids seen (GPU; the CPU raises instead).
// Combine, for token t of rank s: each owner rank d of one of t's routes computes, in fp32,
//     partial_d = sum over k ascending of t's kept routes to d: fp32(w[t][k]) * fp32(y(route))
// (each product and each sum rounded to fp32, no fused multiply-add) and rounds it to the dtype;
// rank s then sums the partials of its owner ranks in ascending rank order in fp32 and rounds
// once: out[t] = round(sum_d fp32(partial_d)). A token with all routes on one rank therefore gets
// round(sum_k w * y) exactly; a token without routes gets 0.
#pragma once

#include <cstdint>

#include "commlib/types.hpp"

namespace commlib {

class Communicator;

struct EPConfig {
  int64_t max_tokens_per_rank = 0;
  int64_t hidden = 0;
  int64_t num_experts = 0;
  int64_t topk = 0;
  int64_t capacity = 0;  // rows per local expert; 0 means max_tokens_per_rank * world_size
  DataType dtype = DataType::kBFloat16;

  int64_t num_local_experts(int world_size) const { return num_experts / world_size; }
};

// Largest top-k supported.
constexpr int64_t kEPMaxTopk = 16;
// Largest number of experts (the overflow word packs the expert id into 24 bits).
constexpr int64_t kEPMaxExperts = int64_t{1} << 20;
constexpr int kEPOverflowWords = 4;

// Checks the configuration (and fills capacity when 0); throws InvalidArgument naming the field,
// the value and the valid range, or TypeMismatch for the dtype. Not collective.
EPConfig validate_ep_config(const EPConfig& config, int world_size);

// Which part of a dispatch or combine to run (split phases overlap communication with compute:
// kSend returns once this rank's data is on its way; kRecv waits for the peers and finishes).
enum class EPPhase : int { kBoth = 0, kSend = 1, kRecv = 2 };

// The registered state of one EPBuffer on one rank (host or device pointers).
struct EPState {
  void* expert_x = nullptr;          // [L, capacity, hidden], dtype
  int32_t* expert_counts = nullptr;  // [L]
  int32_t* recv_pos = nullptr;       // [world, max_tokens, topk]
  int32_t* meta_idx = nullptr;       // [world, max_tokens, topk]: every rank's topk_idx (as int32)
  float* meta_w = nullptr;           // [world, max_tokens, topk]: every rank's topk_weights
  int32_t* meta_num_tokens = nullptr;  // [world]
  int64_t* overflow = nullptr;       // [kEPOverflowWords]
};

// CPU versions over host shared memory. Collective: every rank calls with the same config.
// A topk_idx value outside [-1, num_experts) throws InvalidArgument before any communication.
void ep_dispatch_host(Communicator& comm, const EPConfig& config, const EPState& state, const void* x,
                      int64_t num_tokens, const int64_t* topk_idx, const float* topk_weights);
// expert_out: [L, capacity, hidden]; out: [num_tokens, hidden] where num_tokens is the dispatch's.
void ep_combine_host(Communicator& comm, const EPConfig& config, const EPState& state, const void* expert_out,
                     void* out);

}  // namespace commlib
