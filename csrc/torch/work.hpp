// The c10d Work objects DdaBackend returns (csrc/torch/backend.hpp).
//   CompletedWork  a CPU call, finished before it was returned (gloo's and NCCL's CPU semantics).
//   JoinedWork     the works of one coalescing region, finished together.
//   CudaWork       a CUDA call enqueued on a stream; wait() orders the caller's current stream
//                  after it without blocking the host, as NCCL's Work does.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <vector>

#if defined(COMMLIB_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace commlib::torch_layer {

// A Work that finished before it was returned (CPU calls run synchronously).
class CompletedWork final : public c10d::Work {
 public:
  CompletedWork(int rank, c10d::OpType op, std::vector<at::Tensor> outputs)
      : Work(rank, op), outputs_(std::move(outputs)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {  // built on first use
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      future_->markCompleted(c10::IValue(outputs_));
    }
    return future_;
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The works an inner backend returned inside one coalescing region (batch_isend_irecv on CPU
// tensors: gloo's sends and receives), finished together.
class JoinedWork final : public c10d::Work {
 public:
  JoinedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : Work(rank, c10d::OpType::COALESCED), works_(std::move(works)) {}
  bool isCompleted() override {
    for (auto& w : works_) {
      if (!w->isCompleted()) return false;
    }
    return true;
  }
  bool isSuccess() const override {
    for (const auto& w : works_) {
      if (!w->isSuccess()) return false;
    }
    return true;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : works_) w->wait(timeout);
    return true;
  }
  void synchronize() override {
    for (auto& w : works_) w->synchronize();
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

#if defined(COMMLIB_TORCH_CUDA)
// A timing-free CUDA event from a per-device pool of reused ones (creating one per call costs more
// than the all-reduce kernel's launch; ATen's CUDAEvent pulls in the cuBLAS/cuSPARSE headers).
class StreamEvent {
 public:
  explicit StreamEvent(int device);
  ~StreamEvent();
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;
  void record(const c10::cuda::CUDAStream& stream);
  // Makes `stream` wait for the work recorded so far (no host wait).
  void block(const c10::cuda::CUDAStream& stream) const;
  bool query() const;

 private:
  int device_;
  cudaEvent_t event_;
};

// A CUDA call enqueued on a stream; `end_` is recorded after its last kernel. wait() makes the
// caller's current stream wait for it (it does not block the host), as NCCL's Work does.
class CudaWork final : public c10d::Work {
 public:
  CudaWork(int rank, c10d::OpType op, std::vector<at::Tensor> outputs, c10::cuda::CUDAStream stream)
      : Work(rank, op), outputs_(std::move(outputs)), device_(stream.device()), stream_(stream), end_(device_.index()) {
    end_.record(stream);
  }
  bool isCompleted() override { return end_.query(); }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    // On the stream the work ran on (every synchronous call), the stream is already in order.
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_.index());
    if (current != stream_) end_.block(current);
    return true;
  }
  void synchronize() override { wait(kNoTimeout); }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Built on first use: most callers never ask, and building it costs as much as the launch.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    if (!future_) {
      // Marked complete on the work's stream: users of the value wait for that stream to reach this
      // point, which is after the collective (later work on it only makes them wait longer).
      c10::cuda::CUDAStreamGuard guard(stream_);
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                         std::vector<c10::Device>{device_});
      future_->markCompleted(c10::IValue(outputs_));
    }
    return future_;
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  StreamEvent end_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};
#endif

}  // namespace commlib::torch_layer
