// Parameters and launchers of the fused reduce-scatter -> residual add + RMSNorm -> all-gather
// kernels (one algorithm per .cu file):
//   rs_rmsnorm_ag_p2p.cu       peer stores (push) for the scatter and the gather, per-block flag
//                              barriers between the phases (default for larger token counts)
//   rs_rmsnorm_ag_p2p_ll.cu    the same data flow without barriers: every 8 bytes pushed carry
//                              their ready flag (Note [LL lines]); for the smallest token counts
//   rs_rmsnorm_ag_multimem.cu  NVLS multimem.ld_reduce / multimem.st (sm_90a; behind the multicast
//                              guard, csrc/core/multicast_guard.hpp; never run on lent machines)
// Semantics, slicing and arithmetic: include/commlib/fused_rmsnorm.hpp. Host-compilable, no torch.
// Launchers validate, split the tokens into chunks that fit one workspace half (one kernel call
// each), and return a Status. launch_rs_rmsnorm_ag_p2p picks the LL kernel itself when the whole
// op fits one LL call (fused_rmsnorm_use_ll).
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
#include "commlib/fused_rmsnorm.hpp"
#include "commlib/symmetric_buffer.hpp"
#include "commlib/types.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;

// Phase ids recorded in DeviceErrorWord::phase. The barrier phases are < kBarrierPhasesPerCall
// (they are part of the flag value); the LL waits have ids of their own, above the all-reduce's.
enum class FusedRmsNormPhase : int { kInputsReady = 0, kRowsPushed = 1, kLLInputs = 4, kLLRows = 5 };
const char* fused_rmsnorm_phase_name(int phase);

// Largest CTA count of the fused kernels, and the by-size cap when num_blocks == 0,
// COMMLIB_FUSED_NUM_SMS is 0 and no tuned count applies (chosen by size, at most this).
constexpr int kFusedMaxBlocks = 132;
constexpr int kFusedDefaultMaxBlocks = 16;
// The barrier (p2p) kernel's by-size cap: the whole GPU. Measured on 2x H200 at 512-4096 tokens x
// 8192 (bench/results/fused-rmsnorm-2026-11-30-d.md): 132 CTAs are the fastest count at every size,
// and 16 CTAs reach 68-80% of that (a CTA is latency-bound, not NVLink-bound: 8 CTAs already
// saturate the link for a plain copy). Callers that overlap the op with compute pass num_sms (or
// COMMLIB_FUSED_NUM_SMS, or the tune file's fused_num_sms) to cap it.
constexpr int kFusedP2pDefaultMaxBlocks = kFusedMaxBlocks;
// The barrier kernel's chunk size in replicated mode (residual gather) when COMMLIB_FUSED_CHUNK_ROWS
// is 0 and the rank's slice would otherwise run as one chunk, or one full chunk and a short one:
// 8 MiB, 512 rows of hidden 8192 (launch_rs_rmsnorm_ag_p2p).
constexpr size_t kFusedRepSplitBytes = size_t{8} << 20;

struct RsRmsNormAgP2pParams {
  FusedRmsNormArgs args{};            // x, residual, weight, out: this rank's, 16-byte aligned
  SymmetricBufferDevice workspace{};  // two halves alternating by call parity (Note [flag barrier])
  SymmetricBufferDevice lines{};      // the communicator's LL buffer (Note [LL lines]), zeroed; may be empty
  BarrierDevice barrier{};
  int num_blocks = 0;  // CTAs; 0: COMMLIB_FUSED_NUM_SMS, else by size (<= the cap, fused_rmsnorm_num_blocks)
  // commlib-tune's fused_num_sms for this world size (tuned_fused_num_sms, read once by CudaComm);
  // 0: none, kFusedP2pDefaultMaxBlocks applies. The barrier kernel's by-size cap; the LL kernel
  // (small slices) keeps kFusedDefaultMaxBlocks.
  int tuned_max_blocks = 0;
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
// (the caller's num_sms) if > 0, else COMMLIB_FUSED_NUM_SMS if > 0, exactly (capped at
// kFusedMaxBlocks); else one CTA per unit of work up to `max_blocks` (the p2p kernel passes
// commlib-tune's measurement or kFusedP2pDefaultMaxBlocks) if > 0, else up to kFusedDefaultMaxBlocks. A cap rather than a count, so small
// batches do not launch idle CTAs that would still take part in every barrier.
int fused_rmsnorm_num_blocks(int requested, int max_blocks, int64_t work_units);

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
// Whether launch_rs_rmsnorm_ag_p2p runs the LL kernel: every rank's slice (ceil(tokens / world)
// rows, at most COMMLIB_FUSED_LL_MAX_ROWS) fits one LL region as lines (twice its bytes) and is at
// most COMMLIB_FUSED_LL_MAX_BYTES.
bool fused_rmsnorm_use_ll(const RsRmsNormAgP2pParams& params);
// Whether that LL call is one-shot (Note [fused one-shot] in rs_rmsnorm_ag_p2p_ll.cu): at most
// COMMLIB_FUSED_ONESHOT_MAX_TOKENS tokens, and every row's lines (sharded: plus the owner's
// residual lines) fit one slot of the LL buffer. fused_rmsnorm_use_ll is then true as well.
bool fused_rmsnorm_use_oneshot(const RsRmsNormAgP2pParams& params);

// The LL kernel's launch shape for `rows_per_rank` rows per rank (one-shot: every row; Note [fused
// LL row split] in rs_rmsnorm_ag_p2p_ll.cu): `row_ctas` CTAs per row (a thread-block cluster when
// > 1; from COMMLIB_FUSED_LL_ROW_CTAS, 0: by size), `blocks` CTAs in all (a multiple of row_ctas,
// within the budget of fused_rmsnorm_num_blocks with the by-size cap max_blocks, 0: its default,
// and by size at least min_blocks), `threads` per CTA and packs per thread. The same on every rank.
struct FusedLLGrid {
  int row_ctas = 1;
  int blocks = 1;
  int threads = 32;
  int packs_per_thread = 1;
};
FusedLLGrid fused_ll_grid(int64_t rows_per_rank, int64_t hidden, int num_blocks, int max_blocks, int min_blocks);

Status launch_rs_rmsnorm_ag_p2p(const RsRmsNormAgP2pParams& params, Stream stream);
Status launch_rs_rmsnorm_ag_p2p_ll(const RsRmsNormAgP2pParams& params, Stream stream);
Status launch_rs_rmsnorm_ag_multimem(const RsRmsNormAgMultimemParams& params, Stream stream);

}  // namespace commlib::kernels
