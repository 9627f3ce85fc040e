// GPU side of commlib.cp's copy-engine ring (Note [cp copy-engine ring] in python/commlib/cp/symmetric.py):
// every rank's mapping of a symmetric tensor, and the ring's slot protocol (CopyEngineRing, Note
// [copy-engine slots] in csrc/cuda/cuda_copy_engine.hpp). Nothing here launches a kernel.
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include "cuda/cuda_comm.hpp"
#include "cuda/cuda_copy_engine.hpp"
#include "torch/bindings.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

// The symmetric buffer of this communicator that holds `t` (a contiguous CUDA tensor), and where.
std::shared_ptr<SymmetricBuffer> symmetric_buffer_of(Communicator& comm, const at::Tensor& t, const char* what,
                                                     size_t* offset) {
  COMMLIB_CHECK(t.is_cuda(), TypeMismatch, what, ": device ", t.device().str(), " not supported; supported: cuda");
  COMMLIB_CHECK(t.is_contiguous(), InvalidArgument, what, ": the tensor must be contiguous");
  COMMLIB_CHECK(comm.has_cuda(), InvalidArgument, what,
                ": this communicator has no GPU state; allocate the tensor with symmetric_empty first");
  CudaComm& cuda = comm.cuda(t.device().index());
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  std::shared_ptr<SymmetricBuffer> buffer = cuda.find_symmetric(t.data_ptr(), bytes, offset);
  COMMLIB_CHECK(buffer != nullptr, InvalidArgument, what,
                ": the tensor is not in this communicator's symmetric memory; allocate it with symmetric_empty");
  return buffer;
}

// Rank r's mapping of `t` (a tensor inside this communicator's symmetric memory), for every r.
std::vector<at::Tensor> symmetric_peer_views(Communicator& comm, const at::Tensor& t) {
  size_t offset = 0;
  std::shared_ptr<SymmetricBuffer> buffer = symmetric_buffer_of(comm, t, "cp_symmetric_peer_views", &offset);
  std::vector<at::Tensor> views;
  for (int r = 0; r < buffer->world_size(); ++r) {
    void* data = static_cast<char*>(buffer->peer(r)) + offset;
    // Each view keeps the mapping alive.
    views.push_back(at::from_blob(
        data, t.sizes(), [buffer](void*) mutable { buffer.reset(); }, t.options()));
  }
  return views;
}

cudaStream_t stream_of(uint64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

BindingRegistrar reg("cp_ring_cuda", [](py::module_& m) {
  m.def("cp_relax_stream_capture_mode", &ce::relax_stream_capture_mode,
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
  py::class_<CopyEngineRing>(m, "CopyEngineRing",
                             "The copy-engine ring's slots over a symmetric tensor whose first "
                             "CopyEngineRing.FLAGS_BYTES hold ready[64], free[64] (Note [copy-engine slots]).")
      .def(py::init([](const py::handle& comm, const at::Tensor& buffer) {
             size_t offset = 0;
             std::shared_ptr<Communicator> c = communicator_from_python(comm);
             return std::make_unique<CopyEngineRing>(
                 symmetric_buffer_of(*c, buffer, "CopyEngineRing", &offset), offset);
           }),
           py::arg("comm"), py::arg("buffer"))
      .def_readonly_static("FLAGS_BYTES", &CopyEngineRing::kFlagsBytes)
      .def_readonly_static("MAX_SLOTS", &CopyEngineRing::kMaxSlots)
      .def(
          "send",
          [](const CopyEngineRing& ring, int peer, int slot, size_t at, const at::Tensor& src, uint64_t stream) {
            COMMLIB_CHECK(src.is_cuda() && src.is_contiguous(), InvalidArgument,
                          "copy-engine ring send: the source must be a contiguous CUDA tensor");
            ring.send(peer, slot, at, src.data_ptr(), static_cast<size_t>(src.numel()) * src.element_size(),
                      stream_of(stream));
          },
          py::arg("peer"), py::arg("slot"), py::arg("at"), py::arg("src"), py::arg("stream"),
          "On `stream`: wait for `peer` to release slot `slot`, copy `src` to byte `at` of its ring (counted "
          "from the flags' start, as this rank's buffer tensor), signal it.")
      .def(
          "receive", [](const CopyEngineRing& ring, int slot, uint64_t stream) { ring.receive(slot, stream_of(stream)); },
          py::arg("slot"), py::arg("stream"), "On `stream`: wait until this rank's slot holds a message; take it.")
      .def(
          "release",
          [](const CopyEngineRing& ring, int sender, int slot, uint64_t stream) {
            ring.release(sender, slot, stream_of(stream));
          },
          py::arg("sender"), py::arg("slot"), py::arg("stream"), "On `stream`: `sender` may refill this rank's slot.");
});

}  // namespace
}  // namespace commlib::torch_layer
