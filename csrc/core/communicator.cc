#include "commlib/communicator.hpp"

#include <unistd.h>

#include <map>
#include <mutex>
#include <thread>

#include "bootstrap/bootstrap.hpp"
#include "commlib/env.hpp"
#include "commlib/errors.hpp"
#include "core/algorithm_selector.hpp"
#include "transport/multicast_guard.hpp"
#include "transport/cuda_multicast.hpp"
#include "transport/host_shm.hpp"

namespace commlib {

// Defined in csrc/core/cuda_comm.cc when built with CUDA.
CudaComm* create_cuda_comm(Communicator& comm, int device);
void destroy_cuda_comm(CudaComm* cuda);
int cuda_device(const CudaComm& cuda);
MulticastWorkspace* create_multicast_workspace(Communicator& comm, int device, int attempt);

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

struct Hello {
  int32_t world_size;
  int32_t rank;
  int64_t pid;
};

}  // namespace

Communicator::Communicator(std::shared_ptr<Store> store, int rank, int world_size, std::string name,
                           CommunicatorOptions options)
    : store_(std::move(store)),
      rank_(rank),
      world_size_(world_size),
      name_(std::move(name)),
      options_(options),
      cuda_(nullptr, destroy_cuda_comm),
      multicast_(nullptr, destroy_multicast_workspace) {
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
  const Hello mine{world_size_, rank_, static_cast<int64_t>(::getpid())};
  store_->set(prefix_ + "/hello/" + std::to_string(rank_), to_bytes(mine));
  peer_pids_.assign(world_size_, 0);
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

void Communicator::check_open(const char* what) const {
  COMMLIB_CHECK(!closed_, InvalidArgument, what, ": communicator '", name_, "' is closed");
}

HostShm& Communicator::host() {
  check_open("host transport");
  if (!host_) {
    size_t slot = options_.shm_slot_bytes != 0 ? options_.shm_slot_bytes
                                               : static_cast<size_t>(env::get_int("COMMLIB_SHM_SLOT_BYTES"));
    COMMLIB_CHECK(slot >= 4096, InvalidArgument, "COMMLIB_SHM_SLOT_BYTES=", slot, " too small; minimum 4096");
    Bootstrap bootstrap(*store_, prefix_, rank_, world_size_, options_.timeout);
    const auto jitter = std::chrono::microseconds(env::get_int("COMMLIB_HOST_TEST_JITTER_US"));
    COMMLIB_CHECK(jitter.count() >= 0, InvalidArgument, "COMMLIB_HOST_TEST_JITTER_US=", jitter.count(),
                  " is negative; valid: 0 (off) or a number of microseconds");
    host_ = std::make_unique<HostShm>(bootstrap, slot, options_.timeout, peer_pids_, jitter);
  }
  host_->check_usable("host transport");
  return *host_;
}

const CommConfig& Communicator::config() {
  if (!config_) config_ = std::make_shared<const CommConfig>(world_size_);
  return *config_;
}

CudaComm& Communicator::cuda(int device) {
  check_open("cuda transport");
  if (!cuda_) {
    cuda_.reset(create_cuda_comm(*this, device));
  } else {
    const int current = cuda_device(*cuda_);
    COMMLIB_CHECK(device == current, InvalidArgument, "communicator '", name_, "': device cuda:", device,
                  " but its GPU state lives on cuda:", current, "; use one device per communicator");
  }
  return *cuda_;
}

CudaComm& Communicator::cuda() {
  check_open("cuda transport");
  COMMLIB_CHECK(cuda_ != nullptr, InvalidArgument, "communicator '", name_, "' has not used a GPU yet");
  return *cuda_;
}

MulticastWorkspace& Communicator::multicast(int device) {
  check_open("multicast transport");
  require_multicast("multicast transport");  // SAFETY: before any CUDA call, on every use
  if (!multicast_) multicast_.reset(create_multicast_workspace(*this, device, multicast_attempts_++));
  return *multicast_;
}

}  // namespace commlib
