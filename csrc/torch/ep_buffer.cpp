// EPBuffer's torch layer and its bindings (Note [EP layout] in include/commlib/ep.hpp).
#include "torch/ep_buffer.hpp"

#include <torch/csrc/utils/pybind.h>

#include "commlib/errors.hpp"
#include "torch/bindings.hpp"
#include "torch/torch_common.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

void no_cuda_state(EPCudaState*) {}

DataType parse_ep_dtype(const std::string& name) {
  if (name == "float32") return DataType::kFloat32;
  if (name == "float16") return DataType::kFloat16;
  if (name == "bfloat16") return DataType::kBFloat16;
  throw TypeMismatch(detail::concat("EPBuffer: dtype ", name, " not supported; supported: float32, float16, bfloat16"));
}

at::ScalarType scalar_type_of(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return at::kFloat;
    case DataType::kFloat16: return at::kHalf;
    default: return at::kBFloat16;
  }
}


EPPhase parse_phase(const std::string& what, const std::string& name) {
  if (name == "both") return EPPhase::kBoth;
  if (name == "send") return EPPhase::kSend;
  if (name == "recv") return EPPhase::kRecv;
  throw InvalidArgument(detail::concat(what, ": phase '", name, "' not supported; supported: both, send, recv"));
}

}  // namespace

EPBufferTorch::EPBufferTorch(std::shared_ptr<Communicator> comm, EPConfig config, at::Device device,
                             const std::string& transport)
    : comm_(std::move(comm)), device_(device), cuda_(nullptr, no_cuda_state) {
  const int n = comm_->world_size();
  config_ = validate_ep_config(config, n);
  COMMLIB_CHECK(device_.is_cpu() || device_.is_cuda(), TypeMismatch, "EPBuffer: device ", device_.str(),
                " not supported; supported: cpu, cuda");
  COMMLIB_CHECK(transport == "peer" || (transport == "nvshmem" && device_.is_cuda()), InvalidArgument,
                "EPBuffer: transport '", transport, "' not supported on ", device_.str(), "; supported: peer",
                device_.is_cuda() ? ", nvshmem" : "");
  if (device_.is_cuda()) {
#if defined(COMMLIB_TORCH_CUDA)
    cuda_ = std::unique_ptr<EPCudaState, void (*)(EPCudaState*)>(
        ep_cuda_create(*comm_, config_, device_, t_, transport == "nvshmem"), ep_cuda_destroy);
    return;
#else
    throw TypeMismatch("EPBuffer: CUDA tensors are not supported by this build (torch or commlib without CUDA); "
                       "supported: cpu");
#endif
  }
  const int64_t num_local = config_.num_local_experts(n);
  auto opts = at::TensorOptions().device(device_);
  const std::vector<int64_t> meta_shape{n, config_.max_tokens_per_rank, config_.topk};
  t_.expert_x = at::empty({num_local, config_.capacity, config_.hidden}, opts.dtype(scalar_type_of(config_.dtype)));
  t_.expert_counts = at::zeros({num_local}, opts.dtype(at::kInt));
  t_.recv_pos = at::full(meta_shape, -1, opts.dtype(at::kInt));
  t_.meta_idx = at::full(meta_shape, -1, opts.dtype(at::kInt));
  t_.meta_w = at::zeros(meta_shape, opts.dtype(at::kFloat));
  t_.meta_num_tokens = at::zeros({n}, opts.dtype(at::kInt));
  t_.overflow = at::zeros({kEPOverflowWords}, opts.dtype(at::kLong));
}

EPBufferTorch::~EPBufferTorch() = default;

std::pair<at::Tensor, at::Tensor> EPBufferTorch::dispatch(const at::Tensor& x_in, const at::Tensor& idx_in,
                                                          const at::Tensor& w_in, EPPhase phase) {
  const char* what = "EPBuffer.dispatch";
  if (phase != EPPhase::kRecv) {
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"x", &x_in}, {"topk_idx", &idx_in},
                                  {"topk_weights", &w_in}}) {
      COMMLIB_CHECK(t->defined() && t->device() == device_, TypeMismatch, what, ": ", name, " is on ",
                    t->defined() ? t->device().str() : "nothing", " but the buffer is on ", device_.str());
    }
    COMMLIB_CHECK(x_in.scalar_type() == scalar_type_of(config_.dtype), TypeMismatch, what, ": x has dtype ",
                  dtype_str(x_in.scalar_type()), " but the buffer was created for ", dtype_name(config_.dtype));
    COMMLIB_CHECK(x_in.dim() == 2 && x_in.size(1) == config_.hidden, InvalidArgument, what,
                  ": x must have shape [num_tokens, ", config_.hidden, "]; got ", x_in.sizes());
    const int64_t num_tokens = x_in.size(0);
    COMMLIB_CHECK(num_tokens <= config_.max_tokens_per_rank, InvalidArgument, what, ": num_tokens ", num_tokens,
                  " exceeds max_tokens_per_rank ", config_.max_tokens_per_rank);
    COMMLIB_CHECK(idx_in.scalar_type() == at::kLong, TypeMismatch, what, ": topk_idx has dtype ",
                  dtype_str(idx_in.scalar_type()), "; supported: int64");
    COMMLIB_CHECK(idx_in.dim() == 2 && idx_in.size(0) == num_tokens && idx_in.size(1) == config_.topk,
                  InvalidArgument, what, ": topk_idx must have shape [", num_tokens, ", ", config_.topk, "]; got ",
                  idx_in.sizes());
    COMMLIB_CHECK(w_in.scalar_type() == at::kFloat, TypeMismatch, what, ": topk_weights has dtype ",
                  dtype_str(w_in.scalar_type()), "; supported: float32");
    COMMLIB_CHECK(w_in.sizes() == idx_in.sizes(), InvalidArgument, what, ": topk_weights must have shape [",
                  num_tokens, ", ", config_.topk, "]; got ", w_in.sizes());
    const at::Tensor x = x_in.contiguous(), idx = idx_in.contiguous(), w = w_in.contiguous();
    if (device_.is_cuda()) {
#if defined(COMMLIB_TORCH_CUDA)
      ep_cuda_dispatch(*cuda_, x, idx, w, phase);
      pending_x_ = x;  // read by the send kernel, which the caller's stream orders anyway
#endif
    } else {
      EPState st = host_state();
      ep_dispatch_host(*comm_, config_, st, x.data_ptr(), num_tokens, idx.data_ptr<int64_t>(), w.data_ptr<float>());
    }
  } else if (device_.is_cuda()) {
#if defined(COMMLIB_TORCH_CUDA)
    ep_cuda_dispatch(*cuda_, at::Tensor(), at::Tensor(), at::Tensor(), phase);
#endif
  }
  return {t_.expert_x, t_.expert_counts};
}

at::Tensor EPBufferTorch::combine(const at::Tensor& expert_out_in, int64_t num_tokens, const at::Tensor& out_in,
                                  EPPhase phase) {
  const char* what = "EPBuffer.combine";
  if (phase == EPPhase::kRecv) {
    COMMLIB_CHECK(pending_out_.defined(), InvalidArgument, what, ": phase 'recv' without a preceding 'send'");
    at::Tensor out = pending_out_;
#if defined(COMMLIB_TORCH_CUDA)
    if (device_.is_cuda()) ep_cuda_combine(*cuda_, at::Tensor(), out, phase);
#endif
    pending_out_ = at::Tensor();
    return out;
  }
  const int64_t num_local = config_.num_local_experts(comm_->world_size());
  COMMLIB_CHECK(expert_out_in.device() == device_, TypeMismatch, what, ": expert_out is on ",
                expert_out_in.device().str(), " but the buffer is on ", device_.str());
  COMMLIB_CHECK(expert_out_in.scalar_type() == scalar_type_of(config_.dtype), TypeMismatch, what,
                ": expert_out has dtype ", dtype_str(expert_out_in.scalar_type()), " but the buffer was created for ",
                dtype_name(config_.dtype));
  COMMLIB_CHECK(expert_out_in.dim() == 3 && expert_out_in.size(0) == num_local &&
                    expert_out_in.size(1) == config_.capacity && expert_out_in.size(2) == config_.hidden,
                InvalidArgument, what, ": expert_out must have shape [", num_local, ", ", config_.capacity, ", ",
                config_.hidden, "] (like dispatch's expert_x); got ", expert_out_in.sizes());
  at::Tensor out = out_in.defined() ? out_in
                                    : at::empty({num_tokens, config_.hidden},
                                                expert_out_in.options().dtype(scalar_type_of(config_.dtype)));
  COMMLIB_CHECK(out.device() == device_ && out.scalar_type() == scalar_type_of(config_.dtype) && out.dim() == 2 &&
                    out.size(0) == num_tokens && out.size(1) == config_.hidden && out.is_contiguous(),
                InvalidArgument, what, ": out must be a contiguous [", num_tokens, ", ", config_.hidden, "] ",
                dtype_name(config_.dtype), " tensor on ", device_.str(), "; got ", out.sizes(), " ",
                dtype_str(out.scalar_type()), " on ", out.device().str());
  const at::Tensor expert_out = expert_out_in.contiguous();
  if (device_.is_cuda()) {
#if defined(COMMLIB_TORCH_CUDA)
    ep_cuda_combine(*cuda_, expert_out, out, phase);
#endif
  } else {
    EPState st = host_state();
    ep_combine_host(*comm_, config_, st, expert_out.data_ptr(), out.data_ptr());
  }
  if (phase == EPPhase::kSend) pending_out_ = out;
  return out;
}

EPState EPBufferTorch::host_state() {
  EPState st;
  st.expert_x = t_.expert_x.data_ptr();
  st.expert_counts = t_.expert_counts.data_ptr<int32_t>();
  st.recv_pos = t_.recv_pos.data_ptr<int32_t>();
  st.meta_idx = t_.meta_idx.data_ptr<int32_t>();
  st.meta_w = t_.meta_w.data_ptr<float>();
  st.meta_num_tokens = t_.meta_num_tokens.data_ptr<int32_t>();
  st.overflow = t_.overflow.data_ptr<int64_t>();
  return st;
}

std::string EPBufferTorch::kernels() const {
#if defined(COMMLIB_TORCH_CUDA)
  if (cuda_) return ep_cuda_kernels(*cuda_);
#endif
  return "host";
}

void EPBufferTorch::check() {
  const at::Tensor word = t_.overflow.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
  const int64_t* w = word.data_ptr<int64_t>();
  if (w[0] == 0 && w[2] == 0) return;
  t_.overflow.zero_();
  COMMLIB_CHECK(w[2] == 0, InvalidArgument, "EPBuffer.dispatch: ", w[2],
                " topk_idx entries were out of range (valid: -1 or 0..", config_.num_experts - 1,
                "); those routes were dropped");
  throw InvalidArgument(detail::concat(
      "EPBuffer.dispatch: expert capacity overflow: ", w[0], " routes dropped since the last check; largest: expert ",
      w[1] & ((int64_t{1} << 24) - 1), " received ", w[1] >> 24, " routes but capacity is ", config_.capacity,
      " (raise capacity, at most max_tokens_per_rank * world_size * topk, or route fewer tokens per expert)"));
}

namespace {

void bind(py::module_& m) {
  py::class_<EPBufferTorch, std::shared_ptr<EPBufferTorch>>(m, "EPBuffer")
      .def(py::init([](const py::handle& comm, int64_t max_tokens_per_rank, int64_t hidden, int64_t num_experts,
                       int64_t topk, int64_t capacity, const std::string& dtype, const std::string& device,
                       const std::string& transport) {
             EPConfig c;
             c.max_tokens_per_rank = max_tokens_per_rank;
             c.hidden = hidden;
             c.num_experts = num_experts;
             c.topk = topk;
             c.capacity = capacity;
             c.dtype = parse_ep_dtype(dtype);
             auto native = communicator_from_python(comm);
             py::gil_scoped_release release;
             return std::make_shared<EPBufferTorch>(std::move(native), c, at::Device(device), transport);
           }),
           py::arg("comm"), py::arg("max_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"),
           py::arg("topk"), py::arg("capacity"), py::arg("dtype"), py::arg("device"), py::arg("transport") = "peer")
      .def(
          "dispatch",
          [](EPBufferTorch& b, const std::optional<at::Tensor>& x, const std::optional<at::Tensor>& idx,
             const std::optional<at::Tensor>& w, const std::string& phase) {
            auto r = b.dispatch(x.value_or(at::Tensor()), idx.value_or(at::Tensor()), w.value_or(at::Tensor()),
                                parse_phase("EPBuffer.dispatch", phase));
            return std::make_tuple(r.first, r.second);
          },
          py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("phase"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "combine",
          [](EPBufferTorch& b, const std::optional<at::Tensor>& expert_out, int64_t num_tokens,
             const std::optional<at::Tensor>& out, const std::string& phase) {
            return b.combine(expert_out.value_or(at::Tensor()), num_tokens, out.value_or(at::Tensor()),
                             parse_phase("EPBuffer.combine", phase));
          },
          py::arg("expert_out"), py::arg("num_tokens"), py::arg("out"), py::arg("phase"),
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("recv_pos", [](const EPBufferTorch& b) { return b.tensors().recv_pos; })
      .def_property_readonly("meta_num_tokens", [](const EPBufferTorch& b) { return b.tensors().meta_num_tokens; })
      .def("check", &EPBufferTorch::check, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("overflow_word", [](const EPBufferTorch& b) { return b.tensors().overflow; })
      .def_property_readonly("capacity", [](const EPBufferTorch& b) { return b.config().capacity; })
      .def_property_readonly("kernels", &EPBufferTorch::kernels);
}

BindingRegistrar registrar("ep", bind);

}  // namespace
}  // namespace commlib::torch_layer
