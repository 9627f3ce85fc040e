// What the DdaBackend route files (backend*.cpp) share: argument helpers and the fast-path runner.
// Not a public header; only csrc/torch/backend*.cpp include it.
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "commlib/errors.hpp"
#include "torch/backend.hpp"
#include "torch/torch_common.hpp"

#if defined(COMMLIB_TORCH_CUDA)
#include <c10/core/Event.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>

#include <deque>
#include <unordered_map>
#include <utility>
#endif

namespace commlib::torch_layer {
namespace backend_detail {

std::optional<ReduceOp> to_reduce_op(const c10d::ReduceOp& op);
bool is_reducible_type(at::ScalarType t);
// The dtypes of commlib's CPU reductions (every one gloo reduces, and int16).
std::optional<DataType> host_type(at::ScalarType t);
// The op/dtype pairs gloo refuses, refused the same way (RuntimeError), before any peer is involved.
void check_reduction(const char* what, at::ScalarType type, ReduceOp op);
// An all-reduce / reduce-scatter of CPU tensors on commlib's shared memory (any host_type dtype).
void host_all_reduce(Communicator& comm, at::Tensor& t, DataType dtype, ReduceOp op);
void host_reduce_scatter(Communicator& comm, at::Tensor& out, const at::Tensor& in, DataType dtype, ReduceOp op);
// dtypes commlib moves (as bytes): the DataType set of torch_common.cpp's to_data_type.
bool is_movable_type(at::ScalarType t);
bool all_of(const std::vector<at::Tensor>& ts, bool (*pred)(at::ScalarType));
at::Device device_of(const std::vector<at::Tensor>& ts, const char* what);
size_t nbytes_of(const at::Tensor& t);
bool cuda_reducible(const c10d::ReduceOp& reduce_op, at::ScalarType type);
// The list forms of reduce_scatter / all_gather / gather run the tensor form on one flat buffer:
// the inputs concatenated, or the output rows copied out.
at::Tensor cat_flat(const std::vector<at::Tensor>& list);
void copy_rows(const at::Tensor& rows, std::vector<at::Tensor>& outs);

// Runs a fast-path call, translating commlib's errors (translate_errors). A wait of the lazy
// transport set-up reports only its phase ("Timed out after ... at set-up phase 'shm/created'"):
// the operation that triggered it is named in front.
template <typename F>
void run_fast(const char* what, F&& body) {
  translate_errors([&] {
    try {
      body();
    } catch (const Timeout& e) {
      if (std::strncmp(e.what(), "Timed out", 9) != 0) throw;
      throw Timeout(detail::concat(what, ": ", e.what()));
    }
  });
}

}  // namespace backend_detail

template <typename F>
void DdaBackend::run_recorded(fr::Group::Call& call, const char* what, F&& body) {
  try {
    backend_detail::run_fast(what, std::forward<F>(body));
  } catch (const c10::DistBackendError& e) {
    failed(call, last_error_class, e.what_without_backtrace());
    throw;
  }
}

#if defined(COMMLIB_TORCH_CUDA)
struct DdaBackend::CudaState {
  // One internal stream per device for async_op=True calls.
  std::unordered_map<int, c10::cuda::CUDAStream> streams;
  c10::cuda::CUDAStream stream_for(int device) {
    auto it = streams.find(device);
    if (it == streams.end()) {
      it = streams.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)).first;
    }
    return it->second;
  }
};

// Whether the flight recorder takes a GPU call now: it is on and the stream is not being captured
// (a captured call runs at each replay, which the recorder cannot see).
inline bool fr_records_cuda() {
  return fr::enabled() && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
}
#endif

}  // namespace commlib::torch_layer
