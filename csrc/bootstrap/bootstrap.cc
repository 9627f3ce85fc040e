#include "bootstrap/bootstrap.hpp"

#include <algorithm>

namespace commlib {

std::string Bootstrap::key(const std::string& tag, int rank) const {
  return prefix_ + "/" + tag + "/" + std::to_string(rank);
}

std::vector<std::vector<uint8_t>> Bootstrap::all_gather(const std::string& tag, const std::vector<uint8_t>& mine) {
  store_.set(key(tag, rank_), mine);
  std::vector<std::vector<uint8_t>> all(world_size_);
  for (int r = 0; r < world_size_; ++r) {
    all[r] = r == rank_ ? mine : store_.get(key(tag, r));
  }
  return all;
}

std::vector<uint8_t> Bootstrap::broadcast(const std::string& tag, const std::vector<uint8_t>& value, int root) {
  if (rank_ == root) {
    store_.set(key(tag, root), value);
    return value;
  }
  return store_.get(key(tag, root));
}

void Bootstrap::barrier(const std::string& tag) { all_gather(tag, {}); }

}  // namespace commlib
