// Communicator: one rank's membership in a group of processes, on one host or several (Note
// [communicator hosts] in csrc/core/communicator.cc).
//
// Created collectively: every rank of the group constructs it with the same store, name and
// world size (the constructor exchanges through the store and throws PeerError on any rank whose
// view disagrees). All collective methods must be called by every rank in the same order with
// matching arguments; a mismatch found at run time raises PeerError on every rank.
// Methods are not thread-safe: one thread drives a communicator at a time.
//
// Ownership: close() (or the destructor) unmaps shared memory and frees GPU memory; it is not
// collective and never blocks on peers.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "commlib/store.hpp"
#include "commlib/types.hpp"

namespace commlib {

class HostShm;
struct CommConfig;  // csrc/core/algorithm_selector.hpp: every operation's configuration
class HostP2p;  // point-to-point over shared memory (csrc/host/p2p.hpp)
class CudaComm;  // GPU state (csrc/cuda/cuda_comm.hpp), created on first GPU use.
class MulticastWorkspace;  // NVLink multicast workspace (csrc/transport/cuda_multicast.hpp)

struct CommunicatorOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  size_t shm_slot_bytes = 0;  // 0: COMMLIB_SHM_SLOT_BYTES
};

// This process's host id: COMMLIB_TEST_HOST_ID when set (tests), else "<host name>/<boot id>".
std::string host_id();

class Communicator {
 public:
  Communicator(std::shared_ptr<Store> store, int rank, int world_size, std::string name,
               CommunicatorOptions options = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& name() const { return name_; }
  // The store-key prefix of this communicator (unique per (store, name, creation order)).
  const std::string& prefix() const { return prefix_; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  // Bounds every wait from now on, set-up, host and device (a device wait reads it when enqueued),
  // by `timeout`; COMMLIB_TIMEOUT_MS, when set, still wins. Not collective (each rank sets its
  // own, as ProcessGroup.setTimeout does). InvalidArgument unless positive.
  void set_timeout(std::chrono::milliseconds timeout);
  Store& store() { return *store_; }
  const std::vector<int64_t>& peer_pids() const { return peer_pids_; }
  // Hosts of the group (numbered in the order of their lowest rank) and the host of each rank.
  int num_hosts() const { return num_hosts_; }
  const std::vector<int>& host_of() const { return host_of_; }
  // Empty on one host; else why shared and peer memory are unavailable (names two ranks' hosts).
  const std::string& hosts_problem() const { return hosts_problem_; }
  bool closed() const { return closed_; }
  void close();

  // Note [abort]
  // abort() may be called from any thread while another is inside a call of this communicator
  // (a watchdog, a signal handler's thread, torch's ProcessGroup.abort()). It sets one flag that
  // every bounded wait reads at its liveness check: a host wait (shared-memory collectives,
  // send / recv) raises PeerError "aborted" within ~50 ms, a device wait ends at its next check
  // (the GPU state is poisoned by a stream write on a stream of its own, which needs no SM), and
  // every later call raises PeerError at once. It releases nothing (close() still does) and is
  // not collective: each rank aborts its own communicator.
  void abort();
  bool aborted() const { return aborted_->load(std::memory_order_relaxed); }
  // Why the communicator stopped being usable, if it did (torch's getError()).
  enum class ErrorState { kNone, kTimeout, kRemote, kAborted };
  ErrorState error() const;

  // ---- CPU collectives over POSIX shared memory (csrc/host). Collective. ----
  // Reads `count` elements of `input`, writes the reduction to `output`; `input` is not modified
  // unless it is `output` (in place). The two must be the same pointer or not overlap at all
  // (InvalidArgument otherwise). Reduction in fp32, ranks in order 0..n-1: in place and out of
  // place give the same bits.
  void all_reduce_host(const void* input, void* output, size_t count, DataType dtype, ReduceOp op, Algorithm algo);
  // `in` holds world_size * count elements; `out` receives this rank's reduced count elements.
  void reduce_scatter_host(void* out, const void* in, size_t count, DataType dtype, ReduceOp op);
  // `out` receives world_size blocks of `bytes`, block r from rank r.
  void all_gather_host(void* out, const void* in, size_t bytes);
  void broadcast_host(void* data, size_t bytes, int root);
  // in_bytes[r]: bytes this rank sends to rank r (blocks packed in rank order in `in`);
  // out_bytes[r]: bytes it receives from rank r (packed in rank order in `out`).
  void all_to_all_v_host(void* out, const void* in, const std::vector<size_t>& in_bytes,
                         const std::vector<size_t>& out_bytes);
  // Across hosts: over the store (no data, so the slow path costs only set-up time).
  void barrier_host();
  // Shared memory of this host's ranks; InvalidArgument naming the hosts when the ranks span several.
  HostShm& host();
  // Set-up exchanges (never on a hot path): over shared memory on one host, over the store across
  // hosts. Collective; `out` receives world_size blocks of `bytes`, block r from rank r.
  void control_all_gather(void* out, const void* in, size_t bytes);
  void control_barrier();
  // Point-to-point messages over shared memory, created on first use. Not collective: only the two
  // ranks of a pair take part in setting up their channel (Note [host p2p]).
  HostP2p& host_p2p();

  // The configuration of every operation (algorithm, grid, LL, PDL; Note [communicator
  // configuration]), resolved from the built-in table, the tune file and the environment on first
  // use and kept for the communicator's life. Throws InvalidArgument for a bad COMMLIB_* value or
  // tune file (naming it). Not collective.
  const CommConfig& config();

  // ---- GPU state: created on first use for `device` (all ranks must call collectively). ----
  // A communicator drives one GPU: a later call with another device throws InvalidArgument.
  // Defined by the GPU engine (csrc/cuda), as is multicast(): the core holds the state, the
  // engine makes and deletes it.
  CudaComm& cuda(int device);
  // The GPU state cuda(device) created (InvalidArgument when there is none). Not collective.
  CudaComm& cuda();
  bool has_cuda() const { return cuda_ != nullptr; }
  // Set by the GPU engine with the state: what abort() and error() do for it.
  std::function<void(CudaComm&)> cuda_abort_hook;
  std::function<bool(const CudaComm&)> cuda_failed_hook;
  // The multimem kernels' workspace, created on first use (collective, outside graph capture;
  // Note [multicast workspace]). Only where the multicast guard allows it: otherwise throws
  // InvalidArgument naming the deciding variable, before any CUDA call (docs/architecture.md, Safety).
  MulticastWorkspace& multicast(int device);

 private:
  void check_open(const char* what) const;

  std::shared_ptr<Store> store_;
  int rank_;
  int world_size_;
  std::string name_;
  std::string prefix_;
  CommunicatorOptions options_;
  std::vector<int64_t> peer_pids_;
  std::vector<int> host_of_;
  int num_hosts_ = 1;
  std::string hosts_problem_;
  uint64_t control_calls_ = 0;  // store keys of each control exchange across hosts
  bool closed_ = false;
  std::shared_ptr<std::atomic<bool>> aborted_ = std::make_shared<std::atomic<bool>>(false);
  int multicast_attempts_ = 0;  // store keys of each multicast workspace attempt
  std::unique_ptr<HostShm> host_;
  std::shared_ptr<const CommConfig> config_;
  std::shared_ptr<HostP2p> host_p2p_;  // shared_ptr: HostP2p is incomplete here
  std::unique_ptr<CudaComm, void (*)(CudaComm*)> cuda_;
  std::unique_ptr<MulticastWorkspace, void (*)(MulticastWorkspace*)> multicast_;  // released before cuda_
};

}  // namespace commlib
