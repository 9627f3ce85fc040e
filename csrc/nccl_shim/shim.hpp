// The NCCL shim: a libnccl.so.2 with commlib underneath (docs/nccl.md). A program that calls NCCL's
// C API (torch's ProcessGroupNCCL, vLLM's PyNcclCommunicator, nccl-tests) loads it in place of
// NCCL and gets commlib's GPU engine for the operations of Note [nccl shim routes]; every other
// call goes to the real NCCL, loaded by path beside it.
//
// Note [nccl shim forwarding]
// The shim exports every nccl* / pnccl* function of the nccl.h it was built against: those of
// csrc/nccl_shim/*.cc by hand, the rest generated from the header (gen_forwarders.py, run by
// CMake), each calling the real NCCL's function of the same name (real:: below, resolved with
// dlsym on first call). The real NCCL is opened by path, never by the name libnccl.so.2 (that
// finds the shim), with RTLD_LOCAL | RTLD_DEEPBIND so it binds to its own symbols and none of
// its symbols reach the program: $COMMLIB_NCCL_REAL, else the nvidia-nccl wheel's library beside
// the loaded torch, beside the shim's own package, or found at build time (real_nccl.cc).
// A shim communicator keeps a real NCCL communicator inside, created on the first forwarded call
// that needs one (that call is collective in NCCL, so every rank creates it at the same point); a
// forwarder passes the real one on, and wraps a real communicator it receives (split, shrink,
// grow) as a shim communicator that forwards everything. ncclCommSplit of a communicator of
// commlib's makes a commlib communicator again (over the parent's rendezvous), routed anew.
//
// Note [nccl shim unique id]
// ncclGetUniqueId starts this process's TcpStore server (tcp_store.hpp) and returns 128 bytes:
// a magic, the server's IPv4 address and port, a random nonce that names the id's key space, and
// the first kRealIdBytes of a real NCCL unique id when the real NCCL loads and its id's tail is
// zero (NCCL's id is a magic and a socket address: well under kRealIdBytes). ncclCommInitRank
// connects to the server and builds a commlib Communicator over it (named after the nonce), so no
// real NCCL is needed to form a communicator; the real communicator uses the embedded id, or one
// rank 0 makes and shares over the store when the id carries none. An id without the magic is a
// real NCCL's: the communicator is then the real NCCL's alone.
//
// Note [nccl shim routes]
// A communicator whose ranks are all on one host and reach each other's GPU memory (commlib's
// CudaComm p2p_ok) runs ncclAllReduce and ncclReduceScatter (sum / avg of float32, float16,
// bfloat16), ncclAllGather, ncclBroadcast / ncclBcast, ncclAlltoAll (non-overlapping buffers) and
// ncclSend / ncclRecv (a send to itself meets its receive as a copy) on commlib, whatever the size; anything else (other types
// and ops, ncclReduce, gather / scatter, windows, splits) goes to the real NCCL. Every rank decides
// alike: the route depends on the communicator (agreed at init) and the call's arguments.
// COMMLIB_NCCL_SERVE=0 sends everything to the real NCCL. Never NVLink multicast.
#pragma once

#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "commlib/communicator.hpp"
#include "commlib/errors.hpp"
#include "nccl_api.hpp"  // generated: COMMLIB_NCCL_HAS_<name>, real::<name>

#define NCCL_SHIM_API extern "C" __attribute__((visibility("default")))

namespace commlib::nccl_shim {

constexpr uint64_t kCommMagic = 0x636f6d6d6c69622bull;  // "commlib+"
constexpr size_t kRealIdBytes = 96;

// The 128 bytes of an ncclUniqueId made by the shim (Note [nccl shim unique id]).
struct ShimUniqueId {
  char magic[8];       // kIdMagic
  uint32_t ipv4;       // the store server, network byte order
  uint16_t port;       // network byte order
  uint16_t flags;      // kHasRealId
  uint64_t nonce;      // the id's key space in the store
  uint8_t real[kRealIdBytes];  // the real NCCL's id, first kRealIdBytes (its tail is zero)
  uint8_t reserved[8];
};
static_assert(sizeof(ShimUniqueId) == NCCL_UNIQUE_ID_BYTES, "a shim id is an ncclUniqueId");
constexpr char kIdMagic[8] = {'c', 'l', 'n', 'c', 'c', 'l', 'i', 'd'};
constexpr uint16_t kHasRealId = 1;

}  // namespace commlib::nccl_shim

// The shim's communicator: ncclComm_t points at one of these (nccl.h leaves the type opaque).
struct ncclComm {
  uint64_t magic = commlib::nccl_shim::kCommMagic;
  int rank = 0;
  int nranks = 0;
  int device = -1;
  // Null for a communicator of the real NCCL alone (shrink, grow, init-all, a foreign id).
  std::unique_ptr<commlib::Communicator> commlib;
  std::shared_ptr<commlib::Store> store;  // commlib's rendezvous, shared with the communicators split from it
  uint64_t num_splits = 0;                // ncclCommSplit calls so far (names the children alike on every rank)
  bool served = false;  // Note [nccl shim routes]
  std::string route;    // why (or why not), for --check and errors
  // The real NCCL's communicator (created lazily; Note [nccl shim forwarding]) and what creates it.
  std::mutex real_mutex;
  std::atomic<ncclComm_t> real{nullptr};
  bool has_real_id = false;
  ncclUniqueId real_id{};
  bool has_config = false;
  ncclConfig_t config{};
  std::string config_net_name, config_comm_name;  // config's strings, copied
  // Sends to and receives from this rank itself not yet matched (collectives.cc): served ones
  // meet as a copy, as NCCL's do inside a group.
  struct SelfMessage {
    void* buffer;
    size_t bytes;
    cudaStream_t stream;
  };
  std::deque<SelfMessage> self_sends, self_recvs;
};

namespace commlib::nccl_shim {

// ---- the real NCCL (real_nccl.cc) ----
struct RealNccl {
  void* handle = nullptr;
  std::string path;   // what was loaded
  std::string error;  // why nothing was, naming every path tried
  int version = 0;
};
// Loads the real NCCL on first call (Note [nccl shim forwarding]). Thread-safe; never throws.
const RealNccl& real_nccl();
// The real NCCL's `name`, or nullptr (not loaded, or no such function).
void* symbol(const char* name);
// ncclSystemError with a last error saying the real NCCL has no `name` (or none was loaded).
ncclResult_t missing(const char* name);

// ---- trampolines (trampolines.cc; the table is generated) ----
// What a trampoline does with its first argument: passes it on, or swaps a shim communicator for
// the real one inside it.
enum class FirstArg { kPlain, kComm };
struct TrampolineEntry {
  const char* name;
  FirstArg first_arg;
};
extern const TrampolineEntry kTrampolines[];
extern const size_t kNumTrampolines;

// ---- errors (errors.cc) ----
// Records `message` as the last error (ncclGetLastError) and returns `code`.
ncclResult_t fail(ncclResult_t code, const std::string& message);
// A real NCCL function's result (every real:: call passes through it): on failure the last
// error becomes the real NCCL's.
ncclResult_t forwarded(ncclResult_t result);
// The last error for ncclGetLastError(comm).
const char* last_error(ncclComm_t comm);
// Runs `body` (returning ncclResult_t), mapping commlib's exceptions: InvalidArgument and
// TypeMismatch to ncclInvalidArgument, Timeout and PeerError to ncclRemoteError, CudaError to
// ncclUnhandledCudaError, anything else to ncclInternalError; the message, prefixed with `what`,
// becomes the last error.
template <typename Body>
ncclResult_t guarded(const char* what, Body&& body);

// ---- communicators (nccl_comm.cc) ----
// ncclInvalidArgument unless `comm` is a live shim communicator.
ncclResult_t check_comm(ncclComm_t comm, const char* what);
enum class RealComm { kCreate, kExisting };
// The real communicator inside `comm`, created now for kCreate (collective: every rank makes the
// same forwarded call), or nullptr for kExisting when there is none yet. Opens the real NCCL's
// group when a shim group is open (group.cc).
ncclResult_t real_comm(ncclComm_t comm, const char* what, RealComm mode, ncclComm_t* out);
// A shim communicator around the real communicator `real` (nullptr stays nullptr); `parent`, a
// shim communicator or nullptr, lends its device.
ncclComm_t wrap_real(ncclComm_t real, ncclComm_t parent);

// ---- groups (group.cc) ----
// Whether a shim group (ncclGroupStart without its ncclGroupEnd) is open on this thread.
bool in_group();
// Makes the real NCCL's group match the shim's before a forwarded call (opened once per group).
void enter_real_group();
// `waiter` waits for what is enqueued on `signaller` so far: now (kNow), or for kGroupEnd at the
// group's end inside a group (so the sends and receives of a group progress together, as NCCL's
// do) and now outside one.
enum class JoinAt { kNow, kGroupEnd };
void join_streams(cudaStream_t waiter, cudaStream_t signaller, int device, JoinAt at);

template <typename Body>
ncclResult_t guarded(const char* what, Body&& body) {
  try {
    return body();
  } catch (const InvalidArgument& e) {
    return fail(ncclInvalidArgument, std::string(what) + ": " + e.what());
  } catch (const TypeMismatch& e) {
    return fail(ncclInvalidArgument, std::string(what) + ": " + e.what());
  } catch (const Timeout& e) {
    return fail(ncclRemoteError, std::string(what) + ": " + e.what());
  } catch (const PeerError& e) {
    return fail(ncclRemoteError, std::string(what) + ": " + e.what());
  } catch (const CudaError& e) {
    return fail(ncclUnhandledCudaError, std::string(what) + ": " + e.what());
  } catch (const std::exception& e) {
    return fail(ncclInternalError, std::string(what) + ": " + e.what());
  }
}

}  // namespace commlib::nccl_shim
