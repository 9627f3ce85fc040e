// torch layer of the fused all-reduce + RMSNorm, shared by fused_ops.cpp and fused_ops_cuda.cpp.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "commlib/communicator.hpp"
#include "commlib/fused_rmsnorm.hpp"

// The GPU path exists once the CUDA communicator (csrc/cuda/cuda_comm.hpp) is in the tree.
#if defined(COMMLIB_TORCH_CUDA) && __has_include("cuda/cuda_comm.hpp")
#define COMMLIB_FUSED_CUDA 1
#endif

namespace commlib::torch_layer {

using ::commlib::FusedAlgo;  // include/commlib/fused_rmsnorm.hpp

FusedAlgo parse_fused_algo(const std::string& name);
ResidualMode parse_residual_mode(const std::string& name);

// Checks shapes, dtypes, devices and sizes (raising the typed errors) and returns the argument
// struct without data pointers.
FusedRmsNormArgs check_fused_tensors(Communicator& comm, const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps, const at::Tensor& out,
                                     ResidualMode mode, int64_t num_sms);

void fused_allreduce_rmsnorm(Communicator& comm, const at::Tensor& x, at::Tensor& residual,
                             const at::Tensor& weight, double eps, at::Tensor& out, ResidualMode mode,
                             int64_t num_sms, FusedAlgo algo);

#if defined(COMMLIB_FUSED_CUDA)
// csrc/torch/fused_ops_cuda.cpp: on the current stream of x's device; args has the data pointers.
void fused_allreduce_rmsnorm_cuda(Communicator& comm, const FusedRmsNormArgs& args, const at::Tensor& x,
                                  at::Tensor& residual, const at::Tensor& weight, at::Tensor& out, int num_sms,
                                  FusedAlgo algo);
#endif

}  // namespace commlib::torch_layer
