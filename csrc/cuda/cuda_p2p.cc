// Note [cuda p2p] (cuda_p2p.hpp).
#include "cuda/cuda_p2p.hpp"

#include <atomic>
#include <cstring>
#include <mutex>

#include "commlib/communicator.hpp"
#include "commlib/errors.hpp"
#include "cuda/cuda_comm.hpp"
#include "cuda/cuda_copy_engine.hpp"
#include "transport/cuda_ipc.hpp"

namespace commlib {
namespace {

std::mutex namer_mutex;
std::function<std::string(uint32_t)>& dtype_namer() {
  static auto* namer = new std::function<std::string(uint32_t)>();
  return *namer;
}

std::string dtype_name(uint32_t code) {
  std::lock_guard<std::mutex> lock(namer_mutex);
  if (dtype_namer()) return dtype_namer()(code);
  return detail::concat("dtype #", code);
}

constexpr size_t kAlign = 4096;
size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

int lane_of(int64_t tag) {
  const int64_t l = tag % CudaP2p::kLanes;
  return static_cast<int>(l < 0 ? l + CudaP2p::kLanes : l);
}

}  // namespace

void CudaP2p::set_dtype_namer(std::function<std::string(uint32_t)> namer) {
  std::lock_guard<std::mutex> lock(namer_mutex);
  dtype_namer() = std::move(namer);
}

CudaP2p::CudaP2p(Communicator& comm, CudaIpc& ipc, int device, size_t slot_bytes)
    : comm_(comm), rank_(comm.rank()), world_size_(comm.world_size()), device_(device), slot_bytes_(slot_bytes) {
  const char* what = "cuda p2p";
  const size_t num_slots = static_cast<size_t>(world_size_) * kLanes * kSlots;
  busy_offset_ = round_up(num_slots * sizeof(kernels::P2pSlotHeader), 256);
  data_offset_ = round_up(busy_offset_ + num_slots * sizeof(uint32_t), kAlign);
  DeviceGuard guard(device_);
  // Zeroed on every rank before any rank returns (Note [cuda ipc protocol]): every word starts at 0.
  buffer_ = ipc.allocate(data_offset_ + num_slots * slot_bytes_, ZeroFill::kYes, what);
  sent_chunks_.assign(static_cast<size_t>(world_size_) * kLanes, 0);
  received_chunks_.assign(static_cast<size_t>(world_size_) * kLanes, 0);
  cuda_check(cudaMalloc(&poisoned_, sizeof(uint32_t)), what, "cudaMalloc");
  cuda_check(cudaMemset(poisoned_, 0, sizeof(uint32_t)), what, "cudaMemset");
  cuda_check(cudaHostAlloc(&error_host_, sizeof(kernels::P2pErrorWord), cudaHostAllocMapped), what, "cudaHostAlloc");
  std::memset(error_host_, 0, sizeof(kernels::P2pErrorWord));
  cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), error_host_, 0), what,
             "cudaHostGetDevicePointer");
  int least = 0, greatest = 0;
  cuda_check(cudaDeviceGetStreamPriorityRange(&least, &greatest), what, "cudaDeviceGetStreamPriorityRange");
  cuda_check(cudaStreamCreateWithPriority(&send_stream_, cudaStreamNonBlocking, greatest), what, "cudaStreamCreate");
  cuda_check(cudaStreamCreateWithPriority(&recv_stream_, cudaStreamNonBlocking, greatest), what, "cudaStreamCreate");
  cuda_check(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
}

CudaP2p::~CudaP2p() {
  DeviceGuard guard(device_);
  // Queued waits are bounded, so this returns.
  if (send_stream_ != nullptr) cudaStreamSynchronize(send_stream_);
  if (recv_stream_ != nullptr) cudaStreamSynchronize(recv_stream_);
  // The two streams are not destroyed: a caching allocator (torch's) records an event on every
  // stream a freed block was used on, and a tensor recorded on them may be freed after this
  // communicator is gone. torch's NCCL process group keeps its streams for the same reason.
  buffer_.reset();
  if (poisoned_ != nullptr) cudaFree(poisoned_);
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  cudaGetLastError();
}

size_t CudaP2p::slot_index(int sender, int receiver, int lane, int slot) const {
  // Indexed by the other end: the sender's slots in the receiver's memory, the receiver's busy
  // words in the sender's memory.
  (void)receiver;
  return (static_cast<size_t>(sender) * kLanes + lane) * kSlots + slot;
}

kernels::P2pSlotHeader* CudaP2p::header(int owner, int sender, int lane, int slot) const {
  auto* base = static_cast<kernels::P2pSlotHeader*>(buffer_->peer(owner));
  return base + slot_index(sender, owner, lane, slot);
}

uint32_t* CudaP2p::busy(int owner, int receiver, int lane, int slot) const {
  auto* base = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(buffer_->peer(owner)) + busy_offset_);
  return base + slot_index(receiver, owner, lane, slot);
}

uint8_t* CudaP2p::data(int owner, int sender, int lane, int slot) const {
  return static_cast<uint8_t*>(buffer_->peer(owner)) + data_offset_ + slot_index(sender, owner, lane, slot) * slot_bytes_;
}

kernels::P2pWaitParams CudaP2p::wait_params(int peer, int lane, kernels::P2pRole role) const {
  kernels::P2pWaitParams p;
  p.poisoned = poisoned_;
  p.error = error_device_;
  p.timeout_ns = static_cast<uint64_t>(comm_.timeout().count()) * 1000000ull;
  p.rank = rank_;
  p.peer = peer;
  p.lane = lane;
  p.role = role;
  return p;
}

void CudaP2p::send(const void* src, size_t bytes, uint32_t dtype, int dst, int64_t tag, cudaStream_t stream) {
  const char* what = "send";
  check_peer_rank(what, "dst", dst, world_size_, rank_);
  check_error(what);
  DeviceGuard guard(device_);
  const int lane = lane_of(tag);
  uint64_t& count = sent_chunks_[static_cast<size_t>(dst) * kLanes + lane];
  size_t offset = 0;
  do {
    const int slot = static_cast<int>(count % kSlots);
    const size_t n = std::min(slot_bytes_, bytes - offset);
    kernels::P2pWaitParams p = wait_params(dst, lane, kernels::P2pRole::kSend);
    p.flag = busy(rank_, dst, lane, slot);
    p.expected = 0;
    p.next = 1;
    p.tag = static_cast<int32_t>(tag);
    p.dtype = dtype;
    p.bytes = bytes;
    kernels::P2pSlotHeader* h = header(dst, rank_, lane, slot);
    if (offset == 0) p.fill = h;  // the message's header, written by the wait kernel
    throw_if_error(kernels::launch_p2p_wait(p, stream));
    // The chunk and the header land at the receiver before `ready` (Note [copy-engine slots]).
    ce::put_and_signal(data(dst, rank_, lane, slot), static_cast<const uint8_t*>(src) + offset, n, &h->ready, 1, stream,
                       what);
    ++count;
    offset += n;
  } while (offset < bytes);
  ++num_sends_;
}

void CudaP2p::recv(void* dst, size_t bytes, uint32_t dtype, int src, int64_t tag, cudaStream_t stream) {
  const char* what = "recv";
  check_peer_rank(what, "src", src, world_size_, rank_);
  check_error(what);
  DeviceGuard guard(device_);
  const int lane = lane_of(tag);
  uint64_t& count = received_chunks_[static_cast<size_t>(src) * kLanes + lane];
  size_t offset = 0;
  do {
    const int slot = static_cast<int>(count % kSlots);
    const size_t n = std::min(slot_bytes_, bytes - offset);
    kernels::P2pSlotHeader* h = header(rank_, src, lane, slot);
    kernels::P2pWaitParams p = wait_params(src, lane, kernels::P2pRole::kRecv);
    p.flag = &h->ready;
    p.expected = 1;
    p.next = 0;
    p.header = offset == 0 ? h : nullptr;
    p.tag = static_cast<int32_t>(tag);
    p.dtype = dtype;
    p.bytes = bytes;
    throw_if_error(kernels::launch_p2p_wait(p, stream));
    if (n != 0) {
      cuda_check(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + offset, data(rank_, src, lane, slot), n,
                                 cudaMemcpyDeviceToDevice, stream),
                 what, "cudaMemcpyAsync");
    }
    // With the memory barrier, after the copy above has read the slot: the sender may refill it.
    ce::signal(busy(src, rank_, lane, slot), 0, stream, what);
    ++count;
    offset += n;
  } while (offset < bytes);
  ++num_recvs_;
}

void CudaP2p::check_error(const char* what) const {
  const auto* word = static_cast<volatile kernels::P2pErrorWord*>(error_host_);
  if (word->failed == 0) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  const auto failure = static_cast<kernels::P2pFailure>(word->failure);
  const bool sending = word->role == static_cast<uint32_t>(kernels::P2pRole::kSend);
  const char* unusable = "; this communicator's GPU point-to-point channels are unusable, create a new communicator";
  if (failure == kernels::P2pFailure::kMismatch) {
    throw PeerError(detail::concat(what, ": ranks disagree: rank ", word->peer, " sent ", word->got_bytes,
                                   " bytes of ", dtype_name(word->got_dtype), " with tag ", word->got_tag, " but rank ",
                                   word->rank, " receives ", word->expected_bytes, " bytes of ",
                                   dtype_name(word->expected_dtype), " with tag ", word->expected_tag, " (lane ",
                                   word->lane, ")", unusable));
  }
  throw Timeout(detail::concat(what, ": Timed out after ", word->elapsed_ns / 1000000, " ms (timeout ",
                               comm_.timeout().count(), " ms): rank ", word->rank, " waiting for rank ", word->peer,
                               " at phase '", sending ? "send: slot freed by the receiver" : "recv: chunk from the sender",
                               "' (tag ", word->expected_tag, ", ", word->expected_bytes, " bytes, lane ", word->lane, ")",
                               unusable));
}

}  // namespace commlib
