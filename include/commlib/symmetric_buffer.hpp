// Symmetric GPU memory: one allocation of the same size on every rank, each rank's piece mapped
// read/write into every rank's address space (csrc/transport/cuda_ipc.cc: cuMemCreate + POSIX-fd
// handles over a Unix-domain socket).
//
// Contract:
// - Created collectively (CudaComm::allocate_symmetric): every rank allocates the same sizes in
//   the same order; a mismatch raises PeerError on every rank (never silent corruption).
// - The host object owns this rank's mappings; destroying it is local (not collective). Physical
//   memory lives until every rank that mapped it has unmapped it.
// - Kernels never see the host object: they take the trivially copyable SymmetricBufferDevice by
//   value (device_handle()). Peer pointers are plain global pointers; the ordering of accesses to
//   them is the kernel's business (see commlib/device/barrier.cuh).
//
// Also here, because kernels take them by value and host code fills them in: BarrierDevice (the
// per-communicator flag barrier) and DeviceErrorWord (the host-visible record of a failed wait).
// This header compiles without nvcc and without CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

namespace commlib {

// Largest world size the device tables hold (one NVLink node).
constexpr int kMaxDeviceRanks = 8;
// Largest grid a barrier-using kernel may launch (the signal pad has one flag row per block).
constexpr int kMaxBarrierBlocks = 256;
// Barrier phases per collective call: the flag value of (call, phase) is
// call * kBarrierPhasesPerCall + phase + 1, so flags only ever grow.
constexpr int kBarrierPhasesPerCall = 8;

struct SymmetricBufferDevice {
  void* peers[kMaxDeviceRanks];  // peers[r]: rank r's piece, mapped here
  size_t bytes;                  // bytes of each rank's piece
  int rank;
  int world_size;

#if defined(__CUDACC__)
  template <typename T = void>
  __host__ __device__ T* peer(int r) const { return static_cast<T*>(peers[r]); }
  template <typename T = void>
  __host__ __device__ T* local() const { return static_cast<T*>(peers[rank]); }
#endif
};
static_assert(std::is_trivially_copyable_v<SymmetricBufferDevice>);

// Written by the device when a bounded wait expires; lives in host-mapped pinned memory.
// One writer per rank (claimed through BarrierCallState::poisoned); `failed` is stored last
// (release), so a host that reads failed == 1 sees the other fields.
struct DeviceErrorWord {
  uint32_t reserved;
  uint32_t failed;
  int32_t rank;   // the rank that waited
  int32_t peer;   // the rank it waited for
  int32_t phase;  // a Phase (commlib/phase.hpp)
  int32_t block;
  uint64_t elapsed_ns;
  uint64_t call;  // the communicator's collective call number
};

// Device-local per-communicator state shared by all barrier-using kernels (see barrier.cuh).
struct BarrierCallState {
  uint64_t calls[kMaxBarrierBlocks];  // collective calls completed on this rank, one count per block index
  uint32_t poisoned;                  // set (atomically) on a failed wait: later calls return at once
  uint32_t reserved;
};

struct BarrierDevice {
  uint64_t* flags[kMaxDeviceRanks];  // rank r's signal pad: [kMaxBarrierBlocks][kMaxDeviceRanks]
  BarrierCallState* state;           // this rank's, device memory
  DeviceErrorWord* error;            // this rank's, host-mapped
  uint64_t timeout_ns;
  int rank;
  int world_size;
};
static_assert(std::is_trivially_copyable_v<BarrierDevice>);

class SymmetricBuffer {
 public:
  // `peers[r]` is rank r's piece mapped here; `release` unmaps them (called once, by the destructor).
  SymmetricBuffer(std::vector<void*> peers, int rank, size_t bytes, uint64_t sequence, std::function<void()> release)
      : peers_(std::move(peers)), rank_(rank), bytes_(bytes), sequence_(sequence), release_(std::move(release)) {}
  ~SymmetricBuffer() {
    if (release_) release_();
  }
  SymmetricBuffer(const SymmetricBuffer&) = delete;
  SymmetricBuffer& operator=(const SymmetricBuffer&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return static_cast<int>(peers_.size()); }
  size_t bytes() const { return bytes_; }
  // Position of this allocation in the communicator's collective allocation order.
  uint64_t sequence() const { return sequence_; }
  void* local() const { return peers_[rank_]; }
  void* peer(int r) const { return peers_[r]; }
  // True when [ptr, ptr + n) lies inside this rank's piece.
  bool contains(const void* ptr, size_t n) const {
    auto p = reinterpret_cast<uintptr_t>(ptr), base = reinterpret_cast<uintptr_t>(local());
    return p >= base && p + n <= base + bytes_;
  }
  SymmetricBufferDevice device_handle() const {
    SymmetricBufferDevice d{};
    for (int r = 0; r < world_size() && r < kMaxDeviceRanks; ++r) d.peers[r] = peers_[r];
    d.bytes = bytes_;
    d.rank = rank_;
    d.world_size = world_size();
    return d;
  }
  // The same buffer seen from `offset` bytes in (for a tensor that starts inside it).
  SymmetricBufferDevice device_handle_at(size_t offset) const {
    SymmetricBufferDevice d = device_handle();
    for (int r = 0; r < world_size() && r < kMaxDeviceRanks; ++r) d.peers[r] = static_cast<char*>(peers_[r]) + offset;
    d.bytes = bytes_ - offset;
    return d;
  }

 private:
  std::vector<void*> peers_;
  int rank_;
  size_t bytes_;
  uint64_t sequence_;
  std::function<void()> release_;
};

}  // namespace commlib
