// CPU collectives over HostShm (Note [host shm protocol]); reduction per Note [reduction order].
//
// Note [host all_reduce memory floor]
// A 2-rank in-place all_reduce of 32 MiB fp32 is bound by each core's own memory parallelism, not
// by the algorithm. Measured on a 2-core AMD EPYC Zen 3 VM (bench/cpu_bandwidth.c and a producer /
// consumer ring between the two CPUs): the in-place update of 32 MiB takes 4.1 ms with one process
// or both; reading 32 MiB that the other core wrote moves at 13-29 GB/s (128 KiB chunks, ring depth
// 4: 12.6-15.3 GB/s; a flag round trip between the CPUs 108-117 ns), 1.2-2.6 ms more: 5.3-6.7 ms in
// all, which the tree's best runs reach. The tree touches the fewest bytes a staged 2-rank
// all_reduce can (per rank, MiB: copy-in R16 W16, reduce R16 + R16 W16 + W16, gather R16 W16).
// Tried and within the run-to-run spread or slower: other pipeline distances and ring depths,
// 64 / 256 KiB chunks, streaming stores in place, huge pages for the tensors. Cross-memory attach
// (process_vm_readv / process_vm_writev of the peer's half, no shared memory) is slower with the
// 4 KiB pages of a torch tensor: a 32 MiB copy takes 9.1-11.6 ms against memcpy's 5.9 ms, and a
// 2-rank all_reduce built on it 11.5-13.1 ms; with huge pages it only matches the tree.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "commlib/communicator.hpp"
#include "commlib/errors.hpp"
#include "core/algorithm_selector.hpp"
#include "core/plan.hpp"
#include "host/host_ops.hpp"
#include "host/reduce.hpp"
#include "transport/host_shm.hpp"

namespace commlib {
namespace {

constexpr size_t kSliceAlign = 64;  // bytes; keeps every rank's slice cache-line aligned

size_t align_down(size_t x, size_t a) { return x / a * a; }

void check_reducible(const char* what, DataType dtype, ReduceOp op) {
  COMMLIB_CHECK(host::supports(dtype, op), TypeMismatch, what, ": op ", reduce_op_name(op), " not supported on dtype ",
                dtype_name(dtype), "; avg needs a floating dtype (float32, float64, float16, bfloat16), band / bor / "
                "bxor an integer or bool one");
}

const uint8_t* byte_ptr(const void* p) { return static_cast<const uint8_t*>(p); }
uint8_t* byte_ptr(void* p) { return static_cast<uint8_t*>(p); }

// The pipelines rely on input == output or no shared byte (Note [host all_reduce out of place]).
void check_same_or_disjoint(const char* what, const void* input, const void* output, size_t bytes) {
  const auto in = reinterpret_cast<uintptr_t>(input), out = reinterpret_cast<uintptr_t>(output);
  COMMLIB_CHECK(in == out || bytes == 0 || in + bytes <= out || out + bytes <= in, InvalidArgument, what,
                ": output overlaps input partly (input ", input, ", output ", output, ", ", bytes,
                " bytes); supported: the same buffer (in place) or disjoint buffers");
}

}  // namespace

// Note [host all_reduce]
// Flat, message fits one slot: copy the input into a slot, one barrier, then every rank reduces
// straight into its output, reading its own values from its input and the peers' from their
// slots. One barrier and no trailing one (the slots are double-buffered, Note [host shm protocol]).
// Anything larger, and tree at every size, runs as a pipeline over cache-sized chunks (Note [host
// shm pipeline]): step t copies chunk t in, reduces chunk t-1 (whose peers' copies were published a
// step earlier, so the wait is usually already over) and, for tree, gathers chunk t-2. Chunks of
// the ring are reused every kRingDepth steps, so the shared memory that is written and read stays in
// cache and DRAM sees only the user's buffers: one read of the input and one write of the output
// per rank (the same buffer in place).
//   flat: each rank copies the whole chunk and reduces the whole chunk from every peer's copy.
//   tree: chunk slice r is rank r's. A rank copies only the other slices in; reduces its slice from
//         its input and the peers' copies, writing the result to its output and its ring slot;
//         then copies the other slices' results from their owners' ring slots (all-gather).
// Both add the ranks in the order of Note [reduction order], so they give the same bits.
//
// Note [host all_reduce out of place]
// Every path reads this rank's values only from `input` and writes results only to `output`, and
// within a chunk all reads of the input come before any write of the output: the one-round flat
// copies the input to its slot before reducing; the pipeline copies chunk t in (step t) before it
// reduces chunk t (step t + 1), tree reads its own slice of chunk t in that reduce before writing
// it, and the all-gather writes only the other slices, which this rank read in its copy-in. So in
// place (input == output) is the same schedule on one buffer, and out of place reads exactly the
// values in place would have read: the results are the same bits. A partial overlap would break
// that ordering across chunks and is rejected.
//
// Note [host slot rotation]
// Which rank writes which slot (or ring) rotates: in flat round k rank r writes the slot of rank
// (r + k / 2) mod n in buffer k mod 2, and pipeline step g writes ring (r + g / depth) mod n. For
// two ranks this makes the reader of a line its next writer: what rank 1 reads in round k, rank 1
// writes in round k + 2. Writing a line that the other core read last (and so holds) costs a
// cross-core invalidation per line, which was half the time of a 16-128 KiB all_reduce on the 2-core
// VM; writing a line that this core read last does not. Safety is unchanged: a round still touches
// only its own buffer, and a ring chunk is rewritten only after every peer released it.
namespace {

constexpr size_t kPipelineChunkBytes = 128 << 10;  // per step; a ring of these stays in L2
constexpr size_t kRingDepth = 4;                     // >= 3: a step's copy waits for gathers 3 steps back
// Out-of-place outputs at least this large are written with streaming stores (Note [host streaming
// stores]): the caller reads them only after they left the caches. On the 2-core VM this took the
// 2-rank out-of-place all_reduce from 11.2 to 9.2 ms (32 MiB) and 2.5 to 2.0 ms (8 MiB), min of 18.
constexpr size_t kStreamingMinBytes = 8 << 20;

struct AllReduceArgs {
  const char* what;
  OpTag tag;
  const uint8_t* input;  // this rank's values; may equal `output` (in place), never partly overlap it
  uint8_t* output;
  size_t count;
  size_t esize;
  DataType dtype;
  ReduceOp op;
  int rank;
  int world_size;
};

// Flat in one round: the message fits a slot (Note [host all_reduce]).
void all_reduce_one_round(HostShm& shm, const AllReduceArgs& a) {
  const int n = a.world_size;
  const uint64_t round = shm.next_round();
  const int buf = static_cast<int>(round & 1);
  // Rank r's data goes to slot (r + rotation) mod n (Note [host slot rotation]).
  const int rotation = static_cast<int>((round >> 1) % static_cast<uint64_t>(n));
  auto slot_of = [&](int r) { return shm.slot((r + rotation) % n, buf); };
  std::memcpy(slot_of(a.rank), a.input, a.count * a.esize);
  shm.barrier(a.what, "flat", a.tag);
  std::vector<const void*> srcs(n);
  for (int r = 0; r < n; ++r) srcs[r] = r == a.rank ? a.input : slot_of(r);
  host::reduce(a.output, srcs.data(), n, a.count, a.dtype, a.op, n);
}

// Flat or tree as a pipeline of chunk steps (Note [host all_reduce], Note [host shm pipeline]).
class PipelinedAllReduce {
 public:
  PipelinedAllReduce(HostShm& shm, const AllReduceArgs& args, Algorithm algo)
      : shm_(shm), a_(args), tree_(algo == Algorithm::kTree), srcs_(args.world_size) {
    const int n = a_.world_size;
    const size_t budget = std::min(kPipelineChunkBytes, shm.ring_bytes() / kRingDepth);
    slice_elems_ = std::max<size_t>(1, align_down(budget / n, kSliceAlign) / a_.esize);
    chunk_elems_ = slice_elems_ * n;
    num_steps_ = std::max<uint64_t>(1, (a_.count + chunk_elems_ - 1) / chunk_elems_);
    // In place, the output lines are in cache already (this rank read them): nothing to save.
    if (a_.output != a_.input && a_.count * a_.esize >= kStreamingMinBytes) out_mode_ = host::StoreMode::kStreaming;
  }

  void run() {
    shm_.next_buffer();  // keeps the ranks' round parity equal whichever path a mismatched call took
    shm_.barrier(a_.what, tree_ ? "tree start" : "flat start", a_.tag);
    first_ = shm_.reserve_steps(num_steps_);
    // Each phase publishes as early as possible: step t's copy-in is needed by the peers' next step.
    for (uint64_t t = 0; t < num_steps_ + (tree_ ? 2 : 1); ++t) {
      if (t < num_steps_) copy_in(t);
      if (t >= 1 && t - 1 < num_steps_) reduce(t - 1);
      if (tree_ && t >= 2) gather(t - 2);
    }
    if (out_mode_ == host::StoreMode::kStreaming) host::store_fence();
    // Every peer is done with the ring: the slots are free for the next collective.
    shm_.wait_peers(Progress::kReleased, first_ + num_steps_, a_.what, "finish");
  }

 private:
  // Where rank r writes step t (Note [host slot rotation]).
  uint8_t* ring_chunk(int r, uint64_t t) const {
    const uint64_t g = first_ + t;
    const int owner = static_cast<int>((r + g / kRingDepth) % static_cast<uint64_t>(a_.world_size));
    return shm_.ring(owner) + (g % kRingDepth) * chunk_elems_ * a_.esize;
  }
  size_t chunk_len(uint64_t t) const { return std::min(chunk_elems_, a_.count - t * chunk_elems_); }
  // Chunk t of the user's input and output (the same bytes in place, Note [host all_reduce out of place]).
  const uint8_t* input_chunk(uint64_t t) const { return a_.input + t * chunk_elems_ * a_.esize; }
  uint8_t* output_chunk(uint64_t t) const { return a_.output + t * chunk_elems_ * a_.esize; }
  // Tree: rank r's slice of a chunk of `len` elements is [slice_lo(len, r), slice_lo(len, r + 1)).
  size_t slice_lo(size_t len, int r) const { return std::min(len, slice_elems_ * r); }

  void copy_in(uint64_t t) {
    // The ring chunk was last used at step t - depth: wait until every peer has released it.
    if (first_ + t >= kRingDepth) shm_.wait_peers(Progress::kReleased, first_ + t + 1 - kRingDepth, a_.what, "copy-in");
    const size_t len = chunk_len(t), es = a_.esize;
    const uint8_t* in = input_chunk(t);
    uint8_t* ring = ring_chunk(a_.rank, t);
    if (!tree_) {
      std::memcpy(ring, in, len * es);
    } else {  // the peers need only their slices; this rank's own slice is read from the input
      const size_t lo = slice_lo(len, a_.rank), hi = slice_lo(len, a_.rank + 1);
      std::memcpy(ring, in, lo * es);
      std::memcpy(ring + hi * es, in + hi * es, (len - hi) * es);
    }
    shm_.publish(Progress::kCopied, first_ + t + 1);
  }

  void reduce(uint64_t t) {
    shm_.wait_peers(Progress::kCopied, first_ + t + 1, a_.what, tree_ ? "tree reduce-scatter" : "flat reduce");
    const size_t len = chunk_len(t), es = a_.esize;
    const size_t lo = tree_ ? slice_lo(len, a_.rank) : 0, hi = tree_ ? slice_lo(len, a_.rank + 1) : len;
    const uint8_t* own = input_chunk(t) + lo * es;
    uint8_t* out = output_chunk(t) + lo * es;
    for (int r = 0; r < a_.world_size; ++r) srcs_[r] = r == a_.rank ? own : ring_chunk(r, t) + lo * es;
    // Tree: the slice's owner hands the result to the peers' all-gather through its ring chunk,
    // written in the same pass as the output.
    uint8_t* handoff = tree_ ? ring_chunk(a_.rank, t) + lo * es : nullptr;
    host::reduce(out, srcs_.data(), a_.world_size, hi - lo, a_.dtype, a_.op, a_.world_size, out_mode_, handoff);
    shm_.publish(tree_ ? Progress::kReduced : Progress::kReleased, first_ + t + 1);
  }

  void gather(uint64_t t) {
    shm_.wait_peers(Progress::kReduced, first_ + t + 1, a_.what, "tree all-gather");
    const size_t len = chunk_len(t), es = a_.esize;
    uint8_t* out = output_chunk(t);
    for (int r = 0; r < a_.world_size; ++r) {
      if (r == a_.rank) continue;
      const size_t lo = slice_lo(len, r), hi = slice_lo(len, r + 1);
      host::copy(out + lo * es, ring_chunk(r, t) + lo * es, (hi - lo) * es, out_mode_);
    }
    shm_.publish(Progress::kReleased, first_ + t + 1);
  }

  HostShm& shm_;
  const AllReduceArgs a_;
  const bool tree_;
  std::vector<const void*> srcs_;
  size_t slice_elems_ = 0;  // tree: elements of each rank's slice of a chunk
  size_t chunk_elems_ = 0;  // elements per step (the last step may have fewer)
  uint64_t num_steps_ = 0;
  uint64_t first_ = 0;      // global index of step 0 (HostShm::reserve_steps)
  host::StoreMode out_mode_ = host::StoreMode::kCached;  // how results go to the output
};

}  // namespace

void Communicator::all_reduce_host(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                                   Algorithm algo) {
  const char* what = "all_reduce";
  check_reducible(what, dtype, op);
  const size_t esize = dtype_size(dtype);
  check_same_or_disjoint(what, input, output, count * esize);
  AllReduceShape shape;
  shape.bytes = count * esize;
  shape.dtype = dtype;
  shape.placement = Placement::kCpu;
  shape.requested = algo;
  // Note [plan]; an explicit algorithm does not read the configuration (nor a bad tune file).
  const Plan plan = plan_host_all_reduce(algo == Algorithm::kAuto ? &config() : nullptr, shape);
  algo = plan.variant == Variant::kHostTree ? Algorithm::kTree : Algorithm::kFlat;
  HostShm& shm = host();
  plan_executed(plan, rank_);
  const OpTag tag{static_cast<uint32_t>(algo == Algorithm::kFlat ? HostOp::kAllReduceFlat : HostOp::kAllReduceTree),
                  static_cast<uint32_t>(dtype), count, static_cast<uint64_t>(op)};
  const AllReduceArgs args{what, tag, byte_ptr(input), byte_ptr(output), count, esize, dtype, op, rank_, world_size_};
  // A 0-element call still takes a round, so mismatched calls are caught.
  if (algo == Algorithm::kFlat && count * esize <= shm.slot_bytes()) return all_reduce_one_round(shm, args);
  PipelinedAllReduce(shm, args, algo).run();
}

void Communicator::reduce_scatter_host(void* out, const void* in, size_t count, DataType dtype, ReduceOp op) {
  const char* what = "reduce_scatter";
  check_reducible(what, dtype, op);
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


}  // namespace commlib

namespace commlib::host {

void agree(Communicator& comm, const char* what, uint32_t kind, uint32_t dtype_code, uint64_t count, uint32_t reduction) {
  HostShm& shm = comm.host();
  shm.next_buffer();
  shm.barrier(what, "agree", OpTag{static_cast<uint32_t>(HostOp::kAgree), dtype_code, count,
                                   (static_cast<uint64_t>(kind) << 8) | reduction});
}

}  // namespace commlib::host

namespace commlib::host {

// Gather and scatter: rounds of one slot each (Note [host shm protocol]). In a gather every rank
// writes its own slot and the root reads them all; in a scatter the root writes every rank's slot
// of the round's buffer and each rank reads its own.
void gather(Communicator& comm, void* out, const void* in, size_t bytes, int root) {
  const char* what = "gather";
  const int n = comm.world_size(), rank = comm.rank();
  COMMLIB_CHECK(root >= 0 && root < n, InvalidArgument, what, ": dst ", root, " out of range; valid: 0..", n - 1);
  HostShm& shm = comm.host();
  const OpTag tag{static_cast<uint32_t>(HostOp::kGather), 0, bytes, static_cast<uint64_t>(root)};
  size_t offset = 0;
  do {
    const size_t len = std::min(shm.slot_bytes(), bytes - offset);
    const int buf = shm.next_buffer();
    std::memcpy(shm.slot(rank, buf), byte_ptr(in) + offset, len);
    shm.barrier(what, "gather", tag);
    if (rank == root) {
      for (int r = 0; r < n; ++r) std::memcpy(byte_ptr(out) + r * bytes + offset, shm.slot(r, buf), len);
    }
    offset += len;
  } while (offset < bytes);
}

void scatter(Communicator& comm, void* out, const void* in, size_t bytes, int root) {
  const char* what = "scatter";
  const int n = comm.world_size(), rank = comm.rank();
  COMMLIB_CHECK(root >= 0 && root < n, InvalidArgument, what, ": src ", root, " out of range; valid: 0..", n - 1);
  HostShm& shm = comm.host();
  const OpTag tag{static_cast<uint32_t>(HostOp::kScatter), 0, bytes, static_cast<uint64_t>(root)};
  size_t offset = 0;
  do {
    const size_t len = std::min(shm.slot_bytes(), bytes - offset);
    const int buf = shm.next_buffer();
    if (rank == root) {
      for (int r = 0; r < n; ++r) std::memcpy(shm.slot(r, buf), byte_ptr(in) + r * bytes + offset, len);
    }
    shm.barrier(what, "scatter", tag);
    std::memcpy(byte_ptr(out) + offset, shm.slot(rank, buf), len);
    offset += len;
  } while (offset < bytes);
}

}  // namespace commlib::host
