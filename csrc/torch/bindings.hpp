// Each binding file adds its part of commlib._C through a registrar, so files stay independent:
//   static commlib::torch_layer::BindingRegistrar reg("ep", [](pybind11::module_& m) { ... });
#pragma once

#include <torch/extension.h>

#include <functional>
#include <memory>

#include "commlib/communicator.hpp"

namespace commlib::torch_layer {

using BindFn = std::function<void(pybind11::module_&)>;

struct BindingRegistrar {
  BindingRegistrar(const char* name, BindFn fn);
};

// The Python-side communicator object: the core communicator plus what the torch layer keeps.
std::shared_ptr<Communicator> communicator_from_python(const pybind11::handle& obj);

}  // namespace commlib::torch_layer
