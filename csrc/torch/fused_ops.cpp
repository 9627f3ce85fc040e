// torch layer of the fused all-reduce + residual add + RMSNorm (include/commlib/fused_rmsnorm.hpp):
// argument checks and the CPU / GPU call behind torch.ops.commlib.fused_allreduce_rmsnorm
// (csrc/torch/ops.cpp), and the multicast guard's Python face.

#include "commlib/fused_rmsnorm.hpp"
#include "common/multicast_guard.hpp"
#include "transport/cuda_multicast.hpp"
#include "torch/bindings.hpp"
#include "torch/fused_ops.hpp"
#include "torch/ops.hpp"
#include "torch/torch_common.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

constexpr const char* kWhat = "fused_allreduce_rmsnorm";

}  // namespace

FusedAlgo parse_fused_algo(const std::string& name) {
  if (name == "auto") return FusedAlgo::kAuto;
  if (name == "p2p") return FusedAlgo::kP2p;
  if (name == "multimem") return FusedAlgo::kMultimem;
  throw InvalidArgument(detail::concat(kWhat, ": algo '", name, "' not supported; supported: auto, p2p, multimem"));
}

ResidualMode parse_residual_mode(const std::string& name) {
  if (name == "replicated") return ResidualMode::kReplicated;
  if (name == "sharded") return ResidualMode::kSharded;
  throw InvalidArgument(
      detail::concat(kWhat, ": residual_mode '", name, "' not supported; supported: replicated, sharded"));
}

FusedRmsNormArgs check_fused_tensors(Communicator& comm, const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps, const at::Tensor& out,
                                     ResidualMode mode, int64_t num_sms) {
  check_cpu_or_cuda(x, kWhat, "x");
  check_cpu_or_cuda(residual, kWhat, "residual");
  check_cpu_or_cuda(weight, kWhat, "weight");
  check_cpu_or_cuda(out, kWhat, "out");
  const DataType dtype = reducible_type(x, kWhat);
  for (const auto& [t, name] : {std::pair{&residual, "residual"}, {&weight, "weight"}, {&out, "out"}}) {
    COMMLIB_CHECK(t->scalar_type() == x.scalar_type(), TypeMismatch, kWhat, ": dtype mismatch: ", name, " is ",
                  dtype_str(t->scalar_type()), " but x is ", dtype_str(x.scalar_type()),
                  "; x, residual, weight and out must have the same dtype");
    COMMLIB_CHECK(t->device() == x.device(), TypeMismatch, kWhat, ": device mismatch: ", name, " is on ",
                  t->device().str(), " but x is on ", x.device().str());
  }
  COMMLIB_CHECK(x.dim() == 2, InvalidArgument, kWhat, ": x must be 2-D [tokens, hidden]; got ", x.dim(),
                "-D shape ", x.sizes());
  const int64_t num_tokens = x.size(0);
  const int64_t hidden = x.size(1);
  COMMLIB_CHECK(hidden % kFusedHiddenAlign == 0 && hidden >= kFusedHiddenAlign && hidden <= kFusedMaxHidden,
                InvalidArgument, kWhat, ": hidden size ", hidden, " not supported; supported: multiples of ",
                kFusedHiddenAlign, " from ", kFusedHiddenAlign, " to ", kFusedMaxHidden);
  COMMLIB_CHECK(weight.dim() == 1 && weight.size(0) == hidden, InvalidArgument, kWhat, ": weight must have shape [",
                hidden, "]; got ", weight.sizes());
  COMMLIB_CHECK(out.sizes() == x.sizes(), InvalidArgument, kWhat, ": out must have x's shape ", x.sizes(), "; got ",
                out.sizes());
  const TokenSlice mine = token_slice(num_tokens, comm.world_size(), comm.rank());
  ResidualLayout layout = ResidualLayout::kFull;
  const bool full = residual.dim() == 2 && residual.size(0) == num_tokens && residual.size(1) == hidden;
  if (!full) {
    const bool slice = residual.dim() == 2 && residual.size(0) == mine.size() && residual.size(1) == hidden;
    COMMLIB_CHECK(slice && mode == ResidualMode::kSharded, InvalidArgument, kWhat, ": residual must have shape [",
                  num_tokens, ", ", hidden, "]",
                  mode == ResidualMode::kSharded
                      ? detail::concat(" or this rank's slice [", mine.size(), ", ", hidden, "]")
                      : std::string(""),
                  " (residual_mode '", mode == ResidualMode::kSharded ? "sharded" : "replicated", "'); got ",
                  residual.sizes());
    layout = ResidualLayout::kSlice;
  }
  COMMLIB_CHECK(residual.is_contiguous() && out.is_contiguous(), InvalidArgument, kWhat,
                ": residual and out are written in place and must be contiguous");
  COMMLIB_CHECK(out.numel() == 0 || (out.data_ptr() != residual.data_ptr() && out.data_ptr() != x.data_ptr()),
                InvalidArgument, kWhat, ": out must not alias x or residual");
  COMMLIB_CHECK(num_sms >= 0 && num_sms <= 1024, InvalidArgument, kWhat, ": num_sms ", num_sms,
                " out of range; valid: 0 (auto) or 1..1024");
  FusedRmsNormArgs args;
  args.num_tokens = num_tokens;
  args.hidden = hidden;
  args.dtype = dtype;
  args.eps = static_cast<float>(eps);
  args.mode = mode;
  args.residual_layout = layout;
  check_fused_rmsnorm_args(args, comm.world_size(), comm.rank());
  return args;
}

void fused_allreduce_rmsnorm(Communicator& comm, const at::Tensor& x_in, at::Tensor& residual,
                             const at::Tensor& weight_in, double eps, at::Tensor& out, ResidualMode mode,
                             int64_t num_sms, FusedAlgo algo) {
  // Refused before anything else, in particular before any CUDA call.
  if (algo == FusedAlgo::kMultimem) require_multicast(kWhat);
  FusedRmsNormArgs args = check_fused_tensors(comm, x_in, residual, weight_in, eps, out, mode, num_sms);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  args.x = x.data_ptr();
  args.weight = weight.data_ptr();
  args.residual = residual.data_ptr();
  args.out = out.data_ptr();
  if (x.device().is_cuda()) {
#if defined(COMMLIB_FUSED_CUDA)
    return fused_allreduce_rmsnorm_cuda(comm, args, x, residual, weight, out, static_cast<int>(num_sms), algo);
#else
    throw TypeMismatch(detail::concat(kWhat, ": CUDA tensors are not supported by this build; supported: cpu"));
#endif
  }
  COMMLIB_CHECK(algo != FusedAlgo::kMultimem, InvalidArgument, kWhat,
                ": algo 'multimem' needs CUDA tensors; CPU tensors support: auto, p2p");
  fused_allreduce_rmsnorm_host(comm, args);
}

}  // namespace commlib::torch_layer

namespace commlib::torch_layer {
namespace {

const BindingRegistrar kRegistrar("fused", [](py::module_& m) {
  m.def(
      "token_slice",
      [](int64_t num_tokens, int world_size, int rank) {
        COMMLIB_CHECK(world_size >= 1 && rank >= 0 && rank < world_size && num_tokens >= 0, InvalidArgument,
                      "token_slice: need num_tokens >= 0 and 0 <= rank < world_size; got num_tokens ", num_tokens,
                      ", world_size ", world_size, ", rank ", rank);
        const TokenSlice s = token_slice(num_tokens, world_size, rank);
        return py::make_tuple(s.begin, s.end);
      },
      py::arg("num_tokens"), py::arg("world_size"), py::arg("rank"));
  m.def("multicast_allowed", [] {
    const MulticastDecision d = multicast_decision();
    return py::make_tuple(d.allowed, d.variable, d.reason);
  }, "(allowed, deciding variable, reason) from the process environment; makes no CUDA call.");
  m.def(
      "multicast_decision_for",
      [](const std::map<std::string, std::string>& vars) {
        const MulticastDecision d = multicast_decision([&](const char* name) -> std::optional<std::string> {
          auto it = vars.find(name);
          if (it == vars.end()) return std::nullopt;
          return it->second;
        });
        return py::make_tuple(d.allowed, d.variable, d.reason);
      },
      py::arg("variables"), "The guard's decision for the given variables instead of the environment.");
  m.def(
      "require_multicast", [](const std::string& what) { require_multicast(what.c_str()); }, py::arg("what"));
  m.def("multicast_objects_created", &multicast_objects_created,
        "NVLink multicast objects this process has created (0 wherever the guard refuses).");
  m.def(
      "multicast_workspace_bytes",
      [](const std::string& group_name, int device) {
        std::shared_ptr<Communicator> comm = communicator_from_group(group_name, "multicast workspace");
        return comm->multicast(device).bytes();
      },
      py::arg("group_name"), py::arg("device"),
      "Collective: the communicator's multicast workspace (created on first use) and its bytes per rank; "
      "raises ValueError, before any CUDA call, where the multicast guard refuses.");
});

}  // namespace
}  // namespace commlib::torch_layer
