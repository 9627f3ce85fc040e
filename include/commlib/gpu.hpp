// GPU operations of a Communicator, for C++ callers (the torch layer drives the same core calls).
// Everything runs on `stream` of the communicator's GPU and never synchronises the host, so every
// call can be captured in a CUDA graph once its communicator and buffers exist (create them, and
// make a first call of each operation, outside capture). A communicator drives one GPU: the first
// GPU call picks `device`, a later call with another device throws InvalidArgument.
//
// Collective: every rank calls each operation in the same order with matching sizes, dtypes and
// modes. Errors: InvalidArgument / TypeMismatch (bad argument, on the calling rank, before any
// communication; the communicator stays usable), PeerError (the GPUs cannot reach each other's
// memory), Timeout (a peer did not arrive: raised by the next call or check_gpu_error, naming rank,
// peer and phase; the communicator is then unusable). Configuration: Note [communicator
// configuration] (Communicator::config()). Host-compilable; needs no CUDA header. In a build
// without CUDA every call throws InvalidArgument.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "commlib/communicator.hpp"
#include "commlib/ep.hpp"
#include "commlib/fused_rmsnorm.hpp"
#include "commlib/types.hpp"

struct CUstream_st;

namespace commlib {

using GpuStream = CUstream_st*;

// Whether this build has the GPU paths.
bool gpu_built();

// In-place (input == output) or out-of-place all-reduce of `count` elements (float32, float16,
// bfloat16; sum or avg). algo kAuto chooses by size (Communicator::config()); kNccl is refused
// (no NCCL engine here).
void all_reduce_gpu(Communicator& comm, int device, const void* input, void* output, size_t count, DataType dtype,
                    ReduceOp op, Algorithm algo, GpuStream stream);

// The other collectives, one push-exchange kernel each (docs/gpu-collectives.md); any size (the
// messages larger than a workspace half run as several calls). In the torch backend, sizes above
// the communicator's crossover (Note [collective crossovers]) go to NCCL instead.
// reduce_scatter: `output` (count elements) receives this rank's slice of the sum (or avg) of every
// rank's `input` (world * count elements; float32, float16, bfloat16), reduced as all_reduce does.
void reduce_scatter_gpu(Communicator& comm, int device, const void* input, void* output, size_t count,
                        DataType dtype, ReduceOp op, GpuStream stream);
// all_gather: `output` (world * bytes) receives every rank's `input` (bytes) in rank order; `input`
// may be this rank's block of `output` (in place).
void all_gather_gpu(Communicator& comm, int device, const void* input, void* output, size_t bytes,
                    GpuStream stream);
// broadcast: every rank's `data` (bytes) receives rank `root`'s.
void broadcast_gpu(Communicator& comm, int device, void* data, size_t bytes, int root, GpuStream stream);
// all_to_all with equal splits: block q (block_bytes) of `input` goes to rank q, where it lands as
// block `rank` of `output`. `input` and `output` must not overlap.
void all_to_all_gpu(Communicator& comm, int device, const void* input, void* output, size_t block_bytes,
                    GpuStream stream);

// Fused all-reduce + residual add + RMSNorm (include/commlib/fused_rmsnorm.hpp) on bfloat16 or
// float16 device pointers, 16-byte aligned. num_sms: CTAs (0: COMMLIB_FUSED_NUM_SMS, else by size).
void fused_allreduce_rmsnorm_gpu(Communicator& comm, int device, const FusedRmsNormArgs& args, int num_sms,
                                 FusedAlgo algo, GpuStream stream);

// Raises Timeout if a GPU wait of this communicator expired (host memory only; no synchronisation).
void check_gpu_error(Communicator& comm);

// The GPU side of an expert-parallel buffer (Note [EP layout], Note [EP GPU protocol]): registered
// once, then each dispatch / combine only moves data. Created collectively (agrees on the grid and
// on the LL kernels with the peers, allocates symmetric memory). The caller owns expert_x
// [L, capacity, hidden], expert_counts [L] and recv_pos [world, max_tokens, topk] on the device and
// registers them with set_local before the first dispatch; meta_idx, meta_w, meta_num_tokens and
// overflow live in the buffer's symmetric memory (state()). Calls alternate dispatch, combine; a
// split phase (kSend) is followed by its kRecv.
// How an EPBufferGpu reaches its peers: CUDA peer memory (one node) or NVSHMEM puts (any peer
// NVSHMEM reaches: NVLink or the network; Note [EP NVSHMEM protocol]). kNvshmem needs
// ep_nvshmem_attach first.
enum class EPTransport : int { kPeerMemory = 0, kNvshmem = 1 };

// Loads libcommlib_nvshmem.so from `path` (once per process) and registers its kernels with the
// NVSHMEM runtime this process already initialised (nvshmem4py); returns (my_pe, n_pes) as the
// kernels see them. Throws InvalidArgument when the library cannot be loaded or NVSHMEM is not
// initialised. Not collective. Whoever initialises NVSHMEM sets NVSHMEM_DISABLE_NVLS=1 first
// (docs/architecture.md, Safety; python/commlib/_nvshmem.py does).
std::pair<int, int> ep_nvshmem_attach(const std::string& path, int device);

class EPBufferGpu {
 public:
  EPBufferGpu(Communicator& comm, const EPConfig& config, int device,
              EPTransport transport = EPTransport::kPeerMemory);
  ~EPBufferGpu();
  EPBufferGpu(const EPBufferGpu&) = delete;
  EPBufferGpu& operator=(const EPBufferGpu&) = delete;

  void set_local(void* expert_x, int32_t* expert_counts, int32_t* recv_pos);
  // The registered state; meta_num_tokens[r] is at meta_num_tokens + r * meta_num_tokens_stride().
  EPState state() const;
  int64_t meta_num_tokens_stride() const;
  // The symmetric memory behind state()'s meta_* and overflow (keeps the mapping alive).
  std::shared_ptr<void> symmetric_keepalive() const;
  const EPConfig& config() const;
  int device() const;
  const char* kernels() const;  // "flags", "ll" (Note [EP LL protocol]) or "nvshmem"

  // x, topk_idx, topk_weights: [num_tokens, ...] device rows of this rank (kRecv: ignored).
  void dispatch(const void* x, int64_t num_tokens, const int64_t* topk_idx, const float* topk_weights, EPPhase phase,
                GpuStream stream);
  // expert_out: [L, capacity, hidden] (kRecv: ignored); out: [num_tokens of the dispatch, hidden].
  void combine(const void* expert_out, void* out, EPPhase phase, GpuStream stream);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Developer aid: the EP kernels' last-call timing trace on the current device (%globaltimer ns per
// point); empty unless built with -DCOMMLIB_EP_TRACE (bench/ep_trace.py reads it).
std::vector<int64_t> ep_trace_snapshot_gpu();

}  // namespace commlib
