// The phase ids a GPU kernel records in DeviceErrorWord::phase when a bounded wait expires, and
// their names in the host's Timeout message. One enum for every kernel (docs/architecture.md, Conventions). The
// barrier phases (Note [flag barrier]) are < kBarrierPhasesPerCall, because the flag value carries
// them; the flag- and line-based waits have ids of their own, distinct from theirs. Host-compilable; no CUDA.
#pragma once

namespace commlib {

enum class Phase : int {
  // Barrier phases (all-reduce, reduce_scatter, the push exchange, all_to_all_v, fused all-reduce +
  // RMSNorm barrier and multimem kernels): below kBarrierPhasesPerCall (device::barrier_block
  // checks at compile time).
  kInputsReady = 0,     // inputs copied in or pushed to the peers
  kSlicesReduced = 1,   // tree: reduced slices written, before the gather
  kRowsPushed = 1,      // fused: normalised (or residual) rows pushed, before the gather
  kPeersDone = 2,       // peers done reading (end of a call)
  kAllToAllOffsetsPublished = 6,  // all_to_all_v: receive offsets written into the peers
  kAllToAllRowsLanded = 7,        // all_to_all_v: rows pushed
  // Line and flag waits.
  kLLData = 3,          // LL all-reduce: data lines from the peer
  kFusedLLInputs = 4,   // fused LL: x rows from the peer (the owner waits)
  kFusedLLRows = 5,     // fused LL: normalised rows from the owner
  kDispatchLanded = 16, // EP dispatch: tokens landed
  kCombineLanded = 17,  // EP combine: partials landed
  kDispatchMeta = 18,   // EP dispatch: routing counts landed
};

inline const char* phase_name(int phase) {
  switch (static_cast<Phase>(phase)) {
    case Phase::kInputsReady: return "inputs ready (after the copy-in or push)";
    case Phase::kSlicesReduced: return "slices reduced or rows pushed (before the gather)";
    case Phase::kPeersDone: return "peers done reading (end)";
    case Phase::kLLData: return "LL data from the peer";
    case Phase::kFusedLLInputs: return "LL x rows from the peer (owner waits)";
    case Phase::kFusedLLRows: return "LL normalised rows from the owner";
    case Phase::kDispatchLanded: return "EP dispatch: tokens landed";
    case Phase::kCombineLanded: return "EP combine: partials landed";
    case Phase::kDispatchMeta: return "EP dispatch: routing counts landed";
    case Phase::kAllToAllOffsetsPublished: return "all_to_all_v: offsets published";
    case Phase::kAllToAllRowsLanded: return "all_to_all_v: rows landed";
  }
  return "unknown phase";
}

}  // namespace commlib
