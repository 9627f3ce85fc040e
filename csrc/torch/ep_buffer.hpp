// The torch side of EPBuffer (python/commlib/ep.py): owns the registered buffers and calls the CPU
// (csrc/host/ep_dispatch_combine.cc) or GPU (csrc/torch/ep_cuda_ops.cpp) implementation.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "commlib/communicator.hpp"
#include "commlib/ep.hpp"

namespace commlib::torch_layer {

using ::commlib::EPPhase;  // include/commlib/ep.hpp

struct EPCudaState;  // GPU buffers and launch state (ep_cuda_ops.cpp)

// Tensors over the registered state (Note [EP layout]); on CUDA some are views of symmetric memory.
struct EPTensors {
  at::Tensor expert_x;         // [L, capacity, hidden]
  at::Tensor expert_counts;    // [L] int32
  at::Tensor recv_pos;         // [world, max_tokens, topk] int32
  at::Tensor meta_idx;         // [world, max_tokens, topk] int32
  at::Tensor meta_w;           // [world, max_tokens, topk] float32
  at::Tensor meta_num_tokens;  // [world] int32
  at::Tensor overflow;         // [kEPOverflowWords] int64
};

class EPBufferTorch {
 public:
  // Collective on CUDA (allocates symmetric memory); local on CPU. transport: "peer" (CUDA peer
  // memory, or host shared memory on CPU) or "nvshmem" (CUDA only; Note [EP NVSHMEM protocol]).
  EPBufferTorch(std::shared_ptr<Communicator> comm, EPConfig config, at::Device device,
                const std::string& transport = "peer");
  ~EPBufferTorch();

  // Returns (expert_x, expert_counts): views of the registered buffers, valid until the next dispatch.
  std::pair<at::Tensor, at::Tensor> dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                             const at::Tensor& topk_weights, EPPhase phase);
  at::Tensor combine(const at::Tensor& expert_out, int64_t num_tokens, const at::Tensor& out, EPPhase phase);
  // Reads the overflow word (a device sync on CUDA); raises InvalidArgument describing it and clears it when set.
  void check();
  const EPTensors& tensors() const { return t_; }
  const EPConfig& config() const { return config_; }
  at::Device device() const { return device_; }
  // Which kernels run the calls: "host" (CPU), "flags" or "ll" (CUDA, Note [EP LL protocol]).
  std::string kernels() const;

 private:
  EPState host_state();

  std::shared_ptr<Communicator> comm_;
  EPConfig config_;
  at::Device device_;
  EPTensors t_;
  at::Tensor pending_x_;  // kSend's inputs kept alive until kRecv (CUDA)
  at::Tensor pending_out_;
  std::unique_ptr<EPCudaState, void (*)(EPCudaState*)> cuda_;
};

#if defined(COMMLIB_TORCH_CUDA)
// csrc/torch/ep_cuda_ops.cpp; all on the current stream of the buffer's device.
EPCudaState* ep_cuda_create(Communicator& comm, const EPConfig& config, at::Device device, EPTensors& tensors,
                            bool nvshmem);
void ep_cuda_destroy(EPCudaState* state);
void ep_cuda_dispatch(EPCudaState& state, const at::Tensor& x, const at::Tensor& topk_idx,
                      const at::Tensor& topk_weights, EPPhase phase);
void ep_cuda_combine(EPCudaState& state, const at::Tensor& expert_out, at::Tensor& out, EPPhase phase);
const char* ep_cuda_kernels(const EPCudaState& state);
#endif

}  // namespace commlib::torch_layer
