// The copy-engine mechanism of commlib's GPU point-to-point paths: messages move into slots a
// receiver owns in symmetric memory by copy-engine transfers, and 32-bit words written and waited
// on by stream memory operations hand each slot between its one sender and its one receiver. No
// kernel moves data and no SM is held (Note [copy-engine slots]).
//
// Note [copy-engine slots]
// Both users share put_and_signal (the copy into the peer's slot, then its `ready` word at the
// receiver, with the write's memory barrier so the data lands first) and signal (a word written
// once the stream reaches it). They differ only in how a wait is bounded:
//   - CudaP2p (Note [cuda p2p], send / recv of the direct API and the backend) waits with its
//     one-thread p2p_wait kernel, which gives up after the communicator's timeout: a general API
//     must never hang the stream.
//   - CopyEngineRing (context parallelism's ring, Note [cp copy-engine ring] in
//     python/commlib/cp/symmetric.py) waits with cuStreamWaitValue32, which holds no SM (the ring
//     exists to leave the SMs to attention) and cannot time out on the device; the host watchdog
//     bounds it (Note [cp ring watchdog]).
// Slot protocol of the ring: slot x of every rank has flags ready[x] (in the receiver's memory:
// the slot holds a message) and free[x] (in the sender's memory: the receiver has released its
// slot x). Sender, on its copy stream: wait free[x] == 1, write free[x] = 0, put the message and
// signal ready[x] = 1 at the receiver. Receiver, on its compute stream: wait ready[x] == 1, write
// ready[x] = 0, compute, signal free[x] = 1 at the sender. Each word returns to its initial value
// after every use (no sequence numbers), so a captured CUDA graph replays the same operations.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "commlib/symmetric_buffer.hpp"

namespace commlib {

class CudaComm;

namespace ce {

// On `stream`: copies `bytes` from `src` to `dst` (a peer-mapped address: a copy-engine transfer),
// then writes `value` to `*ready` (the copy lands before the word is seen).
void put_and_signal(void* dst, const void* src, size_t bytes, uint32_t* ready, uint32_t value, cudaStream_t stream,
                    const char* what);
// On `stream`: writes `value` to `*word` once the stream's earlier work is done and visible.
void signal(uint32_t* word, uint32_t value, cudaStream_t stream, const char* what);
// On `stream`: waits until `*word == value`. Unbounded on the device (the caller bounds it).
void wait_equal(const uint32_t* word, uint32_t value, cudaStream_t stream, const char* what);
// The calling thread's stream-capture interaction mode becomes relaxed: its event queries never
// invalidate a graph that another thread captures in global mode (a watchdog thread).
void relax_stream_capture_mode();

}  // namespace ce

// The ring's slots (Note [copy-engine slots]): the flags ready[kMaxSlots], free[kMaxSlots] at the
// start of a symmetric buffer, the message slots after them at offsets the caller lays out. Not
// collective once made; one thread drives it.
class CopyEngineRing {
 public:
  static constexpr int kMaxSlots = 64;
  static constexpr size_t kFlagsBytes = 2 * sizeof(uint32_t) * kMaxSlots;

  // The flags start `offset` bytes into `buffer`, a symmetric buffer of this communicator, and
  // every rank has initialised them (ready 0, free 1) before any rank uses the ring.
  CopyEngineRing(std::shared_ptr<SymmetricBuffer> buffer, size_t offset);

  // On `stream`: waits until `peer` has released slot `slot`, takes it, copies `bytes` from `src`
  // to `at` bytes past the start of the flags in `peer`'s buffer and signals the slot ready there.
  void send(int peer, int slot, size_t at, const void* src, size_t bytes, cudaStream_t stream) const;
  // On `stream`: waits until this rank's slot `slot` holds a message and takes it.
  void receive(int slot, cudaStream_t stream) const;
  // On `stream`: tells `sender` that this rank's slot `slot` may be refilled.
  void release(int sender, int slot, cudaStream_t stream) const;

  int rank() const { return buffer_->rank(); }
  int world_size() const { return buffer_->world_size(); }

 private:
  uint32_t* ready(int owner, int slot) const;
  uint32_t* free_word(int owner, int slot) const;
  void check_slot(const char* what, int slot) const;

  std::shared_ptr<SymmetricBuffer> buffer_;
  size_t offset_;
};

}  // namespace commlib
