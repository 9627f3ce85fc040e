// GPU all-reduce algorithm choice by (bytes, world size, dtype).
//
// Order of precedence (highest first):
//   1. COMMLIB_ALLREDUCE_ALGO=flat|tree|nccl forces one algorithm for every size;
//   2. COMMLIB_FLAT_MAX_BYTES / COMMLIB_TREE_MAX_BYTES (non-zero) replace the limits below;
//   3. the tune cache (COMMLIB_TUNE_FILE, else ~/.cache/commlib/tune.txt when it exists);
//   4. the built-in table (kBuiltinAllReduceTable in algorithm_selector.cc).
// bytes <= flat_max_bytes -> flat; <= tree_max_bytes -> tree; larger -> nccl. These are the limits
// and the choice by size; what a call runs (LL or not, zero-copy, nccl or tree where no NCCL engine
// is attached) is its plan's (plan_all_reduce, Note [plan] in csrc/core/plan.hpp).
//
// Note [tune file format]
// A text file written by commlib-tune (python/commlib/perf/tune.py, Note [tune file writer]), one
// entry per line, `<section> key=value ...` (words split on whitespace, values hold no space),
// `#` comments and blank lines skipped; no JSON, so no parser. The sections read here:
//   all_reduce world_size=2 dtype=bfloat16 flat_max_bytes=131072 tree_max_bytes=67108864
//   all_reduce world_size=4 flat_max_bytes=65536 tree_max_bytes=33554432
//   fused_num_sms world_size=2 num_sms=16
//   host_all_reduce world_size=2 flat_max_bytes=65536
//   collectives world_size=2 op=all_gather max_bytes=16777216
//   hierarchical op=all_gather num_hosts=2 local_size=8 min_bytes=65536
// An all_reduce entry applies to its world_size and, if dtype= is present (float32, float16,
// bfloat16), to that dtype only; a dtype-specific entry wins over a generic one. A fused_num_sms
// entry gives, for its world_size, the CTA count commlib-tune measured for the fused all-reduce +
// RMSNorm P2P kernel (tuned_fused_num_sms below); the last entry for a world size wins. A
// host_all_reduce entry gives the CPU all-reduce's flat limit for its world size (the last wins;
// resolve_host_all_reduce below). A collectives entry gives an op's crossover (Note [collective
// crossovers]). A hierarchical entry gives, for a multi-host group of num_hosts hosts with
// local_size ranks each, the smallest message of `op` (all_reduce, reduce_scatter, all_gather,
// broadcast, barrier) that takes the two-level path (Note [hierarchical crossover]); the last
// matching entry wins. Unknown sections and keys are ignored (commlib.tuned keeps its own records,
// e.g. `entry`, `cp`, `tokenweave`, in the same file). A file that cannot be read, a word without
// `=`, or a missing or non-integer number raises InvalidArgument naming the path, the line number
// and the line; a file whose first word starts with `{` is an older commlib's JSON file and raises
// InvalidArgument asking to re-run commlib-tune. Files are read once per path per process.
#pragma once

#include <cstddef>
#include <string>

#include "commlib/types.hpp"
#include "kernels/all_reduce_params.hpp"
#include "kernels/launch.hpp"
#include "kernels/rs_rmsnorm_ag_params.hpp"

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
  Algorithm forced() const { return forced_; }  // COMMLIB_ALLREDUCE_ALGO; kAuto: by the limits
  const AllReduceLimits& limits(DataType dtype) const;  // TypeMismatch for a dtype that is not reducible

 private:
  Algorithm forced_;
  AllReduceLimits limits_[3];  // float32, float16, bfloat16
};

// commlib-tune's CPU flat limit for world_size: the tune file's "host_all_reduce" entry (Note
// [tune file format]), or -1 when there is none (or no file). Throws InvalidArgument for a
// malformed file.
int64_t tuned_host_flat_max_bytes(int world_size);

// The CPU all-reduce choice for kAuto (the Python API and the torch backend both end here):
// COMMLIB_HOST_TREE_THRESHOLD when set, else the tune file's host_all_reduce flat limit, else the
// built-in threshold (COMMLIB_HOST_TREE_THRESHOLD's default): tree from `tree_min_bytes` on.
struct HostAllReduceConfig {
  size_t tree_min_bytes = 0;
  Algorithm select(size_t bytes) const { return bytes >= tree_min_bytes ? Algorithm::kTree : Algorithm::kFlat; }
};
HostAllReduceConfig resolve_host_all_reduce(int world_size);

// Note [communicator configuration]
// Every choice an operation makes that is not a function of its arguments alone (algorithm,
// grid caps, LL or not, one-shot limits, programmatic launch) is resolved here, once per
// communicator, from the built-in table, the tune file and the COMMLIB_* environment, in that
// order of increasing precedence; an invalid value raises InvalidArgument naming the variable
// (or the tune file) when the communicator first needs the configuration. The Python API, the
// C++ API and the torch backend all read the same CommConfig (Communicator::config()), and the
// kernel launchers receive it in their params: they never read the environment and never switch
// to another kernel. A process that wants other values creates another communicator.
struct AllReduceConfig {
  explicit AllReduceConfig(int world_size);
  AllReduceSelector selector;  // algorithm by size and dtype
  int max_blocks = 0;          // COMMLIB_ALLREDUCE_MAX_BLOCKS (0: the kernels' built-in caps)
  size_t flat_ll_max_bytes = 0;  // COMMLIB_FLAT_LL_MAX_BYTES: flat messages up to this run the LL kernel
  kernels::TreeLaunchConfig tree;  // COMMLIB_TREE_* (Note [tree geometry])
  kernels::LaunchOrder order = kernels::LaunchOrder::kStream;  // COMMLIB_PDL (flat and flat LL)
};

struct FusedConfig {
  int num_sms = 0;  // COMMLIB_FUSED_NUM_SMS: CTAs when the caller gives none (0: by size)
  kernels::FusedKernelConfig kernel;  // LL / one-shot limits, LL grid, tuned cap, launch order
};

// Note [collective crossovers]
// reduce_scatter, all_gather, broadcast and all_to_all (equal splits) on CUDA have one commlib
// algorithm each (Note [push exchange], csrc/kernels/exchange_params.hpp): it runs for messages of
// at most max_bytes (the whole message: reduce_scatter's input, all_gather's output, all_to_all's
// input, broadcast's tensor); larger ones go to NCCL where attached (the torch backend; the direct
// API has no NCCL engine and always runs commlib's). Precedence: COMMLIB_<OP>_MAX_BYTES (non-zero;
// -1: never commlib's), then the tune file's "collectives" section
// (`collectives world_size=2 op=all_gather max_bytes=16777216`, Note [tune file format]; the last
// entry of a world size and op wins), then the built-in table (kBuiltinCollectiveTable). Every
// input is the same on every rank, so the route is too.
enum class CollectiveOp : int { kReduceScatter = 0, kAllGather = 1, kBroadcast = 2, kAllToAll = 3 };
constexpr int kNumCollectiveOps = 4;
const char* collective_op_name(CollectiveOp op);

struct CollectiveConfig {
  explicit CollectiveConfig(int world_size);
  // Whether commlib's kernel takes a message of `bytes` (else NCCL).
  bool use_commlib(CollectiveOp op, size_t bytes) const {
    return bytes <= max_bytes[static_cast<int>(op)];
  }
  size_t max_bytes[kNumCollectiveOps];
};

struct EPPolicy {
  bool want_ll = false;  // COMMLIB_EP_LL: this rank asks for the LL kernels (used if every rank does)
  kernels::LaunchOrder order = kernels::LaunchOrder::kStream;  // COMMLIB_PDL
};

struct CommConfig {
  explicit CommConfig(int world_size);  // reads the environment and the tune file
  int world_size;
  AllReduceConfig all_reduce;
  CollectiveConfig collectives;  // Note [collective crossovers]
  FusedConfig fused;
  EPPolicy ep;
  HostAllReduceConfig host;
};

// Note [hierarchical crossover]
// A "ddacomm" group spanning several hosts runs all_reduce, reduce_scatter, all_gather, broadcast
// and barrier either flat (the group's inner gloo / NCCL backend) or two-level (commlib inside each
// host, gloo / NCCL between the hosts; Note [hierarchical collectives] in csrc/torch/hierarchy.hpp).
// Per op, messages of at least min_bytes go two-level, smaller ones flat. Precedence (highest
// first): COMMLIB_HIER_ALGO=hier|flat forces every op; the tune file's "hierarchical" entries for
// (num_hosts, local_size); the built-in limits: two-level from 0 bytes for every op. The built-in
// table is not measured across hosts (no multi-node machine has run it): two-level sends each
// element over the network once per host instead of once per rank for the reductions, and keeps the
// intra-host legs on shared memory / NVLink; commlib-tune --hierarchical measures a real group.
// Same inputs on every rank give the same choice on every rank (the route must agree). The choice
// is a plan (plan_hierarchical in plan.hpp): two_level, or inner (the group's own gloo / NCCL).
enum class HierOp : int { kAllReduce = 0, kReduceScatter, kAllGather, kBroadcast, kBarrier, kCount };
const char* hier_op_name(HierOp op);

class HierarchicalSelector {
 public:
  HierarchicalSelector(int num_hosts, int local_size);  // reads the environment and the tune file
  size_t min_bytes(HierOp op) const { return min_bytes_[static_cast<int>(op)]; }

 private:
  static constexpr size_t kNever = ~size_t{0};
  size_t min_bytes_[static_cast<int>(HierOp::kCount)];
};

}  // namespace commlib
