// Parameters and launcher of the dynamic all-to-all (csrc/kernels/all_to_all_v.cu): splits live
// in device memory and are never read by the host. Host-compilable; no torch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "commlib/errors.hpp"
#include "commlib/phase.hpp"
#include "commlib/symmetric_buffer.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;


// Where peers write the rows.
enum class AllToAllVTarget : int {
  kWorkspace = 0,        // `recv` is the workspace (two halves by call parity); the kernel copies out
  kSymmetricOutput = 1,  // `recv` is the output itself (symmetric memory, at the tensor's offset)
};

// Control area (symmetric): [kMaxBarrierBlocks][kMaxDeviceRanks] slots of 16 bytes, then the error
// word (uint64: splits rejected or mismatched since the last check).
constexpr size_t kAllToAllVErrorOffset = static_cast<size_t>(kMaxBarrierBlocks) * kMaxDeviceRanks * 16;
constexpr size_t kAllToAllVControlBytes = kAllToAllVErrorOffset + 64;

struct AllToAllVParams {
  const void* input = nullptr;
  void* output = nullptr;
  int64_t row_bytes = 0;
  int64_t in_rows = 0;                 // rows of input (a bound for sum(in_splits))
  int64_t out_rows = 0;                // rows of output (a bound for sum(out_splits))
  const int64_t* in_splits = nullptr;  // device [world]; null: in_rows / world each
  const int64_t* out_splits = nullptr; // device [world]; null: out_rows / world each
  AllToAllVTarget target = AllToAllVTarget::kWorkspace;
  SymmetricBufferDevice recv{};
  SymmetricBufferDevice control{};
  BarrierDevice barrier{};
  int num_blocks = 32;  // must be the same on every rank
};

Status launch_all_to_all_v(const AllToAllVParams& params, Stream stream);

}  // namespace commlib::kernels
