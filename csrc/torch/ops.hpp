// The torch.ops.commlib operators (csrc/torch/ops.cpp) and the registry of names they take.
//
// Ops name their communicator (or EP buffer) by a string, as torch's symmetric-memory and
// functional-collective ops name a process group: a graph keeps a constant it can print and
// compare, never an object or a handle. The Python layer registers a name when it creates the
// object and unregisters it when it closes it; the registry holds objects weakly.
#pragma once

#include <memory>
#include <string>

#include "commlib/communicator.hpp"
#include "torch/ep_buffer.hpp"

namespace commlib::torch_layer {

// What register_group does when another open communicator has the name: raise InvalidArgument
// (the direct API: a name is the user's), or take the name over (process groups: torch reuses a
// destroyed group's name while its backend may still be alive).
enum class NameClash : int { kRaise = 0, kReplace = 1 };

// Registers `comm` under `name` in this process; registering the same communicator again is a no-op.
void register_group(const std::string& name, const std::shared_ptr<Communicator>& comm,
                    NameClash clash = NameClash::kRaise);
// Removes `name` when it names `comm` (or nothing live); another communicator's entry is kept.
void unregister_group(const std::string& name, const Communicator* comm);
// The live, open communicator named `name`; raises InvalidArgument naming `what` otherwise.
std::shared_ptr<Communicator> communicator_from_group(const std::string& name, const char* what);

void register_ep_buffer(const std::string& name, const std::shared_ptr<EPBufferTorch>& buffer);
void unregister_ep_buffer(const std::string& name, const EPBufferTorch* buffer);
std::shared_ptr<EPBufferTorch> ep_buffer_from_name(const std::string& name, const char* what);

}  // namespace commlib::torch_layer
