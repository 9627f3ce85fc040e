// Parameters and launchers of the GPU all-reduce kernels (one algorithm per .cu file):
//   all_reduce_flat.cu  one-shot: copy-in, barrier, every rank reduces everything from all peers
//   all_reduce_tree.cu  two-shot: copy-in, barrier, reduce own 1/n slice, barrier, gather slices
//   all_reduce_flat_ll.cu  one-shot without a barrier: every 8 bytes carry their own ready flag
// Host-compilable (no nvcc needed); no torch. Launchers validate, choose the grid, split messages
// larger than one workspace half into several calls, and return a Status (never throw).
//
// Every kernel reduces as Note [reduction order] (csrc/host/reduce.hpp) says: fp32, rank order
// 0..n-1, one rounding, avg = sum / n (IEEE division), so flat, tree and the CPU path agree
// bitwise. Synchronisation: Note [flag barrier] (commlib/device/barrier.cuh); workspace halves
// alternate by call parity, so the copy-in paths need no trailing barrier.
#pragma once

#include <cstddef>
#include <cstdint>

#include "commlib/errors.hpp"
#include "commlib/phase.hpp"
#include "commlib/symmetric_buffer.hpp"
#include "commlib/types.hpp"
#include "kernels/launch.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;


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
  LaunchOrder order = LaunchOrder::kStream;  // COMMLIB_PDL, resolved by the core
};

// Launch geometry of the tree kernel; 0 fields take the built-in choice (all_reduce_tree.cu).
// Every rank must pass the same values: block b of every rank must own the same data.
struct TreeLaunchConfig {
  int max_blocks = 0;           // grid cap, 1..kMaxBarrierBlocks
  int threads = 0;              // threads per block cap, a multiple of 32 in 32..512
  int64_t min_packs_per_block = 0;  // fewer 16-byte packs of a slice per block: fewer blocks
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
  int max_blocks = 0;  // COMMLIB_ALLREDUCE_MAX_BLOCKS; config.max_blocks wins when set
  TreeLaunchConfig config{};
};

// Valid ranges of TreeLaunchConfig (checked by the host when it reads the knobs).
constexpr int kTreeMaxThreads = 512;
constexpr int64_t kTreeMaxMinPacksPerBlock = int64_t{1} << 24;

// Note [LL lines]
// The LL buffer of each rank holds, per call parity and per source rank, 16-byte lines
// {data0, flag, data1, flag} (8 payload bytes per line; 8-byte stores are single-copy atomic, so
// a reader that sees the flag in a half sees that half's data). flag = call number + 1 (never 0,
// the buffer's initial value; the other parity's stale lines carry call - 1). Block-local, no
// barrier: a rank that starts call k + 2 has finished call k + 1, which needed every peer's call
// k + 1 data, which each peer wrote after finishing its call k reads: so reusing a parity is safe.
// Every LL kernel (all-reduce, exchange, reduce_scatter, fused, EP) stores and receives lines through
// include/commlib/device/ll.cuh only (ll_store, ll_wait_all).
struct AllReduceFlatLLParams {
  const void* input = nullptr;
  void* output = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  SymmetricBufferDevice lines{};  // ll_buffer_bytes(world, max_bytes_per_call) per rank, zeroed
  size_t max_bytes_per_call = 0;  // payload per call; larger messages run as several calls
  BarrierDevice barrier{};        // call counter, timeout and error word only
  int max_blocks = 0;
  LaunchOrder order = LaunchOrder::kStream;  // COMMLIB_PDL, resolved by the core
};

// Bytes of each rank's LL buffer for `max_bytes_per_call` of payload (two parities, all sources).
inline size_t ll_buffer_bytes(int world_size, size_t max_bytes_per_call) {
  return 2 * static_cast<size_t>(world_size) * 2 * max_bytes_per_call;
}

Status launch_all_reduce_flat(const AllReduceFlatParams& params, Stream stream);
Status launch_all_reduce_tree(const AllReduceTreeParams& params, Stream stream);
Status launch_all_reduce_flat_ll(const AllReduceFlatLLParams& params, Stream stream);

}  // namespace commlib::kernels
