// The plan: what one call runs (docs/architecture.md, "Configuration and the plan").
//
// Note [plan]
// Every operation asks one function of its family what runs: plan_all_reduce (GPU and CPU),
// plan_exchange (reduce_scatter, all_gather, broadcast, all_to_all), plan_fused (all-reduce +
// RMSNorm), plan_ep (EP dispatch / combine, once per buffer) and plan_hierarchical (a group spanning
// several hosts: two-level or the group's own gloo / NCCL). Each is a pure function of the
// communicator's resolved configuration (CommConfig, Note [communicator configuration]) and the
// call's shape (bytes, dtype, world, where the tensors live, whether an NCCL engine is attached),
// and returns a Plan: the variant that runs, its launch geometry and the rule that chose it. The
// engines execute exactly the variant and geometry they are handed (kernels decide nothing), the
// torch backend routes a Variant::kNccl plan to NCCL, and nothing else chooses; the direct API,
// the C++ API and the benchmark ask the same functions (commlib.Communicator.plan).
//
// The reason is not a string: a plan keeps the rule's text and its two numbers and formats
// "flat_ll: 64 KiB <= flat_ll_max 256 KiB" only when asked (Plan::reason), since a small
// all_reduce costs ~3 µs and the plan must add nothing measurable. Executing a plan
// (plan_executed) bumps a process-wide relaxed counter per variant, what the tests assert
// (commlib.plan_counters()), and with COMMLIB_LOG_PLAN=1 logs it once per (op, bytes, dtype,
// variant) to stderr.
//
// Adding a variant: an enumerator below, its name in variant_name, the rule in its family's
// plan_* function, the branch that executes it in the engine, and a test that asserts its counter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "commlib/fused_rmsnorm.hpp"
#include "commlib/gpu.hpp"
#include "commlib/types.hpp"
#include "core/algorithm_selector.hpp"
#include "kernels/launch.hpp"

namespace commlib {

// Payload of one LL call (the communicator's LL buffer holds ll_buffer_bytes(world, this)); larger
// LL messages run as several calls. The buffer is also the fused op's (Note [fused LL layout]):
// this size lets its LL kernel take 32 tokens of hidden 8192 on 2 ranks in one call.
constexpr size_t kLLBytesPerCall = 512u << 10;

// Largest symmetric tensor that the tree reduces in place (zero-copy). Above it the copy-in tree,
// whose NVLink traffic is all stores, beat the zero-copy one, whose reduce loads the peers' slices,
// on 2x H200: 64 MiB 211.7 vs 221.3 µs, 256 MiB 755.2 vs 809.3 (a tie at 16 MiB; docs/gpu-allreduce.md).
constexpr size_t kZeroCopyTreeMaxBytes = size_t{16} << 20;

enum class Variant : uint8_t {
  // all_reduce on CUDA
  kFlatLL,
  kFlat,
  kTree,
  kTreeZeroCopy,  // tree reducing a symmetric tensor in place (no copy-in)
  kNccl,          // the torch backend's inner NCCL (all_reduce and the exchange ops)
  // reduce_scatter / all_gather / broadcast / all_to_all on CUDA (Note [push exchange])
  kReduceScatterLL,
  kReduceScatter,
  kExchangeLL,
  kExchange,
  kLocalCopy,  // one rank: the copy engine (broadcast: nothing)
  // CPU engine
  kHostFlat,
  kHostTree,
  kHostExchange,
  // fused all-reduce + RMSNorm
  kFusedOneShot,
  kFusedLL,
  kFusedP2p,
  kFusedMultimem,
  kFusedHost,
  // EP dispatch / combine
  kEpLL,
  kEpNormal,
  kEpNvshmem,
  kEpHost,
  // a group spanning several hosts (the torch backend; Note [hierarchical crossover])
  kTwoLevel,  // commlib inside each host, gloo / NCCL between the hosts
  kInner,     // the group's own gloo / NCCL over every rank
  kCount
};
constexpr int kNumVariants = static_cast<int>(Variant::kCount);
const char* variant_name(Variant variant);

enum class Placement : uint8_t { kCpu, kCuda };
enum class NcclEngine : uint8_t { kNone, kAttached };  // the torch backend attaches one; the direct API has none
enum class Residence : uint8_t { kPlain, kSymmetricInPlace };  // an all_reduce_ of a symmetric tensor

// What the launcher is handed. 0 means "not applicable" for the variant.
struct Geometry {
  int grid = 0;      // CTAs (fused / EP) or the cap on them (all-reduce: COMMLIB_ALLREDUCE_MAX_BLOCKS)
  int block = 0;     // threads per CTA
  int row_ctas = 0;  // fused LL: CTAs per row (a cluster when > 1)
  int packs_per_thread = 0;  // fused LL
  size_t chunk_bytes = 0;    // LL variants: payload per LL call (larger messages run as several)
  kernels::LaunchOrder order = kernels::LaunchOrder::kStream;  // COMMLIB_PDL
};

struct Plan {
  Variant variant = Variant::kCount;
  Geometry geometry;
  // The inputs of the reason, formatted on demand (Note [plan]).
  const char* op = "";
  size_t bytes = 0;
  DataType dtype = DataType::kFloat32;
  // "{bytes} <= flat_ll_max {limit}": {bytes} and {limit} print bytes and limit as sizes, {count}
  // and {max} print count and limit as numbers.
  const char* rule = "";
  size_t limit = 0;
  int64_t count = 0;
  Variant planned = Variant::kCount;  // when the rule chose another variant than what runs
  const char* instead = "";           // why `planned` does not run

  // "flat_ll: 64 KiB <= flat_ll_max 256 KiB"; "tree (nccl planned; the direct API has no NCCL
  // engine): 512 MiB > tree_max 256 MiB".
  std::string reason() const;
};

// ---- all_reduce ----
struct AllReduceShape {
  size_t bytes = 0;
  DataType dtype = DataType::kFloat32;
  Placement placement = Placement::kCuda;
  Algorithm requested = Algorithm::kAuto;  // the caller's algo argument
  NcclEngine nccl = NcclEngine::kNone;
  Residence residence = Residence::kPlain;
};
// Throws InvalidArgument for an algo the placement cannot run (CPU: nccl; CUDA without an NCCL
// engine: an explicit nccl), TypeMismatch for a dtype that is not reducible on CUDA.
Plan plan_all_reduce(const CommConfig& config, const AllReduceShape& shape);
// The CPU all-reduce's plan (plan_all_reduce's CPU branch). `config` is read only for algo auto and
// may be null otherwise: an explicit algorithm needs no configuration, so a tune file that cannot
// be read does not stop it.
Plan plan_host_all_reduce(const CommConfig* config, const AllReduceShape& shape);

// ---- reduce_scatter / all_gather / broadcast / all_to_all ----
struct ExchangeShape {
  CollectiveOp op = CollectiveOp::kAllGather;
  size_t message_bytes = 0;  // the whole message (Note [collective crossovers])
  DataType dtype = DataType::kUInt8;  // for the log only
  Placement placement = Placement::kCuda;
  NcclEngine nccl = NcclEngine::kNone;
};
Plan plan_exchange(const CommConfig& config, const ExchangeShape& shape);

// ---- groups spanning several hosts ----
struct HierShape {
  HierOp op = HierOp::kAllReduce;
  size_t bytes = 0;  // the op's message (all_reduce / broadcast: the tensor; all_gather: the input;
                     // reduce_scatter: the output; barrier: 0)
};
// two_level from the op's crossover on (the selector: COMMLIB_HIER_ALGO, the tune file's
// hierarchical entries, the built-in 0), inner below it.
Plan plan_hierarchical(const HierarchicalSelector& selector, const HierShape& shape);

// ---- fused all-reduce + RMSNorm ----
struct FusedShape {
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  DataType dtype = DataType::kBFloat16;
  ResidualMode mode = ResidualMode::kReplicated;
  int num_sms = 0;  // the caller's; 0: COMMLIB_FUSED_NUM_SMS, else by size
  FusedAlgo algo = FusedAlgo::kAuto;
  Placement placement = Placement::kCuda;
};
// geometry: the LL kernels' full launch shape; the barrier and multicast kernels' CTA count
// (grid, 0: by size within their chunking).
Plan plan_fused(const CommConfig& config, const FusedShape& shape);

// ---- EP dispatch / combine: once per EPBuffer (every call of a buffer runs the same variant) ----
enum class LLAgreement : uint8_t { kNotEveryRank, kEveryRank };  // COMMLIB_EP_LL on every rank
enum class LLFit : uint8_t { kNo, kYes };  // the buffer's grid admits the LL kernels (ep_ll_eligible)
struct EPShape {
  Placement placement = Placement::kCuda;
  EPTransport transport = EPTransport::kPeerMemory;
  LLAgreement agreement = LLAgreement::kNotEveryRank;
  LLFit fit = LLFit::kNo;
  int grid = 0;  // the buffer's CTAs (kernels::ep_grid)
  size_t bytes = 0;  // the buffer's largest dispatch (for the log)
};
Plan plan_ep(const CommConfig& config, const EPShape& shape);

// ---- execution ----
// Called by the engine that runs `plan`, right before it launches: bumps the variant's counter and,
// with COMMLIB_LOG_PLAN=1, logs the plan once per (op, bytes, dtype, variant).
void plan_executed(const Plan& plan, int rank);
uint64_t plan_count(Variant variant);
void reset_plan_counters();

}  // namespace commlib
