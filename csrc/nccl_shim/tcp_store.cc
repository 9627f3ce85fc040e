#include "nccl_shim/tcp_store.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <thread>

#include "commlib/errors.hpp"

namespace commlib::nccl_shim {
namespace {

enum Op : uint8_t { kSet = 0, kGet = 1, kAdd = 2, kCheck = 3, kErase = 4 };

// Wire format, both directions little-endian host order (one host family per job):
// request: op u8, key_len u32, value_len u32, arg i64 (get: wait ms; add: delta), key, value;
// reply: status u8 (0 done/found, 1 absent), value_len u32, value.
struct RequestHeader {
  uint8_t op;
  uint32_t key_len;
  uint32_t value_len;
  int64_t arg;
} __attribute__((packed));
struct ReplyHeader {
  uint8_t status;
  uint32_t value_len;
} __attribute__((packed));

bool write_all(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

bool read_all(int fd, void* data, size_t bytes) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

class Server {
 public:
  uint16_t port() const { return port_; }

  explicit Server() {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    COMMLIB_CHECK(listen_fd_ >= 0, Error, "nccl shim store: socket() failed: ", std::strerror(errno));
    const int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    const bool ok = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                    ::listen(listen_fd_, 128) == 0 &&
                    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    COMMLIB_CHECK(ok, Error, "nccl shim store: cannot listen on a TCP port: ", std::strerror(errno));
    port_ = ntohs(addr.sin_port);
    std::thread([this] { accept_loop(); }).detach();
  }

 private:
  void accept_loop() {
    for (;;) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // EMFILE and the like: retry later
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      std::thread([this, fd] { serve(fd); }).detach();
    }
  }

  void serve(int fd) {
    RequestHeader h{};
    std::string key;
    std::vector<uint8_t> value;
    while (read_all(fd, &h, sizeof(h))) {
      key.resize(h.key_len);
      value.resize(h.value_len);
      if (!read_all(fd, key.data(), key.size()) || !read_all(fd, value.data(), value.size())) break;
      uint8_t status = 0;
      std::vector<uint8_t> reply;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        switch (h.op) {
          case kSet:
            data_[key] = value;
            changed_.notify_all();
            break;
          case kGet: {
            const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(h.arg, 0));
            const bool found = changed_.wait_until(lock, until, [&] { return data_.count(key) != 0; });
            if (found) reply = data_[key];
            status = found ? 0 : 1;
            break;
          }
          case kAdd: {
            std::vector<uint8_t>& slot = data_[key];
            int64_t current = 0;
            if (slot.size() == sizeof(int64_t)) std::memcpy(&current, slot.data(), sizeof(current));
            current += h.arg;
            slot.resize(sizeof(current));
            std::memcpy(slot.data(), &current, sizeof(current));
            reply = slot;
            changed_.notify_all();
            break;
          }
          case kCheck:
            status = data_.count(key) != 0 ? 0 : 1;
            break;
          case kErase:
            status = data_.erase(key) != 0 ? 0 : 1;
            break;
          default:
            status = 2;
        }
      }
      const ReplyHeader r{status, static_cast<uint32_t>(reply.size())};
      if (!write_all(fd, &r, sizeof(r)) || !write_all(fd, reply.data(), reply.size())) break;
    }
    ::close(fd);
  }

  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::vector<uint8_t>> data_;
};

}  // namespace

std::string ipv4_name(uint32_t ipv4) {
  char text[INET_ADDRSTRLEN] = {};
  in_addr addr{};
  addr.s_addr = ipv4;
  ::inet_ntop(AF_INET, &addr, text, sizeof(text));
  return text;
}

uint16_t tcp_store_server_port() {
  // Never destroyed: its threads run until the process exits, and ranks of other processes may
  // still be reading from it while this one shuts down.
  static Server* server = new Server();
  return server->port();
}

TcpStore::TcpStore(uint32_t ipv4, uint16_t port, std::string space, std::chrono::milliseconds timeout)
    : space_(std::move(space)), address_(ipv4_name(ipv4) + ":" + std::to_string(port)), timeout_(timeout) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = ipv4;
  addr.sin_port = htons(port);
  const auto start = std::chrono::steady_clock::now();
  auto pause = std::chrono::milliseconds(1);
  std::string last_error;
  for (;;) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    COMMLIB_CHECK(fd_ >= 0, Error, "nccl shim store: socket() failed: ", std::strerror(errno));
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) break;
    last_error = std::strerror(errno);
    ::close(fd_);
    fd_ = -1;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    COMMLIB_CHECK(waited < timeout_, Timeout, "nccl shim store: no server at ", address_, " after ", waited.count(),
                  " ms (", last_error, "); the process that called ncclGetUniqueId must still run");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(200));
  }
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

uint8_t TcpStore::call(uint8_t op, const std::string& key, const std::vector<uint8_t>& value, int64_t arg,
                       std::vector<uint8_t>* reply) {
  const std::string full = space_ + "/" + key;
  std::lock_guard<std::mutex> lock(mutex_);
  const RequestHeader h{op, static_cast<uint32_t>(full.size()), static_cast<uint32_t>(value.size()), arg};
  ReplyHeader r{};
  const bool ok = write_all(fd_, &h, sizeof(h)) && write_all(fd_, full.data(), full.size()) &&
                  write_all(fd_, value.data(), value.size()) && read_all(fd_, &r, sizeof(r));
  COMMLIB_CHECK(ok, PeerError, "nccl shim store: connection to ", address_, " lost at key '", key,
                "' (the process that called ncclGetUniqueId exited?)");
  std::vector<uint8_t> data(r.value_len);
  COMMLIB_CHECK(read_all(fd_, data.data(), data.size()), PeerError, "nccl shim store: connection to ", address_,
                " lost at key '", key, "'");
  if (reply != nullptr) *reply = std::move(data);
  return r.status;
}

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) { call(kSet, key, value, 0, nullptr); }

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  std::vector<uint8_t> value;
  const uint8_t status = call(kGet, key, {}, timeout_.count(), &value);
  COMMLIB_CHECK(status == 0, Timeout, "nccl shim store: key '", key, "' not set within ", timeout_.count(), " ms at ",
                address_);
  return value;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::vector<uint8_t> value;
  call(kAdd, key, {}, delta, &value);
  int64_t result = 0;
  std::memcpy(&result, value.data(), std::min(value.size(), sizeof(result)));
  return result;
}

bool TcpStore::check(const std::string& key) { return call(kCheck, key, {}, 0, nullptr) == 0; }

void TcpStore::erase(const std::string& key) { call(kErase, key, {}, 0, nullptr); }

}  // namespace commlib::nccl_shim
