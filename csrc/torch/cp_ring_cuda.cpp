// GPU side of commlib.cp's copy-engine ring (Note [cp copy-engine ring] in python/commlib/cp/symmetric.py):
// every rank's mapping of a symmetric tensor, and 32-bit stream memory operations on its flags.
// Nothing here launches a kernel: the ring's transfers are cudaMemcpyAsync between peer-mapped
// addresses and its signals are cuStreamWriteValue32 / cuStreamWaitValue32.
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <torch/csrc/utils/pybind.h>

#include "cuda/cuda_comm.hpp"
#include "transport/cuda_driver.hpp"
#include "torch/bindings.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

// Rank r's mapping of `t` (a tensor inside this communicator's symmetric memory), for every r.
std::vector<at::Tensor> symmetric_peer_views(Communicator& comm, const at::Tensor& t) {
  const char* what = "cp_symmetric_peer_views";
  COMMLIB_CHECK(t.is_cuda(), TypeMismatch, what, ": device ", t.device().str(), " not supported; supported: cuda");
  COMMLIB_CHECK(t.is_contiguous(), InvalidArgument, what, ": the tensor must be contiguous");
  COMMLIB_CHECK(comm.has_cuda(), InvalidArgument, what,
                ": this communicator has no GPU state; allocate the tensor with symmetric_empty first");
  CudaComm& cuda = comm.cuda(t.device().index());
  size_t offset = 0;
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  std::shared_ptr<SymmetricBuffer> buffer = cuda.find_symmetric(t.data_ptr(), bytes, &offset);
  COMMLIB_CHECK(buffer != nullptr, InvalidArgument, what,
                ": the tensor is not in this communicator's symmetric memory; allocate it with symmetric_empty");
  std::vector<at::Tensor> views;
  for (int r = 0; r < buffer->world_size(); ++r) {
    void* data = static_cast<char*>(buffer->peer(r)) + offset;
    // Each view keeps the mapping alive.
    views.push_back(at::from_blob(
        data, t.sizes(), [buffer](void*) mutable { buffer.reset(); }, t.options()));
  }
  return views;
}

void stream_write_value32(uint64_t address, uint32_t value, uint64_t stream) {
  cuda::stream_write_value32(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(address), value, 0,
                             "cp ring");
}

void stream_wait_value32(uint64_t address, uint32_t value, uint64_t stream) {
  cuda::stream_wait_value32(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(address), value,
                            CU_STREAM_WAIT_VALUE_EQ, "cp ring");
}

// The calling thread's stream-capture interaction mode becomes relaxed: its event queries never
// invalidate a graph another thread is capturing in global mode (the ring watchdog's thread).
void relax_stream_capture_mode() {
  using Exchange = CUresult (*)(CUstreamCaptureMode*);
  static const auto exchange = reinterpret_cast<Exchange>(cuda::entry_point("cuThreadExchangeStreamCaptureMode", 10010));
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  cuda::check(exchange(&mode), "cp ring watchdog", "cuThreadExchangeStreamCaptureMode");
}

BindingRegistrar reg("cp_ring_cuda", [](py::module_& m) {
  m.def("cp_relax_stream_capture_mode", &relax_stream_capture_mode,
        "Relaxed stream-capture mode for the calling thread (Note [cp ring watchdog]).");
  m.def(
      "cp_symmetric_peer_views",
      [](const py::handle& comm, const at::Tensor& t) {
        std::shared_ptr<Communicator> c = communicator_from_python(comm);
        return symmetric_peer_views(*c, t);
      },
      py::arg("comm"), py::arg("tensor"),
      "Every rank's mapping of a symmetric tensor (list indexed by rank), each a tensor on this GPU.");
  m.def(
      "cp_comm_timeout_s",
      [](const py::handle& comm) { return communicator_from_python(comm)->timeout().count() / 1000.0; },
      py::arg("comm"), "The communicator's bound on a wait for a peer, in s (COMMLIB_TIMEOUT_MS applied).");
  m.def("cp_stream_write_value32", &stream_write_value32, py::arg("address"), py::arg("value"), py::arg("stream"),
        "cuStreamWriteValue32 (with its default memory barrier: earlier work on the stream is visible first).");
  m.def("cp_stream_wait_value32", &stream_wait_value32, py::arg("address"), py::arg("value"), py::arg("stream"),
        "cuStreamWaitValue32 until the word equals value (unbounded on the device: Note [cp ring watchdog]).");
});

}  // namespace
}  // namespace commlib::torch_layer
