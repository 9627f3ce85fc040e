// Parameters and launchers of the fused reduce-scatter -> residual add + RMSNorm -> all-gather
// kernels (one algorithm per .cu file):
//   rs_rmsnorm_ag_p2p.cu       peer stores (push) for the scatter and the gather, per-block flag
//                              barriers between the phases (default for larger token counts)
//   rs_rmsnorm_ag_p2p_ll.cu    the same data flow without barriers: every 8 bytes pushed carry
//                              their ready flag (Note [LL lines]); for the smallest token counts
//   rs_rmsnorm_ag_multimem.cu  NVLS multimem.ld_reduce / multimem.st (sm_90a; behind the multicast
//                              guard, csrc/common/multicast_guard.hpp; never run on lent machines)
// Semantics, slicing and arithmetic: include/commlib/fused_rmsnorm.hpp. Host-compilable, no torch.
// Launchers validate and return a Status; which kernel serves a call, and the LL kernel's whole
// launch shape, are the plan's (plan_fused, Note [plan] in csrc/core/plan.hpp), handed in the params.
//
// Note [NVLink copy rate by CTA count]
// Between two H200 over NV18, both GPUs sending 64 MiB at once, a plain push (16-byte stores to
// peer memory) moves ~45 GB/s per CTA and saturates the link from 8 CTAs (334 GB/s per direction;
// 348 with 132); remote loads move ~26 GB/s per CTA and reach 311 GB/s from 16 CTAs, bulk (TMA)
// pushes the same, 320 from 16. So the fused kernels' CTA count is set by each CTA's chain of
// latencies, not by the link.
#pragma once

#include <cstddef>
#include <cstdint>

#include "commlib/errors.hpp"
#include "commlib/phase.hpp"
#include "commlib/fused_rmsnorm.hpp"
#include "commlib/symmetric_buffer.hpp"
#include "commlib/types.hpp"
#include "kernels/launch.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;


// Largest CTA count of the fused kernels, and the by-size cap when num_blocks == 0 and no tuned
// count applies (chosen by size, at most this).
constexpr int kFusedMaxBlocks = 132;
constexpr int kFusedDefaultMaxBlocks = 16;
// The barrier (p2p) kernel's by-size cap: the whole GPU. Measured on 2x H200 at 512-4096 tokens x
// 8192 (docs/fused.md, "CTA count"): 132 CTAs are the fastest count at every size,
// and 16 CTAs reach 68-80% of that (a CTA is latency-bound, not NVLink-bound: 8 CTAs already
// saturate the link for a plain copy). Callers that overlap the op with compute pass num_sms (the
// core resolves it from the call, COMMLIB_FUSED_NUM_SMS or the tune file's fused_num_sms).
constexpr int kFusedP2pDefaultMaxBlocks = kFusedMaxBlocks;
// The barrier kernel's chunk size in replicated mode (residual gather) when the rank's slice would
// otherwise run as one chunk, or one full chunk and a short one: 8 MiB, 512 rows of hidden 8192
// (launch_rs_rmsnorm_ag_p2p).
constexpr size_t kFusedRepSplitBytes = size_t{8} << 20;

// The fused kernels' configuration, resolved once per communicator by the core (Note
// [communicator configuration] in csrc/core/algorithm_selector.hpp); the defaults are the knobs'.
struct FusedKernelConfig {
  int64_t ll_max_bytes = 262144;         // COMMLIB_FUSED_LL_MAX_BYTES
  int64_t ll_max_rows = 16;              // COMMLIB_FUSED_LL_MAX_ROWS
  int64_t oneshot_max_tokens = 32;       // COMMLIB_FUSED_ONESHOT_MAX_TOKENS
  int64_t oneshot_sharded_max_tokens = 8;  // COMMLIB_FUSED_ONESHOT_SHARDED_MAX_TOKENS
  int64_t ll_bytes_per_cta = 2048;       // COMMLIB_FUSED_LL_BYTES_PER_CTA
  int64_t ll_row_ctas = 0;               // COMMLIB_FUSED_LL_ROW_CTAS
  // commlib-tune's fused_num_sms for this world size (tuned_fused_num_sms); 0: none,
  // kFusedP2pDefaultMaxBlocks applies. The barrier kernel's by-size cap; the LL kernel (small
  // slices) keeps kFusedDefaultMaxBlocks.
  int tuned_max_blocks = 0;
  LaunchOrder order = LaunchOrder::kStream;  // COMMLIB_PDL (the LL kernels)
};

// The LL kernel's launch shape for `rows_per_rank` rows per rank (one-shot: every row; Note [fused
// LL row split] in rs_rmsnorm_ag_p2p_ll.cu): `row_ctas` CTAs per row (a thread-block cluster when
// > 1), `blocks` CTAs in all (a multiple of row_ctas), `threads` per CTA and packs per thread. The
// same on every rank; plan_fused computes it.
struct FusedLLGrid {
  int row_ctas = 1;
  int blocks = 1;
  int threads = 32;
  int packs_per_thread = 1;
};
enum class FusedShot : uint8_t { kTwoShot, kOneShot };  // Note [fused one-shot]

// The LL kernel's limits (the plan sizes its grid within them; the kernel's arrays are sized by them).
constexpr int kLLMaxThreads = 512;   // up to 4 packs per thread (hidden 16384 on one CTA)
constexpr int kLLMinBlocks = 4;      // default floor: spreads the push and gather stores over SMs
constexpr int kLLMaxRowCtas = 8;     // the portable cluster size
// By default a row is split over a cluster only when the slice has at most this many rows. On 2x H200
// (hidden 8192) the split won at 1-4 rows (1 token: 7.5 µs with 8 CTAs per row against 11.0 with
// the lane-high single CTA), but at 8 rows one lane-major CTA per row beat 2 CTAs per row (sharded
// 9.4 vs 12.2 µs; docs/fused.md).
constexpr int64_t kLLSplitMaxRows = 4;
// The one-shot kernel's by-size CTA cap (one CTA per row beyond 4 rows): it normalises every row,
// twice a slice's. On 2x H200 (hidden 8192, replicated) 32 CTAs against 16 took 32 tokens from
// 14.1 to 11.4 µs and 16 tokens from 8.4 to 7.6 (docs/fused.md).
constexpr int kLLOneShotMaxBlocks = 32;
// Most CTAs that COMMLIB_FUSED_LL_BYTES_PER_CTA asks for (one SM stores only ~45 GB/s of lines, so a
// push of many rows wants more SMs than rows: at 32 tokens one-shot, 64 CTAs took 9.8 µs against
// 11.6 with 32; docs/fused.md).
constexpr int kLLMaxPushBlocks = 128;

// Note [fused one-shot]: the bytes from a slot's x lines (every row) to its residual lines.
inline size_t fused_oneshot_residual_offset(int64_t num_tokens, size_t row_bytes) {
  return (2 * static_cast<size_t>(num_tokens) * row_bytes + 31) / 32 * 32;
}

struct RsRmsNormAgP2pParams {
  FusedRmsNormArgs args{};            // x, residual, weight, out: this rank's, 16-byte aligned
  SymmetricBufferDevice workspace{};  // two halves alternating by call parity (Note [flag barrier])
  SymmetricBufferDevice lines{};      // the communicator's LL buffer (Note [LL lines]), zeroed; may be empty
  BarrierDevice barrier{};
  int num_blocks = 0;  // CTAs; 0: by size (<= the cap, fused_rmsnorm_num_blocks)
  FusedKernelConfig config{};
  // The LL kernel only: one-shot or two-shot, and its grid (plan_fused).
  FusedShot shot = FusedShot::kTwoShot;
  FusedLLGrid ll_grid{};
};

// The multimem variant: the reduction reads x through the multicast mapping of the workspace
// (every rank's copy summed by the switch) and the gather stores through it.
struct RsRmsNormAgMultimemParams {
  FusedRmsNormArgs args{};
  SymmetricBufferDevice workspace{};  // unicast view of the workspace (copy-in, local reads)
  void* multicast_workspace = nullptr;  // the same workspace's multicast address on this rank
  BarrierDevice barrier{};
  int num_blocks = 0;
};

// CTAs the launcher uses for `work_units` independent units of work per rank (rows for the LL and
// multimem kernels, row groups for the p2p kernel); the same on every rank. In order: `requested`
// (num_sms as the core resolved it) if > 0, exactly (capped at kFusedMaxBlocks); else one CTA per unit of work up to `max_blocks` (the p2p kernel passes
// commlib-tune's measurement or kFusedP2pDefaultMaxBlocks) if > 0, else up to kFusedDefaultMaxBlocks. A cap rather than a count, so small
// batches do not launch idle CTAs that would still take part in every barrier.
inline int fused_rmsnorm_num_blocks(int requested, int max_blocks, int64_t work_units) {
  const int limit = kFusedMaxBlocks < kMaxBarrierBlocks ? kFusedMaxBlocks : kMaxBarrierBlocks;
  if (requested > 0) return requested < limit ? requested : limit;
  // By size: one CTA per unit of work up to the cap (no idle CTAs in the barriers).
  const int cap = max_blocks > 0 ? (max_blocks < limit ? max_blocks : limit) : kFusedDefaultMaxBlocks;
  return static_cast<int>(work_units < 1 ? 1 : (work_units > cap ? cap : work_units));
}

// Note [fused LL layout]
// The LL kernel shares the communicator's LL buffer with all_reduce_flat_ll (same halves by call
// parity, same flag = call + 1, so Note [LL lines]'s reuse argument covers both). Each half holds,
// per peer slot (world - 1 of them: the rank `s` sits in slot (s - owner - 1) mod world of the
// buffer owner's half) three regions X (x rows pushed to the owner), O (normalised rows pushed by
// an owner), R (residual rows, replicated mode) of fused_ll_region_bytes() of lines each: row i,
// pack k of a region are lines 2 * (i * packs_per_row + k) and + 1.
inline size_t fused_ll_region_bytes(size_t lines_bytes, int world_size) {
  if (world_size < 2) return 0;
  return lines_bytes / (2 * static_cast<size_t>(world_size - 1) * 3) / 32 * 32;
}
Status launch_rs_rmsnorm_ag_p2p(const RsRmsNormAgP2pParams& params, Stream stream);
Status launch_rs_rmsnorm_ag_p2p_ll(const RsRmsNormAgP2pParams& params, Stream stream);
Status launch_rs_rmsnorm_ag_multimem(const RsRmsNormAgMultimemParams& params, Stream stream);

}  // namespace commlib::kernels
