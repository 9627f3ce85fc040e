#include "core/algorithm_selector.hpp"

#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

#include "commlib/env.hpp"
#include "commlib/errors.hpp"

namespace commlib {
namespace {

// World size 2: measured on 2x H200 (docs/gpu-allreduce.md, bf16, graph
// replay): flat (LL up to COMMLIB_FLAT_LL_MAX_BYTES) beats tree up to 256 KiB and loses at 1 MiB;
// tree beats NCCL up to 16 MiB (1.1x) and loses at 64 MiB, so above 16 MiB the call goes to NCCL
// (where attached).
// Larger worlds are not measured yet: one-shot moves (n-1)x the message per rank, so its limit
// falls with n. commlib-tune re-measures.
struct BuiltinRow {
  int max_world_size;
  AllReduceLimits limits;
};
constexpr BuiltinRow kBuiltinAllReduceTable[] = {
    {2, {512u << 10, 256u << 20}},  // tree beats NCCL to 256 MiB (docs/gpu-allreduce.md)
    {4, {256u << 10, 8u << 20}},
    {8, {128u << 10, 8u << 20}},
    {1 << 30, {64u << 10, 4u << 20}},
};

struct TuneEntry {
  int world_size;
  std::string dtype;  // empty: any
  AllReduceLimits limits;
};

struct CollectiveTuneEntry {
  int world_size;
  std::string op;
  int64_t max_bytes;
};

struct FusedTuneEntry {
  int world_size;
  int num_sms;
};

struct HostTuneEntry {
  int world_size;
  int64_t flat_max_bytes;
};

struct HierTuneEntry {
  std::string op;
  int num_hosts;
  int local_size;
  size_t min_bytes;
};

// What this process needs from one tune file (Note [tune file format]).
struct TuneFile {
  std::vector<TuneEntry> all_reduce;
  std::vector<FusedTuneEntry> fused_num_sms;
  std::vector<HostTuneEntry> host_all_reduce;
  std::vector<HierTuneEntry> hierarchical;
  std::vector<CollectiveTuneEntry> collectives;
};

// One line of a tune file (Note [tune file format]): `<section> key=value ...`.
struct TuneLine {
  const std::string& path;
  int number;
  const std::string& text;
  std::map<std::string, std::string> fields;

  [[noreturn]] void fail(const std::string& why) const {
    throw InvalidArgument(detail::concat("COMMLIB_TUNE_FILE: '", path, "' line ", number, ": ", why, ": '", text, "'"));
  }
  const std::string& word(const char* key) const {
    auto it = fields.find(key);
    if (it == fields.end()) fail(detail::concat("no ", key, "=<value>"));
    return it->second;
  }
  int64_t integer(const char* key) const {  // at most 18 digits: fits int64_t
    const std::string& value = word(key);
    if (value.empty() || value.size() > 18 || value.find_first_not_of("0123456789") != std::string::npos) {
      fail(detail::concat(key, "=", value, " is not an integer >= 0"));
    }
    return std::stoll(value);
  }
};

TuneFile load_tune_file(const std::string& path) {
  std::ifstream in(path);
  COMMLIB_CHECK(in.good(), InvalidArgument, "COMMLIB_TUNE_FILE: cannot read '", path, "'");
  TuneFile file;
  bool first = true;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    std::istringstream words(text);
    std::string section, word;
    if (!(words >> section) || section[0] == '#') continue;
    COMMLIB_CHECK(!first || section[0] != '{', InvalidArgument, "COMMLIB_TUNE_FILE: '", path,
                  "' is a JSON tune file of an older commlib; the format is now one `<section> key=value ...` "
                  "line per entry (Note [tune file format]): re-run commlib-tune (it replaces the file)");
    first = false;
    TuneLine line{path, number, text, {}};
    while (words >> word) {
      const size_t eq = word.find('=');
      if (eq == 0 || eq == std::string::npos) line.fail(detail::concat("'", word, "' is not key=value"));
      line.fields[word.substr(0, eq)] = word.substr(eq + 1);
    }
    if (section == "all_reduce") {
      auto dtype = line.fields.find("dtype");
      file.all_reduce.push_back({static_cast<int>(line.integer("world_size")),
                                 dtype == line.fields.end() ? "" : dtype->second,
                                 {static_cast<size_t>(line.integer("flat_max_bytes")),
                                  static_cast<size_t>(line.integer("tree_max_bytes"))}});
    } else if (section == "fused_num_sms") {
      const int64_t num_sms = line.integer("num_sms");
      if (num_sms < 1 || num_sms > 0x7fffffff) line.fail(detail::concat("num_sms=", num_sms, " is not in 1..2^31-1"));
      file.fused_num_sms.push_back({static_cast<int>(line.integer("world_size")), static_cast<int>(num_sms)});
    } else if (section == "host_all_reduce") {
      file.host_all_reduce.push_back({static_cast<int>(line.integer("world_size")), line.integer("flat_max_bytes")});
    } else if (section == "hierarchical") {
      file.hierarchical.push_back({line.word("op"), static_cast<int>(line.integer("num_hosts")),
                                   static_cast<int>(line.integer("local_size")),
                                   static_cast<size_t>(line.integer("min_bytes"))});
    } else if (section == "collectives") {
      file.collectives.push_back(
          {static_cast<int>(line.integer("world_size")), line.word("op"), line.integer("max_bytes")});
    }  // other sections are commlib.tuned's (Python) or a later commlib's
  }
  return file;
}

std::string tune_file_path() {
  std::string path = env::get("COMMLIB_TUNE_FILE");
  if (!path.empty()) return path;
  const char* home = std::getenv("HOME");
  if (home == nullptr) return "";
  path = std::string(home) + "/.cache/commlib/tune.txt";
  // Looked up once per path: this runs on every all-reduce, and opening a file there costs more
  // than the kernel (the file's contents are cached once read, below, in the same way).
  static std::mutex mutex;
  static std::map<std::string, bool> exists;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = exists.find(path);
  if (it == exists.end()) it = exists.emplace(path, std::ifstream(path).good()).first;
  return it->second ? path : "";
}

const TuneFile& tune_file(const std::string& path) {
  static std::mutex mutex;
  static std::map<std::string, TuneFile> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(path);
  if (it == cache.end()) it = cache.emplace(path, load_tune_file(path)).first;
  return it->second;
}

}  // namespace

AllReduceLimits all_reduce_limits(int world_size, DataType dtype) {
  const char* what = "select_all_reduce_algorithm";
  COMMLIB_CHECK(world_size >= 1, InvalidArgument, what, ": world_size ", world_size, " must be >= 1");
  COMMLIB_CHECK(is_reducible(dtype), TypeMismatch, what, ": dtype ", dtype_name(dtype),
                " not supported; supported: float32, float16, bfloat16");
  AllReduceLimits limits{};
  for (const BuiltinRow& row : kBuiltinAllReduceTable) {
    if (world_size <= row.max_world_size) {
      limits = row.limits;
      break;
    }
  }
  const std::string path = tune_file_path();
  if (!path.empty()) {
    bool dtype_specific = false;
    for (const TuneEntry& e : tune_file(path).all_reduce) {
      if (e.world_size != world_size) continue;
      if (e.dtype.empty() && !dtype_specific) {
        limits = e.limits;
      } else if (e.dtype == dtype_name(dtype)) {
        limits = e.limits;
        dtype_specific = true;
      }
    }
  }
  const int64_t flat = env::get_int("COMMLIB_FLAT_MAX_BYTES");
  const int64_t tree = env::get_int("COMMLIB_TREE_MAX_BYTES");
  COMMLIB_CHECK(flat >= 0, InvalidArgument, "COMMLIB_FLAT_MAX_BYTES=", flat, " must be >= 0");
  COMMLIB_CHECK(tree >= 0, InvalidArgument, "COMMLIB_TREE_MAX_BYTES=", tree, " must be >= 0");
  if (flat > 0) limits.flat_max_bytes = static_cast<size_t>(flat);
  if (tree > 0) limits.tree_max_bytes = static_cast<size_t>(tree);
  return limits;
}

int tuned_fused_num_sms(int world_size) {
  const std::string path = tune_file_path();
  int num_sms = 0;
  if (path.empty()) return num_sms;
  for (const FusedTuneEntry& e : tune_file(path).fused_num_sms) {
    if (e.world_size == world_size) num_sms = e.num_sms;
  }
  return num_sms;
}

namespace {

Algorithm forced_algorithm() {
  return parse_algorithm("COMMLIB_ALLREDUCE_ALGO", env::get("COMMLIB_ALLREDUCE_ALGO"));
}

Algorithm choose(size_t bytes, Algorithm forced, const AllReduceLimits& limits) {
  if (forced != Algorithm::kAuto) return forced;
  if (bytes <= limits.flat_max_bytes) return Algorithm::kFlat;
  if (bytes <= limits.tree_max_bytes) return Algorithm::kTree;
  return Algorithm::kNccl;
}

int reducible_index(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return 0;
    case DataType::kFloat16: return 1;
    case DataType::kBFloat16: return 2;
    default: break;
  }
  throw TypeMismatch(detail::concat("select_all_reduce_algorithm: dtype ", dtype_name(dtype),
                                    " not supported; supported: float32, float16, bfloat16"));
}

}  // namespace

Algorithm select_all_reduce_algorithm(size_t bytes, int world_size, DataType dtype) {
  const AllReduceLimits limits = all_reduce_limits(world_size, dtype);
  return choose(bytes, forced_algorithm(), limits);
}

AllReduceSelector::AllReduceSelector(int world_size)
    : forced_(forced_algorithm()),
      limits_{all_reduce_limits(world_size, DataType::kFloat32), all_reduce_limits(world_size, DataType::kFloat16),
              all_reduce_limits(world_size, DataType::kBFloat16)} {}

Algorithm AllReduceSelector::select(size_t bytes, DataType dtype) const {
  return choose(bytes, forced_, limits_[reducible_index(dtype)]);
}

const AllReduceLimits& AllReduceSelector::limits(DataType dtype) const { return limits_[reducible_index(dtype)]; }

int64_t tuned_host_flat_max_bytes(int world_size) {
  const std::string path = tune_file_path();
  int64_t flat_max = -1;
  if (path.empty()) return flat_max;
  for (const HostTuneEntry& e : tune_file(path).host_all_reduce) {
    if (e.world_size == world_size) flat_max = e.flat_max_bytes;
  }
  return flat_max;
}

namespace {

// A non-negative integer knob no larger than `max`.
int64_t knob_in_range(const char* name, int64_t min, int64_t max) {
  const int64_t value = env::get_int(name);
  COMMLIB_CHECK(value >= min && value <= max, InvalidArgument, name, "=", value, " out of range; valid: ", min, "..",
                max);
  return value;
}

kernels::LaunchOrder launch_order() {
  const int64_t value = env::get_int("COMMLIB_PDL");
  COMMLIB_CHECK(value == 0 || value == 1, InvalidArgument, "COMMLIB_PDL=", value, " invalid; valid: 0, 1");
  return value == 1 ? kernels::LaunchOrder::kProgrammatic : kernels::LaunchOrder::kStream;
}

// COMMLIB_TREE_* (Note [tree geometry] in csrc/kernels/all_reduce_tree.cu).
kernels::TreeLaunchConfig tree_config() {
  kernels::TreeLaunchConfig cfg;
  cfg.max_blocks = static_cast<int>(knob_in_range("COMMLIB_TREE_MAX_BLOCKS", 0, kMaxBarrierBlocks));
  const int64_t threads = env::get_int("COMMLIB_TREE_THREADS");
  COMMLIB_CHECK(threads >= 0 && threads <= kernels::kTreeMaxThreads && threads % 32 == 0, InvalidArgument,
                "COMMLIB_TREE_THREADS=", threads, " invalid; valid: 0 or a multiple of 32 in 32..",
                kernels::kTreeMaxThreads);
  cfg.threads = static_cast<int>(threads);
  cfg.min_packs_per_block = knob_in_range("COMMLIB_TREE_MIN_PACKS", 0, kernels::kTreeMaxMinPacksPerBlock);
  return cfg;
}

constexpr int64_t kInt32Max = 0x7fffffff;

}  // namespace

HostAllReduceConfig resolve_host_all_reduce(int world_size) {
  HostAllReduceConfig config;
  const char* set = std::getenv("COMMLIB_HOST_TREE_THRESHOLD");  // an explicit value wins over the tune file
  const int64_t tuned = set == nullptr || *set == '\0' ? tuned_host_flat_max_bytes(world_size) : -1;
  if (tuned >= 0) {
    config.tree_min_bytes = static_cast<size_t>(tuned) + 1;  // flat up to the tuned limit, inclusive
  } else {
    config.tree_min_bytes = static_cast<size_t>(knob_in_range("COMMLIB_HOST_TREE_THRESHOLD", 0, int64_t{1} << 62));
  }
  return config;
}

AllReduceConfig::AllReduceConfig(int world_size)
    : selector(world_size),
      max_blocks(static_cast<int>(knob_in_range("COMMLIB_ALLREDUCE_MAX_BLOCKS", 0, kMaxBarrierBlocks))),
      flat_ll_max_bytes(static_cast<size_t>(knob_in_range("COMMLIB_FLAT_LL_MAX_BYTES", 0, int64_t{1} << 62))),
      tree(tree_config()),
      order(launch_order()) {}

const char* collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kReduceScatter: return "reduce_scatter";
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kBroadcast: return "broadcast";
    case CollectiveOp::kAllToAll: return "all_to_all";
  }
  return "unknown";
}

namespace {

// Note [collective crossovers]: built-in limits by world size, from the shape of the traffic (not
// measured yet; commlib-tune measures). At world 2 the push exchange moves what NCCL moves in one
// step and a ~5 µs barrier instead of NCCL's ~10 µs launch and protocol floor, so it should win
// from the smallest sizes up to where both run at NVLink bandwidth; 16 MiB is where the tree
// all-reduce's lead over NCCL fell to 1.1x on 2x H200. With more ranks a rank's pushes share its
// NVLinks the same way NCCL's ring steps do, but its one-shot copy-out and barrier grow with n, so
// the limits halve; broadcast's root sends n - 1 copies (NCCL's chain sends one), hence lower.
struct CollectiveRow {
  int max_world_size;
  size_t max_bytes[kNumCollectiveOps];  // reduce_scatter, all_gather, broadcast, all_to_all
};
constexpr CollectiveRow kBuiltinCollectiveTable[] = {
    {2, {16u << 20, 16u << 20, 16u << 20, 16u << 20}},
    {4, {8u << 20, 8u << 20, 2u << 20, 8u << 20}},
    {8, {4u << 20, 4u << 20, 1u << 20, 4u << 20}},
    {1 << 30, {1u << 20, 1u << 20, 256u << 10, 1u << 20}},
};

constexpr const char* kCollectiveKnobs[kNumCollectiveOps] = {
    "COMMLIB_REDUCE_SCATTER_MAX_BYTES", "COMMLIB_ALL_GATHER_MAX_BYTES", "COMMLIB_BROADCAST_MAX_BYTES",
    "COMMLIB_ALL_TO_ALL_MAX_BYTES"};

}  // namespace

CollectiveConfig::CollectiveConfig(int world_size) {
  COMMLIB_CHECK(world_size >= 1, InvalidArgument, "collectives: world_size ", world_size, " must be >= 1");
  for (const CollectiveRow& row : kBuiltinCollectiveTable) {
    if (world_size <= row.max_world_size) {
      for (int i = 0; i < kNumCollectiveOps; ++i) max_bytes[i] = row.max_bytes[i];
      break;
    }
  }
  const std::string path = tune_file_path();
  if (!path.empty()) {
    for (const CollectiveTuneEntry& e : tune_file(path).collectives) {
      if (e.world_size != world_size) continue;
      for (int i = 0; i < kNumCollectiveOps; ++i) {
        if (e.op == collective_op_name(static_cast<CollectiveOp>(i))) max_bytes[i] = static_cast<size_t>(e.max_bytes);
      }
    }
  }
  for (int i = 0; i < kNumCollectiveOps; ++i) {
    const int64_t value = env::get_int(kCollectiveKnobs[i]);
    COMMLIB_CHECK(value >= -1, InvalidArgument, kCollectiveKnobs[i], "=", value,
                  " invalid; valid: -1 (never commlib's kernel), 0 (the tuned or built-in limit) or a byte count");
    if (value == -1) {
      max_bytes[i] = 0;  // 0-byte messages launch nothing either way
    } else if (value > 0) {
      max_bytes[i] = static_cast<size_t>(value);
    }
  }
}

CommConfig::CommConfig(int world_size_in)
    : world_size(world_size_in),
      all_reduce(world_size_in),
      collectives(world_size_in),
      host(resolve_host_all_reduce(world_size_in)) {
  fused.num_sms = static_cast<int>(knob_in_range("COMMLIB_FUSED_NUM_SMS", 0, kInt32Max));
  kernels::FusedKernelConfig& k = fused.kernel;
  k.ll_max_bytes = knob_in_range("COMMLIB_FUSED_LL_MAX_BYTES", 0, int64_t{1} << 62);
  k.ll_max_rows = knob_in_range("COMMLIB_FUSED_LL_MAX_ROWS", 0, int64_t{1} << 62);
  k.oneshot_max_tokens = knob_in_range("COMMLIB_FUSED_ONESHOT_MAX_TOKENS", 0, int64_t{1} << 62);
  k.oneshot_sharded_max_tokens = knob_in_range("COMMLIB_FUSED_ONESHOT_SHARDED_MAX_TOKENS", 0, int64_t{1} << 62);
  k.ll_bytes_per_cta = knob_in_range("COMMLIB_FUSED_LL_BYTES_PER_CTA", 0, int64_t{1} << 62);
  k.ll_row_ctas = knob_in_range("COMMLIB_FUSED_LL_ROW_CTAS", 0, kInt32Max);
  k.tuned_max_blocks = tuned_fused_num_sms(world_size_in);
  k.order = all_reduce.order;
  ep.want_ll = env::get_bool("COMMLIB_EP_LL");
  ep.order = all_reduce.order;
}

const char* hier_op_name(HierOp op) {
  switch (op) {
    case HierOp::kAllReduce: return "all_reduce";
    case HierOp::kReduceScatter: return "reduce_scatter";
    case HierOp::kAllGather: return "all_gather";
    case HierOp::kBroadcast: return "broadcast";
    case HierOp::kBarrier: return "barrier";
    case HierOp::kCount: break;
  }
  return "unknown";
}

HierarchicalSelector::HierarchicalSelector(int num_hosts, int local_size) {
  for (size_t& m : min_bytes_) m = 0;  // built-in: two-level for every size (Note [hierarchical crossover])
  const std::string path = tune_file_path();
  if (!path.empty()) {
    for (const HierTuneEntry& e : tune_file(path).hierarchical) {
      if (e.num_hosts != num_hosts || e.local_size != local_size) continue;
      bool known = false;
      for (int i = 0; i < static_cast<int>(HierOp::kCount); ++i) {
        if (e.op == hier_op_name(static_cast<HierOp>(i))) {
          min_bytes_[i] = e.min_bytes;
          known = true;
        }
      }
      COMMLIB_CHECK(known, InvalidArgument, "COMMLIB_TUNE_FILE: '", path, "': hierarchical entry has op '", e.op,
                    "'; valid: all_reduce, reduce_scatter, all_gather, broadcast, barrier");
    }
  }
  const std::string forced = env::get("COMMLIB_HIER_ALGO");
  COMMLIB_CHECK(forced == "auto" || forced == "hier" || forced == "flat", InvalidArgument, "COMMLIB_HIER_ALGO='",
                forced, "' not supported; supported: auto, hier, flat");
  if (forced != "auto") {
    for (size_t& m : min_bytes_) m = forced == "hier" ? 0 : kNever;
  }
}

}  // namespace commlib
