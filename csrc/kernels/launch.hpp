// How a kernel is ordered after the previous work of its stream: part of the configuration the
// core resolves per communicator (COMMLIB_PDL) and passes to the launchers in their params.
// Host-compilable; no CUDA. Note [programmatic dependent launch] in csrc/kernels/launch.cuh.
#pragma once

#include <cstdint>

namespace commlib::kernels {

enum class LaunchOrder : uint8_t {
  kStream,        // plain stream order: starts when the previous kernel has completed
  kProgrammatic,  // Note [programmatic dependent launch]
};

}  // namespace commlib::kernels
