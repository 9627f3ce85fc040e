// The rendezvous interface commlib needs from its host: a key-value store shared by the ranks
// of a group. The torch layer adapts c10d::Store to it; tests may use an in-memory one.
// All calls are collective-free (any rank may call any of them at any time).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace commlib {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until `key` exists or the store's timeout expires (then throws Timeout).
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual bool check(const std::string& key) = 0;
  virtual void erase(const std::string& key) = 0;
};

}  // namespace commlib
