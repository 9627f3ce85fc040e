// Note [host p2p] (p2p.hpp).
#include "host/p2p.hpp"

#include "commlib/communicator.hpp"

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

#include "commlib/env.hpp"
#include "commlib/errors.hpp"
#include "transport/host_shm.hpp"

namespace commlib {

struct alignas(64) HostP2p::Ring {
  std::atomic<uint64_t> head;  // chunks the sender has written
  char pad0[56];
  std::atomic<uint64_t> tail;  // chunks the receiver has copied out
  char pad1[56];
};

namespace {

struct ChunkHeader {
  int64_t tag;
  uint64_t msg_bytes;
  uint64_t offset;
  uint64_t chunk_bytes;
  char dtype[24];
};
constexpr size_t kHeaderBytes = 64;
static_assert(sizeof(ChunkHeader) <= kHeaderBytes);
constexpr size_t kPayloadBytes = HostP2p::kSlotBytes - kHeaderBytes;
// [Ring lo->hi][Ring hi->lo][opened flag] then the slots of lo->hi, then those of hi->lo.
constexpr size_t kControlBytes = 4096;

std::string errno_text() { return std::strerror(errno); }

HostP2p::Handle make_request(P2pRequest::Kind kind, int peer, int64_t tag, void* data, size_t bytes,
                             const std::string& dtype) {
  auto request = std::make_shared<P2pRequest>();
  request->kind = kind;
  request->peer = peer;
  request->tag = tag;
  request->data = static_cast<uint8_t*>(data);
  request->bytes = bytes;
  request->dtype = dtype.substr(0, sizeof(ChunkHeader::dtype) - 1);
  return request;
}

// How long a closing sender waits for a live peer to open the segment holding its unread messages.
constexpr auto kFlushWait = std::chrono::seconds(2);

uint8_t* slot_at(uint8_t* slots, uint64_t index) { return slots + (index % HostP2p::kNumSlots) * HostP2p::kSlotBytes; }

}  // namespace

HostP2p::HostP2p(Store& store, std::string prefix, int rank, int world_size, std::chrono::milliseconds timeout,
                 std::vector<int64_t> peer_pids)
    : store_(store),
      prefix_(std::move(prefix)),
      rank_(rank),
      world_size_(world_size),
      timeout_(timeout),
      peer_pids_(std::move(peer_pids)),
      segment_bytes_(kControlBytes + 2 * kNumSlots * kSlotBytes),
      peers_(world_size) {}

// A message this rank sent may still be in a segment the peer has not opened yet (a send that fits
// the ring is done on return, so the sender may close at once). The creator of such a segment gives
// a live peer up to kFlushWait to open it (it unlinks the name when it does) before unlinking the
// name itself; a peer that closes without having opened a segment whose name was published unlinks
// it from the name in the store. Closing waits for no peer otherwise.
HostP2p::~HostP2p() {
  for (int q = 0; q < world_size_; ++q) {
    Peer& p = peers_[q];
    if (!p.connected) {
      if (q == rank_) continue;
      try {
        const int lo = std::min(rank_, q), hi = std::max(rank_, q);
        const std::string key = prefix_ + "/p2p/" + std::to_string(lo) + "-" + std::to_string(hi) + "/name";
        if (store_.check(key)) {
          const auto name = store_.get(key);
          ::shm_unlink(std::string(name.begin(), name.end()).c_str());
        }
      } catch (const std::exception&) {
        // the store is gone with the job; the creator unlinked it if the peer has exited
      }
      continue;
    }
    auto opened = [&] { return p.opened_seen || p.opened->load(std::memory_order_acquire) != 0; };
    if (p.creator && !opened()) {
      const bool unread = p.out->head.load(std::memory_order_acquire) != p.out->tail.load(std::memory_order_acquire);
      const auto deadline = std::chrono::steady_clock::now() + kFlushWait;
      while (unread && !opened() && peer_alive(q) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!opened()) ::shm_unlink(p.name.c_str());
    }
    ::munmap(p.base, segment_bytes_);
  }
}

void HostP2p::connect(int peer, const char* what) {
  Peer& p = peers_[peer];
  if (p.connected) return;
  const int lo = std::min(rank_, peer), hi = std::max(rank_, peer);
  const std::string key = prefix_ + "/p2p/" + std::to_string(lo) + "-" + std::to_string(hi);
  int fd = -1;
  if (store_.add(key + "/arrive", 1) == 1) {  // first of the pair: create, publish, go on
    const uint64_t uid = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}() ^
                         static_cast<uint64_t>(::getpid());
    char name[80];
    std::snprintf(name, sizeof(name), "/commlib-p2p-%016zx-%016llx", std::hash<std::string>{}(key),
                  static_cast<unsigned long long>(uid));
    p.name = name;
    p.creator = true;
    fd = ::shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    COMMLIB_CHECK(fd >= 0, Error, what, ": shm_open(", p.name, ") failed: ", errno_text());
    if (::ftruncate(fd, static_cast<off_t>(segment_bytes_)) != 0) {
      const std::string why = errno_text();
      ::close(fd);
      ::shm_unlink(name);
      throw Error(detail::concat(what, ": ftruncate(", p.name, ", ", segment_bytes_, ") failed: ", why));
    }
  } else {  // second: the first publishes the name right after its add()
    const auto start = std::chrono::steady_clock::now();
    while (!store_.check(key + "/name")) {
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
      COMMLIB_CHECK(waited < timeout_, Timeout, what, ": Timed out after ", waited.count(), " ms: rank ", rank_,
                    " waiting for rank ", peer, " at set-up phase 'p2p segment'");
      check_peer(peer, what);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    const auto bytes = store_.get(key + "/name");
    p.name.assign(bytes.begin(), bytes.end());
    fd = ::shm_open(p.name.c_str(), O_RDWR, 0600);
    COMMLIB_CHECK(fd >= 0, Error, what, ": rank ", rank_, " could not open ", p.name, ": ", errno_text());
  }
  void* base = ::mmap(nullptr, segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    const std::string why = errno_text();
    if (p.creator) ::shm_unlink(p.name.c_str());
    throw Error(detail::concat(what, ": mmap of ", segment_bytes_, " bytes failed: ", why));
  }
  p.base = static_cast<uint8_t*>(base);
  auto* rings = reinterpret_cast<Ring*>(p.base);
  const int out_dir = rank_ < peer ? 0 : 1;
  p.out = &rings[out_dir];
  p.in = &rings[1 - out_dir];
  p.opened = reinterpret_cast<std::atomic<uint32_t>*>(p.base + 2 * sizeof(Ring));
  p.out_slots = p.base + kControlBytes + out_dir * kNumSlots * kSlotBytes;
  p.in_slots = p.base + kControlBytes + (1 - out_dir) * kNumSlots * kSlotBytes;
  if (p.creator) {
    store_.set(key + "/name", std::vector<uint8_t>(p.name.begin(), p.name.end()));
  } else {
    ::shm_unlink(p.name.c_str());  // both have it mapped now: nothing stays in /dev/shm
    p.opened->store(1, std::memory_order_release);
  }
  p.connected = true;
}

HostP2p::Handle HostP2p::isend(const void* data, size_t bytes, const std::string& dtype, int dst, int64_t tag) {
  const char* what = "send";
  check_peer_rank(what, "dst", dst, world_size_, rank_);
  check_peer(dst, what);
  connect(dst, what);
  auto request = make_request(P2pRequest::Kind::kSend, dst, tag, const_cast<void*>(data), bytes, dtype);
  peers_[dst].sends.push_back(request);
  progress();
  return request;
}

HostP2p::Handle HostP2p::irecv(void* data, size_t bytes, const std::string& dtype, int src, int64_t tag) {
  const char* what = "recv";
  if (src != kAnySource) check_peer_rank(what, "src", src, world_size_, rank_);
  auto request = make_request(P2pRequest::Kind::kRecv, src, tag, data, bytes, dtype);
  for (int q = 0; q < world_size_; ++q) {
    if (q == rank_ || (src != kAnySource && q != src)) continue;
    check_peer(q, what);
    connect(q, what);
  }
  // The earliest unclaimed message already here with this tag (Note [host p2p], matching).
  for (int q = 0; q < world_size_; ++q) {
    if (q == rank_ || (src != kAnySource && q != src)) continue;
    auto& list = peers_[q].unexpected;
    for (auto it = list.begin(); it != list.end(); ++it) {
      Unexpected& m = **it;
      if (m.tag != tag || m.claimed) continue;
      if (m.complete) {
        deliver(request, m, q);
        list.erase(it);
      } else {
        m.claimed = request;
        request->source = q;
      }
      progress();
      return request;
    }
  }
  posted_.push_back(request);
  progress();
  return request;
}

std::string HostP2p::mismatch(int peer, int64_t tag, uint64_t bytes, const std::string& dtype,
                              const P2pRequest& recv) const {
  return detail::concat("recv: ranks disagree: rank ", peer, " sent ", bytes, " bytes of ", dtype, " with tag ", tag,
                        " but rank ", rank_, " receives ", recv.bytes, " bytes of ", recv.dtype,
                        "; the message was discarded");
}

void HostP2p::deliver(const Handle& request, Unexpected& message, int peer) {
  request->source = peer;
  if (message.data.size() != request->bytes || message.dtype != request->dtype) {
    request->error = mismatch(peer, message.tag, message.data.size(), message.dtype, *request);
  } else if (request->bytes != 0) {
    std::memcpy(request->data, message.data.data(), request->bytes);
  }
  request->done_bytes = request->bytes;
  request->done = true;
}

void HostP2p::bind_incoming(int peer, int64_t tag, uint64_t bytes, const std::string& dtype) {
  Peer& p = peers_[peer];
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    P2pRequest& r = **it;
    if (r.tag != tag || (r.peer != peer && r.peer != kAnySource)) continue;
    Handle request = *it;
    posted_.erase(it);
    request->source = peer;
    if (bytes != request->bytes || dtype != request->dtype) {
      request->error = mismatch(peer, tag, bytes, dtype, *request);
      request->done = true;
      p.in_discard = true;
    } else {
      p.in_target = std::move(request);
    }
    return;
  }
  auto m = std::make_shared<Unexpected>();
  m->tag = tag;
  m->dtype = dtype;
  m->data.resize(bytes);
  p.unexpected.push_back(m);
  p.in_unexpected = std::move(m);
}

bool HostP2p::pull(int peer) {
  Peer& p = peers_[peer];
  bool moved = false;
  while (p.in_tail < p.in->head.load(std::memory_order_acquire)) {  // acquire: the chunk's bytes
    const uint8_t* slot = slot_at(p.in_slots, p.in_tail);
    ChunkHeader h;
    std::memcpy(&h, slot, sizeof(h));
    h.dtype[sizeof(h.dtype) - 1] = '\0';
    if (h.offset == 0) bind_incoming(peer, h.tag, h.msg_bytes, h.dtype);
    const uint8_t* payload = slot + kHeaderBytes;
    if (p.in_target) {
      std::memcpy(p.in_target->data + h.offset, payload, h.chunk_bytes);
      p.in_target->done_bytes += h.chunk_bytes;
    } else if (p.in_unexpected) {
      std::memcpy(p.in_unexpected->data.data() + h.offset, payload, h.chunk_bytes);
      p.in_unexpected->received += h.chunk_bytes;
    }
    // Frees the slot for the sender: every read of it is above (release).
    p.in->tail.store(++p.in_tail, std::memory_order_release);
    moved = true;
    if (h.offset + h.chunk_bytes == h.msg_bytes) {  // the message's last chunk
      if (p.in_target) {
        p.in_target->done = true;
      } else if (p.in_unexpected) {
        Unexpected& m = *p.in_unexpected;
        m.complete = true;
        if (m.claimed) {
          Handle request = std::move(m.claimed);
          deliver(request, m, peer);
          p.unexpected.erase(std::find(p.unexpected.begin(), p.unexpected.end(), p.in_unexpected));
        }
      }
      p.in_target.reset();
      p.in_unexpected.reset();
      p.in_discard = false;
    }
  }
  return moved;
}

bool HostP2p::push_sends(int peer) {
  Peer& p = peers_[peer];
  bool moved = false;
  while (!p.sends.empty()) {
    P2pRequest& r = *p.sends.front();
    do {
      // acquire: the receiver has finished reading the slot this chunk overwrites
      if (p.out_head - p.out->tail.load(std::memory_order_acquire) >= kNumSlots) return moved;
      uint8_t* slot = slot_at(p.out_slots, p.out_head);
      ChunkHeader h{};
      h.tag = r.tag;
      h.msg_bytes = r.bytes;
      h.offset = r.done_bytes;
      h.chunk_bytes = std::min(kPayloadBytes, r.bytes - r.done_bytes);
      std::memcpy(h.dtype, r.dtype.data(), std::min(r.dtype.size(), sizeof(h.dtype) - 1));
      std::memcpy(slot, &h, sizeof(h));
      if (h.chunk_bytes != 0) std::memcpy(slot + kHeaderBytes, r.data + r.done_bytes, h.chunk_bytes);
      // Publishes the chunk to the receiver (release).
      p.out->head.store(++p.out_head, std::memory_order_release);
      r.done_bytes += h.chunk_bytes;
      moved = true;
    } while (r.done_bytes < r.bytes);
    r.done = true;
    p.sends.pop_front();
  }
  return moved;
}

bool HostP2p::progress() {
  bool moved = false;
  for (int q = 0; q < world_size_; ++q) {
    Peer& p = peers_[q];
    if (!p.connected || p.broken) continue;
    if (p.creator && !p.opened_seen) p.opened_seen = p.opened->load(std::memory_order_acquire) != 0;
    moved |= push_sends(q);
    moved |= pull(q);
  }
  return moved;
}

void HostP2p::raise_if_failed(const P2pRequest& request) {
  if (!request.error.empty()) throw PeerError(request.error);
}

bool HostP2p::test(const Handle& request) {
  if (!request->done) progress();
  if (request->done) raise_if_failed(*request);
  return request->done;
}

bool HostP2p::peer_alive(int peer) const {
  const int64_t pid = peer_pids_.empty() ? 0 : peer_pids_[peer];
  if (pid <= 0) return true;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  // A dead child not yet reaped by its parent still answers kill(): look at its state.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return true;
  const size_t close_paren = text.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= text.size()) return true;
  const char state = text[close_paren + 2];
  return state != 'Z' && state != 'X';
}

void HostP2p::check_peer(int peer, const char* what) const {
  const Peer& p = peers_[peer];
  COMMLIB_CHECK(!p.broken, PeerError, what, ": the channel between rank ", rank_, " and rank ", peer,
                " is unusable after an earlier failure (", p.broken_reason, ")");
}

void HostP2p::cancel(const Handle& request) {
  if (request->kind == P2pRequest::Kind::kRecv) {
    posted_.remove(request);
    for (Peer& p : peers_) {
      if (p.in_target == request) {  // the rest of its message is discarded
        p.in_target.reset();
        p.in_discard = true;
      }
      for (auto& m : p.unexpected) {
        if (m->claimed == request) m->claimed.reset();
      }
    }
    return;
  }
  Peer& p = peers_[request->peer];
  auto it = std::find(p.sends.begin(), p.sends.end(), request);
  if (it == p.sends.end()) return;
  if (it == p.sends.begin() && request->done_bytes != 0) {  // the receiver holds part of the message
    p.broken = true;
    p.broken_reason = detail::concat("a send to rank ", request->peer, " stopped half-way");
  }
  p.sends.erase(it);
}

void HostP2p::wait(const Handle& request, const char* what) {
  const auto start = std::chrono::steady_clock::now();
  auto last_move = start;
  auto next_liveness_check = start + std::chrono::milliseconds(50);
  while (!request->done) {
    const bool moved = progress();
    if (request->done) break;
    const auto now = std::chrono::steady_clock::now();
    if (moved) last_move = now;
    const auto idle = now - last_move;
    // Spin while the peer is moving; then let it have the core; then sleep in short slices.
    if (idle > std::chrono::microseconds(50)) ::sched_yield();
    if (idle > std::chrono::milliseconds(2)) std::this_thread::sleep_for(std::chrono::microseconds(100));
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - start);
    const bool any = request->peer == kAnySource;
    if (now >= next_liveness_check) {
      next_liveness_check = now + std::chrono::milliseconds(50);
      if (aborted()) {
        cancel(request);
        throw PeerError(detail::concat(what, ": rank ", rank_, " waiting for ",
                                       any ? std::string("any rank") : detail::concat("rank ", request->peer),
                                       " at phase '", request->kind == P2pRequest::Kind::kSend ? "send" : "recv",
                                       "' (tag ", request->tag, "): the communicator was aborted after ",
                                       waited.count(), " ms"));
      }
      for (int q = 0; q < world_size_; ++q) {
        if (q == rank_ || (!any && q != request->peer) || peer_alive(q)) continue;
        cancel(request);
        peers_[q].broken = true;
        peers_[q].broken_reason = detail::concat("rank ", q, " exited");
        throw PeerError(detail::concat(what, ": rank ", rank_, " waiting for rank ", q, " at phase '",
                                       request->kind == P2pRequest::Kind::kSend ? "send" : "recv", "' (tag ",
                                       request->tag, ", ", request->bytes, " bytes): rank ", q, " (pid ",
                                       peer_pids_[q], ") has exited after ", waited.count(), " ms"));
      }
    }
    if (waited >= timeout_) {
      cancel(request);
      throw Timeout(detail::concat(
          what, ": Timed out after ", waited.count(), " ms (timeout ", timeout_.count(), " ms): rank ", rank_,
          " waiting for ", any ? std::string("any rank") : detail::concat("rank ", request->peer), " at phase '",
          request->kind == P2pRequest::Kind::kSend ? "send" : "recv", "' (tag ", request->tag, ", ", request->bytes,
          " bytes, ", request->done_bytes, " moved)"));
    }
  }
  raise_if_failed(*request);
}

bool HostP2p::failed() const {
  for (const auto& p : peers_) {
    if (p.broken) return true;
  }
  return false;
}

// A Communicator member, defined in the host layer that owns HostP2p (the core may not include it).
HostP2p& Communicator::host_p2p() {
  check_open("host p2p");
  COMMLIB_CHECK(num_hosts_ == 1, InvalidArgument, "Communicator '", name(),
                "': send / recv of CPU tensors go through shared memory, which needs every rank on one host; ",
                hosts_problem_);
  if (!host_p2p_) {
    host_p2p_ = std::make_shared<HostP2p>(*store_, prefix_, rank_, world_size_, options_.timeout, peer_pids_);
    host_p2p_->watch_abort(aborted_);
  }
  return *host_p2p_;
}

// A Communicator member, here because it reaches the host layer's HostP2p as well as HostShm.
Communicator::ErrorState Communicator::error() const {
  if (aborted()) return ErrorState::kAborted;
  if (host_) {
    switch (host_->failure()) {
      case HostShm::Failure::kTimeout: return ErrorState::kTimeout;
      case HostShm::Failure::kPeer: return ErrorState::kRemote;
      case HostShm::Failure::kAborted: return ErrorState::kAborted;
      case HostShm::Failure::kNone: break;
    }
  }
  if (host_p2p_ && host_p2p_->failed()) return ErrorState::kRemote;
  if (cuda_failed_hook && cuda_ && cuda_failed_hook(*cuda_)) return ErrorState::kTimeout;
  return ErrorState::kNone;
}

// A Communicator member, here because it reaches the host layer's HostP2p as well as HostShm.
void Communicator::set_timeout(std::chrono::milliseconds timeout) {
  COMMLIB_CHECK(timeout.count() > 0, InvalidArgument, "set_timeout: timeout ", timeout.count(),
                " ms not supported; valid: a positive number of milliseconds");
  const int64_t forced_ms = env::get_int("COMMLIB_TIMEOUT_MS");
  options_.timeout = forced_ms > 0 ? std::chrono::milliseconds(forced_ms) : timeout;
  if (host_) host_->set_timeout(options_.timeout);
  if (host_p2p_) host_p2p_->set_timeout(options_.timeout);
}

}  // namespace commlib
