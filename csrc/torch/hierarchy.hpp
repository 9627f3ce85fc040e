// Hierarchy: the two-level collectives of a "ddacomm" group whose ranks span several hosts.
//
// Note [hierarchical collectives]
// At group creation (python/commlib/backend_registration.py) the ranks are partitioned by host:
// hosts are numbered in the order of their lowest group rank, a rank's local index is its order
// among its host's ranks. When every host has the same number of ranks (local_size), the group's
// DdaBackend gets a Hierarchy holding
//   * intra: a DdaBackend over this host's ranks (its own commlib communicator: shared memory for
//     CPU tensors, commlib's GPU kernels / NCCL on the sub-group for CUDA tensors);
//   * inter: gloo (CPU tensors, and every barrier) and NCCL (CUDA tensors, created on first use)
//     over the ranks of the other hosts with the same local index (num_hosts ranks, rank = host).
// Both are built from the group's store. The legs, for group rank g = (host h, local index l):
//   all_reduce      pad to local_size equal shards; intra reduce-scatter (shard l); inter
//                   all-reduce of shard l; intra all-gather.
//   reduce_scatter  input blocks reordered to [local index][host]; intra reduce-scatter (this rank
//                   gets the num_hosts blocks of the ranks with its local index); inter
//                   reduce-scatter (this rank gets its own block).
//   all_gather      inter all-gather (the inputs of the ranks with this local index); intra
//                   all-gather; blocks reordered to group-rank order.
//   broadcast       the ranks with the root's local index broadcast over inter from the root's
//                   host; then every host broadcasts intra from that local index.
//   barrier         intra, inter (gloo), intra.
// AVG runs as SUM in both legs, then the reduced shard is divided by the world size once, before
// the intra all-gather. Each leg waits for the previous one: CPU calls complete before they return;
// CUDA legs are ordered on the caller's current stream (NCCL's work on its own stream is made to
// precede the next leg by Work::wait, which does not block the host). Hosts of unequal size keep
// the flat path for every call (no Hierarchy). Whether a call goes two-level is decided by (op,
// bytes) alone, the same on every rank (Note [hierarchical crossover]); other collectives, and
// reductions commlib cannot split (PREMUL_SUM, sparse), run on the group's inner gloo / NCCL.
//
// Note [hierarchical reduction order]
// An element of a two-level reduction is reduced inside each host first, in the intra path's order
// (commlib's paths: local ranks 0, 1, ... in rank order as Note [reduction order] says, rounded
// once to the dtype; CUDA tensors the intra backend does not take: NCCL's), then across hosts by
// the inter backend (gloo or NCCL) on the rounded per-host values, in that library's order. This is not the single-host order
// (one left-to-right pass over all ranks), so results can differ from a flat reduction in the last
// bits; they are the same on every rank: each element's final value is computed once per local
// index by the inter all-reduce (whose result every member receives, bit for bit), and then only
// copied. The fused all-reduce + RMSNorm reduces x the same way and normalises the reduced shard
// with the documented arithmetic (Note [fused rmsnorm arithmetic]) before the intra all-gather.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <functional>
#include <mutex>
#include <vector>

#include "core/algorithm_selector.hpp"
#include "core/plan.hpp"

namespace commlib::torch_layer {

struct HostLayout {
  int num_hosts = 1;
  int local_size = 1;
  int host_index = 0;
  int local_rank = 0;
  // rank_of[h * local_size + l]: the group rank of local index l on host h.
  std::vector<int> rank_of;
  int world_size() const { return num_hosts * local_size; }
};

// Creates an inner backend on first use (the NCCL ones: a CPU-only process never creates one).
using InnerFactory = std::function<c10::intrusive_ptr<c10d::Backend>()>;
// The NCCL backend `factory` makes; raises naming `what` when there is no factory (no CUDA or NCCL
// here) or it made none. `which` names the backend in that message ("inner", "inter-host").
c10::intrusive_ptr<c10d::Backend> create_nccl(const InnerFactory& factory, const char* what, const char* which);

class Hierarchy {
 public:

  // How CUDA tensors cross hosts: NCCL, or (tests whose ranks share one GPU, which NCCL refuses)
  // host copies over the inter-host gloo group.
  enum class InterCuda { kNccl, kGlooViaHost };

  // `intra` serves this host's local_size ranks, `inter_gloo` the num_hosts ranks with this local
  // index; `inter_nccl_factory` may be empty (no CUDA). Throws ValueError on an inconsistent layout.
  Hierarchy(HostLayout layout, c10::intrusive_ptr<c10d::Backend> intra, c10::intrusive_ptr<c10d::Backend> inter_gloo,
            InnerFactory inter_nccl_factory, std::chrono::milliseconds timeout, InterCuda inter_cuda = InterCuda::kNccl);

  const HostLayout& layout() const { return layout_; }
  // Whether a call of `op` over `bytes` goes two-level (Note [hierarchical crossover]).
  // What a call of `op` over `bytes` runs: two_level or inner (Note [plan], plan_hierarchical).
  Plan plan(HierOp op, size_t bytes) const { return plan_hierarchical(selector_, HierShape{op, bytes}); }
  // Whether a reduction with `op` on `dtype` can be split into legs (Note [hierarchical collectives]).
  static bool splits(const c10d::ReduceOp& op, at::ScalarType dtype);

  // Collective over the whole group; the tensors are dense, on CPU or CUDA. Blocking on CPU;
  // ordered on the current stream on CUDA.
  void all_reduce(at::Tensor& tensor, const c10d::ReduceOp& op);
  void reduce_scatter(at::Tensor& output, const at::Tensor& input, const c10d::ReduceOp& op);
  void all_gather(at::Tensor& output, const at::Tensor& input);
  void broadcast(at::Tensor& tensor, int root);
  void barrier();

  // The inter-host leg of an all-reduce alone (the fused all-reduce + RMSNorm's middle step).
  void inter_all_reduce(at::Tensor& tensor, const c10d::ReduceOp& op);

  c10d::Backend& intra() { return *intra_; }
  // The inter-host backend for tensors on `device` (NCCL created on first CUDA use).
  const c10::intrusive_ptr<c10d::Backend>& inter(const at::Device& device, const char* what);

  int64_t num_calls() const { return num_calls_; }
  void set_timeout(std::chrono::milliseconds timeout);
  void shutdown();
  void abort();

 private:
  // Group ranks in [local index][host] order (the layout the legs produce and consume).
  at::Tensor local_major_ranks(const at::Device& device) const;
  // Runs an inter-host leg: `call(backend, in, out)`; CUDA tensors go through host copies when
  // inter_cuda_ is kGlooViaHost. `out` may be `in`.
  template <typename F>
  void inter_leg(const char* what, at::Tensor& out, const at::Tensor& in, F&& call);

  HostLayout layout_;
  c10::intrusive_ptr<c10d::Backend> intra_;
  c10::intrusive_ptr<c10d::Backend> inter_gloo_;
  c10::intrusive_ptr<c10d::Backend> inter_nccl_;
  InnerFactory inter_nccl_factory_;
  std::mutex nccl_mutex_;
  std::chrono::milliseconds timeout_;
  InterCuda inter_cuda_;
  HierarchicalSelector selector_;
  int64_t num_calls_ = 0;
};

}  // namespace commlib::torch_layer
