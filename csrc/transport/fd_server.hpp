// Memory shared with processes that are not members of one's communicator (the KV agents of
// csrc/core/kv_agent.hpp): anonymous memfd segments and file descriptors handed over a
// Unix-domain socket.
//
// Note [fd server]
// An exporter that does not know when (or whether) its peers will ask for its memory cannot
// exchange descriptors collectively, as CudaIpc does within a communicator. It runs an FdServer:
// a listening abstract-namespace socket (nothing on the file system, gone when the process is)
// and one thread that accepts a connection, reads one request, asks the owner's handler for the
// reply (bytes and descriptors), sends it (SCM_RIGHTS, at most kMaxFdsPerMessage descriptors a
// message, in order) and closes the connection. The descriptors stay open in the exporter; the
// receiver gets its own copies. A peer that exits holds nothing: a memfd or a cuMem handle lives
// as long as some process maps it, and no name is left in /dev/shm even if a process is killed.
// fd_request() bounds every step by a timeout (Timeout naming the socket and the step).
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace commlib {

// The address of the abstract-namespace Unix socket `name` (sun_path[0] == '\0': nothing on the
// file system, gone with the process); `len` receives its length. Also CudaIpc's sockets.
sockaddr_un abstract_socket_address(const std::string& name, socklen_t& len);

// A new anonymous shared-memory segment of `bytes` (memfd, zero-filled); returns its descriptor.
// `what` names the caller in errors.
int create_memfd(size_t bytes, const char* name, const char* what);
// Maps `bytes` of `fd` shared, read-write; throws Error naming `what`.
void* map_fd(int fd, size_t bytes, const char* what);

struct FdReply {
  std::vector<uint8_t> bytes;
  std::vector<int> fds;  // the server keeps its own; the receiver's copies are its to close
};

class FdServer {
 public:
  static constexpr size_t kMaxFdsPerMessage = 64;
  using Handler = std::function<FdReply(const std::vector<uint8_t>& request)>;

  // Listens on the abstract socket `name` (unique per exporter) and starts the thread.
  FdServer(std::string name, Handler handler);
  ~FdServer();  // stops the thread (within ~100 ms) and closes the socket
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;
  const std::string& name() const { return name_; }

 private:
  void serve();
  void answer(int connection);

  std::string name_;
  Handler handler_;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Sends `request` to the FdServer listening on `name` and returns its reply. Timeout after
// `timeout`; Error when nobody listens (naming `what`, e.g. the peer it was looking for).
FdReply fd_request(const std::string& name, const std::vector<uint8_t>& request, std::chrono::milliseconds timeout,
                   const std::string& what);

}  // namespace commlib
