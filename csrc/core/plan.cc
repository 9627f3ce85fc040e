#include "core/plan.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include "commlib/env.hpp"
#include "commlib/errors.hpp"
#include "kernels/all_reduce_params.hpp"
#include "kernels/rs_rmsnorm_ag_params.hpp"

namespace commlib {

const char* variant_name(Variant variant) {
  switch (variant) {
    case Variant::kFlatLL: return "flat_ll";
    case Variant::kFlat: return "flat";
    case Variant::kTree: return "tree";
    case Variant::kTreeZeroCopy: return "tree_zero_copy";
    case Variant::kNccl: return "nccl";
    case Variant::kReduceScatterLL: return "reduce_scatter_ll";
    case Variant::kReduceScatter: return "reduce_scatter";
    case Variant::kExchangeLL: return "exchange_ll";
    case Variant::kExchange: return "exchange";
    case Variant::kLocalCopy: return "local_copy";
    case Variant::kHostFlat: return "host_flat";
    case Variant::kHostTree: return "host_tree";
    case Variant::kHostExchange: return "host_exchange";
    case Variant::kFusedOneShot: return "fused_oneshot";
    case Variant::kFusedLL: return "fused_ll";
    case Variant::kFusedP2p: return "fused_p2p";
    case Variant::kFusedMultimem: return "fused_multimem";
    case Variant::kFusedHost: return "fused_host";
    case Variant::kEpLL: return "ep_ll";
    case Variant::kEpNormal: return "ep_normal";
    case Variant::kEpNvshmem: return "ep_nvshmem";
    case Variant::kEpHost: return "ep_host";
    case Variant::kTwoLevel: return "two_level";
    case Variant::kInner: return "inner";
    case Variant::kCount: break;
  }
  return "unknown";
}

namespace {

std::string human_bytes(size_t bytes) {
  if (bytes == ~size_t{0}) return "unlimited";
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  size_t v = bytes;
  while (u < 4 && v >= 1024 && v % 1024 == 0) {
    v /= 1024;
    ++u;
  }
  return std::to_string(v) + " " + units[u];
}

Plan make(const char* op, Variant variant, size_t bytes, DataType dtype, const char* rule, size_t limit = 0) {
  Plan p;
  p.variant = variant;
  p.op = op;
  p.bytes = bytes;
  p.dtype = dtype;
  p.rule = rule;
  p.limit = limit;
  return p;
}

}  // namespace

std::string Plan::reason() const {
  std::string out = variant_name(variant);
  if (planned != Variant::kCount && planned != variant) {
    out += detail::concat(" (", variant_name(planned), " planned; ", instead, ")");
  }
  out += ": ";
  // {bytes} and {limit} in the rule are the call's bytes and the rule's limit, as sizes.
  const std::string rule_text = rule;
  for (size_t i = 0; i < rule_text.size();) {
    if (rule_text.compare(i, 7, "{bytes}") == 0) {
      out += human_bytes(bytes);
      i += 7;
    } else if (rule_text.compare(i, 7, "{limit}") == 0) {
      out += human_bytes(limit);
      i += 7;
    } else if (rule_text.compare(i, 7, "{count}") == 0) {
      out += std::to_string(count);
      i += 7;
    } else if (rule_text.compare(i, 5, "{max}") == 0) {
      out += std::to_string(limit);
      i += 5;
    } else {
      out += rule_text[i++];
    }
  }
  return out;
}

// ---- all_reduce ----

Plan plan_host_all_reduce(const CommConfig* config, const AllReduceShape& s) {
  const char* op = "all_reduce";
  COMMLIB_CHECK(s.requested == Algorithm::kAuto || s.requested == Algorithm::kFlat || s.requested == Algorithm::kTree,
                InvalidArgument, op, ": algo ", algorithm_name(s.requested),
                " not supported for CPU tensors; supported: auto, flat, tree");
  if (s.requested == Algorithm::kFlat) return make(op, Variant::kHostFlat, s.bytes, s.dtype, "algo='flat' requested");
  if (s.requested == Algorithm::kTree) return make(op, Variant::kHostTree, s.bytes, s.dtype, "algo='tree' requested");
  COMMLIB_CHECK(config != nullptr, InvalidArgument, op, ": algo auto needs the communicator's configuration");
  const size_t tree_min = config->host.tree_min_bytes;
  return s.bytes >= tree_min
             ? make(op, Variant::kHostTree, s.bytes, s.dtype, "{bytes} >= host_tree_min {limit}", tree_min)
             : make(op, Variant::kHostFlat, s.bytes, s.dtype, "{bytes} < host_tree_min {limit}", tree_min);
}

namespace {

const char* forced_rule(Algorithm algo, Algorithm requested) {
  if (requested != Algorithm::kAuto) {
    return algo == Algorithm::kFlat ? "algo='flat' requested" : algo == Algorithm::kTree ? "algo='tree' requested"
                                                                                        : "algo='nccl' requested";
  }
  return algo == Algorithm::kFlat ? "COMMLIB_ALLREDUCE_ALGO=flat"
         : algo == Algorithm::kTree ? "COMMLIB_ALLREDUCE_ALGO=tree"
                                    : "COMMLIB_ALLREDUCE_ALGO=nccl";
}

}  // namespace

Plan plan_all_reduce(const CommConfig& config, const AllReduceShape& s) {
  if (s.placement == Placement::kCpu) return plan_host_all_reduce(&config, s);
  const char* op = "all_reduce";
  COMMLIB_CHECK(is_reducible(s.dtype), TypeMismatch, op, ": dtype ", dtype_name(s.dtype),
                " not supported; supported: float32, float16, bfloat16");
  COMMLIB_CHECK(s.requested != Algorithm::kNccl || s.nccl == NcclEngine::kAttached, InvalidArgument, op,
                ": algo 'nccl' needs an NCCL engine (the ddacomm torch backend); supported here: auto, flat, tree");
  const AllReduceConfig& cfg = config.all_reduce;
  Plan p;
  // The rule: the caller's algo, else COMMLIB_ALLREDUCE_ALGO, else the limits (Note [communicator
  // configuration]).
  const bool forced = s.requested != Algorithm::kAuto || cfg.selector.forced() != Algorithm::kAuto;
  if (forced) {
    const Algorithm algo = s.requested != Algorithm::kAuto ? s.requested : cfg.selector.forced();
    const Variant v = algo == Algorithm::kFlat ? Variant::kFlat : algo == Algorithm::kTree ? Variant::kTree
                                                                                            : Variant::kNccl;
    p = make(op, v, s.bytes, s.dtype, forced_rule(algo, s.requested));
  } else if (config.world_size == 1) {
    // One rank: the sum (and the average, / 1) is the input; out of place a copy-engine copy, in
    // place nothing, as NCCL does at world 1. An explicit algo still runs its kernel (the bench's
    // world-1 kernel cost).
    p = make(op, Variant::kLocalCopy, s.bytes, s.dtype, "world_size 1");
  } else {
    const AllReduceLimits& limits = cfg.selector.limits(s.dtype);
    if (s.bytes <= limits.flat_max_bytes) {
      p = make(op, Variant::kFlat, s.bytes, s.dtype, "{bytes} <= flat_max {limit}", limits.flat_max_bytes);
    } else if (s.bytes <= limits.tree_max_bytes) {
      p = make(op, Variant::kTree, s.bytes, s.dtype, "{bytes} <= tree_max {limit}", limits.tree_max_bytes);
    } else {
      p = make(op, Variant::kNccl, s.bytes, s.dtype, "{bytes} > tree_max {limit}", limits.tree_max_bytes);
    }
  }
  if (p.variant == Variant::kNccl && s.nccl == NcclEngine::kNone) {
    p.planned = Variant::kNccl;
    p.instead = "the direct API has no NCCL engine";
    p.variant = Variant::kTree;
  }
  // flat: the LL kernel up to its limit (whatever chose flat).
  if (p.variant == Variant::kFlat && s.bytes <= cfg.flat_ll_max_bytes) {
    if (forced) {
      p.variant = Variant::kFlatLL;  // forced flat, LL by size: keep the forcing rule
    } else {
      p = make(op, Variant::kFlatLL, s.bytes, s.dtype, "{bytes} <= flat_ll_max {limit}", cfg.flat_ll_max_bytes);
    }
  }
  // tree: in place on a symmetric tensor without the copy-in, up to kZeroCopyTreeMaxBytes (also where
  // tree stands in for a planned nccl: the rule stays the one that chose tree).
  if (p.variant == Variant::kTree && s.residence == Residence::kSymmetricInPlace && s.bytes <= kZeroCopyTreeMaxBytes) {
    if (forced || p.planned != Variant::kCount) {
      p.variant = Variant::kTreeZeroCopy;
    } else {
      p = make(op, Variant::kTreeZeroCopy, s.bytes, s.dtype, "symmetric in place, {bytes} <= zero_copy_max {limit}",
               kZeroCopyTreeMaxBytes);
    }
  }
  p.geometry.grid = cfg.max_blocks;
  switch (p.variant) {
    case Variant::kFlatLL:
      p.geometry.chunk_bytes = kLLBytesPerCall;
      p.geometry.order = cfg.order;
      break;
    case Variant::kFlat: p.geometry.order = cfg.order; break;
    case Variant::kTree:
    case Variant::kTreeZeroCopy: p.geometry.block = cfg.tree.threads; break;  // the rest: cfg.tree (Note [tree geometry])
    default: p.geometry.grid = 0; break;
  }
  return p;
}

// ---- groups spanning several hosts ----

Plan plan_hierarchical(const HierarchicalSelector& selector, const HierShape& s) {
  const char* op = hier_op_name(s.op);
  const size_t min_bytes = selector.min_bytes(s.op);
  return s.bytes >= min_bytes
             ? make(op, Variant::kTwoLevel, s.bytes, DataType::kUInt8, "{bytes} >= two_level_min {limit}", min_bytes)
             : make(op, Variant::kInner, s.bytes, DataType::kUInt8, "{bytes} < two_level_min {limit}", min_bytes);
}

// ---- reduce_scatter / all_gather / broadcast / all_to_all ----

Plan plan_exchange(const CommConfig& config, const ExchangeShape& s) {
  const char* op = collective_op_name(s.op);
  const size_t bytes = s.message_bytes;
  if (s.placement == Placement::kCpu) return make(op, Variant::kHostExchange, bytes, s.dtype, "CPU tensors");
  const size_t max_bytes = config.collectives.max_bytes[static_cast<int>(s.op)];
  Plan p;
  if (bytes > max_bytes && s.nccl == NcclEngine::kAttached) {
    return make(op, Variant::kNccl, bytes, s.dtype, "{bytes} > commlib_max {limit}", max_bytes);
  }
  if (config.world_size == 1) {
    p = make(op, Variant::kLocalCopy, bytes, s.dtype, "world_size 1");
  } else {
    // Note [push exchange]: the LL kernel (no barrier) up to the all-reduce's LL limit; broadcast
    // keeps the barrier (only the root sends, so nothing would tell it that a line parity is free).
    const size_t ll_max = config.all_reduce.flat_ll_max_bytes;
    const bool reduce = s.op == CollectiveOp::kReduceScatter;
    if (s.op != CollectiveOp::kBroadcast && bytes <= ll_max) {
      p = make(op, reduce ? Variant::kReduceScatterLL : Variant::kExchangeLL, bytes, s.dtype,
               "{bytes} <= flat_ll_max {limit}", ll_max);
      p.geometry.chunk_bytes = kLLBytesPerCall;
    } else if (s.op == CollectiveOp::kBroadcast) {
      p = make(op, Variant::kExchange, bytes, s.dtype, "broadcast has no LL kernel");
    } else {
      p = make(op, reduce ? Variant::kReduceScatter : Variant::kExchange, bytes, s.dtype,
               "{bytes} > flat_ll_max {limit}", ll_max);
    }
    if (bytes > max_bytes) {
      p.planned = Variant::kNccl;
      p.instead = "the direct API has no NCCL engine";
    }
    p.geometry.order = config.all_reduce.order;
  }
  return p;
}

// ---- fused all-reduce + RMSNorm ----

namespace {

// Largest power of two <= v (v >= 1).
int64_t floor_pow2(int64_t v) {
  int64_t p = 1;
  while (2 * p <= v) p *= 2;
  return p;
}

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Whether the one-shot LL kernel serves the call (Note [fused one-shot]): at most
// oneshot_max_tokens (sharded: oneshot_sharded_max_tokens) tokens, and every row's lines (sharded:
// plus the owner's residual lines) fit one slot of the LL buffer.
bool use_oneshot(const kernels::FusedKernelConfig& cfg, const FusedShape& s, int world, size_t lines_bytes) {
  // Sharded, the owners' residual rows travel too: on 2x H200 the two-shot kernel was faster from
  // 16 tokens (9.5 vs 11.2 µs; replicated one-shot 8.4 vs 11.0; docs/fused.md).
  const bool sharded = s.mode == ResidualMode::kSharded;
  const int64_t max_tokens = sharded ? cfg.oneshot_sharded_max_tokens : cfg.oneshot_max_tokens;
  if (s.num_tokens > max_tokens) return false;
  const size_t row_bytes = static_cast<size_t>(s.hidden) * dtype_size(s.dtype);
  const int64_t per_rank = (s.num_tokens + world - 1) / world;
  const size_t residual = sharded ? 2 * static_cast<size_t>(per_rank) * row_bytes : 0;
  // A slot's three regions hold every row's x lines and, sharded, the owner's residual lines.
  return kernels::fused_oneshot_residual_offset(s.num_tokens, row_bytes) + residual <=
         3 * kernels::fused_ll_region_bytes(lines_bytes, world);
}

// Whether the two-shot LL kernel serves the call: every rank's slice (ceil(tokens / world) rows, at
// most ll_max_rows) fits one LL region as lines (twice its bytes) and is at most ll_max_bytes.
bool use_ll(const kernels::FusedKernelConfig& cfg, const FusedShape& s, int world, size_t lines_bytes) {
  const int64_t rows = (s.num_tokens + world - 1) / world;
  const int64_t slice_bytes = rows * s.hidden * static_cast<int64_t>(dtype_size(s.dtype));
  // ll_max_rows (COMMLIB_FUSED_LL_MAX_ROWS, 16): at 16 rows per rank (hidden 8192) the LL kernel with one
  // lane-major CTA per row beat the barrier kernel on 2x H200 (sharded 11.8 vs 13.8 µs, replicated
  // 15.0 vs 15.1; docs/fused.md); beyond, the LL buffer or COMMLIB_FUSED_LL_MAX_BYTES ends it at
  // this hidden size anyway. Lines carry 8 payload bytes in 16.
  return rows <= cfg.ll_max_rows && slice_bytes <= cfg.ll_max_bytes &&
         2 * static_cast<size_t>(slice_bytes) <= kernels::fused_ll_region_bytes(lines_bytes, world);
}

// The LL kernel's grid (Note [fused LL row split] in csrc/kernels/rs_rmsnorm_ag_p2p_ll.cu).
kernels::FusedLLGrid fused_ll_grid(int64_t rows_per_rank, int64_t hidden, int num_blocks, int max_blocks,
                                   int min_blocks, int64_t row_ctas) {
  using namespace kernels;
  // C: row_ctas (COMMLIB_FUSED_LL_ROW_CTAS, rounded down to a power of two, at most kLLMaxRowCtas), or when 0
  // and the slice has at most kLLSplitMaxRows rows the most that give every row of the slice its own
  // cluster within the CTA budget (beyond: 1, lane-major). At least 32 packs per CTA (a smaller
  // share would leave most of a warp holding zeros).
  const int64_t padded = next_pow2(std::max<int64_t>(1, hidden / kFusedHiddenAlign));
  const int64_t knob = row_ctas;
  const int64_t rows = std::max<int64_t>(rows_per_rank, 1);
  const int64_t max_ctas = knob > 0                  ? floor_pow2(std::min<int64_t>(knob, kLLMaxRowCtas))
                           : rows <= kLLSplitMaxRows ? kLLMaxRowCtas
                                                     : 1;
  // The budget: num_blocks (num_sms, or COMMLIB_FUSED_NUM_SMS) exactly, else by size (C CTAs per row, at least
  // kLLMinBlocks and min_blocks, at most max_blocks or kFusedDefaultMaxBlocks). With C = 1: one CTA
  // per row; CTAs beyond the rows only push (and, two-shot, gather).
  const int budget = fused_rmsnorm_num_blocks(
      num_blocks, max_blocks, std::max<int64_t>({rows * max_ctas, kLLMinBlocks, static_cast<int64_t>(min_blocks)}));
  int64_t ctas = 1;
  while (2 * ctas <= max_ctas && 2 * ctas * 32 <= padded && 2 * ctas <= budget &&
         (knob > 0 || rows * 2 * ctas <= budget)) {
    ctas *= 2;
  }
  FusedLLGrid grid;
  grid.row_ctas = static_cast<int>(ctas);
  grid.blocks = static_cast<int>(budget / ctas * ctas);
  const int64_t per_cta = padded / ctas;
  grid.threads = static_cast<int>(std::clamp<int64_t>(per_cta, 32, kLLMaxThreads));
  grid.packs_per_thread = static_cast<int>(std::max<int64_t>(1, per_cta / grid.threads));
  return grid;
}

}  // namespace

Plan plan_fused(const CommConfig& config, const FusedShape& s) {
  const char* op = "fused_allreduce_rmsnorm";
  const int world = config.world_size;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(s.num_tokens, 0) * s.hidden) * dtype_size(s.dtype);
  if (s.placement == Placement::kCpu) return make(op, Variant::kFusedHost, bytes, s.dtype, "CPU tensors");
  const int blocks = s.num_sms > 0 ? s.num_sms : config.fused.num_sms;
  const kernels::FusedKernelConfig& cfg = config.fused.kernel;
  Plan p;
  if (s.algo == FusedAlgo::kMultimem) {
    p = make(op, Variant::kFusedMultimem, bytes, s.dtype, "algo='multimem' requested");
    p.geometry.grid = blocks;  // 0: by size within the kernel's chunk
    return p;
  }
  const size_t lines_bytes = kernels::ll_buffer_bytes(world, kLLBytesPerCall);
  const bool ll_possible = world >= 2 && s.num_tokens > 0;
  kernels::FusedShot shot = kernels::FusedShot::kTwoShot;
  if (ll_possible && use_oneshot(cfg, s, world, lines_bytes)) {
    const bool sharded = s.mode == ResidualMode::kSharded;
    p = make(op, Variant::kFusedOneShot, bytes, s.dtype,
             sharded ? "{count} tokens <= oneshot_sharded_max_tokens {max}" : "{count} tokens <= oneshot_max_tokens {max}",
             static_cast<size_t>(sharded ? cfg.oneshot_sharded_max_tokens : cfg.oneshot_max_tokens));
    p.count = s.num_tokens;
    shot = kernels::FusedShot::kOneShot;
  } else if (ll_possible && use_ll(cfg, s, world, lines_bytes)) {
    p = make(op, Variant::kFusedLL, bytes, s.dtype, "{count} rows per rank <= fused_ll_max_rows {max}",
             static_cast<size_t>(cfg.ll_max_rows));
    p.count = (s.num_tokens + world - 1) / world;
  } else {
    p = make(op, Variant::kFusedP2p, bytes, s.dtype,
             world < 2 || s.num_tokens <= 0 ? "no LL kernel for world 1 or 0 tokens"
                                            : "{count} rows per rank: beyond fused_ll_max_rows {max}, "
                                              "COMMLIB_FUSED_LL_MAX_BYTES or the LL buffer",
             static_cast<size_t>(cfg.ll_max_rows));
    p.count = (s.num_tokens + world - 1) / std::max(world, 1);
    p.geometry.grid = blocks;  // 0: by size within the kernel's chunking (tuned cap: config.kernel)
    return p;
  }
  // The LL grid. One-shot: every rank normalises every row (Note [fused one-shot]). Either way the
  // by-size CTA count also covers the x bytes this rank pushes at COMMLIB_FUSED_LL_BYTES_PER_CTA per
  // CTA. The tuned count (measured on the barrier kernel at a large batch) does not apply here.
  const bool one_shot = shot == kernels::FusedShot::kOneShot;
  const int64_t per_rank = (s.num_tokens + world - 1) / world;
  const int64_t rows = one_shot ? s.num_tokens : per_rank;  // rows a rank normalises and pushes to each peer
  const size_t row_bytes = static_cast<size_t>(s.hidden) * dtype_size(s.dtype);
  const size_t pushed = static_cast<size_t>(world - 1) * rows * row_bytes;
  const int64_t bytes_per_cta = cfg.ll_bytes_per_cta;
  const int push_ctas =
      bytes_per_cta > 0
          ? static_cast<int>(std::min<int64_t>((pushed + bytes_per_cta - 1) / bytes_per_cta, kernels::kLLMaxPushBlocks))
          : 0;
  const int cap = std::max(one_shot ? kernels::kLLOneShotMaxBlocks : kernels::kFusedDefaultMaxBlocks, push_ctas);
  const kernels::FusedLLGrid grid = fused_ll_grid(rows, s.hidden, blocks, cap, push_ctas, cfg.ll_row_ctas);
  p.geometry.grid = grid.blocks;
  p.geometry.block = grid.threads;
  p.geometry.row_ctas = grid.row_ctas;
  p.geometry.packs_per_thread = grid.packs_per_thread;
  p.geometry.chunk_bytes = kLLBytesPerCall;
  p.geometry.order = cfg.order;
  return p;
}

// ---- EP ----

Plan plan_ep(const CommConfig& config, const EPShape& s) {
  const char* op = "ep";
  Plan p;
  if (s.placement == Placement::kCpu) {
    p = make(op, Variant::kEpHost, s.bytes, DataType::kUInt8, "CPU tensors");
  } else if (s.transport == EPTransport::kNvshmem) {
    p = make(op, Variant::kEpNvshmem, s.bytes, DataType::kUInt8, "transport='nvshmem' requested");
  } else if (s.agreement == LLAgreement::kEveryRank && s.fit == LLFit::kYes) {
    p = make(op, Variant::kEpLL, s.bytes, DataType::kUInt8, "COMMLIB_EP_LL=1 on every rank and a decode grid");
  } else {
    p = make(op, Variant::kEpNormal, s.bytes, DataType::kUInt8,
             s.agreement == LLAgreement::kEveryRank ? "COMMLIB_EP_LL=1 but the grid admits no LL kernel"
             : config.ep.want_ll                    ? "COMMLIB_EP_LL=1 here but not on every rank"
                                                    : "COMMLIB_EP_LL=0");
  }
  p.geometry.grid = s.grid;
  p.geometry.order = config.ep.order;
  return p;
}

// ---- execution ----

namespace {

std::atomic<uint64_t> g_counters[kNumVariants];

bool log_enabled() {
  static const bool enabled = env::get_bool("COMMLIB_LOG_PLAN");
  return enabled;
}

void log_once(const Plan& plan, int rank) {
  using Key = std::tuple<std::string, size_t, int, int>;
  static std::mutex mutex;
  static std::set<Key> seen;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!seen.emplace(plan.op, plan.bytes, static_cast<int>(plan.dtype), static_cast<int>(plan.variant)).second) return;
  }
  const std::string line = detail::concat("commlib plan: rank ", rank, " ", plan.op, " ", plan.bytes, " bytes ",
                                          dtype_name(plan.dtype), " -> ", plan.reason(), "\n");
  std::fputs(line.c_str(), stderr);
}

}  // namespace

void plan_executed(const Plan& plan, int rank) {
  const int v = static_cast<int>(plan.variant);
  if (v < 0 || v >= kNumVariants) return;
  g_counters[v].fetch_add(1, std::memory_order_relaxed);
  if (log_enabled()) log_once(plan, rank);
}

uint64_t plan_count(Variant variant) {
  const int v = static_cast<int>(variant);
  return v >= 0 && v < kNumVariants ? g_counters[v].load(std::memory_order_relaxed) : 0;
}

void reset_plan_counters() {
  for (auto& c : g_counters) c.store(0, std::memory_order_relaxed);
}

}  // namespace commlib
