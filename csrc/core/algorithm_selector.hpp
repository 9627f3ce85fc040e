// GPU all-reduce algorithm choice by (bytes, world size, dtype).
//
// Order of precedence (highest first):
//   1. COMMLIB_ALLREDUCE_ALGO=flat|tree|nccl forces one algorithm for every size;
//   2. COMMLIB_FLAT_MAX_BYTES / COMMLIB_TREE_MAX_BYTES (non-zero) replace the limits below;
//   3. the tune cache (COMMLIB_TUNE_FILE, else ~/.cache/commlib/tune.json when it exists);
//   4. the built-in table (kBuiltinAllReduceTable in algorithm_selector.cc).
// bytes <= flat_max_bytes -> flat; <= tree_max_bytes -> tree; larger -> nccl.
// The direct API has no NCCL engine: there "nccl" runs tree (docs/gpu-allreduce.md); the torch
// backend routes it to NCCL.
//
// Note [tune file format]
// JSON written by commlib-tune (python/commlib/tune.py), read here:
//   {"version": 1,
//    "all_reduce": [
//      {"world_size": 2, "dtype": "bfloat16", "flat_max_bytes": 131072, "tree_max_bytes": 67108864},
//      {"world_size": 4, "flat_max_bytes": 65536, "tree_max_bytes": 33554432}, ...]}
//    "fused_num_sms": [{"world_size": 2, "num_sms": 16}, ...]}
// An all_reduce entry applies to its world_size and, if "dtype" is present ("float32", "float16",
// "bfloat16"), to that dtype only; a dtype-specific entry wins over a generic one. A fused_num_sms
// entry gives, for its world_size, the CTA count commlib-tune measured for the fused all-reduce +
// RMSNorm P2P kernel (tuned_fused_num_sms below); the last entry for a world size wins. Unknown
// keys are ignored (other collectives may add their own sections). A file that cannot be read or
// parsed raises InvalidArgument naming the path. Files are read once per path per process.
#pragma once

#include <cstddef>
#include <string>

#include "commlib/types.hpp"

namespace commlib {

struct AllReduceLimits {
  size_t flat_max_bytes;
  size_t tree_max_bytes;
};

// The limits that apply to (world_size, dtype) after steps 2-4 above.
AllReduceLimits all_reduce_limits(int world_size, DataType dtype);

// Pure: never kAuto. Throws InvalidArgument for world_size < 1, TypeMismatch for a dtype that is
// not reducible, InvalidArgument for a bad COMMLIB_* value or tune file.
Algorithm select_all_reduce_algorithm(size_t bytes, int world_size, DataType dtype);

// The fused all-reduce + RMSNorm kernel's tuned CTA count for world_size: the tune file's
// "fused_num_sms" entry (Note [tune file format]), 0 when there is none (or no file). It is the
// by-size cap of the P2P kernel when neither the caller nor COMMLIB_FUSED_NUM_SMS gives a count
// (csrc/kernels/rs_rmsnorm_ag_params.hpp, fused_rmsnorm_num_blocks). Reads no COMMLIB_* knob but
// COMMLIB_TUNE_FILE. Throws InvalidArgument for a malformed file.
int tuned_fused_num_sms(int world_size);

// The same choice with the environment and tune file read once, at construction (as NCCL reads
// its variables at init): what the per-call paths (the torch backend, CudaComm) use, since
// reading five variables on every call costs a visible part of a small all-reduce.
class AllReduceSelector {
 public:
  explicit AllReduceSelector(int world_size);
  Algorithm select(size_t bytes, DataType dtype) const;  // never kAuto

 private:
  Algorithm forced_;
  AllReduceLimits limits_[3];  // float32, float16, bfloat16
};

}  // namespace commlib
