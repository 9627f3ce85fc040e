// Note [copy-engine slots] (cuda_copy_engine.hpp).
#include "cuda/cuda_copy_engine.hpp"

#include <cuda.h>

#include "commlib/errors.hpp"
#include "cuda/cuda_comm.hpp"
#include "transport/cuda_driver.hpp"

namespace commlib {
namespace ce {

void put_and_signal(void* dst, const void* src, size_t bytes, uint32_t* ready, uint32_t value, cudaStream_t stream,
                    const char* what) {
  if (bytes != 0) cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), what, "cudaMemcpyAsync");
  signal(ready, value, stream, what);  // the write's memory barrier: the copy lands first
}

void signal(uint32_t* word, uint32_t value, cudaStream_t stream, const char* what) {
  cuda::stream_write_value32(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value, 0, what);
}

void wait_equal(const uint32_t* word, uint32_t value, cudaStream_t stream, const char* what) {
  cuda::stream_wait_value32(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                            CU_STREAM_WAIT_VALUE_EQ, what);
}

void relax_stream_capture_mode() {
  using Exchange = CUresult (*)(CUstreamCaptureMode*);
  static const auto exchange = reinterpret_cast<Exchange>(cuda::entry_point("cuThreadExchangeStreamCaptureMode", 10010));
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  cuda::check(exchange(&mode), "copy-engine watchdog", "cuThreadExchangeStreamCaptureMode");
}

}  // namespace ce

CopyEngineRing::CopyEngineRing(std::shared_ptr<SymmetricBuffer> buffer, size_t offset)
    : buffer_(std::move(buffer)), offset_(offset) {
  COMMLIB_CHECK(buffer_ != nullptr && offset_ + kFlagsBytes <= buffer_->bytes(), InvalidArgument,
                "copy-engine ring: the buffer must hold its ", kFlagsBytes, " bytes of flags");
}

uint32_t* CopyEngineRing::ready(int owner, int slot) const {
  return reinterpret_cast<uint32_t*>(static_cast<char*>(buffer_->peer(owner)) + offset_) + slot;
}

uint32_t* CopyEngineRing::free_word(int owner, int slot) const { return ready(owner, slot) + kMaxSlots; }

void CopyEngineRing::check_slot(const char* what, int slot) const {
  COMMLIB_CHECK(slot >= 0 && slot < kMaxSlots, InvalidArgument, what, ": slot ", slot, " out of range; valid: 0..",
                kMaxSlots - 1);
}

void CopyEngineRing::send(int peer, int slot, size_t at, const void* src, size_t bytes, cudaStream_t stream) const {
  const char* what = "copy-engine ring send";
  check_slot(what, slot);
  check_peer_rank(what, "peer", peer, world_size(), rank());
  COMMLIB_CHECK(at >= kFlagsBytes && offset_ + at + bytes <= buffer_->bytes(), InvalidArgument, what, ": bytes [", at,
                ", ", at + bytes, ") outside the slots [", kFlagsBytes, ", ", buffer_->bytes() - offset_, ")");
  uint32_t* mine = free_word(rank(), slot);
  ce::wait_equal(mine, 1, stream, what);
  ce::signal(mine, 0, stream, what);
  ce::put_and_signal(static_cast<char*>(buffer_->peer(peer)) + offset_ + at, src, bytes, ready(peer, slot), 1, stream,
                     what);
}

void CopyEngineRing::receive(int slot, cudaStream_t stream) const {
  const char* what = "copy-engine ring receive";
  check_slot(what, slot);
  ce::wait_equal(ready(rank(), slot), 1, stream, what);
  ce::signal(ready(rank(), slot), 0, stream, what);
}

void CopyEngineRing::release(int sender, int slot, cudaStream_t stream) const {
  const char* what = "copy-engine ring release";
  check_slot(what, slot);
  check_peer_rank(what, "sender", sender, world_size(), rank());
  ce::signal(free_word(sender, slot), 1, stream, what);
}

}  // namespace commlib
