// Parameters and launchers of the GPU data-movement collectives besides all-reduce, all one shape
// (Note [push exchange]):
//   exchange.cu        all_gather, all_to_all (equal splits), broadcast: push, barrier, copy out
//   reduce_scatter.cu  reduce_scatter: push, barrier, reduce the landed slices locally
//   exchange_ll.cu     all_gather, all_to_all and reduce_scatter of small messages without the
//                      barrier: the pushes travel as flag-carrying LL lines (Note [LL lines])
// Host-compilable (no nvcc needed); no torch. Launchers validate, choose the grid, split messages
// larger than one workspace half into several calls (one barrier each), and return a Status.
//
// Note [push exchange]
// Every byte that crosses NVLink is a store into the receiver's workspace half (posted: no round
// trip on the critical path), then one flag barrier (Note [flag barrier]: release arrival publishes
// the pushes, acquire wait makes the peers' pushes visible), then each rank reads its own workspace
// locally (HBM) into the output. Per call, each rank moves over NVLink exactly what it must send
// (all_gather and reduce_scatter: (n - 1) / n of the message; all_to_all: the blocks for the
// peers; broadcast: the root, (n - 1) copies), as a ring or NCCL's two-shot would, in one step
// instead of n - 1: so the same kernel is the one-shot algorithm at small sizes and moves
// bandwidth-optimally at large ones (no two-shot variant is needed except for broadcast at n > 2,
// where the root's egress is the limit and NCCL's pipelined chain wins above the crossover).
// Why push + local copy-out rather than copy-in + remote pull: a pull puts NVLink load latency on
// every pack's critical path, a push only its store; the extra local pass costs HBM bandwidth
// (~10x NVLink's), not NVLink's. Why SM copies rather than the copy engine: the exchange is one
// kernel with the barrier inside it (a copy-engine transfer needs stream-ordered flags around it,
// two more graph nodes and ~2-3 µs each at small sizes), and at world 2 SM stores reach ~NVLink
// bandwidth with 128 CTAs; the copy engine's advantage (0 SMs) matters for overlap (the CP ring
// uses it), not for a blocking collective.
// Workspace: each half holds world slots of slot_bytes; slot s of rank q's half receives rank s's
// data for q. Halves alternate by call parity (no trailing barrier). Block b of every rank owns
// the same packs of every slot (the same grid on every rank: a function of the sizes only).
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

// all_gather, all_to_all and broadcast as one byte exchange. Source block of rank r for peer q:
// input + q * in_stride; it lands at output + r * out_stride on q.
//   all_gather:  in_stride 0,     out_stride bytes, root -1
//   all_to_all:  in_stride bytes, out_stride bytes, root -1
//   broadcast:   in_stride 0,     out_stride 0,     root = src (input == output)
struct ExchangeParams {
  const void* input = nullptr;
  void* output = nullptr;
  size_t bytes = 0;        // bytes of one block
  size_t in_stride = 0;    // bytes between the blocks for consecutive peers in `input`
  size_t out_stride = 0;   // bytes between the blocks of consecutive sources in `output`
  int root = -1;           // -1: every rank sends; else only `root` does (broadcast)
  SymmetricBufferDevice workspace{};  // two halves of workspace.bytes / 2, alternating per call
  BarrierDevice barrier{};
  int max_blocks = 0;  // 0: the built-in cap; the same on every rank
  LaunchOrder order = LaunchOrder::kStream;  // COMMLIB_PDL, resolved by the core
  const char* what = "exchange";  // the operation named in errors
  // launch_exchange_ll only: the LL line buffer (CudaComm::ll_lines_handle) and its payload per
  // source rank and call; larger blocks run as several calls.
  SymmetricBufferDevice lines{};
  size_t max_bytes_per_call = 0;
};

// output (count elements) = reduction over the ranks of their input[rank * count .. + count).
struct ReduceScatterParams {
  const void* input = nullptr;  // world * count elements
  void* output = nullptr;       // count elements; must not overlap the input
  size_t count = 0;             // elements of the output
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;  // kSum or kAvg
  SymmetricBufferDevice workspace{};
  BarrierDevice barrier{};
  int max_blocks = 0;
  LaunchOrder order = LaunchOrder::kStream;
  SymmetricBufferDevice lines{};  // launch_reduce_scatter_ll only (as ExchangeParams)
  size_t max_bytes_per_call = 0;
};

Status launch_exchange(const ExchangeParams& params, Stream stream);
Status launch_reduce_scatter(const ReduceScatterParams& params, Stream stream);
// The LL variants (exchange_ll.cu): every rank sends to every peer (root must be -1), so a parity
// of the line buffer is reused only after every peer read it (Note [LL lines]).
Status launch_exchange_ll(const ExchangeParams& params, Stream stream);
Status launch_reduce_scatter_ll(const ReduceScatterParams& params, Stream stream);

}  // namespace commlib::kernels
