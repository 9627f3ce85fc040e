// CudaComm: a communicator's GPU state, created collectively on first GPU use
// (Communicator::cuda(device)); nothing CUDA happens at import or communicator construction.
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
#include "commlib/symmetric_buffer.hpp"
#include "commlib/types.hpp"
#include "core/algorithm_selector.hpp"
#include "kernels/all_reduce_params.hpp"

namespace commlib {

class CudaIpc;

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

  // Stream ordering around one collective (see above). begin_op also calls check_error.
  void begin_op(cudaStream_t stream, const char* what);
  void end_op(cudaStream_t stream, const char* what);

  // In-place or out-of-place all-reduce of `count` elements on `stream` (collective).
  // algo kAuto chooses (csrc/core/algorithm_selector.hpp); kNccl runs tree here (no NCCL engine).
  void all_reduce(const void* input, void* output, size_t count, DataType dtype, ReduceOp op, Algorithm algo,
                  cudaStream_t stream);

  // commlib-tune's CTA count for the fused all-reduce + RMSNorm kernel at this world size (0: none),
  // read once at creation (tuned_fused_num_sms in csrc/core/algorithm_selector.hpp).
  int fused_tuned_blocks() const { return fused_tuned_blocks_; }

 private:
  int device_;
  int rank_;
  int world_size_;
  uint64_t timeout_ns_;
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
  // Read once, at creation (COMMLIB_ALLREDUCE_ALGO, the limits, the tune file, the LL, grid and tree knobs).
  AllReduceSelector selector_;
  int64_t max_blocks_;
  int64_t ll_max_bytes_;
  kernels::TreeLaunchConfig tree_config_;  // COMMLIB_TREE_* (Note [tree geometry])
  int fused_tuned_blocks_;  // whether the call between begin_op and end_op is being captured
};

}  // namespace commlib
