// Expert-parallel dispatch / combine over NVSHMEM (Note [EP NVSHMEM protocol]): the parameters, the
// layout of a buffer on the NVSHMEM symmetric heap, and the C entry table of the separately built
// library libcommlib_nvshmem.so (csrc/nvshmem/ep_nvshmem.cu). Host-compilable; no NVSHMEM header; the core includes it.
//
// Why a separate library: NVSHMEM's device library must be linked with relocatable device code and
// a device-link step, and its host library must already be loaded (nvshmem4py loads it) when the
// kernels' module registers its device state. commlib._C loads this library with dlopen only when
// a buffer asks for the NVSHMEM transport, so `import commlib` never needs NVSHMEM.
//
// Note [EP NVSHMEM protocol]
// Same contract as the peer-memory kernels (Note [EP layout]): same row positions, same sums in the
// same order, so the results are bitwise identical. Every remote write is an NVSHMEM put whose
// signal travels with it (nvshmemx_putmem_signal_nbi_warp), so the kernels run unchanged whether a
// peer is reached over NVLink (NVSHMEM's P2P transport) or the network (IBGDA). A put's source must
// be on the symmetric heap for IBGDA, so rows are staged in this rank's own slot first.
// Grid: G blocks on every rank (fixed at creation); block b owns tokens [b * c, (b + 1) * c) of
// every source, c = tokens_per_block, in every phase; block b of a rank waits only for block b of
// the peers (and for the peers' meta), never for another block of its own rank.
// Signals (uint64, only ever increased; nothing is reset):
//   meta_signal[s]        += 1 per message of source s's routing (3 a call: expert ids, weights,
//                            token count), from s's block 0.
//   data_signal[s][b]     += 1 per token row of s's block-b tokens that has an expert here.
//   combine_signal[d][b]  += 1 per partial from owner d for this rank's block-b tokens, and 1 when
//                            block b of d has finished reading this rank's routing in the combine.
// The receiver knows how many messages to expect from the routing (which it has), so it waits for
// a cumulative count kept per block in its own control area (expected_*), advanced after each wait.
// dispatch send, block b of source s: block 0 writes s's routing (sanitised ids, weights, count)
//   into s's own meta slot and puts it to every peer; every block stages each of its tokens that has
//   an expert on another rank into land_x[s][t] (own slot) and puts the row to land_x[s][t] of every
//   such rank.
// dispatch recv, block b of rank d: waits for every peer's meta; for each source s in rank order
//   counts s's routes to each local expert before its token range and walks its range in (t, k)
//   order (warp 0, __match_any_sync) to get every route's position base(s, l) + j, writes recv_pos,
//   then adds s's totals to base; waits for data_signal[s][b]; copies each token row (own: from x)
//   to its kept expert rows. Block 0 writes expert_counts and, from every source's routing (every
//   rank has all of it), the overflow word for all experts, so each rank's word equals the one the
//   peer-memory kernels build by remote atomics.
// combine send, block b of owner d: for each source s and token t of the range with a route to d,
//   the partial (k ascending, fp32, no FMA) into land_y[d][t] (own tokens) or staged in send_y[s][t]
//   and put to land_y[d][t] of s; then one more signal to every peer.
// combine recv, block b of source s: waits for combine_signal[d][b] of every peer d; sums the
//   partials of t's owner ranks in rank order into out[t]; advances seq[b].
// Reuse without a reset: s overwrites its slots on d (meta, land_x) in dispatch n + 1 only after
//   its combine n received every block's last signal from d, sent after d's dispatch n (all blocks:
//   kernel order) and after block b's last read of s's routing; d overwrites land_y on s in combine
//   n + 1 only after it received s's meta of dispatch n + 1, sent after s's combine n. A staged
//   source (land_x own slot, send_y) is rewritten only after the peer acknowledged the call that
//   read it, which covers the completion of the non-blocking put.
// The own routing in a fused dispatch comes from topk_idx itself (block 0's copy into the meta slot
// is not ordered for the other blocks of the same kernel); in split mode and in the combine, from
// the meta slot (an earlier kernel wrote it).
// World size: up to kMaxRanks (a multi-node EP group), not kMaxDeviceRanks. Rank sets are 64-bit
// masks (bit r: rank r); per-rank work runs on thread r of the block, or in laps of 32 ranks over a
// warp (lane l: ranks l and l + 32); an owner set is reduced over a warp in two 32-bit halves. Every
// order that decides a result (sources in rank order for positions, owners in rank order in the
// combine's sum) is the same at every world size, so wherever the peer-memory kernels also run
// (world <= 8) the results match theirs bit for bit. Of the communicator's BarrierDevice the
// kernels use only state (poisoned), error and timeout: its per-rank arrays (kMaxDeviceRanks) are
// never indexed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "kernels/ep_params.hpp"

namespace commlib::nvshmem_ep {

constexpr int kApiVersion = 1;
// Largest world (rank sets are uint64 masks; Note [EP NVSHMEM protocol]).
constexpr int kMaxRanks = 64;
// Largest grid (the per-block control words and signals are sized by it).
constexpr int kMaxBlocks = 64;
// Messages of one source's routing per call (Note [EP NVSHMEM protocol]).
constexpr uint64_t kMetaMessages = 3;

// Rank sets (bit r: rank r), right for every world of 1..kMaxRanks (a shift by 64 is undefined, so
// the full set is built from its complement). constexpr: the kernels call them too.
constexpr uint64_t rank_bit(int r) { return uint64_t{1} << r; }
constexpr uint64_t all_ranks(int n) { return n >= 64 ? ~uint64_t{0} : rank_bit(n) - 1u; }
constexpr uint64_t other_ranks(int n, int me) { return all_ranks(n) & ~rank_bit(me); }

static_assert(all_ranks(1) == 1u && all_ranks(8) == 0xffu && all_ranks(32) == 0xffffffffu);
static_assert(all_ranks(33) == 0x1ffffffffu && all_ranks(kMaxRanks) == ~uint64_t{0});
static_assert(other_ranks(1, 0) == 0u && other_ranks(8, 3) == 0xf7u && other_ranks(64, 63) == (~uint64_t{0} >> 1));
static_assert(other_ranks(64, 0) == (~uint64_t{0} << 1) && other_ranks(40, 35) == 0xf7ffffffffu);

// Byte offsets in one buffer on the symmetric heap (the same on every PE).
struct Layout {
  size_t seq = 0;               // uint64 [blocks]: dispatch/combine pairs block b completed
  size_t data_expected = 0;     // uint64 [blocks][world]: data_signal[s][b] counted so far
  size_t combine_expected = 0;  // uint64 [blocks][world]: combine_signal[d][b] counted so far
  size_t overflow = 0;          // int64 [kEPOverflowWords]
  size_t meta_signal = 0;       // uint64 [world]
  size_t data_signal = 0;       // uint64 [world][blocks]
  size_t combine_signal = 0;    // uint64 [world][blocks]
  size_t control_end = 0;       // [0, control_end) must be zero at creation
  size_t num_tokens = 0;        // int32 [world]
  size_t meta_idx = 0;          // int32 [world][max_tokens][topk]
  size_t meta_w = 0;            // float [world][max_tokens][topk]
  size_t land_x = 0;            // dtype [world][max_tokens][hidden]
  size_t land_y = 0;            // dtype [world][max_tokens][hidden]
  size_t send_y = 0;            // dtype [world][max_tokens][hidden]
  size_t total = 0;
};

inline Layout make_layout(const EPConfig& c, int world_size, int num_blocks, size_t elem_size) {
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t n = static_cast<size_t>(world_size), blocks = static_cast<size_t>(num_blocks);
  const size_t routes = n * static_cast<size_t>(c.max_tokens_per_rank * c.topk);
  const size_t rows = n * static_cast<size_t>(c.max_tokens_per_rank) * static_cast<size_t>(c.hidden) * elem_size;
  Layout l;
  size_t at = 0;
  auto take = [&](size_t& field, size_t bytes) {
    field = at;
    at = align(at + bytes);
  };
  take(l.seq, blocks * 8);
  take(l.data_expected, blocks * n * 8);
  take(l.combine_expected, blocks * n * 8);
  take(l.overflow, kEPOverflowWords * 8);
  take(l.meta_signal, n * 8);
  take(l.data_signal, n * blocks * 8);
  take(l.combine_signal, n * blocks * 8);
  l.control_end = at;
  take(l.num_tokens, n * 4);
  take(l.meta_idx, routes * 4);
  take(l.meta_w, routes * 4);
  take(l.land_x, rows);
  take(l.land_y, rows);
  take(l.send_y, rows);
  l.total = at;
  return l;
}

struct Params {
  kernels::EPParams base{};  // config, rank, world, this call's inputs, local state, barrier (errors)
  char* heap = nullptr;      // the buffer on the symmetric heap (this PE's address; the same on every PE)
  Layout layout{};
  int num_blocks = 1;
  int64_t tokens_per_block = 1;
};

// Whether the kernels can run `q` (every launch checks it); if not, false and a message naming
// `what`, the value and the valid range in `message` (len bytes).
inline bool check_params(const Params& q, const char* what, char* message, size_t len) {
  const EPConfig& c = q.base.config;
  const int n = q.base.world_size;
  auto fail = [&](const char* field, long long value, long long lo, long long hi) {
    if (message != nullptr && len > 0) {
      std::snprintf(message, len, "%s: %s %lld not supported; valid: %lld..%lld", what, field, value, lo, hi);
    }
    return false;
  };
  if (n < 1 || n > kMaxRanks) return fail("world_size", n, 1, kMaxRanks);
  if (q.base.rank < 0 || q.base.rank >= n) return fail("rank", q.base.rank, 0, n - 1);
  if (c.topk < 1 || c.topk > kEPMaxTopk) return fail("topk", c.topk, 1, kEPMaxTopk);
  if (c.num_experts < n || c.num_experts % n != 0 || c.num_experts > kernels::kEPMaxExpertsCuda) {
    return fail("num_experts (a multiple of world_size)", c.num_experts, n, kernels::kEPMaxExpertsCuda);
  }
  if (q.num_blocks < 1 || q.num_blocks > kMaxBlocks) return fail("num_blocks", q.num_blocks, 1, kMaxBlocks);
  if (q.tokens_per_block < 1 || q.tokens_per_block * q.num_blocks < c.max_tokens_per_rank) {
    if (message != nullptr && len > 0) {
      std::snprintf(message, len, "%s: a grid of %d blocks x %lld tokens does not cover max_tokens_per_rank %lld",
                    what, q.num_blocks, static_cast<long long>(q.tokens_per_block),
                    static_cast<long long>(c.max_tokens_per_rank));
    }
    return false;
  }
  if (q.base.num_tokens < 0 || q.base.num_tokens > c.max_tokens_per_rank) {
    return fail("num_tokens", q.base.num_tokens, 0, c.max_tokens_per_rank);
  }
  return true;
}

// The library's entry table (commlib_nvshmem_ep_api). Functions returning int return 0 on success,
// else write a message into `message` (len bytes).
struct Api {
  int version;
  // After NVSHMEM is initialised in this process (nvshmem4py): registers this library's device state
  // with the host library and checks it on the device (my_pe, n_pes as the kernels see them).
  int (*attach)(int device, int* my_pe, int* n_pes, char* message, size_t len);
  void* (*malloc)(size_t bytes);  // collective over all PEs (nvshmem_malloc)
  void (*free)(void* ptr);        // collective over all PEs (nvshmem_free)
  int (*dispatch)(const Params* params, int mode, void* stream, char* message, size_t len);
  int (*combine)(const Params* params, int mode, void* stream, char* message, size_t len);
};

}  // namespace commlib::nvshmem_ep

extern "C" const commlib::nvshmem_ep::Api* commlib_nvshmem_ep_api();
