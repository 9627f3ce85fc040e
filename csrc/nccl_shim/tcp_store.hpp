// TcpStore: the shim's own rendezvous (Note [nccl shim unique id] in nccl_shim/shim.hpp), so ranks
// form a commlib Communicator from an ncclUniqueId with no torch, no c10d store and no real NCCL.
//
// One server per process, started by the first ncclGetUniqueId and kept for the process's life: a
// thread that accepts connections and a thread per connection, over one in-memory map. Each
// unique id names a key space (its nonce), so ids of one process never meet. Clients are
// commlib::Stores over one TCP connection each; every call is a request and its reply (get waits
// on the server, bounded by the client's timeout). Set-up traffic only: never on a hot path.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "commlib/store.hpp"

namespace commlib::nccl_shim {

// Starts this process's server on first call (every interface, an ephemeral port) and returns its
// port. Throws commlib::Error when no socket can be opened. Thread-safe.
uint16_t tcp_store_server_port();

class TcpStore final : public Store {
 public:
  // Connects to the server at ipv4:port (network byte order), retrying until `timeout`; `space`
  // prefixes every key. Throws Timeout naming the address when no server answers in time.
  TcpStore(uint32_t ipv4, uint16_t port, std::string space, std::chrono::milliseconds timeout);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  void erase(const std::string& key) override;

 private:
  // One request and its reply; returns the reply's status (0: done or found, 1: absent).
  uint8_t call(uint8_t op, const std::string& key, const std::vector<uint8_t>& value, int64_t arg,
               std::vector<uint8_t>* reply);

  int fd_ = -1;
  std::string space_;
  std::string address_;  // "a.b.c.d:port", for messages
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;  // one request at a time on the connection
};

// "a.b.c.d" of an IPv4 address in network byte order.
std::string ipv4_name(uint32_t ipv4);

}  // namespace commlib::nccl_shim
