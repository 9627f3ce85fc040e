// KvAgent's private parts shared by csrc/core/kv_agent.cc (registration, connect, sending) and
// csrc/core/kv_receive.cc (notification records, poll / wait). Not a public header.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/kv_agent.hpp"
#include "core/kv_notify.hpp"

namespace commlib {

// A rank's published descriptor (Note [kv peers]).
struct KvDescriptor {
  std::string instance;
  KvRole role = KvRole::kBoth;
  int32_t tp_rank = 0;
  int32_t tp_size = 1;
  int64_t pid = 0;
  std::string host;
  std::string device_type;
  int32_t device = -1;
  KvCacheLayout layout;  // planes: not sent (addresses of the other process)
  // Receiving ranks only.
  bool receives = false;
  std::string server;
  uint64_t segment_bytes = 0;
  uint32_t slots = 0;
  std::vector<KvRegion> regions;
  std::vector<std::pair<uint32_t, uint64_t>> plane_regions;  // (region, offset) per plane

  std::vector<uint8_t> serialize() const;
  static KvDescriptor parse(const std::vector<uint8_t>& bytes, const std::string& what);
  std::string name() const;  // "instance 'x' rank r (pid p)"
};

struct KvAgent::Peer {
  struct Dest {
    int rank = 0;
    int64_t pid = 0;
    int lane = 0;
    KvSegment segment;  // the destination's notification segment, mapped here
    uint32_t* flags_base = nullptr;  // the same, as the engine's copies address it
    uint32_t num_contributors = 0;
    uint32_t contributor = 0;
    int32_t first_sender = 0;
    uint64_t next_seq = 1;
    uint32_t cursor = 0;  // where the next free-slot search starts
    std::string name;
  };
  std::string name;
  std::vector<KvDescriptor> ranks;  // every rank of the peer instance
  std::vector<Dest> dests;
  KvCopyParams base;         // geometry and tables; per-request fields filled by begin / send_layers
  uint64_t align_gcd = 0;    // gcd of strides and bases (kv_vector_bytes)
  int64_t peer_blocks = 0;
  int32_t peer_block_size = 0;
  std::vector<uint32_t> dst_stamp;  // begin()'s duplicate check (stamp_now: the current check)
  uint32_t stamp_now = 0;
};

struct KvAgent::Send {
  Peer* peer = nullptr;
  std::string request_id;
  std::vector<std::pair<int, uint64_t>> slots;  // per destination: (slot, seq)
  uint64_t announced[kernels::kKvMaxLayers / 64] = {};
  uint64_t sent[kernels::kKvMaxLayers / 64] = {};
  int num_announced = 0;
  int num_sent = 0;
  KvCopyParams params;  // geometry of this request (coalesced)
  KvStagedBlocks staged;
  bool staged_held = false;
  bool empty = false;
};

struct KvAgent::Tracked {
  struct Ref {
    int lane;
    int slot;
    uint64_t seq;
  };
  uint64_t hash = 0;
  std::string request_id;
  std::vector<Ref> records;
  uint32_t num_contributors = 0;
  size_t progress = 0;  // records found + layers landed: grows while the request moves
  std::chrono::steady_clock::time_point last_progress;
  KvEvent event;  // state kPending until evaluate() decides
  bool abandoned = false;  // failed by timeout: records kept until they finish
  bool reported = false;   // abandoned and handed out; waits for records_settled()
};

inline bool kv_has_layer(const uint64_t* mask, int layer) { return (mask[layer / 64] >> (layer % 64)) & 1u; }
inline void kv_set_layer(uint64_t* mask, int layer) { mask[layer / 64] |= 1ull << (layer % 64); }

// Whether process `pid` (on this host) still runs.
bool kv_process_alive(int64_t pid);

}  // namespace commlib
