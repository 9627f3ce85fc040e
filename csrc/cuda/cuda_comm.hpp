// CudaComm: a communicator's GPU state and the orchestration of its GPU operations (all-reduce,
// fused all-reduce + RMSNorm, all_to_all_v; EP in csrc/cuda/cuda_ep.cc), created collectively on
// first GPU use (Communicator::cuda(device)); nothing CUDA happens at import or communicator
// construction. It takes every choice from the communicator's configuration (Note [communicator
// configuration]) and calls the kernel launchers with it; the public face is include/commlib/gpu.hpp.
//
// Owns: the CudaIpc transport (symmetric allocations), the barrier signal pad (symmetric, zeroed),
// the device-local BarrierCallState, the host-mapped DeviceErrorWord, and the copy-in workspace
// (COMMLIB_GPU_WORKSPACE_BYTES, two alternating halves) and the LL line buffer (zeroed). Kernels written by other modules share
// the same barrier (barrier_handle()) and must follow Note [flag barrier]: call_begin first,
// call_end last, so the call counter stays the same on every rank.
//
// Ordering: collectives of one communicator run one at a time in call order. On a stream other
// than the previous call's, the call first waits (cudaStreamWaitEvent, outside graph capture) for
// the previous call; during capture the caller orders the streams.
// Errors: a failed device wait poisons the communicator; check_error() (called at the start of
// every collective, or explicitly) raises Timeout naming rank, peer, phase and elapsed time.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "commlib/communicator.hpp"
#include "commlib/fused_rmsnorm.hpp"
#include "commlib/symmetric_buffer.hpp"
#include "commlib/types.hpp"
#include "core/algorithm_selector.hpp"
#include "core/plan.hpp"

namespace commlib {

class CudaIpc;
class CudaP2p;

class CudaComm {
 public:
  CudaComm(Communicator& comm, int device);  // collective
  ~CudaComm();
  CudaComm(const CudaComm&) = delete;
  CudaComm& operator=(const CudaComm&) = delete;

  int device() const { return device_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // Whether every pair of ranks reaches each other's GPU memory; when false GPU collectives raise
  // PeerError (the torch backend routes them to NCCL instead) and peer_problem() says why.
  bool p2p_ok() const;
  const std::string& peer_problem() const;

  // Collective: every rank allocates the same sizes in the same order (PeerError otherwise).
  std::shared_ptr<SymmetricBuffer> allocate_symmetric(size_t bytes);
  // The symmetric buffer from allocate_symmetric that holds [ptr, ptr + bytes), or null;
  // `offset` receives ptr's offset in it. Not collective.
  std::shared_ptr<SymmetricBuffer> find_symmetric(const void* ptr, size_t bytes, size_t* offset) const;

  const SymmetricBuffer& workspace() const { return *workspace_; }
  // The transport, for modules that map memory of their own (collective calls only).
  CudaIpc& ipc() const { return *ipc_; }
  // The LL line buffer (Note [LL lines]) as the LL kernels see it, shared by all of them: `bytes`
  // is its nominal size, whose halves they use by call parity (the allocation may be rounded up).
  SymmetricBufferDevice ll_lines_handle() const;
  BarrierDevice barrier_handle() const;

  // Raises Timeout (naming rank, peer, phase) if a device wait of this communicator expired.
  // Not collective; reads host memory only (no synchronisation).
  void check_error(const char* what) const;
  // Whether a device wait of this communicator expired (the host-mapped word; no synchronisation).
  bool failed() const;
  // Poisons the device call state from a stream of its own (Note [abort] in communicator.hpp):
  // device waits end at their next check and later kernels return at once. Never throws.
  void abort() noexcept;

  // Stream ordering around one collective (see above). begin_op also calls check_error.
  void begin_op(cudaStream_t stream, const char* what);
  void end_op(cudaStream_t stream, const char* what);

  const CommConfig& config() const { return config_; }

  // Point-to-point over peer memory (Note [cuda p2p]); its channels are allocated with the rest of
  // the GPU state. PeerError when peer memory is unavailable (p2p_ok() false).
  CudaP2p& p2p();

  // In-place or out-of-place all-reduce of `count` elements on `stream` (collective), as
  // plan_all_reduce plans it without an NCCL engine (a planned nccl runs tree; an explicit algo
  // nccl raises InvalidArgument).
  void all_reduce(const void* input, void* output, size_t count, DataType dtype, ReduceOp op, Algorithm algo,
                  cudaStream_t stream);
  // The same with the caller's plan (Note [plan]): runs exactly plan.variant with plan.geometry;
  // InvalidArgument for a variant that is not a CUDA all-reduce kernel (nccl is the caller's).
  void all_reduce(const void* input, void* output, size_t count, DataType dtype, ReduceOp op, const Plan& plan,
                  cudaStream_t stream);
  // Whether an all-reduce from `input` to `output` of `bytes` may reduce in place in a symmetric
  // buffer of this communicator (the zero-copy tree's condition; the plan decides). Not collective.
  Residence residence(const void* input, const void* output, size_t bytes) const;

  // The push-exchange collectives (Note [push exchange], csrc/kernels/exchange_params.hpp) on
  // `stream` (collective; include/commlib/gpu.hpp has the contracts), as plan_exchange plans them
  // without an NCCL engine: commlib's kernel whatever the size (the torch backend routes its nccl
  // plans to NCCL before calling these).
  void reduce_scatter(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                      cudaStream_t stream);
  void all_gather(const void* input, void* output, size_t bytes, cudaStream_t stream);
  void broadcast(void* data, size_t bytes, int root, cudaStream_t stream);
  void all_to_all(const void* input, void* output, size_t block_bytes, cudaStream_t stream);

  // Fused all-reduce + RMSNorm (include/commlib/gpu.hpp) on `stream` (collective): the LL or the
  // barrier P2P kernel by size, or the multicast kernel for FusedAlgo::kMultimem where the guard
  // allows it (csrc/cuda/fused_cuda.cc).
  void fused_allreduce_rmsnorm(const FusedRmsNormArgs& args, int num_sms, FusedAlgo algo, cudaStream_t stream);

  // all_to_all_v of `row_bytes`-byte rows on `stream` (collective). in_splits / out_splits: device
  // [world] int64 row counts, or null for equal splits (rows divisible by the world size). The
  // output is written in place when it lies in a symmetric buffer, else through the workspace.
  void all_to_all_v(const void* input, void* output, int64_t row_bytes, int64_t in_rows, int64_t out_rows,
                    const int64_t* in_splits, const int64_t* out_splits, cudaStream_t stream);
  // Raises InvalidArgument if an all_to_all_v since the last check found bad device splits (a
  // device synchronisation). Not collective.
  void check_all_to_all();

 private:
  // The all_to_all_v control area, allocated collectively by the first all_to_all_v.
  const SymmetricBuffer& all_to_all_control();

  Communicator& comm_;
  const CommConfig& config_;
  int device_;
  int rank_;
  int world_size_;
  std::unique_ptr<CudaIpc> ipc_;
  std::shared_ptr<SymmetricBuffer> signal_pad_;
  std::shared_ptr<SymmetricBuffer> workspace_;
  std::shared_ptr<SymmetricBuffer> ll_lines_;  // Note [LL lines], zeroed
  std::vector<std::weak_ptr<SymmetricBuffer>> user_buffers_;
  BarrierCallState* state_ = nullptr;
  DeviceErrorWord* error_host_ = nullptr;
  DeviceErrorWord* error_device_ = nullptr;
  cudaEvent_t last_done_ = nullptr;
  cudaStream_t last_stream_ = nullptr;
  bool has_last_ = false;
  bool capturing_ = false;
  std::shared_ptr<SymmetricBuffer> a2a_control_;
  std::unique_ptr<CudaP2p> p2p_;
};

// Sets `device` current for the scope (restores the previous one).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Waits for every piece of `device`'s work before what it uses is released (docs/architecture.md,
// Memory and synchronisation): kernels still in flight may use the mappings; every device wait is
// bounded, so this returns. Never throws; leaves no sticky error for the next CUDA call.
void wait_device_before_release(int device) noexcept;

void cuda_check(cudaError_t err, const char* what, const char* call);

}  // namespace commlib
