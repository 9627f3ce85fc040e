// CudaP2p: point-to-point messages between the GPUs of a communicator over peer memory, with no
// SM doing the copying; the CUDA side of Communicator's send / recv and of the ddacomm backend's.
//
// Note [cuda p2p]
// Channels. Every ordered pair (sender s, receiver d) has kLanes lanes (a message with tag t uses
// lane t mod kLanes) of kSlots slots each, all in one symmetric buffer allocated when the GPU
// state is created (that is collective; a send is not). In d's memory: for each (s, lane, slot)
// the chunk buffer (COMMLIB_P2P_SLOT_BYTES) and a P2pSlotHeader whose `ready` word says "full";
// in s's memory: for each (d, lane, slot) a `busy` word that says "the receiver has not drained
// it yet". All words start at 0 (the allocation is zeroed before any rank returns from it).
// A message is a sequence of chunks (at least one: a 0-byte message is a handshake), chunk i of
// the lane's running count going to slot i mod kSlots (double buffering: the sender fills one slot
// while the receiver drains the other). Both ends count a lane's chunks on the host, so they pick
// the same slots; the words return to 0 after every chunk, so the count needs no reset and a
// captured CUDA graph replays the same operations.
//   sender, on its stream: wait busy == 0 and set it to 1, and for the first chunk write the
//     header's tag, bytes and dtype at the receiver (p2p_wait kernel, bounded); copy the chunk into the
//     receiver's slot (cudaMemcpyAsync between peer-mapped addresses: a copy-engine transfer);
//     write ready = 1 at the receiver (cuStreamWriteValue32 with its memory barrier: the chunk
//     and the header land first).
//   receiver, on its stream: wait ready == 1, check the header against the receive (first chunk)
//     and set ready to 0 (p2p_wait); copy the chunk out of the slot; write busy = 0 at the sender
//     (with the barrier, after the copy has read the slot).
// Matching: per (sender, lane), messages are matched in the order they were posted, as NCCL
// does; a receive whose message has another tag, size or dtype fails ("ranks disagree"). Messages
// of different lanes pass each other, so receives may be posted in another tag order than the
// sends as long as what the sender posted before fits its lane's slots.
// Bounded waits: cuStreamWaitValue32 cannot time out, so every wait is the one-thread p2p_wait
// kernel, which gives up after the communicator's timeout (read at enqueue time), records rank,
// peer, lane and what it waited for in a host-mapped P2pErrorWord and poisons the channels: every
// later wait returns at once, so queued work drains instead of hanging, and check_error() raises.
// The data never goes through an SM; the waits hold one thread each while they spin. The copies and
// the signals are the copy-engine mechanism CopyEngineRing also runs on (Note [copy-engine slots]).
// Streams: sends run on send_stream(), receives on recv_stream() (so a rank blocked sending to a
// peer still drains what that peer sends it); callers order them after their own stream. They are
// this channel's own, not a pool's: a wait parks on its stream until the peer arrives, and work of
// others sharing a pool stream would queue behind it.
// Thread-safety: one thread drives a communicator at a time.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "commlib/symmetric_buffer.hpp"
#include "kernels/p2p_params.hpp"

namespace commlib {

class Communicator;
class CudaIpc;

class CudaP2p {
 public:
  static constexpr int kLanes = 4;
  static constexpr int kSlots = 2;

  // Collective (allocates the channels). `comm` outlives this object; its timeout bounds the waits.
  CudaP2p(Communicator& comm, CudaIpc& ipc, int device, size_t slot_bytes);
  ~CudaP2p();
  CudaP2p(const CudaP2p&) = delete;
  CudaP2p& operator=(const CudaP2p&) = delete;

  // Enqueues a send of `bytes` at `data` (device memory of this GPU) to `dst` on `stream`. `dtype`
  // is compared with the receiver's (an opaque code; dtype_name below prints it). Not collective.
  void send(const void* data, size_t bytes, uint32_t dtype, int dst, int64_t tag, cudaStream_t stream);
  // Enqueues a receive of exactly `bytes` from `src` into `data` on `stream`. Not collective.
  void recv(void* data, size_t bytes, uint32_t dtype, int src, int64_t tag, cudaStream_t stream);

  // The streams this communicator's sends and receives run on (high priority, non-blocking).
  cudaStream_t send_stream() const { return send_stream_; }
  cudaStream_t recv_stream() const { return recv_stream_; }
  size_t slot_bytes() const { return slot_bytes_; }

  // Raises Timeout or PeerError ("ranks disagree") if a wait of these channels failed. Reads
  // host memory only (no synchronisation). Not collective.
  void check_error(const char* what) const;

  // Messages enqueued (tests assert the path was taken).
  int64_t num_sends() const { return num_sends_; }
  int64_t num_recvs() const { return num_recvs_; }

  // How error messages print a dtype code (the torch layer passes at::ScalarType names).
  static void set_dtype_namer(std::function<std::string(uint32_t)> namer);

 private:
  size_t slot_index(int sender, int receiver, int lane, int slot) const;
  kernels::P2pSlotHeader* header(int owner, int sender, int lane, int slot) const;
  uint32_t* busy(int owner, int receiver, int lane, int slot) const;
  uint8_t* data(int owner, int sender, int lane, int slot) const;
  kernels::P2pWaitParams wait_params(int peer, int lane, kernels::P2pRole role) const;

  Communicator& comm_;
  int rank_;
  int world_size_;
  int device_;
  size_t slot_bytes_;
  size_t busy_offset_ = 0;
  size_t data_offset_ = 0;
  std::shared_ptr<SymmetricBuffer> buffer_;
  std::vector<uint64_t> sent_chunks_;      // [peer][lane]
  std::vector<uint64_t> received_chunks_;  // [peer][lane]
  uint32_t* poisoned_ = nullptr;
  kernels::P2pErrorWord* error_host_ = nullptr;
  kernels::P2pErrorWord* error_device_ = nullptr;
  cudaStream_t send_stream_ = nullptr;
  cudaStream_t recv_stream_ = nullptr;
  int64_t num_sends_ = 0;
  int64_t num_recvs_ = 0;
};

}  // namespace commlib
