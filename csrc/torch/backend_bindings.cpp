// The Python class commlib._C.DdaBackend.
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>

#include "torch/backend.hpp"
#include "torch/bindings.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

// Holds a Python callable; takes the GIL to call and to release it.
DdaBackend::InnerFactory python_factory(py::object fn) {
  if (fn.is_none()) return {};
  std::shared_ptr<py::object> holder(new py::object(std::move(fn)), [](py::object* p) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete p;
    } else {
      p->release();  // the interpreter is gone: leak the reference rather than touch it
      delete p;
    }
  });
  return [holder]() -> c10::intrusive_ptr<c10d::Backend> {
    py::gil_scoped_acquire gil;
    return (*holder)().cast<c10::intrusive_ptr<c10d::Backend>>();
  };
}

void bind_backend(py::module_& m) {
  // torch's Backend must be registered with pybind11 before a class can derive from it.
  py::module_::import("torch._C._distributed_c10d");
  py::class_<DdaBackend, c10d::Backend, c10::intrusive_ptr<DdaBackend>>(
      m, "DdaBackend", "The c10d backend of \"ddacomm\" (see commlib.backend_registration).")
      .def(py::init([](int rank, int size, py::object comm, const c10::intrusive_ptr<c10d::Backend>& gloo,
                       py::object nccl_factory, std::chrono::milliseconds timeout, std::string group_name,
                       std::vector<uint64_t> global_ranks) {
             DdaBackend::Config config;
             config.timeout = timeout;
             config.group_name = std::move(group_name);
             config.global_ranks_in_group = std::move(global_ranks);
             std::shared_ptr<Communicator> native = comm.is_none() ? nullptr : communicator_from_python(comm);
             return c10::make_intrusive<DdaBackend>(rank, size, std::move(native), gloo,
                                                    python_factory(std::move(nccl_factory)), std::move(config));
           }),
           py::arg("rank"), py::arg("size"), py::arg("comm"), py::arg("gloo"), py::arg("nccl_factory"),
           py::arg("timeout"), py::arg("group_name"), py::arg("global_ranks_in_group"))
      .def_property_readonly("has_fast_path", &DdaBackend::has_fast_path)
      .def_property_readonly("nccl_created", &DdaBackend::nccl_created)
      .def_property_readonly("num_fast_calls", &DdaBackend::num_fast_calls)
      .def_property_readonly("num_fallback_calls", &DdaBackend::num_fallback_calls)
      .def(
          "_attach_hierarchy",
          [](DdaBackend& self, int num_hosts, int local_size, int host_index, int local_rank, std::vector<int> rank_of,
             const c10::intrusive_ptr<c10d::Backend>& intra, const c10::intrusive_ptr<c10d::Backend>& inter_gloo,
             py::object inter_nccl_factory, std::chrono::milliseconds timeout, bool inter_cuda_via_host) {
            HostLayout layout{num_hosts, local_size, host_index, local_rank, std::move(rank_of)};
            self.attach_hierarchy(std::make_unique<Hierarchy>(
                std::move(layout), intra, inter_gloo, python_factory(std::move(inter_nccl_factory)), timeout,
                inter_cuda_via_host ? Hierarchy::InterCuda::kGlooViaHost : Hierarchy::InterCuda::kNccl));
          },
          py::arg("num_hosts"), py::arg("local_size"), py::arg("host_index"), py::arg("local_rank"),
          py::arg("rank_of"), py::arg("intra"), py::arg("inter_gloo"), py::arg("inter_nccl_factory"),
          py::arg("timeout"), py::arg("inter_cuda_via_host") = false,
          "Makes this multi-host group run two-level collectives (Note [hierarchical collectives]); "
          "backend_registration calls it once, at group creation.")
      .def(
          "_inter_host_all_reduce",
          [](DdaBackend& self, at::Tensor tensor) {
            TORCH_CHECK_VALUE(self.hierarchy() != nullptr, "ddacomm: this group has no hierarchy");
            self.hierarchy()->inter_all_reduce(tensor, c10d::ReduceOp(c10d::ReduceOp::SUM));
          },
          py::arg("tensor"),
          "Sums `tensor` in place over the ranks of the other hosts with this rank's local index (the "
          "inter-host leg of a two-level all-reduce); blocking on CPU, on the current stream on CUDA.")
      .def_property_readonly("hierarchical", [](const DdaBackend& self) { return self.hierarchy() != nullptr; })
      .def_property_readonly("host_layout",
                             [](const DdaBackend& self) -> py::object {
                               const Hierarchy* h = self.hierarchy();
                               if (h == nullptr) return py::none();
                               const HostLayout& l = h->layout();
                               return py::make_tuple(l.num_hosts, l.local_size, l.host_index, l.local_rank);
                             })
      .def_property_readonly("num_hierarchical_calls", [](const DdaBackend& self) -> int64_t {
        return self.hierarchy() ? self.hierarchy()->num_calls() : 0;
      });
}

BindingRegistrar registrar("backend", bind_backend);

}  // namespace
}  // namespace commlib::torch_layer
