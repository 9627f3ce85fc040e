#include "torch/p2p.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>

#include "commlib/errors.hpp"
#include "torch/bindings.hpp"
#include "torch/torch_common.hpp"
#include "torch/work.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
// Note [host p2p of cuda tensors]
// Where the peer-memory path is not set up (Note [cuda p2p routing]), the direct API moves CUDA
// tensors through host memory: a send copies the tensor to the host when posted (after the work
// already queued on the current stream, which it waits for), a receive lands in host memory and is
// copied to the tensor, on the current stream, when wait() (or a completed is_completed()) finishes it. Correct, not fast: the
// ddacomm backend sends such CUDA tensors through NCCL instead.
namespace {

void check_p2p_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), what, ": tensor is undefined");
  TORCH_CHECK_TYPE((t.device().is_cpu() || t.device().is_cuda()) && t.layout() == at::kStrided, what, ": a ",
                   t.device().str(), " ", t.layout(), " tensor is not supported here; supported: dense cpu and cuda "
                   "tensors");
}

}  // namespace

P2pWork::Item post_send(Communicator& comm, const at::Tensor& tensor, int dst, int64_t tag) {
  check_p2p_tensor(tensor, "send");
  // CUDA tensors travel through host memory (Note [host p2p of cuda tensors]).
  at::Tensor data = tensor.is_cuda() ? contiguous_bits(tensor).to(at::kCPU) : contiguous_bits(tensor);
  HostP2p::Handle request;
  translate_errors([&] {
    request = comm.host_p2p().isend(data.data_ptr(), static_cast<size_t>(data.numel()) * data.element_size(),
                                    c10::toString(data.scalar_type()), dst, tag);
  });
  return {std::move(request), std::move(data), {}};
}

P2pWork::Item post_recv(Communicator& comm, const at::Tensor& tensor, int src, int64_t tag) {
  check_p2p_tensor(tensor, "recv");
  at::Tensor staging;
  if (tensor.is_cuda()) {
    staging = at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
  } else if (!tensor.is_contiguous()) {
    staging = at::empty_like(tensor, at::MemoryFormat::Contiguous);
  }
  at::Tensor& into = staging.defined() ? staging : const_cast<at::Tensor&>(tensor);
  HostP2p::Handle request;
  translate_errors([&] {
    request = comm.host_p2p().irecv(into.data_ptr(), static_cast<size_t>(into.numel()) * into.element_size(),
                                    c10::toString(into.scalar_type()), src, tag);
  });
  return {std::move(request), tensor, std::move(staging)};
}

P2pWork::P2pWork(int rank, c10d::OpType op, std::shared_ptr<Communicator> comm, std::vector<Item> items)
    : Work(rank, op), comm_(std::move(comm)), items_(std::move(items)) {}

void P2pWork::finish() {
  if (finished_) return;
  finished_ = true;
  for (Item& item : items_) {
    if (item.staging.defined()) copy_bits(item.tensor, item.staging);
  }
}

bool P2pWork::isCompleted() {
  if (finished_) return true;
  bool done = true;
  translate_errors([&] {
    for (Item& item : items_) done = comm_->host_p2p().test(item.request) && done;
  });
  if (done) finish();
  return done;
}

bool P2pWork::isSuccess() const {
  for (const Item& item : items_) {
    if (!item.request->done || !item.request->error.empty()) return false;
  }
  return true;
}

bool P2pWork::wait(std::chrono::milliseconds /*timeout: the communicator's bounds every wait*/) {
  if (finished_) return true;
  translate_errors([&] {
    for (Item& item : items_) {
      comm_->host_p2p().wait(item.request, item.request->kind == P2pRequest::Kind::kSend ? "send" : "recv");
    }
  });
  finish();
  return true;
}

int P2pWork::sourceRank() const {
  TORCH_CHECK(items_.size() == 1 && items_[0].request->kind == P2pRequest::Kind::kRecv,
              "sourceRank: only the work of one receive has a source rank");
  TORCH_CHECK(items_[0].request->source >= 0, "sourceRank: the receive has not matched a message yet; wait() first");
  return items_[0].request->source;
}

std::vector<at::Tensor> P2pWork::result() {
  std::vector<at::Tensor> out;
  for (Item& item : items_) out.push_back(item.tensor);
  return out;
}

c10::intrusive_ptr<c10::ivalue::Future> P2pWork::getFuture() {
  if (!future_) {
    wait(kNoTimeout);
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future_->markCompleted(c10::IValue(result()));
  }
  return future_;
}

namespace {

#if defined(COMMLIB_TORCH_CUDA)
// The direct API's CUDA tensors take peer memory where cuda_p2p_available says every rank does
// (Note [cuda p2p routing]); else host memory (Note [host p2p of cuda tensors]).
bool direct_cuda(Communicator& comm, const at::Tensor& tensor, int peer, const char* what) {
  bool available = false;
  translate_errors([&] { available = cuda_p2p_available(comm, tensor); });
  TORCH_CHECK_VALUE(!available || std::strcmp(what, "recv") != 0 || peer != HostP2p::kAnySource, what,
                    ": a receive from any source is not supported for CUDA tensors; pass src");
  return available;
}
#endif

c10::intrusive_ptr<c10d::Work> p2p_batch(const py::object& comm_obj, const py::list& ops) {
  std::shared_ptr<Communicator> comm = communicator_from_python(comm_obj);
  std::vector<std::tuple<std::string, at::Tensor, int, int64_t>> parsed;
  for (const auto& entry : ops) {
    auto op = entry.cast<py::tuple>();
    TORCH_CHECK_VALUE(op.size() == 4, "batch_isend_irecv: each op must be (kind, tensor, peer, tag)");
    const std::string kind = op[0].cast<std::string>();
    TORCH_CHECK_VALUE(kind == "send" || kind == "recv", "batch_isend_irecv: op kind '", kind,
                      "' not supported; supported: send, recv");
    parsed.emplace_back(kind, op[1].cast<at::Tensor>(), op[2].cast<int>(), op[3].cast<int64_t>());
  }
  const int rank = comm->rank();
  // Each op takes its own path (a CUDA op's peer decides the same for the matching op).
  std::vector<P2pWork::Item> items;
#if defined(COMMLIB_TORCH_CUDA)
  std::vector<CudaP2pOp> cuda_ops;
  for (const auto& [kind, tensor, peer, tag] : parsed) {
    const bool sending = kind == "send";
    if (direct_cuda(*comm, tensor, peer, sending ? "send" : "recv")) {
      cuda_ops.push_back({sending ? P2pRequest::Kind::kSend : P2pRequest::Kind::kRecv, tensor, peer, tag});
    }
  }
  if (!cuda_ops.empty() && cuda_ops.size() == parsed.size()) return post_cuda_p2p(comm, c10d::OpType::COALESCED, cuda_ops);
#endif
  for (const auto& [kind, tensor, peer, tag] : parsed) {
#if defined(COMMLIB_TORCH_CUDA)
    if (!cuda_ops.empty() && cuda_p2p_available(*comm, tensor)) continue;
#endif
    items.push_back(kind == "send" ? post_send(*comm, tensor, peer, tag) : post_recv(*comm, tensor, peer, tag));
  }
  c10::intrusive_ptr<c10d::Work> host = c10::make_intrusive<P2pWork>(rank, c10d::OpType::COALESCED, comm, std::move(items));
#if defined(COMMLIB_TORCH_CUDA)
  if (!cuda_ops.empty()) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works{post_cuda_p2p(comm, c10d::OpType::COALESCED, cuda_ops), host};
    return c10::make_intrusive<JoinedWork>(rank, std::move(works));
  }
#endif
  return host;
}

void bind_p2p(py::module_& m) {
  py::module_::import("torch._C._distributed_c10d");  // torch's Work binding, which the results use
  m.def(
      "p2p_isend",
      [](const py::object& comm_obj, const at::Tensor& tensor, int dst, int64_t tag) {
        std::shared_ptr<Communicator> comm = communicator_from_python(comm_obj);
#if defined(COMMLIB_TORCH_CUDA)
        if (direct_cuda(*comm, tensor, dst, "send")) {
          return post_cuda_p2p(comm, c10d::OpType::SEND, {{P2pRequest::Kind::kSend, tensor, dst, tag}});
        }
#endif
        std::vector<P2pWork::Item> items{post_send(*comm, tensor, dst, tag)};
        const int rank = comm->rank();
        return c10::intrusive_ptr<c10d::Work>(
            c10::make_intrusive<P2pWork>(rank, c10d::OpType::SEND, std::move(comm), std::move(items)));
      },
      py::arg("comm"), py::arg("tensor"), py::arg("dst"), py::arg("tag"),
      "Posts a send (CPU tensors: shared memory; CUDA: peer memory); returns a torch.distributed Work.");
  m.def(
      "p2p_irecv",
      [](const py::object& comm_obj, const at::Tensor& tensor, int src, int64_t tag) {
        std::shared_ptr<Communicator> comm = communicator_from_python(comm_obj);
#if defined(COMMLIB_TORCH_CUDA)
        if (direct_cuda(*comm, tensor, src, "recv")) {
          return post_cuda_p2p(comm, c10d::OpType::RECV, {{P2pRequest::Kind::kRecv, tensor, src, tag}});
        }
#endif
        std::vector<P2pWork::Item> items{post_recv(*comm, tensor, src, tag)};
        const int rank = comm->rank();
        return c10::intrusive_ptr<c10d::Work>(
            c10::make_intrusive<P2pWork>(rank, c10d::OpType::RECV, std::move(comm), std::move(items)));
      },
      py::arg("comm"), py::arg("tensor"), py::arg("src"), py::arg("tag"),
      "Posts a receive (src -1: any source; not for CUDA tensors on peer memory); returns a torch.distributed Work.");
  m.def("p2p_batch", &p2p_batch, py::arg("comm"), py::arg("ops"),
        "Posts (kind, tensor, peer, tag) sends and receives together; returns one Work for all.");
}

BindingRegistrar registrar("p2p", bind_p2p);

}  // namespace
}  // namespace commlib::torch_layer
