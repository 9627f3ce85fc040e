// CUDA peer memory between the processes of one node: symmetric allocations with the VMM API.
//
// Note [cuda ipc protocol]
// allocate(bytes) is collective. Every rank first publishes (sequence, bytes) through the Store
// and compares: any rank whose allocation differs raises PeerError naming both ranks' sizes (so a
// mismatch never maps memory of the wrong size). Then each rank cuMemCreate()s its piece with a
// POSIX-fd shareable handle, sends the fd to every peer over that peer's Unix-domain socket
// (abstract name from the communicator prefix, rank 0's pid and the rank; SCM_RIGHTS) with a
// header (magic, sequence, rank, bytes) that the receiver checks again, imports the peers' fds,
// maps every piece into one reserved range each and grants this device read/write access
// (cuMemSetAccess). Handles are released after mapping; the memory lives until the last rank
// unmaps. A Store barrier ends the allocation, so a zeroed buffer is zero everywhere before any
// rank uses it. Connections are made per allocation (set-up only, never on a hot path); sends
// complete before accepts because the listening socket's backlog holds the world's connections.
// broadcast_fd sends one rank's descriptor the same way, numbered in the same sequence.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "commlib/store.hpp"
#include "commlib/symmetric_buffer.hpp"

namespace commlib {

enum class ZeroFill { kNo, kYes };

class CudaIpc {
 public:
  // Collective: checks P2P reachability of every pair and opens this rank's socket. A non-empty
  // `unreachable` (ranks on several hosts: Note [communicator hosts]), or a world above
  // kMaxDeviceRanks, is the problem at once: no exchange, no socket.
  CudaIpc(Store& store, std::string prefix, int rank, int world_size, int device, int64_t rank0_pid,
          std::chrono::milliseconds timeout, std::string unreachable = {});
  ~CudaIpc();
  CudaIpc(const CudaIpc&) = delete;
  CudaIpc& operator=(const CudaIpc&) = delete;

  // Collective (see the Note). `what` names the caller for error messages. Every piece's size and
  // mapped address are multiples of the allocation granularity and of `alignment` (a power of
  // two; 0: the granularity only).
  std::shared_ptr<SymmetricBuffer> allocate(size_t bytes, ZeroFill zero, const char* what, size_t alignment = 0);

  // Collective: rank `root` passes a file descriptor, which reaches every other rank over the
  // same sockets as the allocations' handles (SCM_RIGHTS); those ranks get their own descriptor
  // of it back and close it. Root gets `fd` back. Bounded by the timeout (Timeout naming the rank).
  int broadcast_fd(int root, int fd, const char* what);

  // Whether every pair of ranks can reach each other's memory (the same answer on every rank);
  // when false, problem() says which pair and allocate() raises PeerError.
  bool p2p_ok() const { return p2p_ok_; }
  const std::string& problem() const { return problem_; }
  int device() const { return device_; }

 private:
  std::string socket_name(int rank) const;
  void send_fd(int peer, int fd, uint64_t sequence, size_t bytes, const char* what);
  // Receives one descriptor from each rank r whose peer_fds[r] is kAwaitedFd (cuda_ipc.cc); the
  // other entries stay as they are.
  void receive_fds(uint64_t sequence, size_t bytes, std::vector<int>& peer_fds, const char* what);

  Store& store_;
  std::string prefix_;
  int rank_;
  int world_size_;
  int device_;
  int64_t rank0_pid_;
  std::chrono::milliseconds timeout_;
  int listen_fd_ = -1;
  uint64_t sequence_ = 0;
  bool p2p_ok_ = true;
  std::string problem_;
};

}  // namespace commlib
