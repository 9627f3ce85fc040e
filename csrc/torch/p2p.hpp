// Point-to-point on CPU tensors over commlib's shared memory (Note [host p2p], csrc/host/p2p.hpp),
// for the ddacomm backend (send / recv / recvAnysource / batch_isend_irecv) and the direct API
// (Communicator.isend / irecv / send / recv / batch_isend_irecv).
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <vector>

#include "commlib/communicator.hpp"
#include "host/p2p.hpp"

namespace commlib::torch_layer {

// The pending sends and receives of one call (or one coalescing region). wait() makes progress on
// every pending message of the communicator until these are done (bounded by its timeout) and
// copies received data into non-contiguous destinations; errors raise DistBackendError.
class P2pWork final : public c10d::Work {
 public:
  struct Item {
    HostP2p::Handle request;
    at::Tensor tensor;   // the caller's tensor (kept alive until done)
    at::Tensor staging;  // receives into a non-contiguous tensor land here first
  };
  P2pWork(int rank, c10d::OpType op, std::shared_ptr<Communicator> comm, std::vector<Item> items);

  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override {}
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void finish();

  std::shared_ptr<Communicator> comm_;
  std::vector<Item> items_;
  bool finished_ = false;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Posts one send / receive of a dense CPU tensor (any dtype, moved as bytes; receiver and sender
// must agree on dtype and element count). `src` may be HostP2p::kAnySource.
P2pWork::Item post_send(Communicator& comm, const at::Tensor& tensor, int dst, int64_t tag);
P2pWork::Item post_recv(Communicator& comm, const at::Tensor& tensor, int src, int64_t tag);

#if defined(COMMLIB_TORCH_CUDA)
// CUDA tensors over peer memory (Note [cuda p2p], csrc/cuda/cuda_p2p.hpp; csrc/torch/p2p_cuda.cpp).
struct CudaP2pOp {
  P2pRequest::Kind kind;
  at::Tensor tensor;
  int peer;
  int64_t tag;
};
// Whether send / recv of `tensor` take the peer-memory path: a dense CUDA tensor, and GPU state
// with peer memory, which exists once any CUDA operation of the communicator set it up (or is set
// up here when the group has two ranks, the pair itself). Every rank answers alike (Note [cuda p2p
// routing], p2p_cuda.cpp).
bool cuda_p2p_available(Communicator& comm, const at::Tensor& tensor);
// Enqueues `ops` (NCCL's stream semantics: after the work queued on the current stream) and
// returns one Work for all of them; its wait() makes the current stream wait.
c10::intrusive_ptr<c10d::Work> post_cuda_p2p(const std::shared_ptr<Communicator>& comm, c10d::OpType op,
                                             const std::vector<CudaP2pOp>& ops);
#endif

}  // namespace commlib::torch_layer
