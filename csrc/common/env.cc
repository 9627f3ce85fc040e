#include "commlib/env.hpp"

#include <cstdlib>
#include <cstring>

#include "commlib/errors.hpp"

namespace commlib::env {

const char* category_name(KnobCategory category) {
  switch (category) {
    case KnobCategory::kRuntime: return "runtime";
    case KnobCategory::kTuning: return "tuning";
    case KnobCategory::kTestOnly: return "test-only";
    case KnobCategory::kBuild: return "build";
  }
  return "unknown";
}

// The one declaration of every COMMLIB_* environment variable, in docs/knobs.md's order
// (tools/knobs_table.py parses this table: keep each entry {"NAME", "default", KnobCategory::kX,
// "meaning" ...}).
const std::vector<Knob>& knobs() {
  static const std::vector<Knob> table = {
      {"COMMLIB_TIMEOUT_MS", "0", KnobCategory::kRuntime,
       "Bound on every wait for a peer (host and device), in ms; 0 uses the communicator's timeout "
       "(init_process_group's timeout, 300 s by default)."},
      {"COMMLIB_SHM_SLOT_BYTES", "4194304", KnobCategory::kRuntime,
       "Bytes of each rank's shared-memory slot per buffer (two buffers per rank); larger "
       "messages go in chunks of this size."},
      {"COMMLIB_ALLREDUCE_ALGO", "auto", KnobCategory::kRuntime,
       "Force the all-reduce algorithm: auto, flat, tree or nccl."},
      {"COMMLIB_GPU_WORKSPACE_BYTES", "67108864", KnobCategory::kRuntime,
       "Bytes of each rank's symmetric GPU workspace used for copy-in of non-symmetric tensors."},
      {"COMMLIB_P2P_SLOT_BYTES", "1048576", KnobCategory::kRuntime,
       "Bytes of each slot of the GPU send/recv channels (2 slots x 4 lanes per pair of ranks, "
       "allocated with the GPU state); larger messages go in chunks of this size."},
      {"COMMLIB_TUNE_FILE", "", KnobCategory::kRuntime,
       "Path of the crossover cache written by commlib-tune (Note [tune file format]); empty: "
       "~/.cache/commlib/tune.txt when it exists, else the built-in table."},
      {"COMMLIB_EP_LL", "0", KnobCategory::kRuntime,
       "EPBuffer on GPU: 1: buffers with a decode grid (column parts, at most 4 tokens a chunk, rows a "
       "whole number of 16-byte packs) run dispatch / combine over flag-carrying lines (Note [EP LL "
       "protocol], csrc/kernels/ep_ll.cu); 0: the flag kernels. Read once per communicator; "
       "used only if every rank asks for it."},
      {"COMMLIB_PDL", "0", KnobCategory::kRuntime,
       "Programmatic dependent launch (sm_90) of the EP dispatch / combine, fused LL and flat / flat "
       "LL all-reduce kernels: 1: each may be scheduled while the previous kernel of its stream "
       "finishes and waits on the GPU (griddepcontrol.wait) before touching memory; 0: plain stream "
       "order. Read once per communicator (Note [communicator configuration]). Note [programmatic "
       "dependent launch] (csrc/kernels/launch.cuh)."},
      {"COMMLIB_ENABLE_MULTICAST", "0", KnobCategory::kRuntime,
       "Opt in to NVLink multicast (NVLS multimem) kernels. Refused whenever "
       "COMMLIB_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 or "
       "NVSHMEM_DISABLE_NVLS=1 is set."},
      {"COMMLIB_DISABLE_MULTICAST", "0", KnobCategory::kRuntime, "Kill switch: refuse every NVLink multicast path."},
      {"COMMLIB_HIER_ALGO", "auto", KnobCategory::kRuntime,
       "A \"ddacomm\" group spanning several hosts: auto: all_reduce, reduce_scatter, all_gather, broadcast "
       "and barrier run two-level (commlib inside each host, gloo / NCCL between hosts) from the tune file's "
       "or the built-in crossover on (Note [hierarchical crossover]); hier: always two-level; flat: always "
       "the group's inner gloo / NCCL. Read once per group."},
      {"COMMLIB_KV_SLOTS", "128", KnobCategory::kRuntime,
       "commlib.kv: requests in flight from one sending rank to one receiving rank (notification "
       "records per lane, read by the receiving agent when it registers); a sender that finds none free "
       "raises PeerError until the receiver's poll() / wait() reports finished requests."},
      {"COMMLIB_KV_CTAS", "132", KnobCategory::kTuning,
       "commlib.kv on CUDA: largest grid (CTAs) of the KV copy kernel, its SM budget, 1..1024; a "
       "request gets one CTA per 64 KiB up to it. Read by the sending agent (KVAgent num_ctas "
       "overrides it)."},
      {"COMMLIB_KV_STAGING_BYTES", "16777216", KnobCategory::kRuntime,
       "commlib.kv on CUDA: bytes of the sending agent's block-id staging (pinned host + device); a "
       "request holds 8 bytes per block until its last layer is sent."},
      {"COMMLIB_LOG_PLAN", "0", KnobCategory::kRuntime,
       "1: log each call's plan (variant and reason, Note [plan] in csrc/core/plan.hpp) to stderr, one "
       "line with the rank, once per (op, bytes, dtype, variant) in a process. Read once per process."},
      {"COMMLIB_HOST_TREE_THRESHOLD", "262144", KnobCategory::kTuning,
       "CPU all_reduce: messages of at least this many bytes use tree (reduce-scatter + "
       "all-gather), smaller ones flat."},
      {"COMMLIB_FLAT_MAX_BYTES", "0", KnobCategory::kTuning,
       "GPU all_reduce: largest message for flat (one-shot); 0 uses the built-in or tuned table."},
      {"COMMLIB_TREE_MAX_BYTES", "0", KnobCategory::kTuning,
       "GPU all_reduce: largest message for tree (two-shot); larger go to NCCL where attached; "
       "0 uses the built-in or tuned table."},
      {"COMMLIB_FLAT_LL_MAX_BYTES", "262144", KnobCategory::kTuning,
       "GPU all_reduce: flat messages of at most this many bytes use the barrier-free LL variant "
       "(a ready flag in every 8 bytes; csrc/kernels/all_reduce_flat_ll.cu); also the limit (whole "
       "message) of the LL reduce_scatter / all_gather / all_to_all (csrc/kernels/exchange_ll.cu); 0: off."},
      {"COMMLIB_ALLREDUCE_MAX_BLOCKS", "0", KnobCategory::kTuning,
       "GPU all_reduce: largest grid (CTAs) of the flat, LL and tree kernels, 1..256; 0: built-in "
       "(flat 48, LL 64, tree 132). For tuning on a new machine."},
      {"COMMLIB_TREE_MAX_BLOCKS", "0", KnobCategory::kTuning,
       "GPU all_reduce, tree: grid cap (CTAs), 1..256; 0: COMMLIB_ALLREDUCE_MAX_BLOCKS when set, "
       "else 132. Same value on every rank. For tuning (docs/gpu-allreduce.md, Note [tree geometry])."},
      {"COMMLIB_TREE_THREADS", "0", KnobCategory::kTuning,
       "GPU all_reduce, tree: threads per CTA cap, a multiple of 32 in 32..512; 0: 256. For tuning."},
      {"COMMLIB_TREE_MIN_PACKS", "0", KnobCategory::kTuning,
       "GPU all_reduce, tree: fewest 16-byte packs of each rank's slice per CTA (fewer: fewer CTAs), "
       "1..16777216; 0: 256. For tuning."},
      {"COMMLIB_REDUCE_SCATTER_MAX_BYTES", "0", KnobCategory::kTuning,
       "GPU reduce_scatter: largest message (the input's bytes) for commlib's push kernel; larger go "
       "to NCCL where attached; 0: the built-in or tuned limit; -1: always NCCL (Note [collective "
       "crossovers])."},
      {"COMMLIB_ALL_GATHER_MAX_BYTES", "0", KnobCategory::kTuning,
       "GPU all_gather: largest message (the output's bytes) for commlib's push kernel; 0: built-in "
       "or tuned; -1: always NCCL."},
      {"COMMLIB_BROADCAST_MAX_BYTES", "0", KnobCategory::kTuning,
       "GPU broadcast: largest tensor for commlib's push kernel; 0: built-in or tuned; -1: always NCCL."},
      {"COMMLIB_ALL_TO_ALL_MAX_BYTES", "0", KnobCategory::kTuning,
       "GPU all_to_all_single with equal splits: largest input for commlib's push kernel; 0: built-in "
       "or tuned; -1: always NCCL."},
      {"COMMLIB_FUSED_NUM_SMS", "0", KnobCategory::kTuning,
       "CTAs of the fused all-reduce + RMSNorm kernel; 0 chooses by size (barrier kernel: at most "
       "132, or commlib-tune's fused_num_sms for this world size when the tune file has one; LL "
       "kernels: see COMMLIB_FUSED_LL_BYTES_PER_CTA)."},
      {"COMMLIB_FUSED_LL_MAX_BYTES", "262144", KnobCategory::kTuning,
       "Fused all-reduce + RMSNorm on GPU: when each rank's token slice has at most this many bytes "
       "and at most COMMLIB_FUSED_LL_MAX_ROWS rows (and fits the LL buffer) it runs the barrier-free LL kernel "
       "(csrc/kernels/rs_rmsnorm_ag_p2p_ll.cu); 0: never."},
      {"COMMLIB_FUSED_LL_MAX_ROWS", "16", KnobCategory::kTuning,
       "Fused all-reduce + RMSNorm on GPU: most rows (ceil(tokens / world)) of a rank's slice that "
       "run the LL kernel; more rows run the barrier kernel."},
      {"COMMLIB_FUSED_ONESHOT_MAX_TOKENS", "32", KnobCategory::kTuning,
       "Fused all-reduce + RMSNorm on GPU: up to this many tokens (and when every row fits the LL "
       "buffer) every rank receives every row and normalises all of them itself, one NVLink "
       "crossing instead of two (one-shot LL kernel); 0: never. Replicated mode; sharded: "
       "COMMLIB_FUSED_ONESHOT_SHARDED_MAX_TOKENS."},
      {"COMMLIB_FUSED_ONESHOT_SHARDED_MAX_TOKENS", "8", KnobCategory::kTuning,
       "COMMLIB_FUSED_ONESHOT_MAX_TOKENS for residual_mode=\"sharded\" (the owners' residual rows "
       "travel too); 0: never."},
      {"COMMLIB_FUSED_LL_BYTES_PER_CTA", "2048", KnobCategory::kTuning,
       "Fused all-reduce + RMSNorm, LL kernels (one-shot and two-shot): the CTA count chosen by size "
       "is at least the x bytes a rank pushes divided by this (at most 128); 0: by rows only."},
      {"COMMLIB_FUSED_LL_ROW_CTAS", "0", KnobCategory::kTuning,
       "Fused all-reduce + RMSNorm, LL kernel: CTAs (a thread-block cluster) that share one row, "
       "1, 2, 4 or 8; 0 chooses by size (up to 4 rows per rank as many as the CTA budget allows for "
       "the slice's rows, at most 8; beyond, 1). 1 is one CTA per row."},
      {"COMMLIB_NCCL_REAL", "", KnobCategory::kRuntime,
       "NCCL shim (libnccl.so.2, docs/nccl.md): path of the real libnccl.so.2 it forwards to; empty: "
       "the nvidia-nccl wheel's beside the loaded torch, beside the shim's package, or found at build time."},
      {"COMMLIB_NCCL_HOST", "", KnobCategory::kRuntime,
       "NCCL shim: the name or IPv4 address of this host that ncclGetUniqueId puts in the id for the "
       "ranks to reach its rendezvous; empty: the first IPv4 address of an interface that is up and "
       "not loopback."},
      {"COMMLIB_NCCL_SERVE", "1", KnobCategory::kRuntime,
       "NCCL shim: 1 runs the collectives and send/recv of one-host communicators on commlib "
       "(docs/nccl.md says which); 0 forwards every call to the real NCCL."},
      {"COMMLIB_HOST_TEST_JITTER_US", "0", KnobCategory::kTestOnly,
       "Testing only: after each of its waits on the CPU shared-memory transport (a barrier, a "
       "pipeline step) a rank sleeps a random 0..N microseconds, so that its peers run ahead as on "
       "a busy machine and tests meet those interleavings (Note [host shm jitter]); 0: off."},
      {"COMMLIB_TEST_TIMEOUT_S", "600", KnobCategory::kTestOnly,
       "tests/conftest.py: default limit, in seconds, of one multi-process test case (the ranks are "
       "killed and the test fails after it, with the Python stacks of the ranks that did not answer)."},
      {"COMMLIB_FUZZ_EXAMPLES", "1", KnobCategory::kTestOnly,
       "tests/fuzz_cases.py: multiplies the number of cases the property-based fuzz tests draw (a long "
       "run: COMMLIB_FUZZ_EXAMPLES=50)."},
      {"COMMLIB_TEST_SHARE_GPUS", "0", KnobCategory::kTestOnly,
       "tests/conftest.py: 1 lets a test's ranks share the GPUs there are (rank r on GPU r mod count), "
       "so world sizes above the GPU count run on one machine; 0: such tests skip."},
      {"COMMLIB_TEST_HOST_ID", "", KnobCategory::kTestOnly,
       "Testing only: when set, a communicator or \"ddacomm\" group created by the calling rank takes this "
       "string as its host instead of the host name and boot id (commlib::host_id), so that ranks on one "
       "machine can act as several hosts (the hierarchical paths, Note [communicator hosts]); empty: the "
       "real host."},
      {"COMMLIB_TEST_HIER_INTER_GLOO", "0", KnobCategory::kTestOnly,
       "Testing only: 1 makes a multi-host \"ddacomm\" group carry the inter-host leg of CUDA tensors on its "
       "gloo group (through host copies) instead of NCCL, which refuses two ranks on one GPU "
       "(tests/gpu/test_hierarchy_gpu.py with COMMLIB_TEST_SHARE_GPUS=1); 0: NCCL."},
      {"COMMLIB_TEST_PROGRESS", "0", KnobCategory::kTestOnly,
       "tests/conftest.py: 1 makes rank 0 print each test step with the time (run pytest with -s)."},
      {"COMMLIB_NO_CUDA", "0", KnobCategory::kBuild,
       "setup.py: 1 builds without the CUDA kernels and GPU transports (CPU paths only; faster)."},
      {"COMMLIB_NO_NVSHMEM", "0", KnobCategory::kBuild,
       "setup.py: 1 builds without the NVSHMEM EP kernels (libcommlib_nvshmem.so), which are otherwise built "
       "when the nvidia-nvshmem wheel's headers and device library are installed."},
      {"COMMLIB_BUILD_DIR", "", KnobCategory::kBuild,
       "setup.py: CMake build directory; empty: build/cmake in the checkout."},
      {"COMMLIB_EP_TRACE", "", KnobCategory::kBuild,
       "Not read at run time: a compile definition (CUDAFLAGS=-DCOMMLIB_EP_TRACE when building) that "
       "compiles the EP kernels' timing trace in, for bench/ep_trace.py."},
  };
  return table;
}

static const Knob& find(const char* name) {
  for (const Knob& knob : knobs()) {
    if (std::strcmp(knob.name, name) == 0) return knob;
  }
  throw InvalidArgument(detail::concat("env: undeclared knob ", name));
}

std::string get(const char* name) {
  const Knob& knob = find(name);
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : std::string(knob.default_value);
}

int64_t get_int(const char* name) {
  std::string value = get(name);
  char* end = nullptr;
  long long parsed = std::strtoll(value.c_str(), &end, 0);
  COMMLIB_CHECK(end != nullptr && *end == '\0' && !value.empty(), InvalidArgument, "env: ", name, "='", value,
                "' is not an integer");
  return parsed;
}

bool get_bool(const char* name) {
  std::string value = get(name);
  return value == "1" || value == "true" || value == "yes" || value == "on";
}

}  // namespace commlib::env
