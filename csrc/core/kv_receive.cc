// KvAgent, the receiving side: the notification segment, tracking records, poll / wait / wait_layer
// (Note [kv protocol] in csrc/core/kv_agent.hpp).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "commlib/errors.hpp"
#include "core/kv_agent_internal.hpp"
#include "transport/fd_server.hpp"

namespace commlib {
namespace {

constexpr uint64_t kSegmentMagic = 0x636d6c6b766e3031ull;  // "cmlkvn01"

size_t records_offset() {
  const size_t lanes_end = sizeof(KvSegmentHeader) + kKvMaxLanes * sizeof(KvLane);
  return (lanes_end + 255) / 256 * 256;
}

std::string layer_list(const std::vector<int>& layers) {
  if (layers.empty()) return "none";
  std::string out;
  size_t i = 0;
  while (i < layers.size()) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? std::to_string(layers[i]) : detail::concat(layers[i], "..", layers[j]);
    i = j + 1;
  }
  return out;
}

// Blocks briefly: spins first (a transfer often lands within microseconds), then sleeps.
void pause(int round) {
  if (round < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(round < 1024 ? 10 : 200));
  }
}

}  // namespace

size_t KvSegment::size_for(uint32_t slots) {
  const size_t bytes = records_offset() + static_cast<size_t>(kKvMaxLanes) * slots * sizeof(KvRecord);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

KvSegment KvSegment::create(uint32_t slots, const char* what) {
  KvSegment s;
  s.bytes = size_for(slots);
  s.slots = slots;
  s.fd = create_memfd(s.bytes, "commlib-kv-notify", what);
  s.base = map_fd(s.fd, s.bytes, what);
  KvSegmentHeader& h = s.header();
  h.magic = kSegmentMagic;
  h.num_lanes = kKvMaxLanes;
  h.slots = slots;
  kv_store(h.lanes_claimed, 0);
  return s;
}

KvSegment KvSegment::attach(int fd, size_t bytes, const char* what) {
  KvSegment s;
  s.bytes = bytes;
  s.base = map_fd(fd, bytes, what);
  COMMLIB_CHECK(s.header().magic == kSegmentMagic, PeerError, what, ": the peer's notification segment has another "
                "format (another commlib version?)");
  s.slots = s.header().slots;
  COMMLIB_CHECK(size_for(s.slots) == bytes, PeerError, what, ": the peer's notification segment is ", bytes,
                " bytes, expected ", size_for(s.slots));
  return s;
}

void KvSegment::release() {
  if (base != nullptr) ::munmap(base, bytes);
  if (fd >= 0) ::close(fd);
  base = nullptr;
  fd = -1;
}

size_t KvSegment::record_offset(int lane, int slot) const {
  return records_offset() + (static_cast<size_t>(lane) * slots + static_cast<size_t>(slot)) * sizeof(KvRecord);
}

KvRecord& KvSegment::record(int lane, int slot) const {
  return *reinterpret_cast<KvRecord*>(static_cast<char*>(base) + record_offset(lane, slot));
}

// Finds records not seen before (active or failed) and adds them to their request.
void KvAgent::scan() {
  if (!segment_) return;
  const KvSegment& seg = *segment_;
  const uint32_t lanes = std::min<uint32_t>(kv_load(seg.header().lanes_claimed), kKvMaxLanes);
  for (uint32_t lane = 0; lane < lanes; ++lane) {
    if (kv_load(seg.lane(static_cast<int>(lane)).claimed) == 0) continue;
    for (uint32_t slot = 0; slot < seg.slots; ++slot) {
      KvRecord& rec = seg.record(static_cast<int>(lane), static_cast<int>(slot));
      if (kv_load(rec.state) == static_cast<uint32_t>(KvRecordState::kFree)) continue;
      if (seen_[lane][slot] == rec.seq) continue;
      seen_[lane][slot] = rec.seq;
      auto& t = tracked_[rec.id_hash];
      if (!t) {
        t = std::make_unique<Tracked>();
        t->hash = rec.id_hash;
        t->request_id = rec.id;
        t->num_contributors = rec.num_contributors;
        t->last_progress = std::chrono::steady_clock::now();
        t->event.request_id = rec.id;
        t->event.num_layers = static_cast<int>(rec.num_layers);
        t->event.num_blocks = rec.num_blocks;
      }
      t->records.push_back({static_cast<int>(lane), static_cast<int>(slot), rec.seq});
    }
  }
}

// Decides whether a tracked request is done or failed (Note [kv protocol]).
void KvAgent::evaluate(Tracked& t) {
  if (t.event.state != KvEvent::State::kPending) return;
  const KvSegment& seg = *segment_;
  const KvRecord& first = seg.record(t.records[0].lane, t.records[0].slot);
  std::vector<int> landed;  // announced layers landed from every contributor present
  size_t progress = t.records.size();
  std::string failed_reason;
  const KvLane* failed_lane = nullptr;
  const KvLane* dead_lane = nullptr;
  for (int l = 0; l < kernels::kKvMaxLayers; ++l) {
    if (!kv_has_layer(first.layer_mask, l)) continue;
    bool all = true;
    for (const auto& ref : t.records) {
      const bool here = kv_load(seg.record(ref.lane, ref.slot).flags[l]) == static_cast<uint32_t>(ref.seq);
      all = all && here;
      progress += here ? 1 : 0;
    }
    if (all) landed.push_back(l);
  }
  for (const auto& ref : t.records) {
    const KvRecord& rec = seg.record(ref.lane, ref.slot);
    const KvLane& lane = seg.lane(ref.lane);
    if (kv_load(rec.state) == static_cast<uint32_t>(KvRecordState::kFailed) && failed_lane == nullptr) {
      failed_lane = &lane;
      failed_reason = rec.reason;
    }
  }
  const bool complete = t.records.size() == t.num_contributors && static_cast<int>(landed.size()) == t.event.num_layers;
  const auto now = std::chrono::steady_clock::now();
  if (progress > t.progress) {
    t.progress = progress;
    t.last_progress = now;
  }
  t.event.layers_done = landed;
  if (complete) {
    t.event.state = KvEvent::State::kDone;
    return;
  }
  // Who is missing: a contributor whose record is incomplete or absent, and whether its process runs.
  const KvLane* waiting_for = nullptr;
  const uint32_t lanes = std::min<uint32_t>(kv_load(seg.header().lanes_claimed), kKvMaxLanes);
  for (uint32_t c = 0; c < t.num_contributors; ++c) {
    const int32_t rank = first.first_sender + static_cast<int32_t>(c);
    const KvLane* lane = nullptr;
    bool has_record = false;
    for (const auto& ref : t.records) {
      const KvLane& l = seg.lane(ref.lane);
      if (l.sender_rank == rank) {
        lane = &l;
        has_record = true;
      }
    }
    for (uint32_t i = 0; i < lanes && lane == nullptr; ++i) {
      const KvLane& l = seg.lane(static_cast<int>(i));
      if (l.sender_rank == rank && std::string(l.sender_instance) == seg.lane(t.records[0].lane).sender_instance) {
        lane = &l;
      }
    }
    if (lane == nullptr) continue;
    if (waiting_for == nullptr && (!has_record || static_cast<int>(landed.size()) < t.event.num_layers)) {
      waiting_for = lane;
    }
    if (dead_lane == nullptr && !kv_process_alive(lane->sender_pid)) dead_lane = lane;
  }
  int next_layer = -1;
  for (int l = 0; l < kernels::kKvMaxLayers && next_layer < 0; ++l) {
    if (kv_has_layer(first.layer_mask, l) && !std::binary_search(landed.begin(), landed.end(), l)) next_layer = l;
  }
  auto peer_name = [](const KvLane& l) {
    return detail::concat("instance '", l.sender_instance, "' rank ", l.sender_rank, " (pid ", l.sender_pid, ")");
  };
  const std::string partial = detail::concat(
      "; layers landed: ", layer_list(landed), " of ", t.event.num_layers, "; the request's ", t.event.num_blocks,
      " destination blocks hold partial data for the other layers");
  if (failed_lane != nullptr) {
    t.event.state = KvEvent::State::kFailed;
    t.event.error_class = "CommError";
    t.event.peer = peer_name(*failed_lane);
    t.event.reason = detail::concat("KV request '", t.request_id, "' from ", t.event.peer, " failed at the sender: ",
                                    failed_reason, partial);
  } else if (dead_lane != nullptr) {
    t.event.state = KvEvent::State::kFailed;
    t.event.error_class = "PeerError";
    t.event.peer = peer_name(*dead_lane);
    t.event.reason = detail::concat("KV request '", t.request_id, "' from ", t.event.peer,
                                    ": the sender exited before layer ", next_layer, " landed", partial);
  } else if (now - t.last_progress > options_.timeout) {
    t.event.state = KvEvent::State::kFailed;
    t.event.error_class = "CommTimeoutError";
    t.event.peer = waiting_for != nullptr ? peer_name(*waiting_for)
                                          : detail::concat("instance '", seg.lane(t.records[0].lane).sender_instance, "'");
    t.event.reason = detail::concat("KV request '", t.request_id, "' from ", t.event.peer, ": Timed out after ",
                                    options_.timeout.count(), " ms without progress: layer ", next_layer,
                                    " has not landed (", t.records.size(), " of ", t.num_contributors,
                                    " senders announced the request)", partial);
    t.abandoned = true;
  }
  if (t.event.state == KvEvent::State::kPending && waiting_for != nullptr) t.event.peer = peer_name(*waiting_for);
}

// Hands a finished request out once and frees its records (Note [kv protocol]).
KvEvent KvAgent::report(Tracked& t) {
  KvEvent event = t.event;
  if (t.abandoned) {
    t.reported = true;  // the sender may still write into its records: freed once they finish (poll)
    return event;
  }
  for (const auto& ref : t.records) {
    KvRecord& rec = segment_->record(ref.lane, ref.slot);
    if (rec.seq == ref.seq) kv_store(rec.state, static_cast<uint32_t>(KvRecordState::kFree));
  }
  tracked_.erase(t.hash);
  return event;
}

// An abandoned request's records are free to reuse once no sender will write them again.
bool KvAgent::records_settled(const Tracked& t) const {
  for (const auto& ref : t.records) {
    const KvRecord& rec = segment_->record(ref.lane, ref.slot);
    if (kv_load(rec.state) == static_cast<uint32_t>(KvRecordState::kFailed)) continue;
    if (!kv_process_alive(segment_->lane(ref.lane).sender_pid)) continue;
    for (int l = 0; l < kernels::kKvMaxLayers; ++l) {
      if (kv_has_layer(rec.layer_mask, l) && kv_load(rec.flags[l]) != static_cast<uint32_t>(ref.seq)) return false;
    }
  }
  return true;
}

KvAgent::Tracked* KvAgent::find(const std::string& request_id) {
  auto it = tracked_.find(kv_request_hash(request_id));
  if (it == tracked_.end() || it->second->reported || it->second->request_id != request_id) return nullptr;
  return it->second.get();
}

std::vector<KvEvent> KvAgent::poll() {
  check_open("KVAgent.poll");
  std::vector<KvEvent> out;
  scan();
  for (auto it = tracked_.begin(); it != tracked_.end();) {
    Tracked& t = *it->second;
    ++it;  // report() may erase t
    if (t.reported) {
      t.abandoned = false;
      if (records_settled(t)) report(t);
      continue;
    }
    evaluate(t);
    if (t.event.state != KvEvent::State::kPending) out.push_back(report(t));
  }
  for (auto it = sends_.begin(); it != sends_.end();) {
    Send& s = *it->second;
    bool done = false;
    KvEvent event;
    event.request_id = s.request_id;
    event.kind = KvEvent::Kind::kSent;
    event.num_layers = s.num_announced;
    event.peer = detail::concat("instance '", s.peer->name, "'");
    try {
      done = send_done(it->first);
      event.state = KvEvent::State::kDone;
    } catch (const Error& e) {
      done = true;
      event.state = KvEvent::State::kFailed;
      event.error_class = "CommError";
      event.reason = e.what();
    }
    if (done) {
      finish_send(s);
      out.push_back(std::move(event));
      it = sends_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

KvEvent KvAgent::wait(const std::string& request_id, std::chrono::milliseconds timeout) {
  const char* what = "KVAgent.wait";
  check_open(what);
  COMMLIB_CHECK(segment_ != nullptr, InvalidArgument, what, ": instance '", options_.instance,
                "' does not receive (role prefill, or no cache registered)");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int round = 0;; ++round) {
    scan();
    if (Tracked* t = find(request_id)) {
      evaluate(*t);
      if (t->event.state != KvEvent::State::kPending) return report(*t);
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
    pause(round);
  }
  if (Tracked* t = find(request_id)) {
    int next_layer = -1;
    const KvRecord& first = segment_->record(t->records[0].lane, t->records[0].slot);
    for (int l = 0; l < kernels::kKvMaxLayers && next_layer < 0; ++l) {
      if (kv_has_layer(first.layer_mask, l) &&
          !std::binary_search(t->event.layers_done.begin(), t->event.layers_done.end(), l)) {
        next_layer = l;
      }
    }
    throw Timeout(detail::concat(what, ": Timed out after ", timeout.count(), " ms: KV request '", request_id,
                                 "' from ", t->event.peer, ": layer ", next_layer, " has not landed (layers landed: ",
                                 layer_list(t->event.layers_done), " of ", t->event.num_layers, ")"));
  }
  std::string senders;
  const uint32_t lanes = std::min<uint32_t>(kv_load(segment_->header().lanes_claimed), kKvMaxLanes);
  for (uint32_t i = 0; i < lanes; ++i) {
    const KvLane& l = segment_->lane(static_cast<int>(i));
    senders += detail::concat(senders.empty() ? "" : ", ", "instance '", l.sender_instance, "' rank ", l.sender_rank,
                              " (pid ", l.sender_pid, kv_process_alive(l.sender_pid) ? "" : ", exited", ")");
  }
  throw Timeout(detail::concat(what, ": Timed out after ", timeout.count(), " ms: nothing of KV request '", request_id,
                               "' arrived at instance '", options_.instance, "' rank ", options_.tp_rank,
                               "; senders connected: ", senders.empty() ? "none" : senders));
}

bool KvAgent::wait_layer(const std::string& request_id, int layer, std::chrono::milliseconds timeout) {
  const char* what = "KVAgent.wait_layer";
  check_open(what);
  COMMLIB_CHECK(layer >= 0 && layer < layout_.num_layers, InvalidArgument, what, ": layer ", layer,
                " out of range; valid: 0..", layout_.num_layers - 1);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int round = 0;; ++round) {
    scan();
    if (Tracked* t = find(request_id)) {
      evaluate(*t);
      if (std::binary_search(t->event.layers_done.begin(), t->event.layers_done.end(), layer) &&
          t->records.size() == t->num_contributors) {
        return true;
      }
      if (t->event.state == KvEvent::State::kFailed) {
        const std::string reason = t->event.reason;
        if (t->event.error_class == "CommTimeoutError") throw Timeout(reason);
        if (t->event.error_class == "PeerError") throw PeerError(reason);
        throw Error(reason);
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    pause(round);
  }
}

}  // namespace commlib
