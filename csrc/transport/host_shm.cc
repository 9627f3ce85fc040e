#include "transport/host_shm.hpp"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

#include "bootstrap/bootstrap.hpp"
#include "commlib/errors.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#define COMMLIB_CPU_RELAX() _mm_pause()
#else
#define COMMLIB_CPU_RELAX() ((void)0)
#endif

namespace commlib {

struct alignas(128) HostShm::RankControl {
  std::atomic<uint64_t> arrived;  // last barrier sequence number this rank reached
  OpTag tags[2];                  // tag of barrier seq, indexed by seq & 1 (a peer is at most one ahead)
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

}  // namespace

HostShm::HostShm(Bootstrap& bootstrap, size_t slot_bytes, std::chrono::milliseconds timeout,
                 std::vector<int64_t> peer_pids)
    : rank_(bootstrap.rank()),
      world_size_(bootstrap.world_size()),
      slot_bytes_(round_up(slot_bytes, 256)),
      timeout_(timeout),
      peer_pids_(std::move(peer_pids)),
      oversubscribed_(static_cast<unsigned>(world_size_) > std::max(1u, std::thread::hardware_concurrency())) {
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

HostShm::RankControl& HostShm::control(int rank) const {
  return reinterpret_cast<RankControl*>(base_)[rank];
}

uint8_t* HostShm::slot(int rank, int buffer) const {
  return base_ + control_bytes_ + (static_cast<size_t>(rank) * 2 + buffer) * slot_bytes_;
}

void HostShm::check_usable(const char* what) const {
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

void HostShm::wait_for(int peer, uint64_t seq, const char* what, const char* phase) {
  std::atomic<uint64_t>& arrived = control(peer).arrived;
  if (arrived.load(std::memory_order_acquire) >= seq) return;
  const auto start = std::chrono::steady_clock::now();
  auto next_liveness_check = start + std::chrono::milliseconds(50);
  // Spin while the peer is likely running on another core; once ranks outnumber cores, or the
  // wait is long, give the core away (a yield, then short sleeps), so the awaited rank can run.
  const uint64_t spin_limit = oversubscribed_ ? 16 : 4096;
  for (uint64_t spins = 1;; ++spins) {
    if (arrived.load(std::memory_order_acquire) >= seq) return;
    if (spins < spin_limit) {
      COMMLIB_CPU_RELAX();
      continue;
    }
    if (spins < spin_limit + 256) {
      ::sched_yield();
    } else {
      ::usleep(20);
    }
    if ((spins & 15) != 0) continue;
    const auto now = std::chrono::steady_clock::now();
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - start);
    if (now >= next_liveness_check) {
      next_liveness_check = now + std::chrono::milliseconds(50);
      if (!peer_alive(peer)) {
        broken_ = true;
        broken_reason_ = detail::concat("rank ", peer, " (pid ", peer_pids_[peer], ") exited");
        throw PeerError(detail::concat(what, ": rank ", rank_, " waiting for rank ", peer, " at phase '", phase,
                                       "': rank ", peer, " (pid ", peer_pids_[peer], ") has exited after ",
                                       waited.count(), " ms"));
      }
    }
    if (waited >= timeout_) {
      broken_ = true;
      broken_reason_ = detail::concat("timeout waiting for rank ", peer);
      throw Timeout(detail::concat(what, ": rank ", rank_, " timed out after ", waited.count(),
                                   " ms waiting for rank ", peer, " at phase '", phase, "' (barrier ", seq, ")"));
    }
  }
}

void HostShm::barrier(const char* what, const char* phase, const OpTag& tag) {
  check_usable(what);
  const uint64_t seq = ++seq_;
  RankControl& mine = control(rank_);
  mine.tags[seq & 1] = tag;
  // Release: makes this rank's slot writes of the round and its tag visible to every peer that
  // acquires `arrived` >= seq.
  mine.arrived.store(seq, std::memory_order_release);
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer != rank_) wait_for(peer, seq, what, phase);
  }
  for (int peer = 0; peer < world_size_; ++peer) {
    const OpTag& theirs = control(peer).tags[seq & 1];
    if (!(theirs == tag)) {
      throw PeerError(detail::concat(what, ": ranks disagree at phase '", phase, "': rank ", rank_,
                                     " called (op ", tag.op, ", dtype ", tag.dtype, ", size ", tag.size,
                                     ", extra ", tag.extra, ") but rank ", peer, " called (op ", theirs.op,
                                     ", dtype ", theirs.dtype, ", size ", theirs.size, ", extra ", theirs.extra,
                                     "); every rank must call the same collective with matching sizes"));
    }
  }
}

}  // namespace commlib
