// GPU side of EPBuffer and the dynamic all_to_all_v with device splits: tensors to pointers, and
// the bindings. The orchestration (grid, LL agreement, protocol state, control area) is the core's
// (include/commlib/gpu.hpp, csrc/cuda/cuda_ep.cc, CudaComm::all_to_all_v). Everything runs on the
// current stream of the tensors' device; nothing here reads device memory on the host, so dispatch
// and combine can be graph-captured.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>

#include "commlib/gpu.hpp"
#include "cuda/cuda_comm.hpp"
#include "torch/bindings.hpp"
#include "torch/ep_buffer.hpp"
#include "torch/torch_common.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {

struct EPCudaState {
  std::unique_ptr<EPBufferGpu> gpu;
  at::Device device{at::kCUDA, 0};
};

namespace {

at::ScalarType scalar_type_of(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return at::kFloat;
    case DataType::kFloat16: return at::kHalf;
    default: return at::kBFloat16;
  }
}

// A tensor over device memory that `keep` keeps alive.
at::Tensor view(std::shared_ptr<void> keep, void* data, std::vector<int64_t> shape, std::vector<int64_t> strides,
                at::ScalarType dtype, const at::Device& device) {
  return at::from_blob(data, shape, strides, [keep](void*) mutable { keep.reset(); },
                       at::TensorOptions().dtype(dtype).device(device));
}

GpuStream current_stream(const at::Device& device) {
  return reinterpret_cast<GpuStream>(c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

int device_index(const at::Device& device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}

}  // namespace

EPCudaState* ep_cuda_create(Communicator& comm, const EPConfig& config, at::Device device, EPTensors& t,
                            bool nvshmem) {
  auto state = std::make_unique<EPCudaState>();
  const int index = device_index(device);
  c10::cuda::CUDAGuard guard(index);
  state->gpu = std::make_unique<EPBufferGpu>(
      comm, config, index, nvshmem ? EPTransport::kNvshmem : EPTransport::kPeerMemory);  // collective
  state->device = at::Device(at::kCUDA, state->gpu->device());
  const EPConfig& c = state->gpu->config();
  const int64_t n = comm.world_size();
  const int64_t num_local = c.num_local_experts(static_cast<int>(n));
  const std::vector<int64_t> meta_shape{n, c.max_tokens_per_rank, c.topk};
  const std::vector<int64_t> meta_strides{c.max_tokens_per_rank * c.topk, c.topk, 1};
  auto opts = at::TensorOptions().device(state->device);
  t.expert_x = at::empty({num_local, c.capacity, c.hidden}, opts.dtype(scalar_type_of(c.dtype)));
  t.expert_counts = at::zeros({num_local}, opts.dtype(at::kInt));
  t.recv_pos = at::full(meta_shape, -1, opts.dtype(at::kInt));
  state->gpu->set_local(t.expert_x.data_ptr(), t.expert_counts.data_ptr<int32_t>(), t.recv_pos.data_ptr<int32_t>());
  const EPState st = state->gpu->state();
  std::shared_ptr<void> keep = state->gpu->symmetric_keepalive();
  t.meta_idx = view(keep, st.meta_idx, meta_shape, meta_strides, at::kInt, state->device);
  t.meta_w = view(keep, st.meta_w, meta_shape, meta_strides, at::kFloat, state->device);
  t.meta_num_tokens = view(keep, st.meta_num_tokens, {n}, {state->gpu->meta_num_tokens_stride()}, at::kInt,
                           state->device);
  t.overflow = view(keep, st.overflow, {kEPOverflowWords}, {1}, at::kLong, state->device);
  return state.release();
}

void ep_cuda_destroy(EPCudaState* state) { delete state; }

const char* ep_cuda_kernels(const EPCudaState& state) { return state.gpu->kernels(); }

void ep_cuda_dispatch(EPCudaState& s, const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                      EPPhase phase) {
  c10::cuda::CUDAGuard guard(s.device);
  const bool send = phase != EPPhase::kRecv;
  s.gpu->dispatch(send ? x.data_ptr() : nullptr, send ? x.size(0) : 0,
                  send ? topk_idx.data_ptr<int64_t>() : nullptr, send ? topk_weights.data_ptr<float>() : nullptr,
                  phase, current_stream(s.device));
}

void ep_cuda_combine(EPCudaState& s, const at::Tensor& expert_out, at::Tensor& out, EPPhase phase) {
  c10::cuda::CUDAGuard guard(s.device);
  s.gpu->combine(phase != EPPhase::kRecv ? expert_out.data_ptr() : nullptr, out.data_ptr(), phase,
                 current_stream(s.device));
}

}  // namespace commlib::torch_layer

// ---- dynamic all_to_all_v (csrc/kernels/all_to_all_v.cu) ----

namespace commlib::torch_layer {
namespace {

at::Tensor device_splits(const at::Tensor& splits, int n, const at::Device& device, const char* what,
                         const char* arg) {
  COMMLIB_CHECK(splits.device() == device, TypeMismatch, what, ": ", arg, " is on ", splits.device().str(),
                " but the tensors are on ", device.str());
  COMMLIB_CHECK(splits.scalar_type() == at::kLong, TypeMismatch, what, ": ", arg, " has dtype ",
                dtype_str(splits.scalar_type()), "; supported: int64");
  COMMLIB_CHECK(splits.dim() == 1 && splits.size(0) == n, InvalidArgument, what, ": ", arg,
                " must have shape [world_size] = [", n, "]; got ", splits.sizes());
  return splits.contiguous();
}

}  // namespace

void all_to_all_v_cuda(Communicator& comm, at::Tensor& out, const at::Tensor& in, const at::Tensor& in_splits_in,
                       const at::Tensor& out_splits_in) {
  const char* what = "all_to_all_v";
  COMMLIB_CHECK(in.is_cuda() && out.device() == in.device(), TypeMismatch, what,
                ": input and output must be on the same CUDA device; got ", in.device().str(), " and ",
                out.device().str());
  check_same_dtype(out, in, what);
  const int n = comm.world_size();
  const int64_t in_rows = in.dim() == 0 ? 1 : in.size(0);
  const int64_t out_rows = out.dim() == 0 ? 1 : out.size(0);
  const int64_t row_bytes = in_rows > 0 ? static_cast<int64_t>(in.numel() * in.element_size() / in_rows)
                                        : static_cast<int64_t>(out_rows > 0 ? out.numel() * out.element_size() / out_rows : 0);
  if (in_rows > 0 && out_rows > 0) {
    COMMLIB_CHECK(row_bytes * out_rows == static_cast<int64_t>(out.numel() * out.element_size()), InvalidArgument,
                  what, ": input rows have ", row_bytes, " bytes but output rows have ",
                  out.numel() * out.element_size() / out_rows);
  }
  if (!in_splits_in.defined()) {
    COMMLIB_CHECK(in_rows % n == 0 && out_rows % n == 0, InvalidArgument, what, ": input has ", in_rows,
                  " rows and output ", out_rows, "; both must be divisible by world_size ", n, " (or pass splits)");
  }
  c10::cuda::CUDAGuard guard(in.device());
  CudaComm& cuda = comm.cuda(in.device().index());
  const at::Tensor src = in.contiguous();
  at::Tensor in_splits, out_splits;
  if (in_splits_in.defined()) {
    in_splits = device_splits(in_splits_in, n, in.device(), what, "input_split_sizes");
    out_splits = device_splits(out_splits_in, n, in.device(), what, "output_split_sizes");
  }
  at::Tensor dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  cuda.all_to_all_v(src.data_ptr(), dst.data_ptr(), row_bytes, in_rows, out_rows,
                    in_splits.defined() ? in_splits.data_ptr<int64_t>() : nullptr,
                    out_splits.defined() ? out_splits.data_ptr<int64_t>() : nullptr,
                    c10::cuda::getCurrentCUDAStream(in.device().index()).stream());
  if (!dst.is_same(out)) out.copy_(dst);
}

// Raises ValueError if a CUDA all_to_all_v since the last check found bad or mismatched device
// splits (those calls sent nothing between the ranks concerned). Synchronises the device.
void all_to_all_v_check(Communicator& comm) {
  if (!comm.has_cuda()) return;
  comm.cuda().check_all_to_all();
}

namespace {

template <typename F, typename... Extra>
void add_method(py::object cls, const char* name, F&& fn, const Extra&... extra) {
  cls.attr(name) = py::cpp_function(std::forward<F>(fn), py::name(name), py::is_method(cls),
                                    py::sibling(py::getattr(cls, name, py::none())), extra...);
}

BindingRegistrar reg("ep_cuda_ops", [](py::module_& m) {
  py::object cls = m.attr("Communicator");
  add_method(
      cls, "all_to_all_v_device",
      [](Communicator& c, at::Tensor out, const at::Tensor& in, const std::optional<at::Tensor>& in_splits,
         const std::optional<at::Tensor>& out_splits) {
        all_to_all_v_cuda(c, out, in, in_splits.value_or(at::Tensor()), out_splits.value_or(at::Tensor()));
      },
      py::arg("output"), py::arg("input"), py::arg("input_split_sizes"), py::arg("output_split_sizes"),
      py::call_guard<py::gil_scoped_release>());
  add_method(
      cls, "check_all_to_all", [](Communicator& c) { all_to_all_v_check(c); }, py::call_guard<py::gil_scoped_release>());
  // EPBuffer(transport="nvshmem") (python/commlib/_nvshmem.py): after nvshmem4py initialised NVSHMEM.
  m.def(
      "ep_nvshmem_attach", [](const std::string& path, int device) { return ep_nvshmem_attach(path, device); },
      py::arg("path"), py::arg("device"), py::call_guard<py::gil_scoped_release>());
  // Developer aid: the EP kernels' opt-in timing trace (empty unless built with COMMLIB_EP_TRACE).
  m.def("_ep_trace", [] { return ep_trace_snapshot_gpu(); });
});

}  // namespace
}  // namespace commlib::torch_layer
