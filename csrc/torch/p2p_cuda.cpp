// send / recv of CUDA tensors over peer memory for the ddacomm backend and the direct API
// (Note [cuda p2p], csrc/cuda/cuda_p2p.hpp).
//
// Note [cuda p2p routing]
// Both ends of a message must take the same path, so the choice uses only what every rank of the
// group agrees on: the tensor is a dense CUDA tensor, and the communicator has GPU state with peer
// memory. GPU state is created collectively (the first CUDA collective, symmetric_empty, ...), so
// every rank has it or none has; a two-rank group creates it at its first send/recv, where the
// pair is the whole group. A larger group without it keeps NCCL (the backend) or host staging (the
// direct API) until a collective has set it up.
//
// Stream semantics are NCCL's: the sends go on the communicator's send stream and the receives on
// its receive stream, each first waiting for the caller's current stream; received data is written
// on the receive stream; the Work's wait() makes the current stream wait for both (no host
// wait), so the calls can be captured in a CUDA graph. Non-contiguous tensors are staged through a
// contiguous copy made on the current stream. Tensors are kept alive by the Work and recorded on
// the streams that use them.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include "cuda/cuda_comm.hpp"
#include "cuda/cuda_p2p.hpp"
#include "torch/bindings.hpp"
#include "torch/p2p.hpp"
#include "torch/torch_common.hpp"
#include "torch/work.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

// The Work of CUDA sends and receives: completed when the streams they ran on pass their end events.
class CudaP2pWork final : public c10d::Work {
 public:
  CudaP2pWork(int rank, c10d::OpType op, std::shared_ptr<Communicator> comm, int device, std::vector<at::Tensor> outputs,
              int source)
      : Work(rank, op), comm_(std::move(comm)), device_(device), outputs_(std::move(outputs)), source_(source) {}

  void add_end(const c10::cuda::CUDAStream& stream) {
    ends_.push_back(std::make_unique<StreamEvent>(device_));
    ends_.back()->record(stream);
  }

  bool isCompleted() override {
    for (const auto& e : ends_) {
      if (!e->query()) return false;
    }
    check("wait");
    return true;
  }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout: every device wait is bounded by the communicator's*/) override {
    check("wait");
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
    for (const auto& e : ends_) e->block(current);
    return true;
  }
  void synchronize() override { wait(kNoTimeout); }
  int sourceRank() const override { return source_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    if (!future_) {
      wait(kNoTimeout);  // the current stream is ordered after the transfers: mark complete on it
      future_ = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()),
          std::vector<c10::Device>{c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_))});
      future_->markCompleted(c10::IValue(outputs_));
    }
    return future_;
  }

 private:
  // Raises the failure of an earlier device wait of these channels (a host read, no synchronisation).
  void check(const char* what) const {
    if (comm_->closed() || !comm_->has_cuda()) return;
    translate_errors([&] { comm_->cuda().p2p().check_error(what); });
  }

  std::shared_ptr<Communicator> comm_;
  int device_;
  std::vector<at::Tensor> outputs_;
  int source_;
  std::vector<std::unique_ptr<StreamEvent>> ends_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

uint32_t dtype_code(const at::Tensor& t) { return static_cast<uint32_t>(t.scalar_type()); }

}  // namespace

bool cuda_p2p_available(Communicator& comm, const at::Tensor& tensor) {
  if (comm.closed() || !tensor.defined() || !tensor.is_cuda() || tensor.layout() != at::kStrided) return false;
  if (!comm.has_cuda()) {
    if (comm.world_size() != 2) return false;
    translate_errors([&] { comm.cuda(tensor.device().index()); });  // the pair is the group: collective
  }
  return comm.cuda().p2p_ok();
}

c10::intrusive_ptr<c10d::Work> post_cuda_p2p(const std::shared_ptr<Communicator>& comm, c10d::OpType op,
                                             const std::vector<CudaP2pOp>& ops) {
  TORCH_CHECK_VALUE(!ops.empty(), "send/recv: no operation to post");
  const int device = ops[0].tensor.device().index();
  for (const auto& o : ops) {
    const char* what = o.kind == P2pRequest::Kind::kSend ? "send" : "recv";
    TORCH_CHECK_TYPE(o.tensor.is_cuda() && o.tensor.device().index() == device, what, ": tensor on ",
                     o.tensor.device().str(), "; every tensor of one call must be on cuda:", device);
    // Checked for every op before any is enqueued, so a bad one leaves nothing half-posted.
    TORCH_CHECK_VALUE(o.peer >= 0 && o.peer < comm->world_size() && o.peer != comm->rank(), what, ": ",
                      o.kind == P2pRequest::Kind::kSend ? "dst " : "src ", o.peer, " out of range; valid: 0..",
                      comm->world_size() - 1, " except this rank (", comm->rank(), ")");
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  CudaP2p* p2p = nullptr;
  translate_errors([&] {
    p2p = &comm->cuda(device).p2p();
    p2p->check_error(ops[0].kind == P2pRequest::Kind::kSend ? "send" : "recv");
  });
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  const c10::cuda::CUDAStream send_stream =
      c10::cuda::getStreamFromExternal(p2p->send_stream(), static_cast<c10::DeviceIndex>(device));
  const c10::cuda::CUDAStream recv_stream =
      c10::cuda::getStreamFromExternal(p2p->recv_stream(), static_cast<c10::DeviceIndex>(device));

  // Sources made contiguous and staging for non-contiguous destinations, on the current stream,
  // before the start event.
  std::vector<at::Tensor> buffers;
  bool any_send = false, any_recv = false;
  for (const auto& o : ops) {
    const bool sending = o.kind == P2pRequest::Kind::kSend;
    any_send |= sending;
    any_recv |= !sending;
    if (o.tensor.is_contiguous()) {
      buffers.push_back(o.tensor);
    } else {
      buffers.push_back(sending ? contiguous_bits(o.tensor) : at::empty(o.tensor.sizes(), o.tensor.options()));
    }
  }
  StreamEvent start(device);
  start.record(current);
  if (any_send) start.block(send_stream);
  if (any_recv) start.block(recv_stream);

  std::vector<at::Tensor> outputs;
  int source = -1;
  translate_errors([&] {
    for (size_t i = 0; i < ops.size(); ++i) {
      const CudaP2pOp& o = ops[i];
      at::Tensor& buffer = buffers[i];
      const size_t bytes = static_cast<size_t>(buffer.numel()) * buffer.element_size();
      if (o.kind == P2pRequest::Kind::kSend) {
        p2p->send(buffer.data_ptr(), bytes, dtype_code(buffer), o.peer, o.tag, send_stream.stream());
        buffer.record_stream(send_stream);
      } else {
        p2p->recv(buffer.data_ptr(), bytes, dtype_code(buffer), o.peer, o.tag, recv_stream.stream());
        buffer.record_stream(recv_stream);
        if (!buffer.is_same(o.tensor)) {
          c10::cuda::CUDAStreamGuard on_recv(recv_stream);
          copy_bits(o.tensor, buffer);
          o.tensor.record_stream(recv_stream);
        }
        source = o.peer;
      }
      outputs.push_back(o.tensor);
    }
  });
  auto work = c10::make_intrusive<CudaP2pWork>(comm->rank(), op, comm, device, std::move(outputs),
                                               ops.size() == 1 ? source : -1);
  if (any_send) work->add_end(send_stream);
  if (any_recv) work->add_end(recv_stream);
  return work;
}

namespace {

BindingRegistrar registrar("p2p_cuda", [](py::module_& m) {
  CudaP2p::set_dtype_namer([](uint32_t code) { return dtype_str(static_cast<at::ScalarType>(code)); });
  m.def(
      "cuda_p2p_counts",
      [](const py::handle& comm_obj) {
        std::shared_ptr<Communicator> comm = communicator_from_python(comm_obj);
        if (comm->closed() || !comm->has_cuda() || !comm->cuda().p2p_ok()) return py::make_tuple(int64_t{0}, int64_t{0});
        CudaP2p& p2p = comm->cuda().p2p();
        return py::make_tuple(p2p.num_sends(), p2p.num_recvs());
      },
      py::arg("comm"),
      "(sends, receives) this communicator has enqueued over GPU peer memory (Note [cuda p2p]).");
});

}  // namespace
}  // namespace commlib::torch_layer
