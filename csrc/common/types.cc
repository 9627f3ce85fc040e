#include "commlib/types.hpp"

#include "commlib/errors.hpp"

namespace commlib {

void throw_if_error(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk:
      return;
    case StatusCode::kInvalidArgument:
    case StatusCode::kUnsupported:
      throw InvalidArgument(status.message());
    case StatusCode::kTypeMismatch:
      throw TypeMismatch(status.message());
    case StatusCode::kCudaError:
      throw CudaError(status.message());
    case StatusCode::kTimeout:
      throw Timeout(status.message());
    case StatusCode::kInternal:
      break;
  }
  throw Error(status.message());
}

size_t dtype_size(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kFloat64: return 8;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kUInt8: return 1;
    case DataType::kInt8: return 1;
    case DataType::kInt16: return 2;
    case DataType::kBool: return 1;
  }
  return 0;
}

const char* dtype_name(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat64: return "float64";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt8: return "int8";
    case DataType::kInt16: return "int16";
    case DataType::kBool: return "bool";
  }
  return "unknown";
}

bool is_reducible(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
}

namespace {
constexpr const char* kOpNames[] = {"sum", "avg", "min", "max", "prod", "band", "bor", "bxor"};
constexpr const char* kAlgoNames[] = {"auto", "flat", "tree", "nccl"};
}  // namespace

const char* reduce_op_name(ReduceOp op) { return kOpNames[static_cast<int>(op)]; }
const char* algorithm_name(Algorithm algo) { return kAlgoNames[static_cast<int>(algo)]; }

ReduceOp parse_reduce_op(const std::string& what, const std::string& op_name) {
  for (int i = 0; i < 5; ++i) {
    if (op_name == kOpNames[i]) return static_cast<ReduceOp>(i);
  }
  throw InvalidArgument(what + ": op '" + op_name + "' not supported; supported: sum, avg, min, max, prod");
}

Algorithm parse_algorithm(const std::string& what, const std::string& algo_name) {
  for (int i = 0; i < 4; ++i) {
    if (algo_name == kAlgoNames[i]) return static_cast<Algorithm>(i);
  }
  throw InvalidArgument(what + ": algo '" + algo_name + "' not supported; supported: auto, flat, tree, nccl");
}

}  // namespace commlib
