#include "torch/work.hpp"

#if defined(COMMLIB_TORCH_CUDA)
#include <c10/cuda/CUDAException.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace commlib::torch_layer {
namespace {

// Timing-free CUDA events, reused: creating one per call costs more than the all-reduce kernel's
// launch. Events belong to the device that was current at creation, so the pool is per device.
class EventPool {
 public:
  static cudaEvent_t acquire(int device) {
    EventPool& pool = instance();
    {
      std::lock_guard<std::mutex> lock(pool.mutex_);
      auto& free = pool.free_[device];
      if (!free.empty()) {
        cudaEvent_t event = free.back();
        free.pop_back();
        return event;
      }
    }
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    cudaEvent_t event = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }
  static void release(int device, cudaEvent_t event) {
    EventPool& pool = instance();
    std::lock_guard<std::mutex> lock(pool.mutex_);
    pool.free_[device].push_back(event);
  }

 private:
  // Never destroyed: events may be released during interpreter exit, after static destructors.
  static EventPool& instance() {
    static auto* pool = new EventPool();
    return *pool;
  }
  std::mutex mutex_;
  std::unordered_map<int, std::vector<cudaEvent_t>> free_;
};

}  // namespace

StreamEvent::StreamEvent(int device) : device_(device), event_(EventPool::acquire(device)) {}

StreamEvent::~StreamEvent() { EventPool::release(device_, event_); }

void StreamEvent::record(const c10::cuda::CUDAStream& stream) { C10_CUDA_CHECK(cudaEventRecord(event_, stream.stream())); }

void StreamEvent::block(const c10::cuda::CUDAStream& stream) const {
  C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), event_, 0));
}

bool StreamEvent::query() const {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

}  // namespace commlib::torch_layer
#endif
