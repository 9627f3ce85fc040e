// CPU collectives over HostShm (Note [host shm protocol]); reduction per Note [reduction order].
#include <algorithm>
#include <cstring>

#include "commlib/communicator.hpp"
#include "commlib/env.hpp"
#include "commlib/errors.hpp"
#include "host/reduce.hpp"
#include "transport/host_shm.hpp"

namespace commlib {
namespace {

constexpr size_t kSliceAlign = 64;  // bytes; keeps every rank's slice cache-line aligned

size_t align_down(size_t x, size_t a) { return x / a * a; }

void check_reducible(const char* what, DataType dtype) {
  COMMLIB_CHECK(is_reducible(dtype), TypeMismatch, what, ": dtype ", dtype_name(dtype),
                " not supported; supported: float32, float16, bfloat16");
}

const uint8_t* byte_ptr(const void* p) { return static_cast<const uint8_t*>(p); }
uint8_t* byte_ptr(void* p) { return static_cast<uint8_t*>(p); }

}  // namespace

void Communicator::all_reduce_host(void* data, size_t count, DataType dtype, ReduceOp op, Algorithm algo) {
  const char* what = "all_reduce";
  check_reducible(what, dtype);
  const size_t esize = dtype_size(dtype);
  if (algo == Algorithm::kAuto) {
    algo = count * esize >= static_cast<size_t>(env::get_int("COMMLIB_HOST_TREE_THRESHOLD")) ? Algorithm::kTree
                                                                                              : Algorithm::kFlat;
  }
  COMMLIB_CHECK(algo == Algorithm::kFlat || algo == Algorithm::kTree, InvalidArgument, what, ": algo ",
                algorithm_name(algo), " not supported for CPU tensors; supported: auto, flat, tree");
  HostShm& shm = host();
  const int n = world_size_;
  const size_t chunk_elems = shm.slot_bytes() / esize;
  const OpTag tag{static_cast<uint32_t>(algo == Algorithm::kFlat ? HostOp::kAllReduceFlat : HostOp::kAllReduceTree),
                  static_cast<uint32_t>(dtype), count, static_cast<uint64_t>(op)};
  std::vector<const void*> srcs(n);
  size_t offset = 0;
  do {  // one round per chunk; a 0-element call still takes one round so mismatches are caught
    const size_t len = std::min(chunk_elems, count - offset);
    uint8_t* user = byte_ptr(data) + offset * esize;
    const int buf = shm.next_buffer();
    uint8_t* mine = shm.slot(rank_, buf);
    if (algo == Algorithm::kFlat) {
      std::memcpy(mine, user, len * esize);
      shm.barrier(what, "flat", tag);
      for (int r = 0; r < n; ++r) srcs[r] = shm.slot(r, buf);
      host::reduce(user, srcs.data(), n, len, dtype, op, n);
    } else {
      // Slice r of every slot is reduced by rank r into its own slot, then gathered by all. A rank
      // reads its own slice straight from the user buffer, so only the peers' slices are copied in.
      const size_t elems_per_line = kSliceAlign / esize;
      const size_t slice = align_down((len + n - 1) / n + elems_per_line - 1, elems_per_line);  // rounded up
      auto slice_begin = [&](int r) { return std::min(len, slice * r); };
      const size_t lo = slice_begin(rank_), hi = slice_begin(rank_ + 1);
      std::memcpy(mine, user, lo * esize);
      std::memcpy(mine + hi * esize, user + hi * esize, (len - hi) * esize);
      shm.barrier(what, "tree reduce-scatter", tag);
      for (int r = 0; r < n; ++r) srcs[r] = r == rank_ ? user + lo * esize : shm.slot(r, buf) + lo * esize;
      host::reduce(mine + lo * esize, srcs.data(), n, hi - lo, dtype, op, n);
      shm.barrier(what, "tree all-gather", tag);
      for (int r = 0; r < n; ++r) {
        const size_t a = slice_begin(r), b = slice_begin(r + 1);
        std::memcpy(user + a * esize, shm.slot(r, buf) + a * esize, (b - a) * esize);
      }
    }
    offset += len;
  } while (offset < count);
}

void Communicator::reduce_scatter_host(void* out, const void* in, size_t count, DataType dtype, ReduceOp op) {
  const char* what = "reduce_scatter";
  check_reducible(what, dtype);
  HostShm& shm = host();
  const int n = world_size_;
  const size_t esize = dtype_size(dtype);
  // Each slot holds n blocks of up to `block` elements: block d is this rank's data for rank d.
  const size_t block = align_down(shm.slot_bytes() / n, kSliceAlign) / esize;
  const OpTag tag{static_cast<uint32_t>(HostOp::kReduceScatter), static_cast<uint32_t>(dtype), count,
                  static_cast<uint64_t>(op)};
  std::vector<const void*> srcs(n);
  size_t offset = 0;
  do {
    const size_t len = std::min(block, count - offset);
    const int buf = shm.next_buffer();
    uint8_t* mine = shm.slot(rank_, buf);
    for (int d = 0; d < n; ++d) {
      std::memcpy(mine + d * block * esize, byte_ptr(in) + (d * count + offset) * esize, len * esize);
    }
    shm.barrier(what, "reduce", tag);
    for (int r = 0; r < n; ++r) srcs[r] = shm.slot(r, buf) + rank_ * block * esize;
    host::reduce(byte_ptr(out) + offset * esize, srcs.data(), n, len, dtype, op, n);
    offset += len;
  } while (offset < count);
}

void Communicator::all_gather_host(void* out, const void* in, size_t bytes) {
  const char* what = "all_gather";
  HostShm& shm = host();
  const OpTag tag{static_cast<uint32_t>(HostOp::kAllGather), 0, bytes, 0};
  size_t offset = 0;
  do {
    const size_t len = std::min(shm.slot_bytes(), bytes - offset);
    const int buf = shm.next_buffer();
    std::memcpy(shm.slot(rank_, buf), byte_ptr(in) + offset, len);
    shm.barrier(what, "gather", tag);
    for (int r = 0; r < world_size_; ++r) {
      std::memcpy(byte_ptr(out) + r * bytes + offset, shm.slot(r, buf), len);
    }
    offset += len;
  } while (offset < bytes);
}

void Communicator::broadcast_host(void* data, size_t bytes, int root) {
  const char* what = "broadcast";
  COMMLIB_CHECK(root >= 0 && root < world_size_, InvalidArgument, what, ": src ", root,
                " out of range; valid: 0..", world_size_ - 1);
  HostShm& shm = host();
  const OpTag tag{static_cast<uint32_t>(HostOp::kBroadcast), 0, bytes, static_cast<uint64_t>(root)};
  size_t offset = 0;
  do {
    const size_t len = std::min(shm.slot_bytes(), bytes - offset);
    const int buf = shm.next_buffer();
    if (rank_ == root) std::memcpy(shm.slot(rank_, buf), byte_ptr(data) + offset, len);
    shm.barrier(what, "copy", tag);
    if (rank_ != root) std::memcpy(byte_ptr(data) + offset, shm.slot(root, buf), len);
    offset += len;
  } while (offset < bytes);
}

void Communicator::all_to_all_v_host(void* out, const void* in, const std::vector<size_t>& in_bytes,
                                     const std::vector<size_t>& out_bytes) {
  const char* what = "all_to_all";
  const int n = world_size_;
  COMMLIB_CHECK(static_cast<int>(in_bytes.size()) == n && static_cast<int>(out_bytes.size()) == n, InvalidArgument,
                what, ": split lists must have world_size (", n, ") entries; got ", in_bytes.size(), " and ",
                out_bytes.size());
  HostShm& shm = host();
  COMMLIB_CHECK(shm.slot_bytes() >= 2 * n * sizeof(uint64_t), Error, what, ": shm slot too small");
  // Round 0: every rank publishes its send and receive sizes, so every rank can check every pair
  // and agree on the number of data rounds.
  const OpTag meta_tag{static_cast<uint32_t>(HostOp::kAllToAllV), 0, 0, 0};
  int buf = shm.next_buffer();
  auto* sizes = reinterpret_cast<uint64_t*>(shm.slot(rank_, buf));
  for (int r = 0; r < n; ++r) {
    sizes[r] = in_bytes[r];
    sizes[n + r] = out_bytes[r];
  }
  shm.barrier(what, "exchange sizes", meta_tag);
  uint64_t max_block = 0;
  for (int q = 0; q < n; ++q) {
    const auto* theirs = reinterpret_cast<const uint64_t*>(shm.slot(q, buf));
    for (int r = 0; r < n; ++r) {
      const uint64_t sent = theirs[r];
      const uint64_t expected = reinterpret_cast<const uint64_t*>(shm.slot(r, buf))[n + q];
      COMMLIB_CHECK(sent == expected, InvalidArgument, what, ": rank ", q, " sends ", sent, " bytes to rank ", r,
                    " but rank ", r, " expects ", expected, " bytes from rank ", q,
                    " (output_split_sizes must match the peers' input_split_sizes)");
      max_block = std::max(max_block, sent);
    }
  }
  std::vector<size_t> in_off(n + 1, 0), out_off(n + 1, 0);
  for (int r = 0; r < n; ++r) {
    in_off[r + 1] = in_off[r] + in_bytes[r];
    out_off[r + 1] = out_off[r] + out_bytes[r];
  }
  const size_t sub = align_down(shm.slot_bytes() / n, kSliceAlign);
  const uint64_t num_rounds = (max_block + sub - 1) / sub;
  const OpTag tag{static_cast<uint32_t>(HostOp::kAllToAllV), 1, max_block, 0};
  for (uint64_t t = 0; t < num_rounds; ++t) {
    const size_t pos = t * sub;
    buf = shm.next_buffer();
    uint8_t* mine = shm.slot(rank_, buf);
    for (int r = 0; r < n; ++r) {
      if (pos < in_bytes[r]) {
        std::memcpy(mine + r * sub, byte_ptr(in) + in_off[r] + pos, std::min(sub, in_bytes[r] - pos));
      }
    }
    shm.barrier(what, "exchange data", tag);
    for (int q = 0; q < n; ++q) {
      if (pos < out_bytes[q]) {
        std::memcpy(byte_ptr(out) + out_off[q] + pos, shm.slot(q, buf) + rank_ * sub,
                    std::min(sub, out_bytes[q] - pos));
      }
    }
  }
}

void Communicator::barrier_host() {
  HostShm& shm = host();
  shm.next_buffer();
  shm.barrier("barrier", "barrier", OpTag{static_cast<uint32_t>(HostOp::kBarrier), 0, 0, 0});
}

}  // namespace commlib
