// Point-to-point messages between the ranks of a communicator over POSIX shared memory: the CPU
// send / recv / isend / irecv of the torch backend and of Communicator.send / recv.
//
// Note [host p2p]
// Each pair of ranks that exchanges messages gets its own segment, set up lazily by the pair alone
// (never by the whole group): the first of the two to need it creates it (the store's add() on the
// pair's key decides who is first) and publishes its name, and goes on without waiting; the second
// opens it, maps it and unlinks the name. A segment holds one ring per direction: kNumSlots slots of
// kSlotBytes, each a chunk of one message (a header, then up to kSlotBytes - header bytes of data).
// The sender writes chunks in order and publishes a monotonically increasing `head` (release); the
// receiver copies them out and publishes `tail` (release), which frees the slots for the sender.
// A message of any size (0 bytes included) is a sequence of chunks, so large messages stream
// through the ring.
// Matching follows MPI and gloo: a message from rank s with tag t goes to the earliest posted
// receive for (s or any source, t); a message no receive matches yet is copied into an
// "unexpected" buffer and handed to the next receive that matches. Because arriving data is always
// drained, a rank blocked in a send to a peer that is itself blocked in a send never deadlocks.
// Progress is made by whoever waits or tests (HostP2p::wait / test): every call moves the pending
// sends and receives of every connected peer as far as the rings allow, so sends and receives
// posted together (batch_isend_irecv, "send to next, receive from previous") overlap.
// Every wait is bounded by the communicator's timeout (Timeout, "Timed out ...") and notices a peer
// that exited (PeerError). A receive whose message has another size or dtype fails with PeerError
// ("ranks disagree ..."); the message is discarded and the pair stays usable.
// Thread-safety: one thread drives a HostP2p at a time (like the communicator).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "commlib/store.hpp"

namespace commlib {

struct P2pRequest {
  enum class Kind { kSend, kRecv };
  Kind kind;
  int peer;  // destination, source, or HostP2p::kAnySource
  int64_t tag;
  uint8_t* data;
  size_t bytes;
  std::string dtype;  // compared between sender and receiver; shown in errors
  size_t done_bytes = 0;
  bool done = false;
  std::string error;  // set with done when the request failed
  int source = -1;    // receives: the rank the message came from
};

class HostP2p {
 public:
  static constexpr int kAnySource = -1;
  static constexpr size_t kSlotBytes = 256 << 10;
  static constexpr size_t kNumSlots = 8;
  using Handle = std::shared_ptr<P2pRequest>;

  HostP2p(Store& store, std::string prefix, int rank, int world_size, std::chrono::milliseconds timeout,
          std::vector<int64_t> peer_pids);
  ~HostP2p();
  HostP2p(const HostP2p&) = delete;
  HostP2p& operator=(const HostP2p&) = delete;

  // Posts a send of `bytes` at `data` to `dst` (the buffer must stay valid until the request is
  // done) and makes what progress it can at once: a message that fits the ring is done on return.
  Handle isend(const void* data, size_t bytes, const std::string& dtype, int dst, int64_t tag);
  // Posts a receive of exactly `bytes` into `data` from `src` (or kAnySource).
  Handle irecv(void* data, size_t bytes, const std::string& dtype, int src, int64_t tag);
  // Makes progress; true when `request` is done (throws PeerError if it failed).
  bool test(const Handle& request);
  // Makes progress until `request` is done; bounded by the timeout. `what` names the operation.
  void wait(const Handle& request, const char* what);
  // Bounds the waits from now on (the group's timeout changed).
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }
  // Waits end (PeerError, within ~50 ms) and new requests are refused once *flag is true (the
  // communicator's abort flag; Note [abort]).
  void watch_abort(std::shared_ptr<const std::atomic<bool>> flag) { abort_ = std::move(flag); }
  bool aborted() const { return abort_ && abort_->load(std::memory_order_relaxed); }
  // Whether a channel failed (a peer exited, a send stopped half-way).
  bool failed() const;

 private:
  struct Unexpected {
    int64_t tag;
    std::string dtype;
    std::vector<uint8_t> data;
    size_t received = 0;
    bool complete = false;
    Handle claimed;  // the receive this message goes to once complete
  };
  struct Ring;
  struct Peer {
    bool connected = false;
    bool creator = false;
    bool opened_seen = false;  // creator: the peer mapped the segment (and unlinked its name)
    bool broken = false;
    std::string broken_reason;
    std::string name;
    uint8_t* base = nullptr;
    Ring* out = nullptr;
    Ring* in = nullptr;
    std::atomic<uint32_t>* opened = nullptr;
    uint8_t* out_slots = nullptr;
    uint8_t* in_slots = nullptr;
    uint64_t out_head = 0;
    uint64_t in_tail = 0;
    std::deque<Handle> sends;
    // The incoming message being copied: to a receive, to an unexpected buffer, or discarded.
    Handle in_target;
    std::shared_ptr<Unexpected> in_unexpected;
    bool in_discard = false;
    std::deque<std::shared_ptr<Unexpected>> unexpected;
  };

  void connect(int peer, const char* what);
  bool progress();
  bool push_sends(int peer);
  bool pull(int peer);
  void bind_incoming(int peer, int64_t tag, uint64_t bytes, const std::string& dtype);
  void deliver(const Handle& request, Unexpected& message, int peer);
  // The request's own error, if any, as PeerError.
  static void raise_if_failed(const P2pRequest& request);
  bool peer_alive(int peer) const;
  void check_peer(int peer, const char* what) const;
  // Withdraws a request that timed out so that no later message lands in its buffer.
  void cancel(const Handle& request);
  std::string mismatch(int peer, int64_t tag, uint64_t bytes, const std::string& dtype, const P2pRequest& recv) const;

  Store& store_;
  std::string prefix_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<const std::atomic<bool>> abort_;
  std::vector<int64_t> peer_pids_;
  size_t segment_bytes_;
  std::vector<Peer> peers_;
  std::list<Handle> posted_;  // receives not yet matched, in posting order
};

}  // namespace commlib
