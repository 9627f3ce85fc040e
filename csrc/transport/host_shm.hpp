// POSIX shared-memory transport for CPU collectives.
//
// Note [host shm protocol]
// One segment per communicator, created by rank 0 (name: "/commlib-<prefix hash>-<random>",
// mode 0600), opened by the others, and shm_unlink()ed by every rank as soon as all have mapped
// it: afterwards nothing is left in /dev/shm, even if a rank is killed. Layout:
//   [RankControl x world][slot(rank 0, buf 0)][slot(0, 1)][slot(1, 0)] ...
// A collective is a sequence of rounds. Each round writes into this rank's slot of one buffer,
// then barrier(), then reads the peers' slots of that buffer. Rounds alternate buffers, so no
// trailing barrier is needed: a rank cannot write a buffer again before every peer has passed
// the next round's barrier, which a peer reaches only after finishing its reads of this one.
// The argument needs only that a round touches nothing but its buffer's slots, not that a rank
// writes its own slot: an algorithm may rotate which slot of the buffer each rank writes
// (Note [host slot rotation]).
// barrier() stores a monotonically increasing sequence number (never reset) with release
// semantics and waits with acquire for every peer to reach it, bounded by the timeout; it also
// compares an OpTag so that mismatched collectives raise PeerError on every rank instead of
// corrupting memory.
//
// Note [host shm pipeline]
// Large collectives run as a pipeline of steps instead of barrier rounds: each rank treats its
// two slots as one ring of chunk buffers (ring(rank)) and publishes per-step progress counters
// (Progress) that peers wait for one at a time, so a rank waits only for the data it is about to
// read and never for a whole round. Counters are monotonically increasing across calls (never
// reset); a pipelined collective reserves its steps with reserve_steps(), starts with barrier()
// (the tag check, and proof that every peer has finished reading this rank's slots in earlier
// rounds) and ends by waiting until every peer has finished reading its ring, so the slots are
// free again for the next collective of either kind.
//
// Note [host shm jitter]
// Whether a rank that runs ahead can overwrite what a slower peer has not read yet depends on the
// protocol alone (double buffering, the release counters), but on an idle machine the ranks leave
// each wait nearly together and such a bug shows only now and then. With a test jitter
// (COMMLIB_HOST_TEST_JITTER_US) a rank sleeps a random time after each of its waits, the moment it
// is about to read or overwrite shared slots, so its peers run ahead into the next round or step;
// tests/cpu/test_host_sequences.py runs mixed operation sequences with it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace commlib {

class Bootstrap;

// What a rank is doing in a round; every rank must agree.
struct OpTag {
  uint32_t op = 0;
  uint32_t dtype = 0;
  uint64_t size = 0;
  uint64_t extra = 0;
  bool operator==(const OpTag&) const = default;
};

enum class HostOp : uint32_t {
  kAllReduceFlat = 1,
  kAllReduceTree,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kAllToAllV,
  kBarrier,
  kFused,
  kGather,
  kScatter,
  kAgree,  // only the tag check: a call that then goes to another library (Note [ddacomm routing])
  kPointToPoint,
  kUser,  // extensions (EP, fused) tag their own rounds as kUser + n
};

// "all_reduce(float32, 10 elements, sum)": a tag in words, for mismatch errors.
std::string describe(const OpTag& tag);

// Per-rank progress counters of pipelined collectives (Note [host shm pipeline]).
enum class Progress : int {
  kCopied = 0,  // steps whose input this rank has copied into its ring
  kReduced,     // steps whose result this rank has written to its ring (tree)
  kReleased,    // steps whose ring chunks this rank will not read again; every pipelined
                // collective publishes it for each of its steps, since ring reuse in a later call
                // (of whichever algorithm) waits for it
  kNumCounters,
};

class HostShm {
 public:
  // `test_jitter` > 0: sleep a random 0..test_jitter after every wait (Note [host shm jitter]).
  HostShm(Bootstrap& bootstrap, size_t slot_bytes, std::chrono::milliseconds timeout,
          std::vector<int64_t> peer_pids, std::chrono::microseconds test_jitter = {});
  ~HostShm();
  HostShm(const HostShm&) = delete;
  HostShm& operator=(const HostShm&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  size_t slot_bytes() const { return slot_bytes_; }

  // Starts a round: returns the buffer (0 or 1) whose slots this round uses.
  int next_buffer() { return static_cast<int>(next_round() & 1); }
  // Starts a round: returns its index (the same on every rank); it uses buffer index & 1.
  uint64_t next_round() { return round_++; }
  uint8_t* slot(int rank, int buffer) const;

  // Publishes this rank's writes of the round and waits for every peer (see the Note).
  // `what` names the operation and `phase` the step, for error messages.
  void barrier(const char* what, const char* phase, const OpTag& tag);

  // This rank's two slots as one contiguous ring of 2 * slot_bytes() bytes (pipelined collectives).
  uint8_t* ring(int rank) const { return slot(rank, 0); }
  size_t ring_bytes() const { return 2 * slot_bytes_; }

  // Reserves `num_steps` pipeline steps; returns the global index of the first. Every rank makes
  // the same reservations in the same order, so a step index means the same thing on every rank.
  uint64_t reserve_steps(uint64_t num_steps) {
    const uint64_t first = steps_;
    steps_ += num_steps;
    return first;
  }
  // Publishes `value` (a step count) for `counter`, with release semantics: everything this rank
  // wrote before is visible to a peer that waits for it.
  void publish(Progress counter, uint64_t value);
  // Waits (bounded, like barrier()) until every peer's `counter` has reached `value`.
  void wait_peers(Progress counter, uint64_t value, const char* what, const char* phase);

  // Throws PeerError if an earlier wait failed (the ranks' sequence numbers no longer agree) or
  // the communicator was aborted.
  void check_usable(const char* what) const;
  // What ended this transport's usability: none, a timeout, a peer that exited, or an abort.
  enum class Failure { kNone, kTimeout, kPeer, kAborted };
  Failure failure() const { return failure_; }
  // Every wait from now on also ends (PeerError, within ~50 ms) once *flag is true: the
  // communicator's abort flag, set from any thread (Note [abort]).
  void watch_abort(std::shared_ptr<const std::atomic<bool>> flag) { abort_ = std::move(flag); }
  // Bounds the waits from now on (the group's timeout changed).
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 private:
  struct RankControl;
  RankControl& control(int rank) const;
  // Publishes 1 + the CPU this rank runs on in its control block when it changed; returns it (0: unknown).
  int32_t note_cpu();
  // Waits until `word` (in `peer`'s control block) reaches `target`; `unit` names it in errors.
  void wait_for(int peer, std::atomic<uint64_t>& word, uint64_t target, const char* what, const char* phase,
                const char* unit);
  bool peer_alive(int peer) const;
  // Note [host shm jitter]: a random pause when a test asked for one.
  void jitter();

  int rank_;
  int world_size_;
  size_t slot_bytes_;
  std::chrono::milliseconds timeout_;
  std::vector<int64_t> peer_pids_;
  bool oversubscribed_;  // more ranks than cores: sleep at once instead of spinning first
  std::chrono::microseconds test_jitter_;
  std::minstd_rand jitter_rng_;
  int32_t last_cpu_ = 0;  // what note_cpu() last published
  uint8_t* base_ = nullptr;
  size_t total_bytes_ = 0;
  size_t control_bytes_ = 0;
  uint64_t seq_ = 0;
  uint64_t round_ = 0;
  uint64_t steps_ = 0;
  bool broken_ = false;
  std::string broken_reason_;
  Failure failure_ = Failure::kNone;
  std::shared_ptr<const std::atomic<bool>> abort_;
};

}  // namespace commlib
