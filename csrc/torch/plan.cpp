// commlib._C.Plan, plan, plan_counters, reset_plan_counters: the plan of a call (Note [plan] in
// csrc/core/plan.hpp) as Python sees it: Communicator.plan, the benchmark's routing and the tests.
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "core/plan.hpp"
#include "torch/bindings.hpp"
#include "torch/fused_ops.hpp"
#include "torch/torch_common.hpp"

#if defined(COMMLIB_TORCH_CUDA)
#include "cuda/cuda_comm.hpp"
#endif

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

constexpr const char* kOps =
    "all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, fused_allreduce_rmsnorm";

// `device`: "" for the tensor's own; "cpu" or "cuda" to plan as if it lived there (the plan is pure:
// a CUDA call's plan needs no GPU).
Placement placement_of(const at::Tensor& t, const std::string& device, const char* what) {
  if (device == "cpu") return Placement::kCpu;
  if (device == "cuda") return Placement::kCuda;
  COMMLIB_CHECK(device.empty(), InvalidArgument, what, ": device '", device, "' not supported; supported: cpu, cuda");
  check_cpu_or_cuda(t, what, "tensor");
  return t.is_cuda() ? Placement::kCuda : Placement::kCpu;
}

size_t bytes_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

Residence residence_of(Communicator& comm, const at::Tensor& t) {
#if defined(COMMLIB_TORCH_CUDA)
  if (t.is_cuda() && comm.has_cuda()) return comm.cuda().residence(t.data_ptr(), t.data_ptr(), bytes_of(t));
#endif
  (void)comm;
  (void)t;
  return Residence::kPlain;
}

// The plan `op` would run for `tensor` (all_reduce, broadcast: the tensor; reduce_scatter,
// all_gather, all_to_all: the input; fused: x) on `comm`, as the direct API runs it, or as the
// torch backend runs it when `nccl` (an NCCL engine attached).
Plan plan_for(Communicator& comm, const std::string& op, const at::Tensor& t, const std::string& algo, bool nccl,
              int64_t num_sms, const std::string& residual_mode, const std::string& fused_algo,
              const std::string& device) {
  const char* what = "Communicator.plan";
  const Placement placement = placement_of(t, device, what);
  const NcclEngine engine = nccl ? NcclEngine::kAttached : NcclEngine::kNone;
  const CommConfig& config = comm.config();
  if (op == "all_reduce") {
    AllReduceShape shape;
    shape.bytes = bytes_of(t);
    shape.dtype = to_data_type(t.scalar_type(), what);
    shape.placement = placement;
    shape.requested = parse_algorithm("all_reduce", algo);
    shape.nccl = engine;
    shape.residence = residence_of(comm, t);
    return plan_all_reduce(config, shape);
  }
  const struct {
    const char* name;
    CollectiveOp op;
  } exchanges[] = {{"reduce_scatter", CollectiveOp::kReduceScatter},
                   {"all_gather", CollectiveOp::kAllGather},
                   {"broadcast", CollectiveOp::kBroadcast},
                   {"all_to_all", CollectiveOp::kAllToAll}};
  for (const auto& e : exchanges) {
    if (op != e.name) continue;
    ExchangeShape shape;
    shape.op = e.op;
    shape.message_bytes = e.op == CollectiveOp::kAllGather ? bytes_of(t) * static_cast<size_t>(comm.world_size())
                                                            : bytes_of(t);
    shape.dtype = to_data_type(t.scalar_type(), what);
    shape.placement = placement;
    shape.nccl = engine;
    return plan_exchange(config, shape);
  }
  if (op == "fused_allreduce_rmsnorm") {
    COMMLIB_CHECK(t.dim() == 2, InvalidArgument, what, ": fused_allreduce_rmsnorm takes x of shape [tokens, hidden]; got ",
                  t.dim(), "-D");
    COMMLIB_CHECK(num_sms >= 0, InvalidArgument, what, ": num_sms ", num_sms, " must be >= 0");
    FusedShape shape;
    shape.num_tokens = t.size(0);
    shape.hidden = t.size(1);
    shape.dtype = to_data_type(t.scalar_type(), what);
    shape.mode = parse_residual_mode(residual_mode);
    shape.num_sms = static_cast<int>(num_sms);
    shape.algo = parse_fused_algo(fused_algo);
    shape.placement = placement;
    return plan_fused(config, shape);
  }
  throw InvalidArgument(detail::concat(what, ": op '", op, "' not known; known: ", kOps));
}

py::dict geometry_dict(const Geometry& g) {
  py::dict d;
  d["grid"] = g.grid;
  d["block"] = g.block;
  d["row_ctas"] = g.row_ctas;
  d["packs_per_thread"] = g.packs_per_thread;
  d["chunk_bytes"] = g.chunk_bytes;
  d["pdl"] = g.order == kernels::LaunchOrder::kProgrammatic;
  return d;
}

BindingRegistrar reg("plan", [](py::module_& m) {
  py::class_<Plan>(m, "Plan", "What one call runs (Note [plan]): variant, geometry, reason.")
      .def_property_readonly("variant", [](const Plan& p) { return std::string(variant_name(p.variant)); })
      .def_property_readonly("reason", &Plan::reason)
      .def_property_readonly("geometry", [](const Plan& p) { return geometry_dict(p.geometry); })
      .def_property_readonly("op", [](const Plan& p) { return std::string(p.op); })
      .def("__repr__", [](const Plan& p) { return "Plan(" + p.reason() + ")"; });
  m.def(
      "plan",
      [](const py::handle& comm_obj, const std::string& op, const at::Tensor& t, const std::string& algo, bool nccl,
         int64_t num_sms, const std::string& residual_mode, const std::string& fused_algo, const std::string& device) {
        std::shared_ptr<Communicator> comm = communicator_from_python(comm_obj);
        COMMLIB_CHECK(!comm->closed(), InvalidArgument, "Communicator.plan: communicator '", comm->name(),
                      "' is closed");
        return plan_for(*comm, op, t, algo, nccl, num_sms, residual_mode, fused_algo, device);
      },
      py::arg("comm"), py::arg("op"), py::arg("tensor"), py::arg("algo") = "auto", py::arg("nccl") = false,
      py::arg("num_sms") = 0, py::arg("residual_mode") = "replicated", py::arg("fused_algo") = "auto",
      py::arg("device") = "",
      "The plan `op` runs for `tensor` on `comm` (direct API; nccl=True: as the torch backend, with NCCL attached).");
  m.def(
      "plan_counters",
      [] {
        py::dict d;
        for (int v = 0; v < kNumVariants; ++v) {
          d[variant_name(static_cast<Variant>(v))] = plan_count(static_cast<Variant>(v));
        }
        return d;
      },
      "Executed plans of this process by variant (every variant, zeros included).");
  m.def("reset_plan_counters", &reset_plan_counters, "Sets every variant's counter of this process to 0.");
});

}  // namespace
}  // namespace commlib::torch_layer
