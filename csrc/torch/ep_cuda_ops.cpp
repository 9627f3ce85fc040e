// GPU side of EPBuffer (Note [EP GPU protocol] in csrc/kernels/ep_params.hpp) and the dynamic
// all_to_all_v with device splits. Everything runs on the current stream of the buffer's device;
// nothing here reads device memory on the host, so dispatch and combine can be graph-captured.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "commlib/env.hpp"
#include "core/cuda_comm.hpp"
#include "kernels/all_to_all_v_params.hpp"
#include "kernels/ep_params.hpp"
#include "torch/bindings.hpp"
#include "torch/ep_buffer.hpp"
#include "torch/torch_common.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {

struct EPCudaState {
  Communicator* comm = nullptr;
  CudaComm* cuda = nullptr;
  at::Device device{at::kCUDA, 0};
  std::shared_ptr<SymmetricBuffer> sym;
  kernels::EPParams params;  // the fixed part; per-call fields are filled by each launch
  const void* pending_x = nullptr;  // the last dispatch send's x (kept alive by EPBufferTorch)
  // The call the protocol expects next: the kernels' flags are sequence-numbered per
  // dispatch/combine pair, so out-of-order calls would read stale rows (Note [EP GPU protocol]).
  enum class Next { kDispatch, kDispatchRecv, kCombine, kCombineRecv } next = Next::kDispatch;
};

namespace {

void cuda_ok(cudaError_t err, const char* what, const char* call) {
  COMMLIB_CHECK(err == cudaSuccess, CudaError, what, ": ", call, " failed: ", cudaGetErrorString(err));
}

CudaComm& cuda_for(Communicator& comm, const at::Device& device, const char* what) {
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  c10::cuda::CUDAGuard guard(index);
  CudaComm& cuda = comm.cuda(index);
  COMMLIB_CHECK(cuda.device() == index, InvalidArgument, what, ": tensor is on cuda:", index,
                " but this communicator's GPU state lives on cuda:", cuda.device(), "; use one device per communicator");
  return cuda;
}

at::ScalarType scalar_type_of(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return at::kFloat;
    case DataType::kFloat16: return at::kHalf;
    default: return at::kBFloat16;
  }
}

// A tensor over a region of the symmetric piece; it keeps the mapping alive.
at::Tensor sym_view(const std::shared_ptr<SymmetricBuffer>& sym, size_t offset, std::vector<int64_t> shape,
                    at::ScalarType dtype, const at::Device& device) {
  std::shared_ptr<SymmetricBuffer> keep = sym;
  return at::from_blob(static_cast<char*>(sym->local()) + offset, shape, [keep](void*) mutable { keep.reset(); },
                       at::TensorOptions().dtype(dtype).device(device));
}

cudaStream_t current_stream(const at::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

}  // namespace

EPCudaState* ep_cuda_create(Communicator& comm, const EPConfig& config, at::Device device, EPTensors& t) {
  const char* what = "EPBuffer";
  auto state = std::make_unique<EPCudaState>();
  CudaComm& cuda = cuda_for(comm, device, what);
  device = at::Device(at::kCUDA, cuda.device());
  c10::cuda::CUDAGuard guard(device);
  const int n = comm.world_size();
  COMMLIB_CHECK(n <= kMaxDeviceRanks, InvalidArgument, what, ": world_size ", n, " not supported on CUDA; valid: 1..",
                kMaxDeviceRanks);
  COMMLIB_CHECK(config.num_experts <= kernels::kEPMaxExpertsCuda, InvalidArgument, what, ": num_experts ",
                config.num_experts, " not supported on CUDA; valid: up to ", kernels::kEPMaxExpertsCuda);
  // Block b of every rank pairs with block b of the peers (Note [EP GPU protocol]), so every rank
  // launches the same grid (chunks x column parts), at most one block per SM of the smallest GPU
  // (all blocks resident).
  // The LL path (Note [EP LL protocol]) only when every rank asks for it (COMMLIB_EP_LL).
  int num_sms = 0;
  cuda_ok(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, cuda.device()), what,
          "cudaDeviceGetAttribute");
  struct Wish {
    int32_t sms, ll;
  };
  std::vector<Wish> wishes(n);
  const Wish mine{num_sms, env::get_bool("COMMLIB_EP_LL") ? 1 : 0};
  comm.all_gather_host(wishes.data(), &mine, sizeof(Wish));  // collective
  int32_t min_sms = num_sms;
  bool all_ll = true;
  for (const Wish& w : wishes) {
    min_sms = std::min(min_sms, w.sms);
    all_ll = all_ll && w.ll != 0;
  }
  const kernels::EPGrid grid = kernels::ep_grid(config, min_sms);
  const kernels::EPPath path =
      all_ll && kernels::ep_ll_eligible(config, grid) ? kernels::EPPath::kLL : kernels::EPPath::kFlags;
  const kernels::EPLLGeometry ll = kernels::ep_ll_geometry(config, n, grid, path);
  const kernels::EPSymmetricLayout layout = kernels::ep_symmetric_layout(config, n, grid, ll);
  state->comm = &comm;
  state->cuda = &cuda;
  state->device = device;
  state->sym = cuda.allocate_symmetric(layout.total);  // collective
  // Only the control words, overflow word, flags and LL lines must start at zero (every other region
  // is written before it is read); the host barrier keeps peers from raising flags before that.
  cuda_ok(cudaMemset(state->sym->local(), 0, layout.control_end), what, "cudaMemset");
  cuda_ok(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
  comm.barrier_host();

  const int64_t num_local = config.num_local_experts(n);
  const std::vector<int64_t> meta_shape{n, config.max_tokens_per_rank, config.topk};
  auto opts = at::TensorOptions().device(device);
  t.expert_x = at::empty({num_local, config.capacity, config.hidden}, opts.dtype(scalar_type_of(config.dtype)));
  t.expert_counts = at::zeros({num_local}, opts.dtype(at::kInt));
  t.recv_pos = at::full(meta_shape, -1, opts.dtype(at::kInt));
  t.meta_idx = sym_view(state->sym, layout.meta_idx, meta_shape, at::kInt, device);
  t.meta_w = sym_view(state->sym, layout.meta_w, meta_shape, at::kFloat, device);
  // Each chunk's lead block of a source writes its token count into the chunk's slot; column 0 is one of them.
  t.meta_num_tokens = sym_view(state->sym, layout.num_tokens, {n, grid.num_chunks}, at::kInt, device).select(1, 0);
  t.overflow = sym_view(state->sym, layout.overflow, {kEPOverflowWords}, at::kLong, device);

  kernels::EPParams& p = state->params;
  p.config = config;
  p.rank = comm.rank();
  p.world_size = n;
  p.grid = grid;
  p.path = path;
  p.ll = ll;
  p.sym = state->sym->device_handle();
  p.layout = layout;
  p.barrier = cuda.barrier_handle();
  p.expert_x = t.expert_x.data_ptr();
  p.expert_counts = t.expert_counts.data_ptr<int32_t>();
  p.recv_pos = t.recv_pos.data_ptr<int32_t>();
  return state.release();
}

void ep_cuda_destroy(EPCudaState* state) { delete state; }

const char* ep_cuda_kernels(const EPCudaState& state) {
  return state.params.path == kernels::EPPath::kLL ? "ll" : "flags";
}

namespace {

const char* expected_call(EPCudaState::Next next) {
  switch (next) {
    case EPCudaState::Next::kDispatch: return "dispatch or dispatch_send";
    case EPCudaState::Next::kDispatchRecv: return "dispatch_recv";
    case EPCudaState::Next::kCombine: return "combine or combine_send";
    default: return "combine_recv";
  }
}

// Raises unless `phase` of `what` is the call the protocol expects next.
void check_order(const EPCudaState& s, const char* what, EPPhase phase, EPCudaState::Next first,
                 EPCudaState::Next second) {
  const EPCudaState::Next wanted = phase == EPPhase::kRecv ? second : first;
  COMMLIB_CHECK(s.next == wanted, InvalidArgument, what, "(phase ",
                phase == EPPhase::kRecv ? "recv" : (phase == EPPhase::kSend ? "send" : "both"),
                ") out of order: expected ", expected_call(s.next),
                "; on CUDA dispatch and combine alternate, each split phase followed by its recv");
}

kernels::EPMode mode_of(EPPhase phase) {
  switch (phase) {
    case EPPhase::kSend: return kernels::EPMode::kSend;
    case EPPhase::kRecv: return kernels::EPMode::kRecv;
    default: return kernels::EPMode::kBoth;
  }
}

}  // namespace

void ep_cuda_dispatch(EPCudaState& s, const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                      EPPhase phase) {
  const char* what = "EPBuffer.dispatch";
  check_order(s, what, phase, EPCudaState::Next::kDispatch, EPCudaState::Next::kDispatchRecv);
  c10::cuda::CUDAGuard guard(s.device);
  cudaStream_t stream = current_stream(s.device);
  s.cuda->begin_op(stream, what);
  kernels::EPParams p = s.params;
  if (phase != EPPhase::kRecv) {
    s.pending_x = x.data_ptr();  // the receive part expands this rank's own rows from x
    p.topk_idx = topk_idx.data_ptr<int64_t>();
    p.topk_weights = topk_weights.data_ptr<float>();
    p.num_tokens = x.size(0);
  }
  p.x = s.pending_x;
  throw_if_error(kernels::launch_ep_dispatch(p, mode_of(phase), stream));
  s.cuda->end_op(stream, what);
  s.next = phase == EPPhase::kSend ? EPCudaState::Next::kDispatchRecv : EPCudaState::Next::kCombine;
}

void ep_cuda_combine(EPCudaState& s, const at::Tensor& expert_out, at::Tensor& out, EPPhase phase) {
  const char* what = "EPBuffer.combine";
  check_order(s, what, phase, EPCudaState::Next::kCombine, EPCudaState::Next::kCombineRecv);
  c10::cuda::CUDAGuard guard(s.device);
  cudaStream_t stream = current_stream(s.device);
  s.cuda->begin_op(stream, what);
  kernels::EPParams p = s.params;
  p.out = out.data_ptr();
  if (phase != EPPhase::kRecv) p.expert_out = expert_out.data_ptr();
  throw_if_error(kernels::launch_ep_combine(p, mode_of(phase), stream));
  s.cuda->end_op(stream, what);
  s.next = phase == EPPhase::kSend ? EPCudaState::Next::kCombineRecv : EPCudaState::Next::kDispatch;
}

}  // namespace commlib::torch_layer

// ---- dynamic all_to_all_v (csrc/kernels/all_to_all_v.cu) ----

namespace commlib::torch_layer {
namespace {

// The control area of each communicator (by its unique prefix), allocated collectively by the
// first CUDA all_to_all_v: call it once outside graph capture before capturing.
std::shared_ptr<SymmetricBuffer> a2a_control(Communicator& comm, CudaComm& cuda) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<SymmetricBuffer>> areas;
  std::lock_guard<std::mutex> lock(mutex);
  auto& area = areas[comm.prefix()];
  if (!area) {
    const char* what = "all_to_all_v";
    area = cuda.allocate_symmetric(kernels::kAllToAllVControlBytes);
    cuda_ok(cudaMemset(area->local(), 0, kernels::kAllToAllVControlBytes), what, "cudaMemset");
    cuda_ok(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
    comm.barrier_host();  // nobody writes a peer's control area before the peer cleared it
  }
  return area;
}

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
  CudaComm& cuda = cuda_for(comm, in.device(), what);
  c10::cuda::CUDAGuard guard(in.device());
  cudaStream_t stream = current_stream(in.device());
  const at::Tensor src = in.contiguous();
  at::Tensor in_splits, out_splits;
  if (in_splits_in.defined()) {
    in_splits = device_splits(in_splits_in, n, in.device(), what, "input_split_sizes");
    out_splits = device_splits(out_splits_in, n, in.device(), what, "output_split_sizes");
  }
  auto control = a2a_control(comm, cuda);
  cuda.begin_op(stream, what);
  kernels::AllToAllVParams p;
  p.input = src.data_ptr();
  p.row_bytes = row_bytes;
  p.in_rows = in_rows;
  p.out_rows = out_rows;
  p.in_splits = in_splits.defined() ? in_splits.data_ptr<int64_t>() : nullptr;
  p.out_splits = out_splits.defined() ? out_splits.data_ptr<int64_t>() : nullptr;
  p.control = control->device_handle();
  p.barrier = cuda.barrier_handle();
  at::Tensor dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  p.output = dst.data_ptr();
  size_t offset = 0;
  const size_t out_bytes = static_cast<size_t>(dst.numel()) * dst.element_size();
  std::shared_ptr<SymmetricBuffer> sym = cuda.find_symmetric(dst.data_ptr(), std::max<size_t>(out_bytes, 1), &offset);
  if (sym != nullptr) {
    p.target = kernels::AllToAllVTarget::kSymmetricOutput;
    p.recv = sym->device_handle_at(offset);
  } else {
    p.target = kernels::AllToAllVTarget::kWorkspace;
    p.recv = cuda.workspace().device_handle();
    COMMLIB_CHECK(out_bytes <= p.recv.bytes / 2 / 16 * 16, InvalidArgument, what, ": output of ", out_bytes,
                  " bytes exceeds the workspace half (", p.recv.bytes / 2 / 16 * 16,
                  " bytes); allocate the output with comm.symmetric_empty or raise COMMLIB_GPU_WORKSPACE_BYTES");
  }
  throw_if_error(kernels::launch_all_to_all_v(p, stream));
  cuda.end_op(stream, what);
  if (!dst.is_same(out)) out.copy_(dst);
}

// Raises ValueError if a CUDA all_to_all_v since the last check found bad or mismatched device
// splits (those calls sent nothing between the ranks concerned). Synchronises the device.
void all_to_all_v_check(Communicator& comm) {
  if (!comm.has_cuda()) return;
  CudaComm& cuda = comm.cuda(0);
  auto control = a2a_control(comm, cuda);
  uint64_t errors = 0;
  char* word = static_cast<char*>(control->local()) + kernels::kAllToAllVErrorOffset;
  cuda_ok(cudaMemcpy(&errors, word, sizeof(errors), cudaMemcpyDeviceToHost), "all_to_all_v", "cudaMemcpy");
  if (errors == 0) return;
  cuda_ok(cudaMemset(word, 0, sizeof(errors)), "all_to_all_v", "cudaMemset");
  throw InvalidArgument(detail::concat(
      "all_to_all_v: ", errors, " block(s) of CUDA calls since the last check found invalid device splits: a negative "
      "split, splits summing past the tensor's rows, output beyond the workspace, or output_split_sizes[q] on one "
      "rank != input_split_sizes[r] on rank q; the rows between those ranks were not sent"));
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
  // Developer aid: the EP kernels' opt-in timing trace (empty unless built with COMMLIB_EP_TRACE).
  m.def("_ep_trace", [] { return kernels::ep_trace_snapshot(); });
});

}  // namespace
}  // namespace commlib::torch_layer
