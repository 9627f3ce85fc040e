// Parameters and launchers of the fused reduce-scatter -> residual add + RMSNorm -> all-gather
// kernels (one algorithm per .cu file):
//   rs_rmsnorm_ag_p2p.cu       peer loads for the reduction, peer stores for the gather (default)
//   rs_rmsnorm_ag_multimem.cu  NVLS multimem.ld_reduce / multimem.st (sm_90a; behind the multicast
//                              guard, csrc/core/multicast_guard.hpp; never run on lent machines)
// Semantics, slicing and arithmetic: include/commlib/fused_rmsnorm.hpp. Host-compilable, no torch.
// Launchers validate, split the tokens into chunks that fit one workspace half (one kernel call
// each), and return a Status.
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

// Barrier phase ids recorded in DeviceErrorWord::phase.
enum class FusedRmsNormPhase : int { kInputsReady = 0, kRowsPushed = 1 };
const char* fused_rmsnorm_phase_name(int phase);

// Largest CTA count of the fused kernels and the default when num_blocks == 0 and
// COMMLIB_FUSED_NUM_SMS is 0 (chosen by size, at most this).
constexpr int kFusedMaxBlocks = 132;
constexpr int kFusedDefaultMaxBlocks = 16;

struct RsRmsNormAgP2pParams {
  FusedRmsNormArgs args{};            // x, residual, weight, out: this rank's, 16-byte aligned
  SymmetricBufferDevice workspace{};  // two halves alternating by call parity (Note [flag barrier])
  BarrierDevice barrier{};
  int num_blocks = 0;  // CTAs; 0: COMMLIB_FUSED_NUM_SMS, else by size (<= kFusedDefaultMaxBlocks)
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

// CTAs the launcher uses for `rows_per_rank` rows of each rank's slice (the same on every rank).
int fused_rmsnorm_num_blocks(int requested, int64_t rows_per_rank);

Status launch_rs_rmsnorm_ag_p2p(const RsRmsNormAgP2pParams& params, Stream stream);
Status launch_rs_rmsnorm_ag_multimem(const RsRmsNormAgMultimemParams& params, Stream stream);

}  // namespace commlib::kernels
