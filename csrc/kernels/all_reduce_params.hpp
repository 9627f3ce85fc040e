// Parameters and launchers of the GPU all-reduce kernels (one algorithm per .cu file):
//   all_reduce_flat.cu  one-shot: copy-in, barrier, every rank reduces everything from all peers
//   all_reduce_tree.cu  two-shot: copy-in, barrier, reduce own 1/n slice, barrier, gather slices
// Host-compilable (no nvcc needed); no torch. Launchers validate, choose the grid, split messages
// larger than one workspace half into several calls, and return a Status (never throw).
//
// Every kernel reduces as Note [reduction order] (csrc/host/reduce.hpp) says: fp32, rank order
// 0..n-1, one rounding, avg = sum / n (IEEE division), so flat, tree and the CPU path agree
// bitwise. Synchronisation: Note [flag barrier] (commlib/device/barrier.cuh); workspace halves
// alternate by call parity, so the copy-in paths need no trailing barrier.
#pragma once

#include <cstddef>

#include "commlib/errors.hpp"
#include "commlib/symmetric_buffer.hpp"
#include "commlib/types.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;

// Barrier phase ids recorded in DeviceErrorWord::phase.
enum class AllReducePhase : int { kInputsReady = 0, kSlicesReduced = 1, kPeersDone = 2 };
const char* all_reduce_phase_name(int phase);

// Where the tree kernel's sources live.
enum class AllReduceSource : int {
  kWorkspace = 0,        // copied in from `input` by the kernel
  kSymmetricInput = 1,   // `input` == `output` lies in symmetric memory (`source`): no copy-in
};

struct AllReduceFlatParams {
  const void* input = nullptr;
  void* output = nullptr;  // may alias input
  size_t count = 0;        // elements
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;  // kSum or kAvg
  SymmetricBufferDevice workspace{};  // two halves of workspace.bytes / 2, alternating per call
  BarrierDevice barrier{};
  int max_blocks = 0;  // 0: the built-in choice
};

struct AllReduceTreeParams {
  const void* input = nullptr;
  void* output = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  AllReduceSource source_kind = AllReduceSource::kWorkspace;
  SymmetricBufferDevice workspace{};  // kWorkspace: the copy-in halves
  SymmetricBufferDevice source{};     // kSymmetricInput: every rank's input, at the tensor's offset
  BarrierDevice barrier{};
  int max_blocks = 0;
};

Status launch_all_reduce_flat(const AllReduceFlatParams& params, Stream stream);
Status launch_all_reduce_tree(const AllReduceTreeParams& params, Stream stream);

}  // namespace commlib::kernels
