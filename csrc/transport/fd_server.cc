#include "transport/fd_server.hpp"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "commlib/errors.hpp"

namespace commlib {
namespace {

constexpr uint64_t kMagic = 0x636f6d6d6c666431ull;  // "commlfd1"

struct ReplyHeader {
  uint64_t magic;
  uint64_t num_bytes;
  uint64_t num_fds;
};

// Sends (kSend) or receives exactly `bytes` (the socket has its timeouts set); false on error or timeout.
enum class Direction { kSend, kReceive };
bool transfer_all(int s, void* data, size_t bytes, Direction direction) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = direction == Direction::kSend ? ::send(s, p, bytes, MSG_NOSIGNAL) : ::recv(s, p, bytes, MSG_WAITALL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return false;
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}
bool send_all(int s, const void* data, size_t bytes) {
  return transfer_all(s, const_cast<void*>(data), bytes, Direction::kSend);
}
bool recv_all(int s, void* data, size_t bytes) { return transfer_all(s, data, bytes, Direction::kReceive); }

// One message of up to FdServer::kMaxFdsPerMessage descriptors (and one byte), laid out as
// sendmsg / recvmsg take it.
struct FdBatch {
  char byte = 0;
  iovec iov{&byte, 1};
  std::vector<char> control;
  msghdr msg{};
  explicit FdBatch(size_t num_fds) : control(CMSG_SPACE(sizeof(int) * num_fds), 0) {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
  }
  FdBatch(const FdBatch&) = delete;  // msg points into the object itself
  FdBatch& operator=(const FdBatch&) = delete;
};

void set_timeouts(int s, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

}  // namespace

sockaddr_un abstract_socket_address(const std::string& name, socklen_t& len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(addr.sun_path) - 2);
  std::memcpy(addr.sun_path + 1, name.data(), n);
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return addr;
}

int create_memfd(size_t bytes, const char* name, const char* what) {
  const int fd = ::memfd_create(name, MFD_CLOEXEC);
  COMMLIB_CHECK(fd >= 0, Error, what, ": memfd_create failed: ", std::strerror(errno));
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(detail::concat(what, ": sizing a shared segment of ", bytes, " bytes failed: ", std::strerror(e)));
  }
  return fd;
}

void* map_fd(int fd, size_t bytes, const char* what) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  COMMLIB_CHECK(p != MAP_FAILED, Error, what, ": mapping ", bytes, " bytes of shared memory failed: ",
                std::strerror(errno));
  return p;
}

FdServer::FdServer(std::string name, Handler handler) : name_(std::move(name)), handler_(std::move(handler)) {
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  COMMLIB_CHECK(listen_fd_ >= 0, Error, "fd server: socket() failed: ", std::strerror(errno));
  socklen_t len = 0;
  sockaddr_un addr = abstract_socket_address(name_, len);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(listen_fd_, 64) != 0) {
    const int e = errno;
    ::close(listen_fd_);
    throw Error(detail::concat("fd server: listening on the abstract socket '", name_, "' failed: ", std::strerror(e)));
  }
  thread_ = std::thread([this] { serve(); });
}

FdServer::~FdServer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void FdServer::serve() {
  while (!stop_.load()) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    const int s = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (s < 0) continue;
    set_timeouts(s, std::chrono::seconds(10));
    answer(s);
    ::close(s);
  }
}

void FdServer::answer(int s) {
  uint64_t num_bytes = 0;
  if (!recv_all(s, &num_bytes, sizeof(num_bytes)) || num_bytes > (1u << 20)) return;
  std::vector<uint8_t> request(num_bytes);
  if (!recv_all(s, request.data(), request.size())) return;
  FdReply reply;
  try {
    reply = handler_(request);
  } catch (const std::exception& e) {
    // The handler's refusal reaches the client as its message (num_fds = ~0 marks an error).
    const std::string message = e.what();
    const ReplyHeader header{kMagic, message.size(), ~0ull};
    if (send_all(s, &header, sizeof(header))) send_all(s, message.data(), message.size());
    return;
  }
  const ReplyHeader header{kMagic, reply.bytes.size(), reply.fds.size()};
  if (!send_all(s, &header, sizeof(header)) || !send_all(s, reply.bytes.data(), reply.bytes.size())) return;
  for (size_t first = 0; first < reply.fds.size(); first += kMaxFdsPerMessage) {
    const size_t n = std::min(kMaxFdsPerMessage, reply.fds.size() - first);
    FdBatch batch(n);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&batch.msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * n);
    std::memcpy(CMSG_DATA(cmsg), reply.fds.data() + first, sizeof(int) * n);
    if (::sendmsg(s, &batch.msg, MSG_NOSIGNAL) != 1) return;
  }
}

FdReply fd_request(const std::string& name, const std::vector<uint8_t>& request, std::chrono::milliseconds timeout,
                   const std::string& what) {
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  COMMLIB_CHECK(s >= 0, Error, what, ": socket() failed: ", std::strerror(errno));
  set_timeouts(s, timeout);
  FdReply reply;
  auto fail = [&](const std::string& message) {
    for (int fd : reply.fds) ::close(fd);
    ::close(s);
    throw Timeout(detail::concat(what, ": ", message, " (socket '", name, "', timeout ", timeout.count(), " ms)"));
  };
  socklen_t len = 0;
  sockaddr_un addr = abstract_socket_address(name, len);
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    const int e = errno;
    ::close(s);
    throw PeerError(detail::concat(what, ": cannot reach the exporter's socket '", name, "': ", std::strerror(e),
                                   " (has that process exited, or is it on another host?)"));
  }
  const uint64_t num_bytes = request.size();
  if (!send_all(s, &num_bytes, sizeof(num_bytes)) || !send_all(s, request.data(), request.size())) {
    fail("sending the request failed");
  }
  ReplyHeader header{};
  if (!recv_all(s, &header, sizeof(header)) || header.magic != kMagic) fail("no reply");
  reply.bytes.resize(header.num_bytes);
  if (!recv_all(s, reply.bytes.data(), reply.bytes.size())) fail("the reply was cut short");
  if (header.num_fds == ~0ull) {
    ::close(s);
    throw PeerError(detail::concat(what, ": refused: ", std::string(reply.bytes.begin(), reply.bytes.end())));
  }
  while (reply.fds.size() < header.num_fds) {
    FdBatch batch(std::min<size_t>(FdServer::kMaxFdsPerMessage, header.num_fds - reply.fds.size()));
    if (::recvmsg(s, &batch.msg, MSG_CMSG_CLOEXEC) != 1) fail("receiving descriptors failed");
    cmsghdr* cmsg = CMSG_FIRSTHDR(&batch.msg);
    if (cmsg == nullptr || cmsg->cmsg_type != SCM_RIGHTS) fail("a descriptor message carried none");
    const size_t got = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const size_t old = reply.fds.size();
    reply.fds.resize(old + got);
    std::memcpy(reply.fds.data() + old, CMSG_DATA(cmsg), got * sizeof(int));
  }
  ::close(s);
  return reply;
}

}  // namespace commlib
