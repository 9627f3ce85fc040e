// commlib._C: the pybind11 module. Maps commlib's typed errors to Python and runs the registrars.
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <string>

#include "commlib/env.hpp"
#include "torch/bindings.hpp"
#include "torch/torch_common.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {

static std::map<std::string, BindFn>& registry() {
  static std::map<std::string, BindFn> fns;
  return fns;
}

BindingRegistrar::BindingRegistrar(const char* name, BindFn fn) { registry()[name] = std::move(fn); }

std::shared_ptr<Communicator> communicator_from_python(const py::handle& obj) {
  return obj.cast<std::shared_ptr<Communicator>>();
}

namespace {

void set_python_error(const char* cls, const std::exception& e) {
  py::object type = py::module_::import("commlib.errors").attr(cls);
  PyErr_SetString(type.ptr(), e.what());
}

void bind_communicator(py::module_& m) {
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size, std::string name,
                       double timeout_s) {
             CommunicatorOptions options;
             options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
             return std::make_shared<Communicator>(std::make_shared<TorchStore>(store), rank, world_size,
                                                   std::move(name), options);
           }),
           py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("name"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def_property_readonly("name", &Communicator::name)
      .def_property_readonly("closed", &Communicator::closed)
      .def_property_readonly("peer_pids", &Communicator::peer_pids)
      .def_property_readonly("num_hosts", &Communicator::num_hosts)
      .def_property_readonly("host_of", &Communicator::host_of)
      .def(
          "control_all_gather",
          [](Communicator& c, const py::bytes& mine) {
            std::string in = mine;
            std::string out(in.size() * static_cast<size_t>(c.world_size()), '\0');
            {
              py::gil_scoped_release release;
              c.control_all_gather(out.data(), in.data(), in.size());
            }
            std::vector<py::bytes> all;
            for (int r = 0; r < c.world_size(); ++r) all.emplace_back(out.substr(r * in.size(), in.size()));
            return all;
          },
          py::arg("mine"))
      .def("close", &Communicator::close, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Communicator::abort, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("aborted", &Communicator::aborted)
      .def("error",
           [](const Communicator& c) {
             switch (c.error()) {
               case Communicator::ErrorState::kTimeout: return "timeout";
               case Communicator::ErrorState::kRemote: return "remote";
               case Communicator::ErrorState::kAborted: return "aborted";
               case Communicator::ErrorState::kNone: break;
             }
             return "none";
           })
      .def(
          "all_reduce",
          [](Communicator& c, at::Tensor t, const std::string& op, const std::string& algo) {
            all_reduce(c, t, parse_reduce_op("all_reduce", op), parse_algorithm("all_reduce", algo));
          },
          py::arg("tensor"), py::arg("op"), py::arg("algo"), py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce_out",
          [](Communicator& c, at::Tensor out, const at::Tensor& t, const std::string& op, const std::string& algo) {
            all_reduce_out(c, out, t, parse_reduce_op("all_reduce", op), parse_algorithm("all_reduce", algo));
          },
          py::arg("output"), py::arg("tensor"), py::arg("op"), py::arg("algo"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_scatter",
          [](Communicator& c, at::Tensor out, const at::Tensor& in, const std::string& op) {
            reduce_scatter(c, out, in, parse_reduce_op("reduce_scatter", op));
          },
          py::arg("output"), py::arg("input"), py::arg("op"), py::call_guard<py::gil_scoped_release>())
      .def(
          "all_gather", [](Communicator& c, at::Tensor out, const at::Tensor& in) { all_gather(c, out, in); },
          py::arg("output"), py::arg("input"), py::call_guard<py::gil_scoped_release>())
      .def(
          "broadcast", [](Communicator& c, at::Tensor t, int src) { broadcast(c, t, src); }, py::arg("tensor"),
          py::arg("src"), py::call_guard<py::gil_scoped_release>())
      .def(
          "all_to_all_v",
          [](Communicator& c, at::Tensor out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
             const std::vector<int64_t>& in_splits) { all_to_all_v(c, out, in, out_splits, in_splits); },
          py::arg("output"), py::arg("input"), py::arg("output_split_sizes"), py::arg("input_split_sizes"),
          py::call_guard<py::gil_scoped_release>())
      .def("barrier", &Communicator::barrier_host, py::call_guard<py::gil_scoped_release>());
}

}  // namespace
}  // namespace commlib::torch_layer

PYBIND11_MODULE(_C, m) {
  using namespace commlib::torch_layer;
  m.doc() = "commlib native extension (see the commlib package for the documented API)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const commlib::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const commlib::TypeMismatch& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const commlib::Error& e) {
      set_python_error(error_class_name(e), e);
    }
  });
  bind_communicator(m);
  m.def("last_error_class", [] { return std::string(last_error_class); },
        "commlib.errors class name of this thread's last DistBackendError from a torch.ops.commlib op");
  m.def("host_id", &commlib::host_id,
        "This process's host id (COMMLIB_TEST_HOST_ID when set, else host name and boot id)");
  m.def("knobs", [] {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const auto& k : commlib::env::knobs()) out.emplace_back(k.name, k.default_value, k.meaning);
    return out;
  });
#if defined(COMMLIB_WITH_CUDA)
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  for (auto& [name, fn] : registry()) fn(m);
}
