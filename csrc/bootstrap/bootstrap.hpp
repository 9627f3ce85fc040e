// Collective exchanges over the Store: used only at set-up (never on a hot path).
//
// Every wait is bounded by the timeout given here (the group's, not the store's own): a rank that
// never arrives raises Timeout ("Timed out after N ms: rank R waiting for rank P at set-up phase
// 'tag'") instead of waiting for the store's default.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "commlib/store.hpp"

namespace commlib {

class Bootstrap {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::seconds(300)};

  Bootstrap(Store& store, std::string prefix, int rank, int world_size,
            std::chrono::milliseconds timeout = kDefaultTimeout)
      : store_(store), prefix_(std::move(prefix)), rank_(rank), world_size_(world_size), timeout_(timeout) {}

  // Every rank contributes `mine`; returns all contributions in rank order. `tag` must be unique
  // per exchange within this prefix (the same on every rank).
  std::vector<std::vector<uint8_t>> all_gather(const std::string& tag, const std::vector<uint8_t>& mine);
  // Rank `root`'s value reaches every rank.
  std::vector<uint8_t> broadcast(const std::string& tag, const std::vector<uint8_t>& value, int root);
  void barrier(const std::string& tag);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& prefix() const { return prefix_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  std::string key(const std::string& tag, int rank) const;
  // Rank `rank`'s value of `tag`, waiting for it at most timeout_.
  std::vector<uint8_t> wait_get(const std::string& tag, int rank);
  Store& store_;
  std::string prefix_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
};

template <typename T>
std::vector<uint8_t> to_bytes(const T& value) {
  const auto* p = reinterpret_cast<const uint8_t*>(&value);
  return std::vector<uint8_t>(p, p + sizeof(T));
}

template <typename T>
T from_bytes(const std::vector<uint8_t>& bytes) {
  T value{};
  std::copy(bytes.begin(), bytes.begin() + std::min(bytes.size(), sizeof(T)), reinterpret_cast<uint8_t*>(&value));
  return value;
}

}  // namespace commlib
