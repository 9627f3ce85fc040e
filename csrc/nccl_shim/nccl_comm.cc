// Communicators of the shim: ncclGetUniqueId, the ncclCommInit* family, destroy / abort, the
// queries, and the real NCCL communicator each one keeps inside (Notes [nccl shim unique id],
// [nccl shim forwarding] and [nccl shim routes] in nccl_shim/shim.hpp).
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <sstream>

#include "bootstrap/bootstrap.hpp"
#include "commlib/env.hpp"
#include "commlib/gpu.hpp"
#include "cuda/cuda_comm.hpp"
#include "nccl_shim/shim.hpp"
#include "nccl_shim/tcp_store.hpp"

namespace commlib::nccl_shim {
namespace {

std::chrono::milliseconds setup_timeout() {
  const int64_t ms = env::get_int("COMMLIB_TIMEOUT_MS");
  return ms > 0 ? std::chrono::milliseconds(ms) : std::chrono::milliseconds(std::chrono::seconds(300));
}

// The address peers reach this process's store at: COMMLIB_NCCL_HOST (a name or an IPv4
// address), else the first IPv4 address of an interface that is up and not loopback, else
// 127.0.0.1. Network byte order.
uint32_t advertised_ipv4() {
  const std::string host = env::get("COMMLIB_NCCL_HOST");
  if (!host.empty()) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
    COMMLIB_CHECK(rc == 0 && found != nullptr, InvalidArgument, "COMMLIB_NCCL_HOST '", host,
                  "' has no IPv4 address: ", ::gai_strerror(rc));
    const uint32_t ipv4 = reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr.s_addr;
    ::freeaddrinfo(found);
    return ipv4;
  }
  uint32_t ipv4 = htonl(INADDR_LOOPBACK);
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
      if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
      if ((a->ifa_flags & IFF_UP) == 0 || (a->ifa_flags & IFF_LOOPBACK) != 0) continue;
      ipv4 = reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr;
      break;
    }
    ::freeifaddrs(list);
  }
  return ipv4;
}

uint64_t random_nonce() {
  std::random_device device;
  const uint64_t high = device(), low = device();
  const auto now = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return ((high << 32) | low) ^ now;
}

std::string hex(uint64_t value) {
  std::ostringstream os;
  os << std::hex << value;
  return os.str();
}

bool is_shim_id(const ncclUniqueId& id) { return std::memcmp(id.internal, kIdMagic, sizeof(kIdMagic)) == 0; }

ncclResult_t get_unique_id(const char* what, ncclUniqueId* out) {
  if (out == nullptr) return fail(ncclInvalidArgument, std::string(what) + ": uniqueId is NULL");
  return guarded(what, [&] {
    ShimUniqueId id{};
    std::memcpy(id.magic, kIdMagic, sizeof(kIdMagic));
    id.port = htons(tcp_store_server_port());
    id.ipv4 = advertised_ipv4();
    id.nonce = random_nonce();
    // The real NCCL's id, when it loads: its ncclGetUniqueId needs no GPU.
    ncclUniqueId real_id{};
    if (real_nccl().handle != nullptr && real::ncclGetUniqueId(&real_id) == ncclSuccess) {
      bool tail_zero = true;
      for (size_t i = kRealIdBytes; i < sizeof(real_id.internal); ++i) tail_zero &= real_id.internal[i] == 0;
      if (tail_zero) {
        std::memcpy(id.real, real_id.internal, kRealIdBytes);
        id.flags |= kHasRealId;
      }
    }
    static_assert(sizeof(id) == sizeof(*out));
    std::memcpy(out, &id, sizeof(id));
    return ncclSuccess;
  });
}

// Decides the communicator's route (Note [nccl shim routes]); collective (creates the GPU state).
void choose_route(ncclComm& c) {
  Communicator& comm = *c.commlib;
  if (!env::get_bool("COMMLIB_NCCL_SERVE")) {
    c.route = "COMMLIB_NCCL_SERVE=0: every call goes to the real NCCL";
  } else if (!gpu_built()) {
    c.route = "this commlib was built without its GPU paths";
  } else if (!comm.hosts_problem().empty()) {
    c.route = "ranks on several hosts: " + comm.hosts_problem();
  } else {
    CudaComm& cuda = comm.cuda(c.device);
    c.served = cuda.p2p_ok();
    c.route = c.served ? "one host, peer memory between every pair of GPUs" : "no peer memory: " + cuda.peer_problem();
  }
}

// NCCL_API_MAGIC names the config magic from NCCL 2.29 on; older headers write the number.
#ifndef NCCL_API_MAGIC
#define NCCL_API_MAGIC 0xcafebeef
#endif

bool bad_config(const ncclConfig_t* config) {
  return config != nullptr && (config->magic != NCCL_API_MAGIC || config->size < offsetof(ncclConfig_t, blocking));
}

// Keeps a copy of `config` (and of its strings) for the real communicator made later.
void keep_config(ncclComm& c, const ncclConfig_t* config) {
  if (config == nullptr) return;
  c.has_config = true;
  c.config = NCCL_CONFIG_INITIALIZER;
  std::memcpy(&c.config, config, std::min(config->size, sizeof(ncclConfig_t)));
  if (c.config.netName != nullptr) c.config.netName = (c.config_net_name = c.config.netName).c_str();
  if (c.config.commName != nullptr) c.config.commName = (c.config_comm_name = c.config.commName).c_str();
}

// Forms c's commlib Communicator over `store` and routes it (collective over c's ranks).
void form_commlib(ncclComm& c, std::shared_ptr<Store> store, const std::string& name, const std::string& no_device) {
  CommunicatorOptions options;
  options.timeout = setup_timeout();
  c.store = store;
  c.commlib = std::make_unique<Communicator>(std::move(store), c.rank, c.nranks, name, options);
  if (no_device.empty()) {
    choose_route(c);
  } else {
    c.route = no_device + ": every call goes to the real NCCL";
  }
}

ncclResult_t init_rank(const char* what, ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank,
                       const ncclConfig_t* config) {
  const std::string w = what;
  if (out == nullptr) return fail(ncclInvalidArgument, w + ": comm is NULL; pass the address of an ncclComm_t");
  if (nranks < 1) return fail(ncclInvalidArgument, w + ": nranks " + std::to_string(nranks) + " invalid; must be >= 1");
  if (rank < 0 || rank >= nranks) {
    return fail(ncclInvalidArgument, w + ": rank " + std::to_string(rank) + " invalid; valid: 0.." +
                                         std::to_string(nranks - 1) + " (nranks " + std::to_string(nranks) + ")");
  }
  if (bad_config(config)) {
    return fail(ncclInvalidArgument, w + ": config was not set from NCCL_CONFIG_INITIALIZER (magic " +
                                         std::to_string(config->magic) + ")");
  }
  // Without a usable device the communicator still forms (commlib's rendezvous needs none) and
  // forwards every call; the real NCCL then reports what is wrong with the device.
  int device = -1;
  std::string no_device;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    device = -1;
    no_device = std::string("no CUDA device (cudaGetDevice: ") + cudaGetErrorString(err) + ")";
    cudaGetLastError();  // not sticky: later CUDA calls of this thread start clean
  }
  return guarded(what, [&] {
    auto c = std::make_unique<ncclComm>();
    c->rank = rank;
    c->nranks = nranks;
    c->device = device;
    keep_config(*c, config);
    if (!is_shim_id(id)) {
      // A real NCCL's id (made without the shim): the real NCCL's communicator alone.
      c->has_real_id = true;
      c->real_id = id;
      c->route = "the unique id is the real NCCL's: every call goes to it";
      ncclComm_t real = nullptr;
      if (ncclResult_t r = real_comm(c.get(), what, RealComm::kCreate, &real); r != ncclSuccess) return r;
      *out = c.release();
      return ncclSuccess;
    }
    ShimUniqueId shim_id{};
    std::memcpy(&shim_id, &id, sizeof(shim_id));
    if ((shim_id.flags & kHasRealId) != 0) {
      c->has_real_id = true;
      std::memcpy(c->real_id.internal, shim_id.real, kRealIdBytes);
    }
    const std::string space = "nccl-" + hex(shim_id.nonce);
    form_commlib(*c, std::make_shared<TcpStore>(shim_id.ipv4, ntohs(shim_id.port), space, setup_timeout()), space,
                 no_device);
    *out = c.release();
    return ncclSuccess;
  });
}

// ncclCommSplit: a communicator of commlib's splits into commlib communicators over its rendezvous
// (colors and keys exchanged over the parent; new ranks by key, then parent rank, as NCCL orders
// them); one of the real NCCL's alone splits in the real NCCL.
ncclResult_t split(const char* what, ncclComm_t parent, int color, int key, ncclComm_t* newcomm,
                   ncclConfig_t* config) {
  if (ncclResult_t r = check_comm(parent, what); r != ncclSuccess) return r;
  const std::string w = what;
  if (newcomm == nullptr) return fail(ncclInvalidArgument, w + ": newcomm is NULL");
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR) {
    return fail(ncclInvalidArgument, w + ": color " + std::to_string(color) + " invalid; valid: >= 0 or NCCL_SPLIT_NOCOLOR");
  }
  if (bad_config(config)) return fail(ncclInvalidArgument, w + ": config was not set from NCCL_CONFIG_INITIALIZER");
  if (parent->commlib == nullptr) {
    ncclComm_t real_parent = nullptr;
    if (ncclResult_t r = real_comm(parent, what, RealComm::kExisting, &real_parent); r != ncclSuccess) return r;
    ncclComm_t real_child = nullptr;
    const ncclResult_t r = real::ncclCommSplit(real_parent, color, key, &real_child, config);
    *newcomm = wrap_real(real_child, parent);
    return r;
  }
  return guarded(what, [&] {
    struct Choice {
      int32_t color;
      int32_t key;
    };
    const Choice mine{color, key};
    std::vector<Choice> all(parent->nranks);
    parent->commlib->control_all_gather(all.data(), &mine, sizeof(Choice));
    const uint64_t index = parent->num_splits++;
    *newcomm = nullptr;
    if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
    std::vector<std::pair<int32_t, int>> members;  // (key, parent rank)
    for (int r = 0; r < parent->nranks; ++r) {
      if (all[r].color == color) members.emplace_back(all[r].key, r);
    }
    std::sort(members.begin(), members.end());
    auto c = std::make_unique<ncclComm>();
    c->nranks = static_cast<int>(members.size());
    c->rank = static_cast<int>(std::find(members.begin(), members.end(), std::make_pair(key, parent->rank)) -
                               members.begin());
    c->device = parent->device;
    keep_config(*c, config);
    const std::string name = parent->commlib->name() + "-split" + std::to_string(index) + "-color" + std::to_string(color);
    form_commlib(*c, parent->store, name, parent->device < 0 ? "no CUDA device" : "");
    *newcomm = c.release();
    return ncclSuccess;
  });
}

ncclResult_t destroy(const char* what, ncclComm_t comm, bool abort) {
  if (ncclResult_t r = check_comm(comm, what); r != ncclSuccess) return r;
  if (abort && comm->commlib) comm->commlib->abort();
  ncclResult_t result = ncclSuccess;
  if (ncclComm_t real = comm->real.exchange(nullptr)) {
    result = abort ? real::ncclCommAbort(real) : real::ncclCommDestroy(real);
  }
  const ncclResult_t closed = guarded(what, [&] {
    if (comm->commlib) {
      DeviceGuard guard(comm->device);
      comm->commlib->close();
    }
    return ncclSuccess;
  });
  comm->magic = 0;  // a later call with this handle fails check_comm (while the memory is not reused)
  delete comm;
  return result != ncclSuccess ? result : closed;
}

ncclResult_t async_error(const char* what, ncclComm_t comm, ncclResult_t* error) {
  if (ncclResult_t r = check_comm(comm, what); r != ncclSuccess) return r;
  if (error == nullptr) return fail(ncclInvalidArgument, std::string(what) + ": asyncError is NULL");
  *error = ncclSuccess;
  if (comm->commlib) {
    using State = Communicator::ErrorState;
    const State state = comm->commlib->error();
    if (state != State::kNone) {
      std::string why = state == State::kAborted ? "the communicator was aborted" : "a peer did not arrive";
      if (state == State::kTimeout) {
        try {
          check_gpu_error(*comm->commlib);
        } catch (const Error& e) {
          why = e.what();
        }
      }
      // A device wait that timed out: a peer stopped (NCCL's remote error); abort: the system's.
      *error = state == State::kAborted ? ncclSystemError : ncclRemoteError;
      fail(*error, std::string(what) + ": " + why);
      return ncclSuccess;
    }
  }
  if (ncclComm_t real = comm->real.load()) return real::ncclCommGetAsyncError(real, error);
  return ncclSuccess;
}

// Count, user rank, device: the shim's for its communicators, the real NCCL's for one of its own.
template <typename RealQuery>
ncclResult_t query(const char* what, ncclComm_t comm, int* out, const char* out_name, int value, RealQuery&& ask) {
  if (ncclResult_t r = check_comm(comm, what); r != ncclSuccess) return r;
  if (out == nullptr) return fail(ncclInvalidArgument, std::string(what) + ": " + out_name + " is NULL");
  if (comm->commlib == nullptr) return ask(comm->real.load(), out);
  *out = value;
  return ncclSuccess;
}

std::string info_text() {
  const RealNccl& real = real_nccl();
  std::ostringstream os;
  os << "real_path=" << real.path << "\nreal_version=" << real.version << "\nreal_error=" << real.error
     << "\nheader_version=" << NCCL_VERSION_CODE << "\ngpu_built=" << (gpu_built() ? 1 : 0)
     << "\nserved=ncclAllReduce ncclReduceScatter (sum avg; float32 float16 bfloat16), ncclAllGather, "
        "ncclBroadcast, ncclBcast, ncclAlltoAll, ncclSend, ncclRecv (any type)\n";
  return os.str();
}

}  // namespace

ncclResult_t check_comm(ncclComm_t comm, const char* what) {
  if (comm == nullptr) return fail(ncclInvalidArgument, std::string(what) + ": comm is NULL");
  if (comm->magic != kCommMagic) {
    return fail(ncclInvalidArgument, std::string(what) + ": comm is not a live communicator of this library");
  }
  return ncclSuccess;
}

ncclResult_t real_comm(ncclComm_t comm, const char* what, RealComm mode, ncclComm_t* out) {
  if (ncclResult_t r = check_comm(comm, what); r != ncclSuccess) return r;
  *out = comm->real.load();
  if (*out == nullptr && mode == RealComm::kCreate) {
    std::lock_guard<std::mutex> lock(comm->real_mutex);
    if (comm->real.load() == nullptr) {
      if (real_nccl().handle == nullptr) return missing(what);
      ncclUniqueId id = comm->real_id;
      if (!comm->has_real_id) {
        // Rank 0 makes the real id and shares it over the store; a failure reaches every rank.
        Bootstrap bootstrap(comm->commlib->store(), comm->commlib->prefix() + "/nccl_real", comm->rank, comm->nranks,
                            setup_timeout());
        std::vector<uint8_t> mine;
        if (comm->rank == 0 && real::ncclGetUniqueId(&id) == ncclSuccess) mine.assign(id.internal, id.internal + sizeof(id));
        const ncclResult_t shared = guarded(what, [&] {
          const std::vector<uint8_t> got = bootstrap.broadcast("id", mine, 0);
          if (got.size() != sizeof(id)) return fail(ncclSystemError, std::string(what) + ": rank 0 could not make a real NCCL unique id");
          std::memcpy(id.internal, got.data(), sizeof(id));
          return ncclSuccess;
        });
        if (shared != ncclSuccess) return shared;
        comm->real_id = id;
        comm->has_real_id = true;
      }
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      if (comm->has_config) config = comm->config;
      config.blocking = 1;  // the forwarded call that made it needs it now
      ncclComm_t real = nullptr;
      int previous = -1;
      const bool switch_device = comm->device >= 0 && cudaGetDevice(&previous) == cudaSuccess && previous != comm->device;
      if (switch_device) cudaSetDevice(comm->device);
      const ncclResult_t r = real::ncclCommInitRankConfig(&real, comm->nranks, id, comm->rank, &config);
      if (switch_device) cudaSetDevice(previous);
      if (r != ncclSuccess) return r;
      comm->real.store(real);
    }
    *out = comm->real.load();
  }
  if (*out != nullptr) enter_real_group();
  return ncclSuccess;
}

ncclComm_t wrap_real(ncclComm_t real, ncclComm_t parent) {
  if (real == nullptr) return nullptr;
  auto* c = new ncclComm();
  c->real.store(real);
  c->device = parent != nullptr && parent->magic == kCommMagic ? parent->device : -1;
  if (c->device < 0) real::ncclCommCuDevice(real, &c->device);
  real::ncclCommUserRank(real, &c->rank);
  real::ncclCommCount(real, &c->nranks);
  c->route = "made by the real NCCL (split, shrink, grow, init-all or scalable init): every call goes to it";
  return c;
}

}  // namespace commlib::nccl_shim

namespace shim = commlib::nccl_shim;

NCCL_SHIM_API ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  return shim::get_unique_id("ncclGetUniqueId", uniqueId);
}
NCCL_SHIM_API ncclResult_t pncclGetUniqueId(ncclUniqueId* uniqueId) {
  return shim::get_unique_id("pncclGetUniqueId", uniqueId);
}

NCCL_SHIM_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return shim::init_rank("ncclCommInitRank", comm, nranks, commId, rank, nullptr);
}
NCCL_SHIM_API ncclResult_t pncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return shim::init_rank("pncclCommInitRank", comm, nranks, commId, rank, nullptr);
}
NCCL_SHIM_API ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                                  ncclConfig_t* config) {
  return shim::init_rank("ncclCommInitRankConfig", comm, nranks, commId, rank, config);
}
NCCL_SHIM_API ncclResult_t pncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                                   ncclConfig_t* config) {
  return shim::init_rank("pncclCommInitRankConfig", comm, nranks, commId, rank, config);
}

namespace commlib::nccl_shim {
namespace {

// One process driving several GPUs: the real NCCL's communicators, wrapped.
ncclResult_t init_all(const char* what, ncclComm_t* comms, int ndev, const int* devlist) {
  if (comms == nullptr) return fail(ncclInvalidArgument, std::string(what) + ": comm is NULL");
  if (ndev < 1) return fail(ncclInvalidArgument, std::string(what) + ": ndev " + std::to_string(ndev) + " invalid; must be >= 1");
  std::vector<ncclComm_t> real(ndev, nullptr);
  const ncclResult_t r = real::ncclCommInitAll(real.data(), ndev, devlist);
  if (r != ncclSuccess) return r;
  for (int i = 0; i < ndev; ++i) comms[i] = wrap_real(real[i], nullptr);
  return ncclSuccess;
}

// Several roots: the real NCCL's communicator, made from the real ids inside the shim's.
ncclResult_t init_scalable(const char* what, ncclComm_t* newcomm, int nranks, int myrank, int nId,
                           ncclUniqueId* commIds, ncclConfig_t* config) {
  if (newcomm == nullptr || commIds == nullptr || nId < 1) {
    return fail(ncclInvalidArgument, std::string(what) + ": newcomm and commIds must be set and nId (" +
                                         std::to_string(nId) + ") >= 1");
  }
  std::vector<ncclUniqueId> ids(commIds, commIds + nId);
  for (ncclUniqueId& id : ids) {
    if (!is_shim_id(id)) continue;
    ShimUniqueId shim_id{};
    std::memcpy(&shim_id, &id, sizeof(shim_id));
    if ((shim_id.flags & kHasRealId) == 0) {
      return fail(ncclInvalidUsage, std::string(what) + ": a unique id carries no real NCCL id (the real NCCL did not "
                                                        "load where ncclGetUniqueId ran)");
    }
    id = ncclUniqueId{};
    std::memcpy(id.internal, shim_id.real, kRealIdBytes);
  }
  ncclComm_t real = nullptr;
  const ncclResult_t r = real::ncclCommInitRankScalable(&real, nranks, myrank, nId, ids.data(), config);
  if (r != ncclSuccess) return r;
  *newcomm = wrap_real(real, nullptr);
  return ncclSuccess;
}

}  // namespace
}  // namespace commlib::nccl_shim

NCCL_SHIM_API ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist) {
  return shim::init_all("ncclCommInitAll", comm, ndev, devlist);
}
NCCL_SHIM_API ncclResult_t pncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist) {
  return shim::init_all("pncclCommInitAll", comm, ndev, devlist);
}
NCCL_SHIM_API ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
                                                    ncclUniqueId* commIds, ncclConfig_t* config) {
  return shim::init_scalable("ncclCommInitRankScalable", newcomm, nranks, myrank, nId, commIds, config);
}
NCCL_SHIM_API ncclResult_t pncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
                                                     ncclUniqueId* commIds, ncclConfig_t* config) {
  return shim::init_scalable("pncclCommInitRankScalable", newcomm, nranks, myrank, nId, commIds, config);
}

NCCL_SHIM_API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                         ncclConfig_t* config) {
  return shim::split("ncclCommSplit", comm, color, key, newcomm, config);
}
NCCL_SHIM_API ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                          ncclConfig_t* config) {
  return shim::split("pncclCommSplit", comm, color, key, newcomm, config);
}

NCCL_SHIM_API ncclResult_t ncclCommDestroy(ncclComm_t comm) { return shim::destroy("ncclCommDestroy", comm, false); }
NCCL_SHIM_API ncclResult_t pncclCommDestroy(ncclComm_t comm) { return shim::destroy("pncclCommDestroy", comm, false); }
NCCL_SHIM_API ncclResult_t ncclCommAbort(ncclComm_t comm) { return shim::destroy("ncclCommAbort", comm, true); }
NCCL_SHIM_API ncclResult_t pncclCommAbort(ncclComm_t comm) { return shim::destroy("pncclCommAbort", comm, true); }

NCCL_SHIM_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  return shim::async_error("ncclCommGetAsyncError", comm, asyncError);
}
NCCL_SHIM_API ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  return shim::async_error("pncclCommGetAsyncError", comm, asyncError);
}

#define NCCL_SHIM_QUERY(name, out, field)                                                                        \
  NCCL_SHIM_API ncclResult_t name(const ncclComm_t comm, int* out) {                                             \
    return shim::query(#name, comm, out, #out, comm != nullptr ? comm->field : 0,                                \
                       [](ncclComm_t real, int* o) { return shim::real::name(real, o); });                       \
  }
NCCL_SHIM_QUERY(ncclCommCount, count, nranks)
NCCL_SHIM_QUERY(pncclCommCount, count, nranks)
NCCL_SHIM_QUERY(ncclCommUserRank, rank, rank)
NCCL_SHIM_QUERY(pncclCommUserRank, rank, rank)
NCCL_SHIM_QUERY(ncclCommCuDevice, device, device)
NCCL_SHIM_QUERY(pncclCommCuDevice, device, device)
#undef NCCL_SHIM_QUERY

// Which way the operations of Note [nccl shim routes] go on `comm`: "commlib: <why>" or
// "nccl: <why>" (tests assert the route; not part of NCCL's API).
NCCL_SHIM_API const char* commlibNcclCommRoute(ncclComm_t comm) {
  if (shim::check_comm(comm, "commlibNcclCommRoute") != ncclSuccess) return "invalid communicator";
  static thread_local std::string text;
  text = (comm->served ? "commlib: " : "nccl: ") + comm->route;
  return text.c_str();
}

// What the shim forwards to and serves, for `python -m commlib.nccl --check` (key=value lines).
NCCL_SHIM_API const char* commlibNcclShimInfo() {
  static const std::string text = shim::info_text();
  return text.c_str();
}
