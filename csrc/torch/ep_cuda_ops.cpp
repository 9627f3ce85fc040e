// GPU side of EPBuffer (Note [EP GPU protocol] in csrc/kernels/ep_params.hpp) and the dynamic
// all_to_all_v with device splits. Everything runs on the current stream of the buffer's device;
// nothing here reads device memory on the host, so dispatch and combine can be graph-captured.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/cuda_comm.hpp"
#include "kernels/ep_params.hpp"
#include "torch/ep_buffer.hpp"
#include "torch/torch_common.hpp"

namespace commlib::torch_layer {

struct EPCudaState {
  Communicator* comm = nullptr;
  CudaComm* cuda = nullptr;
  at::Device device{at::kCUDA, 0};
  std::shared_ptr<SymmetricBuffer> sym;
  kernels::EPParams params;  // the fixed part; per-call fields are filled by each launch
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
  const kernels::EPSymmetricLayout layout = kernels::ep_symmetric_layout(config, n);
  state->comm = &comm;
  state->cuda = &cuda;
  state->device = device;
  state->sym = cuda.allocate_symmetric(layout.total);  // collective
  // Only the overflow word must start at zero (every other region is written before it is read);
  // the host barrier keeps peers from adding to it before it is cleared.
  cuda_ok(cudaMemset(state->sym->local(), 0, layout.meta_num_tokens), what, "cudaMemset");
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
  t.meta_num_tokens = sym_view(state->sym, layout.meta_num_tokens, {n}, at::kInt, device);
  t.overflow = sym_view(state->sym, layout.overflow, {kEPOverflowWords}, at::kLong, device);

  kernels::EPParams& p = state->params;
  p.config = config;
  p.rank = comm.rank();
  p.world_size = n;
  p.sym = state->sym->device_handle();
  p.layout = layout;
  p.barrier = cuda.barrier_handle();
  p.expert_x = t.expert_x.data_ptr();
  p.expert_counts = t.expert_counts.data_ptr<int32_t>();
  p.recv_pos = t.recv_pos.data_ptr<int32_t>();
  return state.release();
}

void ep_cuda_destroy(EPCudaState* state) { delete state; }

void ep_cuda_dispatch(EPCudaState& s, const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                      EPPhase phase) {
  const char* what = "EPBuffer.dispatch";
  c10::cuda::CUDAGuard guard(s.device);
  cudaStream_t stream = current_stream(s.device);
  s.cuda->begin_op(stream, what);
  kernels::EPParams p = s.params;
  if (phase != EPPhase::kRecv) {
    p.x = x.data_ptr();
    p.topk_idx = topk_idx.data_ptr<int64_t>();
    p.topk_weights = topk_weights.data_ptr<float>();
    p.num_tokens = x.size(0);
    throw_if_error(kernels::launch_ep_dispatch_send(p, stream));
  }
  if (phase != EPPhase::kSend) throw_if_error(kernels::launch_ep_dispatch_recv(p, stream));
  s.cuda->end_op(stream, what);
}

void ep_cuda_combine(EPCudaState& s, const at::Tensor& expert_out, at::Tensor& out, EPPhase phase) {
  const char* what = "EPBuffer.combine";
  c10::cuda::CUDAGuard guard(s.device);
  cudaStream_t stream = current_stream(s.device);
  s.cuda->begin_op(stream, what);
  kernels::EPParams p = s.params;
  p.num_tokens = out.size(0);
  p.out = out.data_ptr();
  if (phase != EPPhase::kRecv) {
    p.expert_out = expert_out.data_ptr();
    throw_if_error(kernels::launch_ep_combine_send(p, stream));
  }
  if (phase != EPPhase::kSend) throw_if_error(kernels::launch_ep_combine_recv(p, stream));
  s.cuda->end_op(stream, what);
}

}  // namespace commlib::torch_layer
