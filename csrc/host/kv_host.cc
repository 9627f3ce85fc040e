#include "host/kv_host.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

#include "commlib/errors.hpp"
#include "transport/fd_server.hpp"

namespace commlib {
namespace {

struct HostAllocation {
  size_t bytes;
  int fd;
};

std::mutex& allocations_mutex() {
  static std::mutex m;
  return m;
}

std::map<uintptr_t, HostAllocation>& allocations() {
  static std::map<uintptr_t, HostAllocation> a;
  return a;
}

class HostKvEngine final : public KvEngine {
 public:
  ~HostKvEngine() override {
    for (const auto& [base, bytes] : imports_) ::munmap(reinterpret_cast<void*>(base), bytes);
  }
  const char* device_type() const override { return "cpu"; }
  int device() const override { return -1; }

  KvRegion export_region(uint64_t ptr, uint64_t bytes, const char* what) override {
    std::lock_guard<std::mutex> lock(allocations_mutex());
    auto& all = allocations();
    auto it = all.upper_bound(static_cast<uintptr_t>(ptr));
    if (it != all.begin()) {
      --it;
      if (ptr + bytes <= it->first + it->second.bytes) {
        KvRegion r;
        r.kind = KvRegion::Kind::kHostMemfd;
        r.bytes = it->second.bytes;
        r.base = it->first;
        r.fd = it->second.fd;
        return r;
      }
    }
    throw InvalidArgument(detail::concat(
        what, ": a receiving agent's CPU cache must lie in memory from commlib.kv.host_empty() (a peer process "
              "maps it); the plane at 0x",
        std::hex, ptr, std::dec, " (", bytes, " bytes) does not"));
  }

  uint64_t import_region(const KvRegion& region, int fd, const char* what) override {
    COMMLIB_CHECK(region.kind == KvRegion::Kind::kHostMemfd && fd >= 0, PeerError, what,
                  ": the peer's CPU cache region has no shared-memory descriptor");
    void* p = map_fd(fd, region.bytes, what);
    imports_.emplace_back(reinterpret_cast<uint64_t>(p), region.bytes);
    return reinterpret_cast<uint64_t>(p);
  }

  uint32_t* map_flags(void* host, size_t, const char*) override { return static_cast<uint32_t*>(host); }

  const uint64_t* upload_table(const std::vector<uint64_t>& values, const char*) override {
    tables_.push_back(values);
    return tables_.back().data();
  }

  KvStagedBlocks stage_blocks(const int32_t* src, size_t num_src, const int32_t* dst, size_t num_dst, void*,
                              const char*) override {
    const uint64_t token = next_token_++;
    auto& s = staged_[token];
    s.first.assign(src, src + num_src);
    s.second.assign(dst, dst + num_dst);
    return {s.first.data(), s.second.data(), token};
  }

  void release_blocks(const KvStagedBlocks& blocks, void*) override { staged_.erase(blocks.token); }

  void copy(kernels::KvCopyParams& params, void*, const char*) override { kv_copy_host(params); }

 private:
  std::vector<std::pair<uint64_t, size_t>> imports_;
  std::deque<std::vector<uint64_t>> tables_;  // deque: addresses stay valid as it grows
  std::map<uint64_t, std::pair<std::vector<int32_t>, std::vector<int32_t>>> staged_;
  uint64_t next_token_ = 1;
};

}  // namespace

void* kv_host_allocate(size_t bytes) {
  const char* what = "commlib.kv.host_empty";
  COMMLIB_CHECK(bytes > 0, InvalidArgument, what, ": 0 bytes; must be > 0");
  const int fd = create_memfd(bytes, "commlib-kv-cache", what);
  void* p = nullptr;
  try {
    p = map_fd(fd, bytes, what);
  } catch (...) {
    ::close(fd);
    throw;
  }
  std::lock_guard<std::mutex> lock(allocations_mutex());
  allocations()[reinterpret_cast<uintptr_t>(p)] = {bytes, fd};
  return p;
}

void kv_host_free(void* ptr) {
  HostAllocation a{};
  {
    std::lock_guard<std::mutex> lock(allocations_mutex());
    auto it = allocations().find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations().end()) return;
    a = it->second;
    allocations().erase(it);
  }
  ::munmap(ptr, a.bytes);
  ::close(a.fd);
}

std::unique_ptr<KvEngine> make_host_kv_engine() { return std::make_unique<HostKvEngine>(); }

void kv_copy_host(const kernels::KvCopyParams& p) {
  const int64_t bd = p.dst.block_size;
  const bool head_major = p.dst.head_stride > p.dst.token_stride;
  for (int li = 0; li < p.num_layers; ++li) {
    const int layer = p.layer_begin + li;
    for (int j = 0; j < p.num_dests; ++j) {
      for (int plane = 0; plane < p.num_planes; ++plane) {
        const char* src_plane = reinterpret_cast<const char*>(p.src_planes[layer * p.num_planes + plane]);
        char* dst_plane = reinterpret_cast<char*>(
            p.dst_planes[(static_cast<int64_t>(j) * p.num_layers_total + layer) * p.num_planes + plane]);
        for (int64_t k = 0; k < p.num_dst_blocks; ++k) {
          char* dst_block = dst_plane + static_cast<int64_t>(p.dst_blocks[k]) * p.dst.block_stride;
          const int64_t tokens = std::min<int64_t>(bd, p.num_tokens - k * bd);
          // Rows in the destination's order, as the kernel writes them.
          const int64_t outer_n = head_major ? p.num_heads : tokens;
          const int64_t inner_n = head_major ? tokens : p.num_heads;
          for (int64_t outer = 0; outer < outer_n; ++outer) {
            for (int64_t inner = 0; inner < inner_n; ++inner) {
              const int64_t t = head_major ? inner : outer;
              const int64_t h = head_major ? outer : inner;
              const int64_t i = k * bd + t;
              const char* s = src_plane + static_cast<int64_t>(p.src_blocks[i / p.src.block_size]) * p.src.block_stride +
                              (i % p.src.block_size) * p.src.token_stride + (p.src_head0[j] + h) * p.src.head_stride;
              char* d = dst_block + t * p.dst.token_stride + (p.dst_head0[j] + h) * p.dst.head_stride;
              std::memcpy(d, s, static_cast<size_t>(p.row_bytes));
            }
          }
        }
      }
    }
    // The layer's rows are visible to a receiver that reads its flag with acquire.
    for (int j = 0; j < p.num_dests; ++j) {
      std::atomic_ref<uint32_t>(p.flags[j][layer]).store(p.flag_value[j], std::memory_order_release);
    }
  }
}

}  // namespace commlib
