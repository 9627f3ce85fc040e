// The notification segment of a receiving KV agent (Note [kv protocol] in csrc/core/kv_agent.hpp):
// its layout in shared memory and the atomic accesses both sides use. Host-only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/kv_copy_params.hpp"

namespace commlib {

enum class KvRecordState : uint32_t { kFree = 0, kActive = 1, kFailed = 2 };

struct KvRecord {
  uint32_t state;  // KvRecordState; atomic (kv_load / kv_store)
  uint32_t num_contributors;
  uint32_t contributor;
  uint32_t num_layers;  // announced
  int32_t first_sender;  // contributor c is the sending instance's rank first_sender + c
  uint32_t pad;
  uint64_t seq;
  uint64_t id_hash;
  int64_t num_tokens;
  int64_t num_blocks;  // destination blocks
  uint64_t layer_mask[kernels::kKvMaxLayers / 64];
  char id[96];
  char reason[256];
  uint32_t flags[kernels::kKvMaxLayers];  // (uint32)seq once the layer landed
};

struct KvLane {
  uint32_t claimed;  // atomic: 1 once the fields below are written
  int32_t sender_rank;
  int64_t sender_pid;
  char sender_instance[64];
  char sender_host[128];
};

struct KvSegmentHeader {
  uint64_t magic;
  uint32_t num_lanes;
  uint32_t slots;
  uint32_t lanes_claimed;  // atomic: lanes [0, lanes_claimed) may be in use
  uint32_t pad;
};

inline uint32_t kv_load(const uint32_t& word) {
  return std::atomic_ref<uint32_t>(const_cast<uint32_t&>(word)).load(std::memory_order_acquire);
}
inline void kv_store(uint32_t& word, uint32_t value) {
  std::atomic_ref<uint32_t>(word).store(value, std::memory_order_release);
}

// The segment mapped in this process: header, lanes, then lanes x slots records.
struct KvSegment {
  void* base = nullptr;
  size_t bytes = 0;
  int fd = -1;
  uint32_t slots = 0;

  static size_t size_for(uint32_t slots);
  // Creates (receiver: memfd, zeroed, header written) or maps a peer's (fd received).
  static KvSegment create(uint32_t slots, const char* what);
  static KvSegment attach(int fd, size_t bytes, const char* what);
  void release();

  KvSegmentHeader& header() const { return *static_cast<KvSegmentHeader*>(base); }
  KvLane& lane(int i) const {
    return reinterpret_cast<KvLane*>(static_cast<char*>(base) + sizeof(KvSegmentHeader))[i];
  }
  KvRecord& record(int lane, int slot) const;
  size_t record_offset(int lane, int slot) const;
};

// Copies `text` into a fixed field, cut to fit and terminated.
template <size_t N>
void kv_copy_text(char (&field)[N], const std::string& text) {
  const size_t n = text.size() < N - 1 ? text.size() : N - 1;
  for (size_t i = 0; i < n; ++i) field[i] = text[i];
  field[n] = '\0';
}

}  // namespace commlib
