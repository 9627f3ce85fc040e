// KvAgent: registration, the descriptor, connect and sending (Note [kv peers]). Receiving (records,
// poll / wait) is csrc/core/kv_receive.cc; the TP routes and a request's checks csrc/core/kv_checks.cc.
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>
#include <unordered_map>

#include "commlib/communicator.hpp"
#include "commlib/env.hpp"
#include "commlib/errors.hpp"
#include "core/kv_agent_internal.hpp"
#include "transport/fd_server.hpp"

namespace commlib {
namespace {

constexpr uint64_t kDescriptorMagic = 0x636d6c6b76643031ull;  // "cmlkvd01"
constexpr uint64_t kRequestMagic = 0x636d6c6b76723031ull;     // "cmlkvr01"
#ifdef SYS_pidfd_open
constexpr long kSysPidfdOpen = SYS_pidfd_open;
#else
constexpr long kSysPidfdOpen = 434;  // the same number on every Linux architecture
#endif

class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void put(const std::string& s) {
    put<uint64_t>(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  std::vector<uint8_t> take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

class Reader {
 public:
  Reader(const std::vector<uint8_t>& bytes, const std::string& what) : bytes_(bytes), what_(what) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string str() {
    const auto n = get<uint64_t>();
    need(n);
    std::string s(bytes_.begin() + static_cast<std::ptrdiff_t>(at_), bytes_.begin() + static_cast<std::ptrdiff_t>(at_ + n));
    at_ += n;
    return s;
  }

 private:
  void need(size_t n) const {
    COMMLIB_CHECK(at_ + n <= bytes_.size(), PeerError, what_, ": malformed descriptor (", bytes_.size(),
                  " bytes); is the peer running another commlib version?");
  }
  const std::vector<uint8_t>& bytes_;
  std::string what_;
  size_t at_ = 0;
};

const char* role_name(KvRole role) {
  switch (role) {
    case KvRole::kPrefill: return "prefill";
    case KvRole::kDecode: return "decode";
    case KvRole::kBoth: return "both";
  }
  return "?";
}

bool sends(KvRole role) { return role != KvRole::kDecode; }
bool receives(KvRole role) { return role != KvRole::kPrefill; }

std::string descriptor_key(const std::string& instance, int rank) {
  return detail::concat("kv/", instance, "/", rank);
}

// Store value of `key`, waiting for it at most `timeout` (Timeout naming `who`).
std::vector<uint8_t> wait_get(Store& store, const std::string& key, std::chrono::milliseconds timeout,
                              const std::string& who) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!store.check(key)) {
    COMMLIB_CHECK(std::chrono::steady_clock::now() < deadline, Timeout, who, " did not register its KV cache within ",
                  timeout.count(), " ms (store key '", key, "')");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return store.get(key);
}

void write_layout(Writer& w, const KvCacheLayout& l) {
  w.put(l.layout);
  w.put(l.dtype);
  w.put(l.elem_bytes);
  w.put(l.num_layers);
  w.put(l.num_planes);
  w.put<uint8_t>(l.mla ? 1 : 0);
  w.put(l.num_blocks);
  w.put(l.block_size);
  w.put(l.num_heads);
  w.put(l.head_dim);
  w.put(l.block_stride);
  w.put(l.token_stride);
  w.put(l.head_stride);
  w.put(l.plane_span);
}

KvCacheLayout read_layout(Reader& r) {
  KvCacheLayout l;
  l.layout = r.str();
  l.dtype = r.str();
  l.elem_bytes = r.get<int32_t>();
  l.num_layers = r.get<int32_t>();
  l.num_planes = r.get<int32_t>();
  l.mla = r.get<uint8_t>() != 0;
  l.num_blocks = r.get<int64_t>();
  l.block_size = r.get<int32_t>();
  l.num_heads = r.get<int32_t>();
  l.head_dim = r.get<int32_t>();
  l.block_stride = r.get<int64_t>();
  l.token_stride = r.get<int64_t>();
  l.head_stride = r.get<int64_t>();
  l.plane_span = r.get<uint64_t>();
  return l;
}

}  // namespace

namespace {

// Merges dimensions that are contiguous on both sides into the row (Note [kv copy geometry]): fewer
// index computations per byte, longer runs.
void coalesce(KvCopyParams& p) {
  for (bool merged = true; merged;) {
    merged = false;
    if (p.num_heads > 1 && p.src.head_stride == p.row_bytes && p.dst.head_stride == p.row_bytes) {
      p.row_bytes *= p.num_heads;
      p.num_heads = 1;
      merged = true;
    }
    if (p.src.block_size > 1 && p.src.block_size == p.dst.block_size && p.src.token_stride == p.row_bytes &&
        p.dst.token_stride == p.row_bytes && p.num_tokens % p.dst.block_size == 0 &&
        static_cast<int64_t>(p.row_bytes) * p.dst.block_size <= (1 << 30)) {
      p.row_bytes *= p.dst.block_size;
      p.num_tokens /= p.dst.block_size;
      p.src.block_size = p.dst.block_size = 1;
      p.src.token_stride = p.dst.token_stride = p.row_bytes;
      merged = true;
    }
  }
}

}  // namespace

namespace {

// Liveness by /proc: kill() answers for a zombie too, so its state letter decides (about 10 us).
bool process_alive_by_proc(int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
  // A killed process its parent has not reaped yet still answers kill(); /proc says it is a zombie.
  std::FILE* f = std::fopen(detail::concat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return true;
  char state = 'R';
  const int got = std::fscanf(f, "%*d (%*[^)]) %c", &state);
  std::fclose(f);
  return got != 1 || (state != 'Z' && state != 'X');
}

}  // namespace

// Note [kv liveness]
// Every send checks that each destination process still runs, and a receiver checks its senders
// while it waits. A pidfd (Linux 5.3+) opened once per pid answers in one poll() (under 1 us): it
// turns readable when the process exits, zombie or reaped, and it names that process even if the
// pid is reused later. A pid seen exited drops its pidfd, so a later process with the same pid gets
// a fresh one. Without pidfd_open (older kernels, seccomp) the /proc check answers, at about 10 us.
bool kv_process_alive(int64_t pid) {
  if (pid <= 0) return true;
  static std::mutex mu;
  static std::unordered_map<int64_t, int> pidfds;  // pid -> pidfd; -1: pidfd_open unavailable
  std::lock_guard<std::mutex> lock(mu);
  auto it = pidfds.find(pid);
  if (it == pidfds.end()) {
    const long fd = ::syscall(kSysPidfdOpen, static_cast<pid_t>(pid), 0);
    if (fd < 0 && errno == ESRCH) return false;
    it = pidfds.emplace(pid, fd < 0 ? -1 : static_cast<int>(fd)).first;
  }
  if (it->second < 0) return process_alive_by_proc(pid);
  pollfd p{it->second, POLLIN, 0};
  if (::poll(&p, 1, 0) == 0) return true;
  ::close(it->second);
  pidfds.erase(it);
  return false;
}

uint64_t kv_request_hash(const std::string& request_id) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : request_id) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::vector<uint8_t> KvDescriptor::serialize() const {
  Writer w;
  w.put(kDescriptorMagic);
  w.put(instance);
  w.put(static_cast<uint8_t>(role));
  w.put(tp_rank);
  w.put(tp_size);
  w.put(pid);
  w.put(host);
  w.put(device_type);
  w.put(device);
  write_layout(w, layout);
  w.put<uint8_t>(receives ? 1 : 0);
  if (receives) {
    w.put(server);
    w.put(segment_bytes);
    w.put(slots);
    w.put<uint64_t>(regions.size());
    for (const auto& region : regions) {
      w.put(static_cast<uint32_t>(region.kind));
      w.put(region.bytes);
      w.put(region.handle);
    }
    w.put<uint64_t>(plane_regions.size());
    for (const auto& [region, offset] : plane_regions) {
      w.put(region);
      w.put(offset);
    }
  }
  return w.take();
}

KvDescriptor KvDescriptor::parse(const std::vector<uint8_t>& bytes, const std::string& what) {
  Reader r(bytes, what);
  COMMLIB_CHECK(r.get<uint64_t>() == kDescriptorMagic, PeerError, what,
                ": the peer's descriptor has another format (another commlib version?)");
  KvDescriptor d;
  d.instance = r.str();
  d.role = static_cast<KvRole>(r.get<uint8_t>());
  d.tp_rank = r.get<int32_t>();
  d.tp_size = r.get<int32_t>();
  d.pid = r.get<int64_t>();
  d.host = r.str();
  d.device_type = r.str();
  d.device = r.get<int32_t>();
  d.layout = read_layout(r);
  d.receives = r.get<uint8_t>() != 0;
  if (d.receives) {
    d.server = r.str();
    d.segment_bytes = r.get<uint64_t>();
    d.slots = r.get<uint32_t>();
    d.regions.resize(r.get<uint64_t>());
    for (auto& region : d.regions) {
      region.kind = static_cast<KvRegion::Kind>(r.get<uint32_t>());
      region.bytes = r.get<uint64_t>();
      for (auto& b : region.handle) b = r.get<uint8_t>();
    }
    d.plane_regions.resize(r.get<uint64_t>());
    for (auto& [region, offset] : d.plane_regions) {
      region = r.get<uint32_t>();
      offset = r.get<uint64_t>();
    }
  }
  return d;
}

std::string KvDescriptor::name() const {
  return detail::concat("instance '", instance, "' rank ", tp_rank, " (pid ", pid, ")");
}

KvAgent::KvAgent(std::shared_ptr<Store> store, KvAgentOptions options, std::unique_ptr<KvEngine> engine)
    : store_(std::move(store)), options_(std::move(options)), engine_(std::move(engine)) {
  const char* what = "KVAgent";
  COMMLIB_CHECK(!options_.instance.empty() && options_.instance.size() < 64 &&
                    options_.instance.find('/') == std::string::npos,
                InvalidArgument, what, ": instance '", options_.instance,
                "' must be 1..63 characters without '/'");
  COMMLIB_CHECK(options_.tp_size >= 1 && options_.tp_rank >= 0 && options_.tp_rank < options_.tp_size,
                InvalidArgument, what, ": tp_rank ", options_.tp_rank, " out of range for tp_size ", options_.tp_size,
                "; valid: 0..tp_size-1 with tp_size >= 1");
  COMMLIB_CHECK(options_.timeout.count() > 0, InvalidArgument, what, ": timeout ", options_.timeout.count(),
                " ms must be positive");
  if (options_.slots <= 0) options_.slots = static_cast<int>(env::get_int("COMMLIB_KV_SLOTS"));
  if (options_.num_ctas <= 0) options_.num_ctas = static_cast<int>(env::get_int("COMMLIB_KV_CTAS"));
  COMMLIB_CHECK(options_.slots >= 1 && options_.slots <= 65536, InvalidArgument, what, ": COMMLIB_KV_SLOTS ",
                options_.slots, " out of range; valid: 1..65536");
  COMMLIB_CHECK(options_.num_ctas >= 1 && options_.num_ctas <= 1024, InvalidArgument, what, ": COMMLIB_KV_CTAS ",
                options_.num_ctas, " out of range; valid: 1..1024");
}

KvAgent::~KvAgent() { close(); }

void KvAgent::close() {
  if (closed_) return;
  closed_ = true;
  server_.reset();  // no more lanes handed out
  for (auto& [id, s] : sends_) {
    if (s->staged_held) engine_->release_blocks(s->staged, nullptr);
  }
  sends_.clear();
  engine_.reset();  // undoes the engine's mappings of peers' memory first
  for (auto& [name, p] : peers_) {
    for (auto& d : p->dests) d.segment.release();
  }
  peers_.clear();
  if (segment_) segment_->release();
  segment_.reset();
}

void KvAgent::check_open(const char* what) const {
  COMMLIB_CHECK(!closed_, InvalidArgument, what, ": the KV agent of instance '", options_.instance,
                "' is closed");
}

void KvAgent::register_cache(const KvCacheLayout& layout) {
  const char* what = "KVAgent.register";
  check_open(what);
  COMMLIB_CHECK(!registered_, InvalidArgument, what, ": instance '", options_.instance, "' rank ", options_.tp_rank,
                " registered its cache already; an agent registers once");
  const auto& l = layout;
  COMMLIB_CHECK(l.num_layers >= 1 && l.num_layers <= kernels::kKvMaxLayers, InvalidArgument, what, ": ", l.num_layers,
                " layers; supported: 1..", kernels::kKvMaxLayers);
  COMMLIB_CHECK(l.num_planes == (l.mla ? 1 : 2), InvalidArgument, what, ": ", l.num_planes, " planes for ",
                l.mla ? "an MLA" : "a K/V", " cache; expected ", l.mla ? 1 : 2);
  COMMLIB_CHECK(l.planes.size() == static_cast<size_t>(l.num_layers) * l.num_planes, InvalidArgument, what, ": ",
                l.planes.size(), " plane addresses for ", l.num_layers, " layers x ", l.num_planes, " planes");
  COMMLIB_CHECK(l.num_blocks >= 1 && l.num_blocks <= INT32_MAX && l.block_size >= 1 && l.num_heads >= 1 &&
                    l.head_dim >= 1 && l.elem_bytes >= 1,
                InvalidArgument, what, ": empty cache geometry (", l.num_blocks, " blocks of ", l.block_size,
                " tokens, ", l.num_heads, " heads, head_dim ", l.head_dim, ")");
  layout_ = layout;
  regions_.clear();  // a registration that failed half way leaves nothing behind
  plane_regions_.clear();
  if (sends(options_.role)) src_table_ = engine_->upload_table(layout_.planes, what);
  KvDescriptor d;
  d.instance = options_.instance;
  d.role = options_.role;
  d.tp_rank = options_.tp_rank;
  d.tp_size = options_.tp_size;
  d.pid = static_cast<int64_t>(::getpid());
  d.host = host_id();
  d.device_type = engine_->device_type();
  d.device = engine_->device();
  d.layout = layout_;
  if (receives(options_.role)) {
    // Export every region the planes live in, each once (Note [kv peers]).
    for (uint64_t plane : layout_.planes) {
      auto it = std::find_if(regions_.begin(), regions_.end(), [&](const KvRegion& r) {
        return plane >= r.base && plane + layout_.plane_span <= r.base + r.bytes;
      });
      if (it == regions_.end()) {
        regions_.push_back(engine_->export_region(plane, layout_.plane_span, what));
        it = regions_.end() - 1;
      }
      plane_regions_.emplace_back(static_cast<uint32_t>(it - regions_.begin()), plane - it->base);
    }
    segment_ = std::make_unique<KvSegment>(KvSegment::create(static_cast<uint32_t>(options_.slots), what));
    seen_.assign(kKvMaxLanes, std::vector<uint64_t>(options_.slots, 0));
    const std::string server_name =
        detail::concat("commlib-kv-", ::getpid(), "-", kv_request_hash(options_.instance), "-", options_.tp_rank, "-",
                       reinterpret_cast<uintptr_t>(this));
    server_ = std::make_unique<FdServer>(server_name, [this](const std::vector<uint8_t>& request) {
      FdReply reply;
      reply.bytes = serve(request, reply.fds);
      return reply;
    });
    d.receives = true;
    d.server = server_name;
    d.segment_bytes = segment_->bytes;
    d.slots = segment_->slots;
    d.regions = regions_;
    d.plane_regions = plane_regions_;
  }
  store_->set(descriptor_key(options_.instance, options_.tp_rank), d.serialize());
  registered_ = true;
}

// The FdServer thread: a sender asks for this rank's memory; it gets a lane (Note [kv protocol]).
std::vector<uint8_t> KvAgent::serve(const std::vector<uint8_t>& request, std::vector<int>& fds) {
  Reader r(request, "KVAgent");
  COMMLIB_CHECK(r.get<uint64_t>() == kRequestMagic, PeerError, "malformed request");
  const std::string instance = r.str();
  const int32_t rank = r.get<int32_t>();
  const int64_t pid = r.get<int64_t>();
  const std::string host = r.str();
  KvSegmentHeader& header = segment_->header();
  const uint32_t lane = header.lanes_claimed;  // only this thread writes it
  COMMLIB_CHECK(lane < header.num_lanes, PeerError, "instance '", options_.instance, "' rank ", options_.tp_rank,
                " has no free notification lane for instance '", instance, "' rank ", rank, " (", header.num_lanes,
                " senders connected already)");
  KvLane& l = segment_->lane(static_cast<int>(lane));
  l.sender_rank = rank;
  l.sender_pid = pid;
  kv_copy_text(l.sender_instance, instance);
  kv_copy_text(l.sender_host, host);
  kv_store(l.claimed, 1);  // publishes the fields above
  kv_store(header.lanes_claimed, lane + 1);
  fds.push_back(segment_->fd);
  for (const auto& region : regions_) {
    if (region.fd >= 0) fds.push_back(region.fd);
  }
  Writer w;
  w.put(lane);
  return w.take();
}

std::vector<KvRoute> KvAgent::check_peer(const std::string& peer_name) {
  std::vector<KvDescriptor> ranks;
  return check_peer(peer_name, ranks);
}

// Note [kv peer checks]
// What connect() checks of a peer instance before anything is mapped, for the native path and the
// NIXL one alike (commlib.kv calls check_peer for a peer on another host, then adds NIXL's own
// conditions): the peer receives, same device type, dtype, MLA or not, head_dim, layer count and
// global KV heads on both sides; every rank of the peer registered the same cache (PeerError);
// at most kKvMaxDests destinations; heads that divide by both TP sizes. Returns the routes (Note
// [kv tensor parallelism]) and the peer's descriptors in `ranks`.
std::vector<KvRoute> KvAgent::check_peer(const std::string& peer_name, std::vector<KvDescriptor>& ranks) {
  const char* what = "KVAgent.connect";
  check_open(what);
  COMMLIB_CHECK(registered_, InvalidArgument, what, ": register the cache before connecting");
  COMMLIB_CHECK(sends(options_.role), InvalidArgument, what, ": instance '", options_.instance, "' has role ",
                role_name(options_.role), "; only prefill or both may send");
  ranks.clear();
  auto descriptor = [&](int r) {
    return KvDescriptor::parse(wait_get(*store_, descriptor_key(peer_name, r), options_.timeout,
                                        detail::concat("instance '", peer_name, "' rank ", r)),
                               what);
  };
  ranks.push_back(descriptor(0));
  const int tp_d = ranks.front().tp_size;
  for (int r = 1; r < tp_d; ++r) ranks.push_back(descriptor(r));
  const KvCacheLayout& mine = layout_;
  const KvCacheLayout& theirs = ranks.front().layout;
  const std::string both = detail::concat(" (instance '", options_.instance, "': ", mine.layout, " ", mine.dtype,
                                          ", instance '", peer_name, "': ", theirs.layout, " ", theirs.dtype, ")");
  COMMLIB_CHECK(ranks.front().receives, InvalidArgument, what, ": instance '", peer_name, "' has role ",
                role_name(ranks.front().role), "; it does not receive");
  COMMLIB_CHECK(ranks.front().device_type == engine_->device_type(), InvalidArgument, what,
                ": this agent's cache is on ", engine_->device_type(), " but instance '", peer_name, "' registered ",
                ranks.front().device_type, "; supported: the same device type on both sides");
  COMMLIB_CHECK(mine.dtype == theirs.dtype && mine.elem_bytes == theirs.elem_bytes, InvalidArgument, what,
                ": dtypes differ", both, "; the copy is bitwise, both sides need the same dtype");
  COMMLIB_CHECK(mine.mla == theirs.mla, InvalidArgument, what, ": one side is an MLA latent cache and the other not",
                both);
  COMMLIB_CHECK(mine.head_dim == theirs.head_dim, InvalidArgument, what, ": head_dim ", mine.head_dim, " vs ",
                theirs.head_dim, both);
  COMMLIB_CHECK(mine.num_layers == theirs.num_layers, InvalidArgument, what, ": ", mine.num_layers, " layers vs ",
                theirs.num_layers, both);
  const int heads = mine.num_heads * options_.tp_size;
  COMMLIB_CHECK(mine.mla || heads == theirs.num_heads * tp_d, InvalidArgument, what, ": global KV heads differ: ",
                mine.num_heads, " x TP ", options_.tp_size, " = ", heads, " vs ", theirs.num_heads, " x TP ", tp_d,
                " = ", theirs.num_heads * tp_d, both);
  for (const auto& d : ranks) {
    COMMLIB_CHECK(d.tp_size == tp_d && d.layout.num_heads == theirs.num_heads &&
                      d.layout.block_size == theirs.block_size && d.layout.num_blocks == theirs.num_blocks &&
                      d.layout.layout == theirs.layout,
                  PeerError, what, ": the ranks of instance '", peer_name, "' registered different caches (rank 0 and ",
                  d.name(), ")");
  }
  COMMLIB_CHECK(mine.mla || (heads % options_.tp_size == 0 && heads % tp_d == 0), InvalidArgument, what, ": ", heads,
                " KV heads do not divide by TP ", options_.tp_size, " and TP ", tp_d, both);
  std::vector<KvRoute> routes = kv_routes(heads, mine.mla, options_.tp_rank, options_.tp_size, tp_d);
  COMMLIB_CHECK(static_cast<int>(routes.size()) <= kernels::kKvMaxDests, InvalidArgument, what, ": rank ",
                options_.tp_rank, " would write to ", routes.size(), " ranks of instance '", peer_name,
                "'; at most ", kernels::kKvMaxDests, " (TP ratio up to 1:", kernels::kKvMaxDests, ")");
  return routes;
}

void KvAgent::connect(const std::string& peer_name) {
  const char* what = "KVAgent.connect";
  check_open(what);
  if (peers_.count(peer_name)) return;
  auto p = std::make_unique<Peer>();
  p->name = peer_name;
  const std::vector<KvRoute> routes = check_peer(peer_name, p->ranks);
  const KvCacheLayout& mine = layout_;
  const KvCacheLayout& theirs = p->ranks.front().layout;
  std::vector<int> dest_ranks;
  for (const KvRoute& r : routes) dest_ranks.push_back(r.rank);
  const int copy_heads = routes.empty() ? 0 : routes.front().heads;
  KvCopyParams& b = p->base;
  b.src_planes = src_table_;
  b.src = {mine.block_stride, mine.token_stride, mine.head_stride, mine.block_size};
  b.dst = {theirs.block_stride, theirs.token_stride, theirs.head_stride, theirs.block_size};
  b.row_bytes = mine.head_dim * mine.elem_bytes;
  b.num_heads = copy_heads;
  b.num_planes = mine.num_planes;
  b.num_dests = static_cast<int>(dest_ranks.size());
  b.num_layers_total = mine.num_layers;
  b.num_ctas = options_.num_ctas;
  p->peer_blocks = theirs.num_blocks;
  p->peer_block_size = theirs.block_size;
  uint64_t g = 0;
  for (int64_t v : {mine.block_stride, mine.token_stride, mine.head_stride, theirs.block_stride, theirs.token_stride,
                    theirs.head_stride}) {
    g = std::gcd(g, static_cast<uint64_t>(v < 0 ? -v : v));
  }
  for (uint64_t plane : mine.planes) g = std::gcd(g, plane);
  std::vector<uint64_t> dst_table;
  Writer request;
  request.put(kRequestMagic);
  request.put(options_.instance);
  request.put<int32_t>(options_.tp_rank);
  request.put<int64_t>(::getpid());
  request.put(host_id());
  const std::vector<uint8_t> request_bytes = request.take();
  for (size_t j = 0; j < dest_ranks.size(); ++j) {
    const KvDescriptor& d = p->ranks[dest_ranks[j]];
    COMMLIB_CHECK(d.host == host_id(), InvalidArgument, what, ": ", d.name(), " runs on host '", d.host,
                  "' and this agent on '", host_id(),
                  "'; across hosts the KV transfer needs NIXL, which this build does not have (docs/kv.md)");
    Peer::Dest dest;
    dest.rank = d.tp_rank;
    dest.pid = d.pid;
    dest.name = d.name();
    FdReply reply = fd_request(d.server, request_bytes, options_.timeout, detail::concat(what, " to ", d.name()));
    size_t next_fd = 0;
    auto take_fd = [&]() {
      COMMLIB_CHECK(next_fd < reply.fds.size(), PeerError, what, ": ", d.name(), " sent too few descriptors");
      return reply.fds[next_fd++];
    };
    try {
      Reader rr(reply.bytes, what);
      dest.lane = static_cast<int>(rr.get<uint32_t>());
      const int seg_fd = take_fd();
      dest.segment = KvSegment::attach(seg_fd, d.segment_bytes, what);
      dest.segment.slots = d.slots;
      dest.flags_base = engine_->map_flags(dest.segment.base, dest.segment.bytes, what);
      std::vector<uint64_t> bases;
      for (const auto& region : d.regions) {
        const int fd = region.kind == KvRegion::Kind::kCudaIpc ? -1 : take_fd();
        bases.push_back(engine_->import_region(region, fd, what));
      }
      for (const auto& [region, offset] : d.plane_regions) {
        dst_table.push_back(bases.at(region) + offset);
        g = std::gcd(g, dst_table.back());
      }
    } catch (...) {
      for (int fd : reply.fds) ::close(fd);
      dest.segment.release();
      throw;
    }
    for (int fd : reply.fds) ::close(fd);
    const KvRoute& route = routes[j];
    dest.first_sender = route.first_sender;
    dest.num_contributors = static_cast<uint32_t>(route.num_contributors);
    dest.contributor = static_cast<uint32_t>(route.contributor);
    b.src_head0[j] = route.src_head;
    b.dst_head0[j] = route.dst_head;
    g = std::gcd(g, static_cast<uint64_t>(route.src_head) * static_cast<uint64_t>(mine.head_stride));
    g = std::gcd(g, static_cast<uint64_t>(route.dst_head) * static_cast<uint64_t>(theirs.head_stride));
    b.flags[j] = nullptr;  // per request
    p->dests.push_back(std::move(dest));
  }
  b.dst_planes = dst_table.empty() ? nullptr : engine_->upload_table(dst_table, what);
  p->align_gcd = g;
  peers_[peer_name] = std::move(p);
}

KvAgent::Peer& KvAgent::peer(const std::string& name) {
  auto it = peers_.find(name);
  if (it == peers_.end()) {
    connect(name);
    it = peers_.find(name);
  }
  return *it->second;
}

std::vector<int> KvAgent::destinations(const std::string& name) const {
  auto it = peers_.find(name);
  COMMLIB_CHECK(it != peers_.end(), InvalidArgument, "KVAgent.destinations: not connected to instance '", name, "'");
  std::vector<int> out;
  for (const auto& d : it->second->dests) out.push_back(d.rank);
  return out;
}

uint64_t KvAgent::begin(const std::string& peer_name, const std::string& request_id, const int32_t* src_blocks,
                        size_t num_src, const int32_t* dst_blocks, size_t num_dst, int64_t num_tokens,
                        const std::vector<int>& layers, void* stream) {
  const char* what = "KVAgent.send";
  check_open(what);
  Peer& p = peer(peer_name);
  num_tokens = kv_check_request(what, request_id, src_blocks, num_src, layout_.num_blocks, layout_.block_size,
                                dst_blocks, num_dst, p.peer_blocks, p.peer_block_size, num_tokens, layers,
                                layout_.num_layers, p.dst_stamp, p.stamp_now);
  auto s = std::make_unique<Send>();
  s->peer = &p;
  s->request_id = request_id;
  if (layers.empty()) {
    for (int l = 0; l < layout_.num_layers; ++l) kv_set_layer(s->announced, l);
    s->num_announced = layout_.num_layers;
  } else {
    for (int l : layers) kv_set_layer(s->announced, l);  // checked by kv_check_request
    s->num_announced = static_cast<int>(layers.size());
  }
  for (const auto& d : p.dests) {
    COMMLIB_CHECK(kv_process_alive(d.pid), PeerError, what, ": request '", request_id, "': ", d.name, " has exited");
  }
  // A free record on every destination first, so a request is announced everywhere or nowhere.
  std::vector<int> slots;
  for (auto& d : p.dests) {
    int found = -1;
    for (uint32_t k = 0; k < d.segment.slots && found < 0; ++k) {
      const uint32_t slot = (d.cursor + k) % d.segment.slots;
      if (kv_load(d.segment.record(d.lane, static_cast<int>(slot)).state) == static_cast<uint32_t>(KvRecordState::kFree)) {
        found = static_cast<int>(slot);
      }
    }
    COMMLIB_CHECK(found >= 0, PeerError, what, ": request '", request_id, "': ", d.segment.slots,
                  " requests to ", d.name, " are unfinished (none reported by its poll() / wait() yet); raise "
                  "COMMLIB_KV_SLOTS on the receiving side or let it catch up");
    slots.push_back(found);
  }
  s->params = p.base;
  s->params.num_tokens = num_tokens;
  s->params.num_dst_blocks = static_cast<int64_t>(num_dst);
  s->empty = num_tokens == 0 || p.dests.empty();  // nothing to copy (MLA: this rank serves no one)
  if (!s->empty) {
    s->staged = engine_->stage_blocks(src_blocks, num_src, dst_blocks, num_dst, stream, what);
    s->staged_held = true;
    s->params.src_blocks = s->staged.src;
    s->params.dst_blocks = s->staged.dst;
    coalesce(s->params);
    s->params.num_dst_blocks = s->params.num_tokens / s->params.dst.block_size +
                               (s->params.num_tokens % s->params.dst.block_size != 0 ? 1 : 0);
    s->params.vector_bytes = kernels::kv_vector_bytes(std::gcd(p.align_gcd, static_cast<uint64_t>(s->params.row_bytes)));
  }
  for (size_t j = 0; j < p.dests.size(); ++j) {
    auto& d = p.dests[j];
    d.cursor = (static_cast<uint32_t>(slots[j]) + 1) % d.segment.slots;
    KvRecord& rec = d.segment.record(d.lane, slots[j]);
    const uint64_t seq = d.next_seq++;
    rec.num_contributors = d.num_contributors;
    rec.contributor = d.contributor;
    rec.num_layers = static_cast<uint32_t>(s->num_announced);
    rec.seq = seq;
    rec.id_hash = kv_request_hash(request_id);
    rec.num_tokens = num_tokens;
    rec.num_blocks = static_cast<int64_t>(num_dst);
    std::copy(std::begin(s->announced), std::end(s->announced), rec.layer_mask);
    kv_copy_text(rec.id, request_id);
    rec.first_sender = d.first_sender;
    rec.reason[0] = '\0';
    kv_store(rec.state, static_cast<uint32_t>(KvRecordState::kActive));  // publishes the header
    s->slots.emplace_back(slots[j], seq);
    s->params.flags[j] = d.flags_base + d.segment.record_offset(d.lane, slots[j]) / sizeof(uint32_t) +
                         offsetof(KvRecord, flags) / sizeof(uint32_t);
    s->params.flag_value[j] = static_cast<uint32_t>(seq);
    if (s->empty) {
      for (int l = 0; l < layout_.num_layers; ++l) {
        if (kv_has_layer(s->announced, l)) kv_store(rec.flags[l], static_cast<uint32_t>(seq));
      }
    }
  }
  const uint64_t id = next_send_++;
  sends_[id] = std::move(s);
  return id;
}

void KvAgent::send_layers(uint64_t send, int layer_begin, int num_layers, void* stream) {
  const char* what = "KVAgent.send_layer";
  check_open(what);
  auto it = sends_.find(send);
  COMMLIB_CHECK(it != sends_.end(), InvalidArgument, what, ": send #", send, " is unknown or finished");
  Send& s = *it->second;
  COMMLIB_CHECK(num_layers >= 1 && layer_begin >= 0 && layer_begin + num_layers <= layout_.num_layers,
                InvalidArgument, what, ": layers [", layer_begin, ", ", layer_begin + num_layers,
                ") out of range; valid: 0..", layout_.num_layers - 1);
  for (int l = layer_begin; l < layer_begin + num_layers; ++l) {
    COMMLIB_CHECK(kv_has_layer(s.announced, l), InvalidArgument, what, ": request '", s.request_id, "': layer ", l,
                  " was not announced by send/begin");
    COMMLIB_CHECK(!kv_has_layer(s.sent, l), InvalidArgument, what, ": request '", s.request_id, "': layer ", l,
                  " sent already");
  }
  if (!s.empty) {
    KvCopyParams params = s.params;
    params.layer_begin = layer_begin;
    params.num_layers = num_layers;
    try {
      engine_->copy(params, stream, what);
    } catch (const std::exception& e) {
      for (size_t j = 0; j < s.slots.size(); ++j) {
        auto& d = s.peer->dests[j];
        KvRecord& rec = d.segment.record(d.lane, s.slots[j].first);
        kv_copy_text(rec.reason, e.what());
        kv_store(rec.state, static_cast<uint32_t>(KvRecordState::kFailed));
      }
      throw;
    }
  }
  for (int l = layer_begin; l < layer_begin + num_layers; ++l) kv_set_layer(s.sent, l);
  s.num_sent += num_layers;
  if (s.num_sent == s.num_announced && s.staged_held) {
    engine_->release_blocks(s.staged, stream);
    s.staged_held = false;
  }
}

bool KvAgent::send_done(uint64_t send) {
  const char* what = "KVAgent.send";
  auto it = sends_.find(send);
  if (it == sends_.end()) return true;  // finished and reported
  Send& s = *it->second;
  if (s.num_sent < s.num_announced) return false;
  for (size_t j = 0; j < s.slots.size(); ++j) {
    const auto& d = s.peer->dests[j];
    const KvRecord& rec = d.segment.record(d.lane, s.slots[j].first);
    if (rec.seq != s.slots[j].second) continue;  // the receiver freed it and this agent reused it: done
    COMMLIB_CHECK(kv_load(rec.state) != static_cast<uint32_t>(KvRecordState::kFailed), Error, what, ": request '",
                  s.request_id, "' to ", d.name, " failed: ", rec.reason);
    for (int l = 0; l < layout_.num_layers; ++l) {
      if (kv_has_layer(s.announced, l) && kv_load(rec.flags[l]) != static_cast<uint32_t>(s.slots[j].second)) {
        return false;
      }
    }
  }
  return true;
}

void KvAgent::wait_send(uint64_t send, std::chrono::milliseconds timeout) {
  const char* what = "KVAgent.wait_send";
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!send_done(send)) {
    auto& s = *sends_.at(send);
    for (const auto& d : s.peer->dests) {
      COMMLIB_CHECK(kv_process_alive(d.pid), PeerError, what, ": request '", s.request_id, "': ", d.name,
                    " exited before the send completed");
    }
    COMMLIB_CHECK(std::chrono::steady_clock::now() < deadline, Timeout, what, ": request '", s.request_id,
                  "' to instance '", s.peer->name, "': not complete after ", timeout.count(), " ms (",
                  s.num_sent, " of ", s.num_announced, " layers sent)");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void KvAgent::finish_send(Send& s) {
  if (s.staged_held) {
    engine_->release_blocks(s.staged, nullptr);
    s.staged_held = false;
  }
}

}  // namespace commlib
