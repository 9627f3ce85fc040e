#include "torch/torch_common.hpp"

#include <numeric>

namespace commlib::torch_layer {

std::string dtype_str(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kBool: return "bool";
    default: return c10::toString(type);
  }
}

DataType to_data_type(at::ScalarType type, const char* what) {
  switch (type) {
    case at::kFloat: return DataType::kFloat32;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kDouble: return DataType::kFloat64;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kByte: return DataType::kUInt8;
    case at::kChar: return DataType::kInt8;
    case at::kShort: return DataType::kInt16;
    case at::kBool: return DataType::kBool;
    default: break;
  }
  throw TypeMismatch(detail::concat(what, ": dtype ", dtype_str(type),
                                    " not supported; supported: float32, float16, bfloat16, float64, int32, int64, "
                                    "uint8, int8, int16, bool"));
}

DataType reducible_type(const at::Tensor& t, const char* what) {
  const auto type = t.scalar_type();
  COMMLIB_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16, TypeMismatch, what, ": dtype ",
                dtype_str(type), " not supported; supported: float32, float16, bfloat16");
  return to_data_type(type, what);
}

void check_cpu_or_cuda(const at::Tensor& t, const char* what, const char* arg) {
  COMMLIB_CHECK(t.defined(), InvalidArgument, what, ": ", arg, " is undefined");
  COMMLIB_CHECK(t.device().is_cpu() || t.device().is_cuda(), TypeMismatch, what, ": ", arg, " is on device ",
                t.device().str(), "; supported: cpu, cuda");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what) {
  COMMLIB_CHECK(a.scalar_type() == b.scalar_type(), TypeMismatch, what, ": dtype mismatch: output is ",
                dtype_str(a.scalar_type()), " but input is ", dtype_str(b.scalar_type()),
                "; both must have the same dtype");
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* what) {
  COMMLIB_CHECK(a.device() == b.device(), TypeMismatch, what, ": device mismatch: output is on ", a.device().str(),
                " but input is on ", b.device().str());
}

void check_world_multiple(const char* what, const char* whole_name, const at::Tensor& whole, const char* part_name,
                          const at::Tensor& part, int world_size) {
  COMMLIB_CHECK(whole.numel() == part.numel() * world_size, InvalidArgument, what, ": ", whole_name, " has ",
                whole.numel(), " elements but must have world_size (", world_size, ") x ", part_name, " (",
                part.numel(), ") = ", part.numel() * world_size);
}

namespace {

size_t nbytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

void require_cpu(const at::Tensor& t, const char* what) {
  COMMLIB_CHECK(t.device().is_cpu(), TypeMismatch, what, ": CUDA tensors are not supported by this operation in "
                "this build; supported: cpu");
}

}  // namespace

// The CPU exchange ops have one variant (Note [plan]); the plan is recorded for the counters and
// COMMLIB_LOG_PLAN (here, not in the host engine, whose exchanges also serve other operations).
void record_host_exchange(Communicator& comm, CollectiveOp op, size_t message_bytes, const at::Tensor& t) {
  ExchangeShape shape;
  shape.op = op;
  shape.message_bytes = message_bytes;
  shape.dtype = to_data_type(t.scalar_type(), collective_op_name(op));
  shape.placement = Placement::kCpu;
  plan_executed(plan_exchange(comm.config(), shape), comm.rank());
}

void all_reduce(Communicator& comm, at::Tensor& t, ReduceOp op, Algorithm algo) {
  const char* what = "all_reduce";
  check_cpu_or_cuda(t, what, "tensor");
  const DataType dtype = reducible_type(t, what);
#if defined(COMMLIB_TORCH_CUDA)
  if (t.device().is_cuda()) return all_reduce_cuda(comm, t, op, algo);
#endif
  require_cpu(t, what);
  with_contiguous(t, [&](at::Tensor& c) {
    comm.all_reduce_host(c.data_ptr(), c.data_ptr(), static_cast<size_t>(c.numel()), dtype, op, algo);
  });
}

void all_reduce_out(Communicator& comm, at::Tensor& out, const at::Tensor& in, ReduceOp op, Algorithm algo) {
  const char* what = "all_reduce";
  check_cpu_or_cuda(out, what, "out");
  check_cpu_or_cuda(in, what, "tensor");
  check_same_dtype(out, in, what);
  check_same_device(out, in, what);
  COMMLIB_CHECK(out.sizes() == in.sizes(), InvalidArgument, what, ": out has shape ", out.sizes(),
                " but tensor has shape ", in.sizes(), "; out must have the same shape");
  COMMLIB_CHECK(out.is_contiguous(), InvalidArgument, what, ": out must be contiguous (strides ", out.strides(),
                ")");
  const DataType dtype = reducible_type(in, what);
#if defined(COMMLIB_TORCH_CUDA)
  if (in.device().is_cuda()) {  // GPU: no native out-of-place path; copy, then reduce in place
    if (!out.is_same(in)) copy_bits(out, in);
    return all_reduce_cuda(comm, out, op, algo);
  }
#endif
  require_cpu(in, what);
  const at::Tensor src = contiguous_bits(in);
  comm.all_reduce_host(src.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()), dtype, op, algo);
}

void reduce_scatter(Communicator& comm, at::Tensor& out, const at::Tensor& in, ReduceOp op) {
  const char* what = "reduce_scatter";
  check_cpu_or_cuda(out, what, "output");
  check_cpu_or_cuda(in, what, "input");
  check_same_dtype(out, in, what);
  check_same_device(out, in, what);
  const DataType dtype = reducible_type(in, what);
#if defined(COMMLIB_TORCH_CUDA)
  if (in.device().is_cuda()) return reduce_scatter_cuda(comm, out, in, op);
#endif
  require_cpu(in, what);
  check_world_multiple(what, "input", in, "output", out, comm.world_size());
  const at::Tensor src = contiguous_bits(in);
  record_host_exchange(comm, CollectiveOp::kReduceScatter, nbytes(src), src);
  with_contiguous(out, [&](at::Tensor& c) {
    comm.reduce_scatter_host(c.data_ptr(), src.data_ptr(), static_cast<size_t>(c.numel()), dtype, op);
  });
}

void all_gather(Communicator& comm, at::Tensor& out, const at::Tensor& in) {
  const char* what = "all_gather";
  check_cpu_or_cuda(out, what, "output");
  check_cpu_or_cuda(in, what, "input");
  check_same_dtype(out, in, what);
  check_same_device(out, in, what);
  to_data_type(in.scalar_type(), what);
#if defined(COMMLIB_TORCH_CUDA)
  if (in.device().is_cuda()) return all_gather_cuda(comm, out, in);
#endif
  require_cpu(in, what);
  check_world_multiple(what, "output", out, "input", in, comm.world_size());
  const at::Tensor src = contiguous_bits(in);
  record_host_exchange(comm, CollectiveOp::kAllGather, nbytes(out), src);
  with_contiguous(out, [&](at::Tensor& c) { comm.all_gather_host(c.data_ptr(), src.data_ptr(), nbytes(src)); });
}

void broadcast(Communicator& comm, at::Tensor& t, int src) {
  const char* what = "broadcast";
  check_cpu_or_cuda(t, what, "tensor");
  to_data_type(t.scalar_type(), what);
#if defined(COMMLIB_TORCH_CUDA)
  if (t.device().is_cuda()) return broadcast_cuda(comm, t, src);
#endif
  require_cpu(t, what);
  record_host_exchange(comm, CollectiveOp::kBroadcast, nbytes(t), t);
  with_contiguous(t, [&](at::Tensor& c) { comm.broadcast_host(c.data_ptr(), nbytes(c), src); });
}

void all_to_all(Communicator& comm, at::Tensor& out, const at::Tensor& in) {
  all_to_all_v(comm, out, in, {}, {});
}

void all_to_all_v(Communicator& comm, at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits) {
  const char* what = "all_to_all";
  check_cpu_or_cuda(out, what, "output");
  check_cpu_or_cuda(in, what, "input");
  check_same_dtype(out, in, what);
  check_same_device(out, in, what);
  to_data_type(in.scalar_type(), what);
  const int n = comm.world_size();
  auto row_bytes = [](const at::Tensor& t) -> size_t {
    return t.dim() == 0 ? t.element_size() : nbytes(t) / std::max<int64_t>(1, t.size(0));
  };
  auto to_bytes = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* arg) {
    std::vector<size_t> bytes(n);
    if (splits.empty()) {
      const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
      COMMLIB_CHECK(rows % n == 0, InvalidArgument, what, ": ", arg, " has ", rows,
                    " rows, not divisible by world_size ", n, "; pass split sizes");
      for (int r = 0; r < n; ++r) bytes[r] = static_cast<size_t>(rows / n) * row_bytes(t);
      return bytes;
    }
    COMMLIB_CHECK(static_cast<int>(splits.size()) == n, InvalidArgument, what, ": ", arg, " split sizes have ",
                  splits.size(), " entries; expected world_size = ", n);
    int64_t total = 0;
    for (int r = 0; r < n; ++r) {
      COMMLIB_CHECK(splits[r] >= 0, InvalidArgument, what, ": ", arg, " split size ", splits[r], " is negative");
      total += splits[r];
      bytes[r] = static_cast<size_t>(splits[r]) * row_bytes(t);
    }
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    COMMLIB_CHECK(total == rows, InvalidArgument, what, ": ", arg, " split sizes sum to ", total, " but the tensor has ",
                  rows, " rows");
    return bytes;
  };
  COMMLIB_CHECK(in.dim() == 0 || out.dim() == 0 || row_bytes(in) == row_bytes(out) || in.numel() == 0 ||
                    out.numel() == 0,
                InvalidArgument, what, ": input rows have ", row_bytes(in), " bytes but output rows have ",
                row_bytes(out));
  const std::vector<size_t> in_bytes = to_bytes(in, in_splits, "input");
  const std::vector<size_t> out_bytes = to_bytes(out, out_splits, "output");
#if defined(COMMLIB_TORCH_CUDA)
  if (in.is_cuda()) {
    if (in_splits.empty() && out_splits.empty() && in.numel() == out.numel()) return all_to_all_cuda(comm, out, in);
    at::Tensor ins, outs;
    if (!in_splits.empty() || !out_splits.empty()) {
      auto opts = at::TensorOptions().dtype(at::kLong);
      auto host = [&](const std::vector<int64_t>& v, const at::Tensor& t) {
        if (!v.empty()) return at::tensor(v, opts).to(in.device());
        const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
        return at::full({n}, rows / n, opts).to(in.device());
      };
      ins = host(in_splits, in);
      outs = host(out_splits, out);
    }
    return all_to_all_v_cuda(comm, out, in, ins, outs);
  }
#endif
  require_cpu(in, what);
  const at::Tensor src = contiguous_bits(in);
  record_host_exchange(comm, CollectiveOp::kAllToAll, nbytes(src), src);
  with_contiguous(out, [&](at::Tensor& c) { comm.all_to_all_v_host(c.data_ptr(), src.data_ptr(), in_bytes, out_bytes); });
}

}  // namespace commlib::torch_layer
