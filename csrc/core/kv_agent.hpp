// KvAgent: moves a paged KV cache from a prefill instance to a decode instance (disaggregated
// serving; the Python face is commlib.kv, docs/kv.md). One agent per process (per TP rank of an
// instance). The core keeps the rendezvous, the notification records and the checks; an engine
// (KvEngine: csrc/cuda/cuda_kv.cc for CUDA caches, csrc/host/kv_host.cc for CPU caches) maps
// memory and runs the copies (Note [kv copy geometry] in csrc/kernels/kv_copy_params.hpp).
//
// Note [kv peers]
// A prefill instance and a decode instance are different process groups with different TP sizes
// and no communicator in common, so the agent has its own rendezvous: a c10d Store both reach (the
// router's, say), an instance name, a role and a TP rank / size. register_cache() publishes this
// rank's descriptor under "kv/<instance>/<tp rank>": identity (pid, host, device), the cache's
// geometry, and for a receiving rank how a peer maps its cache and its notification segment.
// connect(peer) (the sender, once per peer instance) reads the descriptors of the peer's ranks that
// this rank sends to, checks that the two caches can be mapped onto each other (dtype, head_dim,
// global heads, layers, MLA or not: InvalidArgument naming both sides otherwise, before anything
// moves), and asks each of those ranks' FdServer (Note [fd server]) for their descriptors: the
// receiver claims a notification lane for the sender there. Nothing about the peer is read on the
// hot path; the receiver reads nothing from the store at all.
// Memory a peer maps (Note [kv memory]): CUDA caches the engine allocated itself (torch's
// allocator) by a legacy IPC handle of the allocation's base (cudaIpcGetMemHandle) plus the
// offset; cuMem allocations (commlib's symmetric memory) by their POSIX-fd handle; CPU caches by
// the memfd of commlib.kv.host_empty(), the only CPU memory another process can write.
// Agents on different hosts: the torch layer (python/commlib/kv.py) sends such peers through NIXL
// (Note [kv over nixl]) and never hands them to connect(), which refuses them.
//
// Note [kv tensor parallelism]
// Both sides split the same global KV heads evenly and in order: rank r of TP t holds heads
// [r H / t, (r + 1) H / t). A sending rank writes to every receiving rank whose head range meets
// its own, the heads in common only; a receiving rank expects one record per such sender (its
// "contributors"). TP 1 -> 2: the one prefill rank writes half its heads to each decode rank;
// TP 2 -> 1: each prefill rank writes its half into the same destination blocks. MLA's latent
// cache has no head axis and every rank holds all of it: decode rank d is served by prefill rank
// d mod TP_prefill alone. H must divide by both TP sizes (InvalidArgument otherwise).
//
// Note [kv protocol]
// Each receiving rank owns a notification segment (memfd): kKvMaxLanes lanes, one per sender that
// connected, each of `slots` records. Only the sender writes a record's contents; the state word
// goes kFree -> kActive (sender, release, after the header) -> kFree (receiver, release, once it
// has reported the request), or kActive -> kFailed (sender, with a reason). A record carries the
// request id, its sequence number `seq` (per lane, increasing, never reused) and one flag per layer:
// layer l has landed when flags[l] == (uint32)seq, stored after the layer's data with release
// semantics at system scope (the copy kernel's last CTA; the CPU engine after its copy), so a
// receiver that reads the flag with acquire sees the data. Flags are never reset: a stale flag
// holds an older seq. A request is done when every contributor's record has every layer it
// announced; it is reported once, by poll() or wait(), and its records are freed then.
// Failure (docs/kv.md): a record in kFailed, a contributor whose process is gone (PeerError), or
// no new layer for the agent's timeout (CommTimeoutError); the message names the request, the
// peer (instance, rank, pid) and the first layer that did not land, and says how many layers
// did, so a partial request is reported, never marked done. A request that failed by timeout
// keeps its records (the sender may still write into them) until they finish; other requests and
// the receiver's cache are untouched. The sender sees its records too: a send is complete when
// every announced layer's flag holds its seq (its source blocks may be reused).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "commlib/store.hpp"
#include "kernels/kv_copy_params.hpp"

namespace commlib {

using kernels::KvCopyParams;

class FdServer;
struct KvSegment;  // csrc/core/kv_notify.hpp

enum class KvRole : uint8_t { kPrefill = 0, kDecode = 1, kBoth = 2 };

constexpr int kKvMaxLanes = 32;  // senders one receiving rank accepts

// Memory that a peer maps (Note [kv peers]).
struct KvRegion {
  enum class Kind : uint32_t { kHostMemfd = 1, kCudaIpc = 2, kCudaVmm = 3 };
  Kind kind = Kind::kHostMemfd;
  uint64_t bytes = 0;
  uint8_t handle[64] = {};  // kCudaIpc: the cudaIpcMemHandle_t
  uint64_t base = 0;        // this process's address (not sent)
  int fd = -1;              // kHostMemfd / kCudaVmm: the descriptor sent to peers (not serialised)
};

// Block ids of one request in memory the engine's copies read (released by the engine).
struct KvStagedBlocks {
  const int32_t* src = nullptr;
  const int32_t* dst = nullptr;
  uint64_t token = 0;  // the engine's own
};

// What an engine does for an agent. Called by one thread (the agent's).
class KvEngine {
 public:
  virtual ~KvEngine() = default;
  virtual const char* device_type() const = 0;  // "cpu" or "cuda"
  virtual int device() const = 0;
  // The region holding [ptr, ptr + bytes), exportable to a peer process.
  virtual KvRegion export_region(uint64_t ptr, uint64_t bytes, const char* what) = 0;
  // Maps a peer's region (fd: its descriptor, or -1); returns its base here. Kept until destruction.
  virtual uint64_t import_region(const KvRegion& region, int fd, const char* what) = 0;
  // A peer's notification segment (mapped here at `host`) as this engine's copies address it.
  virtual uint32_t* map_flags(void* host, size_t bytes, const char* what) = 0;
  // A table of addresses the copies read (device memory for CUDA), kept until destruction.
  virtual const uint64_t* upload_table(const std::vector<uint64_t>& values, const char* what) = 0;
  virtual KvStagedBlocks stage_blocks(const int32_t* src, size_t num_src, const int32_t* dst, size_t num_dst,
                                      void* stream, const char* what) = 0;
  // The staged blocks may be reused once the work queued on `stream` so far is done.
  virtual void release_blocks(const KvStagedBlocks& blocks, void* stream) = 0;
  // Copies `params` (its flags stored last). CUDA: queued on `stream`; CPU: done on return.
  virtual void copy(KvCopyParams& params, void* stream, const char* what) = 0;
};

// A registered cache (Note [kv copy geometry]); built by the torch layer from the tensors.
struct KvCacheLayout {
  std::string layout;  // the axes, e.g. "KBTHD" (docs/kv.md)
  std::string dtype;
  int32_t elem_bytes = 0;
  int32_t num_layers = 0;
  int32_t num_planes = 0;  // 2: K and V; 1: MLA
  bool mla = false;
  int64_t num_blocks = 0;
  int32_t block_size = 0;
  int32_t num_heads = 0;  // this rank's KV heads (1 for MLA)
  int32_t head_dim = 0;   // elements of one (token, head) row
  int64_t block_stride = 0, token_stride = 0, head_stride = 0;  // bytes
  std::vector<uint64_t> planes;  // [layer * num_planes + plane]: address of block 0, token 0, head 0
  uint64_t plane_span = 0;       // bytes from a plane's address that the plane covers
};

// One request as the receiver sees it (KvAgent::poll / wait).
struct KvEvent {
  enum class State { kPending, kDone, kFailed };
  enum class Kind { kReceived, kSent };
  std::string request_id;
  Kind kind = Kind::kReceived;
  State state = State::kPending;
  std::string error_class;  // failed: "CommTimeoutError", "PeerError" or "CommError"
  std::string reason;
  std::string peer;  // "instance 'prefill' rank 1 (pid 4242)"
  int num_layers = 0;            // layers announced
  std::vector<int> layers_done;  // landed from every contributor
  int64_t num_blocks = 0;        // destination blocks of the request
};

struct KvAgentOptions {
  std::string instance;
  KvRole role = KvRole::kBoth;
  int tp_rank = 0;
  int tp_size = 1;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  int slots = 0;  // records per lane; 0: COMMLIB_KV_SLOTS
  int num_ctas = 0;  // CUDA copy grid; 0: COMMLIB_KV_CTAS
};

struct KvRoute;       // below
struct KvDescriptor;  // kv_agent_internal.hpp

class KvAgent {
 public:
  KvAgent(std::shared_ptr<Store> store, KvAgentOptions options, std::unique_ptr<KvEngine> engine);
  ~KvAgent();
  KvAgent(const KvAgent&) = delete;
  KvAgent& operator=(const KvAgent&) = delete;

  const KvAgentOptions& options() const { return options_; }
  KvEngine& engine() { return *engine_; }
  bool closed() const { return closed_; }
  void close();

  // Once per agent: checks the layout (InvalidArgument) and publishes this rank's descriptor.
  void register_cache(const KvCacheLayout& layout);
  // Sender: maps the peer instance's ranks this rank sends to (Note [kv peers]); idempotent.
  void connect(const std::string& peer);
  // Sender: connect()'s checks of `peer` (Note [kv peer checks]) without mapping anything; waits for
  // its ranks to register (up to the timeout). Returns this rank's routes to it.
  std::vector<KvRoute> check_peer(const std::string& peer);
  // Ranks of `peer` this rank sends to (after connect).
  std::vector<int> destinations(const std::string& peer) const;

  // Sender: announces a request to every destination rank of `peer` and stages its block ids
  // (src_blocks in this rank's block size, dst_blocks in the peer's; num_tokens < 0: every token
  // of the source blocks) for copies on `stream`. `layers`: the layers it will carry (empty: all).
  // Returns the send's id.
  // Every argument is checked before anything is written (InvalidArgument).
  uint64_t begin(const std::string& peer, const std::string& request_id, const int32_t* src_blocks, size_t num_src,
                 const int32_t* dst_blocks, size_t num_dst, int64_t num_tokens, const std::vector<int>& layers,
                 void* stream);
  // Copies layers [layer_begin, layer_begin + num_layers) of the send (one launch on CUDA).
  void send_layers(uint64_t send, int layer_begin, int num_layers, void* stream);
  // Whether every announced layer of the send has landed; raises if the send failed.
  bool send_done(uint64_t send);
  void wait_send(uint64_t send, std::chrono::milliseconds timeout);
  // Receiver and sender: requests that finished since the last poll (received and sent), each
  // reported once.
  std::vector<KvEvent> poll();
  // Receiver: waits until `request_id` is done (returns it, reported) or failed (returns it with
  // state kFailed, reported); Timeout (not reported: it may be waited for again) after `timeout`.
  KvEvent wait(const std::string& request_id, std::chrono::milliseconds timeout);
  // Receiver: whether layer `layer` of the request landed from every contributor (waits up to
  // `timeout`; a zero timeout only looks). Raises the request's failure.
  bool wait_layer(const std::string& request_id, int layer, std::chrono::milliseconds timeout);

 private:
  struct Peer;
  struct Send;
  struct Tracked;
  void check_open(const char* what) const;
  std::vector<KvRoute> check_peer(const std::string& peer, std::vector<KvDescriptor>& ranks);
  void publish_descriptor();
  std::vector<uint8_t> serve(const std::vector<uint8_t>& request, std::vector<int>& fds);
  Peer& peer(const std::string& name);
  void scan();
  void evaluate(Tracked& t);
  KvEvent report(Tracked& t);
  bool records_settled(const Tracked& t) const;
  Tracked* find(const std::string& request_id);
  void finish_send(Send& s);

  std::shared_ptr<Store> store_;
  KvAgentOptions options_;
  std::unique_ptr<KvEngine> engine_;
  bool closed_ = false;
  bool registered_ = false;
  KvCacheLayout layout_;
  std::vector<KvRegion> regions_;
  std::vector<std::pair<uint32_t, uint64_t>> plane_regions_;  // (region, offset) per plane
  std::unique_ptr<KvSegment> segment_;  // receiving ranks
  std::unique_ptr<FdServer> server_;
  std::map<std::string, std::unique_ptr<Peer>> peers_;
  const uint64_t* src_table_ = nullptr;
  std::unordered_map<uint64_t, std::unique_ptr<Send>> sends_;
  uint64_t next_send_ = 1;
  std::map<uint64_t, std::unique_ptr<Tracked>> tracked_;  // receiving: by request hash
  std::vector<std::vector<uint64_t>> seen_;               // [lane][slot]: seq last tracked
  std::vector<KvEvent> finished_;                         // reported by the next poll
};

// One destination rank of a sending rank (Note [kv tensor parallelism]): the heads they have in
// common (from src_head of the sender's heads, to dst_head of the destination's) and the senders
// of that destination (ranks first_sender .. first_sender + num_contributors - 1 of the sending
// instance; this rank is number `contributor` of them).
struct KvRoute {
  int rank = 0;
  int src_head = 0;
  int dst_head = 0;
  int heads = 0;
  int first_sender = 0;
  int num_contributors = 0;
  int contributor = 0;
};
// The destinations of rank `tp_rank` of a TP `tp_size` instance holding `heads` global KV heads
// (MLA: one latent "head" every rank holds) in a TP `tp_dest` instance, in rank order. The one
// mapping of both paths (KvAgent::connect, the NIXL path); the caller checks divisibility.
std::vector<KvRoute> kv_routes(int heads, bool mla, int tp_rank, int tp_size, int tp_dest);

// 64-bit FNV-1a of a request id (records carry it; ids are compared in full as well).
uint64_t kv_request_hash(const std::string& request_id);

// The argument checks of one request (Note [kv request checks], kv_agent.cc), shared by
// KvAgent::begin and the NIXL path; returns num_tokens resolved (< 0: every source token). `stamp`
// / `stamp_now`: the caller's duplicate-detection state for the destination's blocks.
int64_t kv_check_request(const char* what, const std::string& request_id, const int32_t* src_blocks, size_t num_src,
                         int64_t src_num_blocks, int64_t bs, const int32_t* dst_blocks, size_t num_dst,
                         int64_t dst_num_blocks, int64_t bd, int64_t num_tokens, const std::vector<int>& layers,
                         int num_layers, std::vector<uint32_t>& stamp, uint32_t& stamp_now);

}  // namespace commlib
