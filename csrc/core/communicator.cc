#include "commlib/communicator.hpp"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "bootstrap/bootstrap.hpp"
#include "commlib/env.hpp"
#include "commlib/errors.hpp"
#include "core/algorithm_selector.hpp"
#include "common/multicast_guard.hpp"
#include "transport/cuda_multicast.hpp"
#include "transport/host_shm.hpp"

namespace commlib {


namespace {

// Ranks create communicators of one name in the same order, so a counter per (name, rank) gives
// every rank the same, fresh key prefix (per rank, so ranks that are threads of one process, as in
// tests/cpp/commlib_example.cc, count alike too).
std::string next_prefix(const std::string& name, int rank) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, int>, int> created;
  std::lock_guard<std::mutex> lock(mutex);
  return "commlib/" + name + "/" + std::to_string(created[{name, rank}]++);
}

constexpr size_t kHostIdBytes = 128;

struct Hello {
  int32_t world_size;
  int32_t rank;
  int64_t pid;
  uint64_t host_hash;       // FNV-1a of the whole host id
  char host[kHostIdBytes];  // the host id, cut to fit (for messages)
};

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

std::string host_id() {
  const std::string override = env::get("COMMLIB_TEST_HOST_ID");
  if (!override.empty()) return override;
  char name[HOST_NAME_MAX + 1] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(name) + "/" + boot;
}

// Note [communicator hosts]
// A communicator may span hosts (an EPBuffer over NVSHMEM across nodes is built on one). The hello
// carries every rank's host id (host_id()); hosts are numbered in the order of their lowest rank,
// as the "ddacomm" backend numbers them (python/commlib/backend_registration.py, HostLayout).
// Shared memory and CUDA peer memory exist only inside one host, so across hosts:
//   * host() (the CPU collectives, the CPU EPBuffer) and host_p2p() (CPU send / recv) raise
//     InvalidArgument naming two ranks' hosts, before touching anything, so the communicator stays
//     usable;
//   * the GPU state maps no peer memory (CudaIpc reports the hosts as its problem: the peer-memory
//     kernels and GPU send / recv raise PeerError) and keeps what needs no peer: the error word and
//     the call state the NVSHMEM EP kernels use;
//   * set-up exchanges (control_all_gather, control_barrier) and barrier_host go over the store.

Communicator::Communicator(std::shared_ptr<Store> store, int rank, int world_size, std::string name,
                           CommunicatorOptions options)
    : store_(std::move(store)),
      rank_(rank),
      world_size_(world_size),
      name_(std::move(name)),
      options_(options),
      cuda_(nullptr, [](CudaComm*) {}),               // the GPU engine sets the real deleters
      multicast_(nullptr, [](MulticastWorkspace*) {}) {  // (Communicator::cuda, ::multicast)
  COMMLIB_CHECK(store_ != nullptr, InvalidArgument, "Communicator: store must not be None");
  COMMLIB_CHECK(world_size_ >= 1, InvalidArgument, "Communicator: world_size ", world_size_, " must be >= 1");
  COMMLIB_CHECK(rank_ >= 0 && rank_ < world_size_, InvalidArgument, "Communicator: rank ", rank_,
                " out of range; valid: 0..", world_size_ - 1);
  const int64_t timeout_ms = env::get_int("COMMLIB_TIMEOUT_MS");
  if (timeout_ms > 0) options_.timeout = std::chrono::milliseconds(timeout_ms);
  prefix_ = next_prefix(name_, rank_);

  // Hello: every rank announces its world size; a rank that disagrees with rank 0 raises at once
  // and tells the others through the abort key, so nobody waits for a rank that does not exist.
  const std::string abort_key = prefix_ + "/abort";
  Hello mine{world_size_, rank_, static_cast<int64_t>(::getpid()), 0, {}};
  const std::string my_host = host_id();
  mine.host_hash = fnv1a(my_host);
  std::strncpy(mine.host, my_host.c_str(), kHostIdBytes - 1);
  store_->set(prefix_ + "/hello/" + std::to_string(rank_), to_bytes(mine));
  peer_pids_.assign(world_size_, 0);
  host_of_.assign(world_size_, 0);
  std::vector<uint64_t> host_hashes;  // of host k, in numbering order
  std::string first_host, other_host;  // for hosts_problem_
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  for (int r = 0; r < world_size_; ++r) {
    const std::string key = prefix_ + "/hello/" + std::to_string(r);
    while (!store_->check(key)) {
      if (store_->check(abort_key)) {
        auto why = store_->get(abort_key);
        throw PeerError(std::string(why.begin(), why.end()));
      }
      COMMLIB_CHECK(std::chrono::steady_clock::now() < deadline, Timeout, "Communicator '", name_, "': rank ", rank_,
                    " timed out waiting for rank ", r, " to join (world_size ", world_size_, ")");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const Hello theirs = from_bytes<Hello>(store_->get(key));
    if (theirs.world_size != world_size_) {
      std::string why = detail::concat("Communicator '", name_, "': world_size mismatch: rank ", rank_, " has ",
                                       world_size_, " but rank ", r, " has ", theirs.world_size);
      store_->set(abort_key, std::vector<uint8_t>(why.begin(), why.end()));
      throw PeerError(why);
    }
    peer_pids_[r] = theirs.pid;
    const auto known = std::find(host_hashes.begin(), host_hashes.end(), theirs.host_hash);
    host_of_[r] = static_cast<int>(known - host_hashes.begin());
    if (known == host_hashes.end()) host_hashes.push_back(theirs.host_hash);
    if (host_hashes.size() == 2 && other_host.empty()) {
      other_host = detail::concat("rank ", r, " on '", std::string(theirs.host, strnlen(theirs.host, kHostIdBytes)), "'");
    }
    if (r == 0) first_host.assign(theirs.host, strnlen(theirs.host, kHostIdBytes));
  }
  num_hosts_ = static_cast<int>(host_hashes.size());
  if (num_hosts_ > 1) {
    hosts_problem_ = detail::concat("its ", world_size_, " ranks span ", num_hosts_, " hosts (rank 0 on '", first_host,
                                    "', ", other_host, ")");
  }
}

Communicator::~Communicator() { close(); }

void Communicator::close() {
  if (closed_) return;
  closed_ = true;
  multicast_.reset();  // unbinds memory that cuda_ owns
  cuda_.reset();
  host_.reset();
  host_p2p_.reset();  // shared_ptr: the host layer defines HostP2p
}

void Communicator::abort() {
  aborted_->store(true, std::memory_order_relaxed);
  if (cuda_abort_hook && cuda_) cuda_abort_hook(*cuda_);
}

void Communicator::check_open(const char* what) const {
  COMMLIB_CHECK(!closed_, InvalidArgument, what, ": communicator '", name_, "' is closed");
  COMMLIB_CHECK(!aborted(), PeerError, what, ": communicator '", name_, "' was aborted; create a new one");
}

HostShm& Communicator::host() {
  check_open("host transport");
  COMMLIB_CHECK(num_hosts_ == 1, InvalidArgument, "Communicator '", name_,
                "': CPU tensors go through shared memory, which needs every rank on one host; ", hosts_problem_,
                ". Across hosts use a \"ddacomm\" process group (docs/multinode.md)");
  if (!host_) {
    size_t slot = options_.shm_slot_bytes != 0 ? options_.shm_slot_bytes
                                               : static_cast<size_t>(env::get_int("COMMLIB_SHM_SLOT_BYTES"));
    COMMLIB_CHECK(slot >= 4096, InvalidArgument, "COMMLIB_SHM_SLOT_BYTES=", slot, " too small; minimum 4096");
    Bootstrap bootstrap(*store_, prefix_, rank_, world_size_, options_.timeout);
    const auto jitter = std::chrono::microseconds(env::get_int("COMMLIB_HOST_TEST_JITTER_US"));
    COMMLIB_CHECK(jitter.count() >= 0, InvalidArgument, "COMMLIB_HOST_TEST_JITTER_US=", jitter.count(),
                  " is negative; valid: 0 (off) or a number of microseconds");
    host_ = std::make_unique<HostShm>(bootstrap, slot, options_.timeout, peer_pids_, jitter);
    host_->watch_abort(aborted_);
  }
  host_->check_usable("host transport");
  return *host_;
}

void Communicator::control_all_gather(void* out, const void* in, size_t bytes) {
  check_open("control_all_gather");
  if (num_hosts_ == 1) return all_gather_host(out, in, bytes);
  Bootstrap bootstrap(*store_, prefix_ + "/control", rank_, world_size_, options_.timeout);
  const auto* p = static_cast<const uint8_t*>(in);
  const auto all = bootstrap.all_gather(std::to_string(control_calls_++), std::vector<uint8_t>(p, p + bytes));
  for (int r = 0; r < world_size_; ++r) {
    COMMLIB_CHECK(all[r].size() == bytes, PeerError, "control_all_gather: rank ", r, " sent ", all[r].size(),
                  " bytes; rank ", rank_, " expected ", bytes);
    std::memcpy(static_cast<uint8_t*>(out) + r * bytes, all[r].data(), bytes);
  }
}

void Communicator::control_barrier() {
  check_open("control_barrier");
  if (num_hosts_ == 1) return barrier_host();
  Bootstrap(*store_, prefix_ + "/control", rank_, world_size_, options_.timeout)
      .barrier(std::to_string(control_calls_++));
}

const CommConfig& Communicator::config() {
  if (!config_) config_ = std::make_shared<const CommConfig>(world_size_);
  return *config_;
}

CudaComm& Communicator::cuda() {
  check_open("cuda transport");
  COMMLIB_CHECK(cuda_ != nullptr, InvalidArgument, "communicator '", name_, "' has not used a GPU yet");
  return *cuda_;
}

// The two shared-memory primitives of the control plane (and of the CPU engine's all_gather and
// barrier, csrc/host): set-up exchanges need them below the engines.
void Communicator::all_gather_host(void* out, const void* in, size_t bytes) {
  const char* what = "all_gather";
  HostShm& shm = host();
  const OpTag tag{static_cast<uint32_t>(HostOp::kAllGather), 0, bytes, 0};
  size_t offset = 0;
  do {
    const size_t len = std::min(shm.slot_bytes(), bytes - offset);
    const int buf = shm.next_buffer();
    std::memcpy(shm.slot(rank_, buf), static_cast<const uint8_t*>(in) + offset, len);
    shm.barrier(what, "gather", tag);
    for (int r = 0; r < world_size_; ++r) {
      std::memcpy(static_cast<uint8_t*>(out) + r * bytes + offset, shm.slot(r, buf), len);
    }
    offset += len;
  } while (offset < bytes);
}

void Communicator::barrier_host() {
  if (num_hosts_ > 1) return control_barrier();  // Note [communicator hosts]
  HostShm& shm = host();
  shm.next_buffer();
  shm.barrier("barrier", "barrier", OpTag{static_cast<uint32_t>(HostOp::kBarrier), 0, 0, 0});
}

}  // namespace commlib
