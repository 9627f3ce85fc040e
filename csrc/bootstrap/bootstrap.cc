#include "bootstrap/bootstrap.hpp"

#include <algorithm>
#include <thread>

#include "commlib/errors.hpp"

namespace commlib {

std::string Bootstrap::key(const std::string& tag, int rank) const {
  return prefix_ + "/" + tag + "/" + std::to_string(rank);
}

std::vector<uint8_t> Bootstrap::wait_get(const std::string& tag, int rank) {
  const std::string k = key(tag, rank);
  const auto start = std::chrono::steady_clock::now();
  // The store's get() would wait with the store's own timeout: poll with check() instead.
  auto pause = std::chrono::microseconds(50);
  while (!store_.check(k)) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    COMMLIB_CHECK(waited < timeout_, Timeout, "Timed out after ", waited.count(), " ms (timeout ", timeout_.count(),
                  " ms): rank ", rank_, " waiting for rank ", rank, " at set-up phase '", tag, "'");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
  return store_.get(k);
}

std::vector<std::vector<uint8_t>> Bootstrap::all_gather(const std::string& tag, const std::vector<uint8_t>& mine) {
  store_.set(key(tag, rank_), mine);
  std::vector<std::vector<uint8_t>> all(world_size_);
  for (int r = 0; r < world_size_; ++r) {
    all[r] = r == rank_ ? mine : wait_get(tag, r);
  }
  return all;
}

std::vector<uint8_t> Bootstrap::broadcast(const std::string& tag, const std::vector<uint8_t>& value, int root) {
  if (rank_ == root) {
    store_.set(key(tag, root), value);
    return value;
  }
  return wait_get(tag, root);
}

void Bootstrap::barrier(const std::string& tag) { all_gather(tag, {}); }

}  // namespace commlib
