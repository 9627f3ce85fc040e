// GPU entry points of the torch layer: all_reduce, reduce_scatter, all_gather, broadcast and
// all_to_all (equal splits) on CUDA tensors, and symmetric tensors.
// Everything runs on the tensor device's current stream; nothing here synchronises the host.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include "cuda/cuda_comm.hpp"
#include "torch/bindings.hpp"
#include "torch/torch_common.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

CudaComm& cuda_state(Communicator& comm, const at::Device& device, const char* what) {
  COMMLIB_CHECK(device.is_cuda(), TypeMismatch, what, ": device ", device.str(), " not supported; supported: cuda");
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  c10::cuda::CUDAGuard guard(index);
  return comm.cuda(index);  // one device per communicator: another index throws
}

}  // namespace

void all_reduce_cuda(Communicator& comm, at::Tensor& t, ReduceOp op, Algorithm algo) {
  const char* what = "all_reduce";
  const DataType dtype = reducible_type(t, what);
  TORCH_CHECK(t.is_cuda(), what, ": expected a CUDA tensor");
  COMMLIB_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, InvalidArgument, what, ": op ", reduce_op_name(op),
                " not supported for CUDA tensors; supported: sum, avg");
  COMMLIB_CHECK(algo != Algorithm::kNccl, InvalidArgument, what,
                ": algo 'nccl' needs an NCCL engine (the ddacomm torch backend); supported here: auto, flat, tree");
  CudaComm& cuda = cuda_state(comm, t.device(), what);
  c10::cuda::CUDAGuard guard(t.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
  with_contiguous(t, [&](at::Tensor& c) {
    cuda.all_reduce(c.data_ptr(), c.data_ptr(), static_cast<size_t>(c.numel()), dtype, op, algo, stream);
  });
}

void all_reduce_cuda(Communicator& comm, at::Tensor& t, ReduceOp op, const Plan& plan) {
  const char* what = "all_reduce";
  const DataType dtype = reducible_type(t, what);
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), what, ": expected a contiguous CUDA tensor");
  CudaComm& cuda = cuda_state(comm, t.device(), what);
  c10::cuda::CUDAGuard guard(t.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
  cuda.all_reduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), dtype, op, plan, stream);
}

namespace {

cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

void check_cuda_pair(const at::Tensor& out, const at::Tensor& in, const char* what) {
  COMMLIB_CHECK(in.is_cuda() && out.device() == in.device(), TypeMismatch, what,
                ": input and output must be on the same CUDA device; got ", in.device().str(), " and ",
                out.device().str());
  check_same_dtype(out, in, what);
}

}  // namespace

void reduce_scatter_cuda(Communicator& comm, at::Tensor& out, const at::Tensor& in, ReduceOp op) {
  const char* what = "reduce_scatter";
  check_cuda_pair(out, in, what);
  const DataType dtype = reducible_type(in, what);
  check_world_multiple(what, "input", in, "output", out, comm.world_size());
  CudaComm& cuda = cuda_state(comm, in.device(), what);
  c10::cuda::CUDAGuard guard(in.device());
  const at::Tensor src = in.contiguous();
  with_contiguous(out, [&](at::Tensor& c) {
    cuda.reduce_scatter(src.data_ptr(), c.data_ptr(), static_cast<size_t>(c.numel()), dtype, op, current_stream(c));
  });
}

void all_gather_cuda(Communicator& comm, at::Tensor& out, const at::Tensor& in) {
  const char* what = "all_gather";
  check_cuda_pair(out, in, what);
  to_data_type(in.scalar_type(), what);
  check_world_multiple(what, "output", out, "input", in, comm.world_size());
  CudaComm& cuda = cuda_state(comm, in.device(), what);
  c10::cuda::CUDAGuard guard(in.device());
  const at::Tensor src = in.contiguous();
  with_contiguous(out, [&](at::Tensor& c) {
    cuda.all_gather(src.data_ptr(), c.data_ptr(), static_cast<size_t>(src.numel()) * src.element_size(),
                    current_stream(c));
  });
}

void broadcast_cuda(Communicator& comm, at::Tensor& t, int src) {
  const char* what = "broadcast";
  TORCH_CHECK(t.is_cuda(), what, ": expected a CUDA tensor");
  to_data_type(t.scalar_type(), what);
  CudaComm& cuda = cuda_state(comm, t.device(), what);
  c10::cuda::CUDAGuard guard(t.device());
  with_contiguous(t, [&](at::Tensor& c) {
    cuda.broadcast(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size(), src, current_stream(c));
  });
}

void all_to_all_cuda(Communicator& comm, at::Tensor& out, const at::Tensor& in) {
  const char* what = "all_to_all";
  check_cuda_pair(out, in, what);
  to_data_type(in.scalar_type(), what);
  const int64_t n = comm.world_size();
  const int64_t rows = in.dim() == 0 ? 1 : in.size(0);
  COMMLIB_CHECK(in.numel() == out.numel() && rows % n == 0, InvalidArgument, what, ": input (", in.numel(),
                " elements, ", rows, " rows) and output (", out.numel(),
                " elements) must have the same size, with rows divisible by world_size ", n);
  CudaComm& cuda = cuda_state(comm, in.device(), what);
  c10::cuda::CUDAGuard guard(in.device());
  const at::Tensor src = in.contiguous();
  with_contiguous(out, [&](at::Tensor& c) {
    cuda.all_to_all(src.data_ptr(), c.data_ptr(), static_cast<size_t>(src.numel()) * src.element_size() / n,
                    current_stream(c));
  });
}

namespace {

at::Tensor symmetric_empty(Communicator& comm, const std::vector<int64_t>& shape, at::ScalarType dtype,
                           const at::Device& device) {
  const char* what = "symmetric_empty";
  COMMLIB_CHECK(device.is_cuda(), TypeMismatch, what, ": device ", device.str(), " not supported; supported: cuda");
  int64_t numel = 1;
  for (int64_t d : shape) {
    COMMLIB_CHECK(d >= 0, InvalidArgument, what, ": shape has a negative dimension ", d);
    numel *= d;
  }
  CudaComm& cuda = cuda_state(comm, device, what);
  const at::Device dev(at::kCUDA, cuda.device());
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(numel) * c10::elementSize(dtype));
  std::shared_ptr<SymmetricBuffer> buffer = cuda.allocate_symmetric(bytes);
  void* data = buffer->local();
  // The tensor keeps the mapping alive; freeing it is local (peers keep their own mappings). A
  // tensor dropped right after a call on it is enqueued: the call's kernels finish before the
  // mapping goes. Not while this thread's stream captures a graph (the wait is illegal there; a
  // captured graph must keep its tensors alive, as with any tensor it reads).
  const c10::DeviceIndex index = dev.index();
  return at::from_blob(
      data, shape,
      [buffer, index](void*) mutable {
        try {  // a deleter never throws (late at exit the CUDA runtime may be gone): it releases anyway
          cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
          if (cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(index).stream(), &status) == cudaSuccess &&
              status == cudaStreamCaptureStatusNone) {
            wait_device_before_release(index);
          }
        } catch (...) {
        }
        buffer.reset();
      },
      at::TensorOptions().dtype(dtype).device(dev));
}

// Adds a method to the Communicator class that module.cpp defined (binding files stay independent).
template <typename F, typename... Extra>
void add_method(py::object cls, const char* name, F&& fn, const Extra&... extra) {
  cls.attr(name) = py::cpp_function(std::forward<F>(fn), py::name(name), py::is_method(cls),
                                    py::sibling(py::getattr(cls, name, py::none())), extra...);
}

BindingRegistrar reg("cuda_all_reduce", [](py::module_& m) {
  py::object cls = m.attr("Communicator");
  add_method(
      cls, "symmetric_empty",
      [](Communicator& c, const std::vector<int64_t>& shape, at::ScalarType dtype, const at::Device& device) {
        return symmetric_empty(c, shape, dtype, device);
      },
      py::arg("shape"), py::arg("dtype"), py::arg("device"), py::call_guard<py::gil_scoped_release>());
  add_method(
      cls, "check_gpu_error",
      [](Communicator& c) {
        if (c.has_cuda()) c.cuda().check_error("check_gpu_error");
      },
      "Raises commlib.TimeoutError if a GPU wait of this communicator expired (no synchronisation).");
  add_method(
      cls, "gpu_p2p_ok",
      [](Communicator& c, const at::Device& device) { return cuda_state(c, device, "gpu_p2p_ok").p2p_ok(); },
      py::arg("device"), py::call_guard<py::gil_scoped_release>());
});

}  // namespace
}  // namespace commlib::torch_layer
