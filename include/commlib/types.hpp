// Value types shared by every layer: element types, reduction ops, algorithms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace commlib {

enum class DataType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,
  kInt8 = 7,
  kInt16 = 8,
  kBool = 9,
};

// kBand / kBor / kBxor: integer and bool types only (the CPU path; gloo's set).
enum class ReduceOp : int { kSum = 0, kAvg = 1, kMin = 2, kMax = 3, kProd = 4, kBand = 5, kBor = 6, kBxor = 7 };

// kAuto chooses per call (csrc/core/algorithm_selector.cc); kNccl is honoured only where an NCCL
// engine is attached (the torch backend), otherwise it is an error.
enum class Algorithm : int { kAuto = 0, kFlat = 1, kTree = 2, kNccl = 3 };

// How a fused all-reduce + RMSNorm leaves the residual (see the fused kernel's header).
enum class ResidualMode : int { kReplicated = 0, kSharded = 1 };

size_t dtype_size(DataType dtype);
const char* dtype_name(DataType dtype);
const char* reduce_op_name(ReduceOp op);
const char* algorithm_name(Algorithm algo);

// Parses "sum" / "avg" / ...; throws InvalidArgument naming `op_name` and the valid set.
ReduceOp parse_reduce_op(const std::string& what, const std::string& op_name);
Algorithm parse_algorithm(const std::string& what, const std::string& algo_name);

// True for the floating types the reduction kernels accept (float32, float16, bfloat16).
bool is_reducible(DataType dtype);

}  // namespace commlib
