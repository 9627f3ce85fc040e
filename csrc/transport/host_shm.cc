#include "transport/host_shm.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <fstream>
#include <functional>
#include <random>

#include "bootstrap/bootstrap.hpp"
#include "commlib/errors.hpp"
#include "commlib/types.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#define COMMLIB_CPU_RELAX() _mm_pause()
#else
#define COMMLIB_CPU_RELAX() ((void)0)
#endif

namespace commlib {

// Note [host shm waiting]
// A waiter spins briefly (the peer is usually a few microseconds away when cores are free), then
// sleeps on a futex on the low 32 bits of the peer's `arrived` word. The spin (250 µs) is longer
// than a futex wake-up takes on the VMs measured (tens of µs to ~100): with a shorter one (50 µs),
// one late rank made its peer sleep, the peer then woke late for the next call, and whole runs
// of calls took 77-176 µs instead of 5-20 (bench/results/cpu-all-reduce-2026-11-30-d.md). With
// more ranks than cores there is no spin at all. After the first 20 µs the spin calls sched_yield()
// between checks: when another process (a compile, another test) keeps one of the two cores busy,
// both ranks share the other one, and a pure spin held the core its peer needed for the whole
// 250 µs at every hand-off: with one other runnable process, 1-128 KiB all_reduces took ~300 µs
// per call spinning and 45-93 µs yielding, a 32 MiB one ~62 ms spinning and 8-26 ms yielding
// (bench/results/cpu-all-reduce-2026-11-30-e.md). With nothing else runnable on the core,
// sched_yield() returns at once. When the peer last ran on this very CPU (each rank publishes the
// CPU it runs on, `cpu`, when that changes), the waiter yields at once instead of after 20 µs: the
// scheduler often wakes both ranks of a 2-core machine on one CPU after a sleep (a gloo call, a
// barrier of the caller's), and until it moves one away, every hand-off spun 20 µs before letting
// the peer run (a 4 KiB all_reduce 31-48 µs instead of ~4; bench/results/cpu-bind-2026-12-01.md).
// Lost-wakeup freedom (Dekker): the waiter increments `sleepers` and
// then re-reads `arrived`; the arriver stores `arrived` and then reads `sleepers`; both seq_cst,
// so at least one sees the other. FUTEX_WAIT also re-checks the word atomically.
// The same protocol covers the progress counters: a waiter sleeps on the counter it waits for, and
// the publisher wakes whenever anyone sleeps on any of its words (a spurious wake is harmless).
struct alignas(128) HostShm::RankControl {
  std::atomic<uint64_t> arrived;   // last barrier sequence number this rank reached
  std::atomic<uint32_t> sleepers;  // peers asleep (or about to sleep) on `arrived` or a counter
  std::atomic<int32_t> cpu;        // 1 + the CPU this rank last ran on (0: not known yet)
  OpTag tags[2];                   // tag of barrier seq, indexed by seq & 1 (a peer is at most one ahead)
  std::atomic<uint64_t> progress[static_cast<int>(Progress::kNumCounters)];  // Note [host shm pipeline]
};

namespace {

constexpr size_t kAlign = 4096;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

std::string segment_name(const std::string& prefix, uint64_t uid) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "/commlib-%016zx-%016llx", std::hash<std::string>{}(prefix),
                static_cast<unsigned long long>(uid));
  return buf;
}

std::string errno_text() { return std::strerror(errno); }

static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free);

// The low 32 bits of a little-endian 64-bit atomic, as a futex word.
uint32_t* futex_word(std::atomic<uint64_t>& word) { return reinterpret_cast<uint32_t*>(&word); }

void futex_wait(uint32_t* addr, uint32_t expected, std::chrono::microseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000), static_cast<long>(timeout.count() % 1000000) * 1000};
  ::syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0);  // EAGAIN/ETIMEDOUT/EINTR: caller re-checks
}

void futex_wake_all(uint32_t* addr) { ::syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

constexpr auto kSpinTime = std::chrono::microseconds(250);
constexpr auto kYieldAfter = std::chrono::microseconds(20);
constexpr auto kSleepSlice = std::chrono::microseconds(20000);  // liveness and timeout checks between sleeps

}  // namespace

std::string describe(const OpTag& tag) {
  auto dtype = [&] {
    return tag.dtype <= static_cast<uint32_t>(DataType::kBool) ? std::string(dtype_name(static_cast<DataType>(tag.dtype)))
                                                                 : detail::concat("dtype #", tag.dtype);
  };
  auto reduction = [&] {
    return tag.extra <= static_cast<uint64_t>(ReduceOp::kBxor) ? std::string(reduce_op_name(static_cast<ReduceOp>(tag.extra)))
                                                                 : detail::concat("op #", tag.extra);
  };
  switch (static_cast<HostOp>(tag.op)) {
    case HostOp::kAllReduceFlat:
    case HostOp::kAllReduceTree:
    case HostOp::kReduceScatter:
      return detail::concat(tag.op == static_cast<uint32_t>(HostOp::kReduceScatter) ? "reduce_scatter(" : "all_reduce(",
                            dtype(), ", ", tag.size, " elements, ", reduction(), ")");
    case HostOp::kAllGather: return detail::concat("all_gather(", tag.size, " bytes)");
    case HostOp::kBroadcast: return detail::concat("broadcast(", tag.size, " bytes, root ", tag.extra, ")");
    case HostOp::kAllToAllV: return "all_to_all";
    case HostOp::kGather: return detail::concat("gather(", tag.size, " bytes, root ", tag.extra, ")");
    case HostOp::kScatter: return detail::concat("scatter(", tag.size, " bytes, root ", tag.extra, ")");
    case HostOp::kBarrier: return "barrier";
    case HostOp::kFused: return "fused all_reduce + rms_norm";
    case HostOp::kAgree: return detail::concat("a collective (kind ", tag.extra >> 8, ", dtype #", tag.dtype, ", ",
                                               tag.size, " elements, reduction #", tag.extra & 0xff, ")");
    default: break;
  }
  return detail::concat("operation #", tag.op, " (dtype #", tag.dtype, ", size ", tag.size, ", extra ", tag.extra, ")");
}

HostShm::HostShm(Bootstrap& bootstrap, size_t slot_bytes, std::chrono::milliseconds timeout,
                 std::vector<int64_t> peer_pids, std::chrono::microseconds test_jitter)
    : rank_(bootstrap.rank()),
      world_size_(bootstrap.world_size()),
      slot_bytes_(round_up(slot_bytes, 256)),
      timeout_(timeout),
      peer_pids_(std::move(peer_pids)),
      oversubscribed_(static_cast<unsigned>(world_size_) > std::max(1u, std::thread::hardware_concurrency())),
      test_jitter_(test_jitter),
      jitter_rng_(static_cast<uint32_t>(::getpid()) * 2654435761u + static_cast<uint32_t>(rank_)) {
  control_bytes_ = round_up(sizeof(RankControl) * world_size_, kAlign);
  total_bytes_ = control_bytes_ + slot_bytes_ * 2 * world_size_;

  uint64_t uid = 0;
  if (rank_ == 0) uid = std::random_device{}() * 0x100000001ull ^ static_cast<uint64_t>(::getpid());
  uid = from_bytes<uint64_t>(bootstrap.broadcast("shm/uid", to_bytes(uid), 0));
  const std::string name = segment_name(bootstrap.prefix(), uid);

  int fd = -1;
  if (rank_ == 0) {
    fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    COMMLIB_CHECK(fd >= 0, Error, "host shm: shm_open(", name, ") failed: ", errno_text());
    if (::ftruncate(fd, static_cast<off_t>(total_bytes_)) != 0) {
      std::string why = errno_text();
      ::close(fd);
      ::shm_unlink(name.c_str());
      throw Error(detail::concat("host shm: ftruncate(", name, ", ", total_bytes_, ") failed: ", why));
    }
  }
  try {
    bootstrap.barrier("shm/created");
    if (rank_ != 0) {
      fd = ::shm_open(name.c_str(), O_RDWR, 0600);
      COMMLIB_CHECK(fd >= 0, Error, "host shm: rank ", rank_, " could not open ", name, ": ", errno_text());
    }
    void* p = ::mmap(nullptr, total_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    fd = -1;
    COMMLIB_CHECK(p != MAP_FAILED, Error, "host shm: mmap of ", total_bytes_, " bytes failed: ", errno_text());
    base_ = static_cast<uint8_t*>(p);
    bootstrap.barrier("shm/mapped");
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::shm_unlink(name.c_str());
    if (base_ != nullptr) ::munmap(base_, total_bytes_);
    base_ = nullptr;
    throw;
  }
  // Every rank has mapped it: the name is no longer needed. Whoever comes first removes it.
  ::shm_unlink(name.c_str());
}

HostShm::~HostShm() {
  if (base_ != nullptr) ::munmap(base_, total_bytes_);
}

int32_t HostShm::note_cpu() {
  const int32_t cpu = ::sched_getcpu() + 1;  // 0 when unknown
  if (cpu != last_cpu_) {  // a store only after a migration, never in the steady state
    last_cpu_ = cpu;
    control(rank_).cpu.store(cpu, std::memory_order_relaxed);
  }
  return cpu;
}

HostShm::RankControl& HostShm::control(int rank) const {
  return reinterpret_cast<RankControl*>(base_)[rank];
}

uint8_t* HostShm::slot(int rank, int buffer) const {
  return base_ + control_bytes_ + (static_cast<size_t>(rank) * 2 + buffer) * slot_bytes_;
}

void HostShm::check_usable(const char* what) const {
  COMMLIB_CHECK(!(abort_ && abort_->load(std::memory_order_relaxed)), PeerError, what,
                ": the communicator was aborted; create a new one");
  COMMLIB_CHECK(!broken_, PeerError, what, ": communicator unusable after an earlier failure (", broken_reason_,
                "); create a new one");
}

bool HostShm::peer_alive(int peer) const {
  const int64_t pid = peer_pids_[peer];
  if (pid <= 0) return true;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  // A dead child not yet reaped by its parent still answers kill(): look at its state.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return true;
  size_t close_paren = text.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= text.size()) return true;
  char state = text[close_paren + 2];
  return state != 'Z' && state != 'X';
}

void HostShm::wait_for(int peer, std::atomic<uint64_t>& arrived, uint64_t seq, const char* what, const char* phase,
                       const char* unit) {
  RankControl& theirs = control(peer);
  if (arrived.load(std::memory_order_acquire) >= seq) return;
  const auto start = std::chrono::steady_clock::now();
  auto next_liveness_check = start + std::chrono::milliseconds(50);
  for (uint64_t spins = 1;; ++spins) {
    if (arrived.load(std::memory_order_acquire) >= seq) return;
    if ((spins & 63) != 0) {
      COMMLIB_CPU_RELAX();
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    // Past the first microseconds, or at once when the peer shares this CPU, the peer may be
    // waiting for this core: let it run.
    const int32_t here = note_cpu();
    if (now - start >= kYieldAfter || (here != 0 && theirs.cpu.load(std::memory_order_relaxed) == here)) {
      ::sched_yield();
    }
    if (oversubscribed_ || now - start >= kSpinTime) {
      // Sleep until the peer arrives (Note [host shm waiting]).
      theirs.sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint64_t seen = arrived.load(std::memory_order_seq_cst);
      if (seen < seq) futex_wait(futex_word(arrived), static_cast<uint32_t>(seen), kSleepSlice);
      theirs.sleepers.fetch_sub(1, std::memory_order_relaxed);
      if (arrived.load(std::memory_order_acquire) >= seq) return;
    }
    const auto after = std::chrono::steady_clock::now();
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(after - start);
    if (after >= next_liveness_check) {
      next_liveness_check = after + std::chrono::milliseconds(50);
      if (abort_ && abort_->load(std::memory_order_relaxed)) {
        broken_ = true;
        failure_ = Failure::kAborted;
        broken_reason_ = "the communicator was aborted";
        throw PeerError(detail::concat(what, ": rank ", rank_, " waiting for rank ", peer, " at phase '", phase,
                                       "': the communicator was aborted after ", waited.count(), " ms"));
      }
      // Every peer, not only the awaited one: at three ranks or more the awaited rank may itself be
      // stuck on (or have left after) the one that died.
      for (int q = peer, i = 0; i < world_size_; ++i, q = (q + 1) % world_size_) {
        if (q == rank_ || peer_alive(q)) continue;
        broken_ = true;
        failure_ = Failure::kPeer;
        broken_reason_ = detail::concat("rank ", q, " (pid ", peer_pids_[q], ") exited");
        throw PeerError(detail::concat(what, ": rank ", rank_, " waiting for rank ", peer, " at phase '", phase,
                                       "': rank ", q, " (pid ", peer_pids_[q], ") has exited after ",
                                       waited.count(), " ms"));
      }
    }
    if (waited >= timeout_) {
      broken_ = true;
      failure_ = Failure::kTimeout;
      broken_reason_ = detail::concat("timeout waiting for rank ", peer);
      throw Timeout(detail::concat(what, ": Timed out after ", waited.count(), " ms (timeout ", timeout_.count(),
                                   " ms): rank ", rank_, " waiting for rank ", peer, " at phase '", phase, "' (",
                                   unit, " ", seq, ")"));
    }
  }
}

void HostShm::jitter() {
  if (test_jitter_.count() == 0) return;
  std::uniform_int_distribution<int64_t> pause(0, test_jitter_.count());
  std::this_thread::sleep_for(std::chrono::microseconds(pause(jitter_rng_)));
}

void HostShm::barrier(const char* what, const char* phase, const OpTag& tag) {
  check_usable(what);
  const uint64_t seq = ++seq_;
  RankControl& mine = control(rank_);
  note_cpu();
  mine.tags[seq & 1] = tag;
  // Publishes the round's slot writes and tag to every peer that acquires `arrived` >= seq; seq_cst
  // (not only release) so that it is ordered before the read of `sleepers` (Note [host shm waiting]).
  mine.arrived.store(seq, std::memory_order_seq_cst);
  if (mine.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(futex_word(mine.arrived));
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) wait_for(peer, control(peer).arrived, seq, what, phase, "barrier");
  }
  for (int peer = 0; peer < world_size_; ++peer) {
    const OpTag& theirs = control(peer).tags[seq & 1];
    if (!(theirs == tag)) {
      throw PeerError(detail::concat(what, ": ranks disagree at phase '", phase, "': rank ", rank_, " called ",
                                     describe(tag), " but rank ", peer, " called ", describe(theirs),
                                     "; every rank must call the same collective with the same dtype, size and "
                                     "reduction (the group stays usable)"));
    }
  }
  jitter();
}

void HostShm::publish(Progress counter, uint64_t value) {
  RankControl& mine = control(rank_);
  // Publishes this rank's ring writes to peers that acquire the counter; seq_cst to order it before
  // the read of `sleepers` (Note [host shm waiting]).
  mine.progress[static_cast<int>(counter)].store(value, std::memory_order_seq_cst);
  if (mine.sleepers.load(std::memory_order_seq_cst) != 0) {
    futex_wake_all(futex_word(mine.progress[static_cast<int>(counter)]));
  }
}

void HostShm::wait_peers(Progress counter, uint64_t value, const char* what, const char* phase) {
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) wait_for(peer, control(peer).progress[static_cast<int>(counter)], value, what, phase, "step");
  }
  jitter();
}

}  // namespace commlib
