// Two-shot ("tree") all-reduce: reduce-scatter then all-gather, both by direct peer access.
//
// Note [tree all-reduce]
// The message (or one chunk of it) is cut into `world` slices; rank q reduces slice q. Block b
// owns part b of every slice on every rank (packs [b * per_block, (b + 1) * per_block) of the
// slice), so it only ever meets block b of the peers (Note [flag barrier]). Every byte that
// crosses NVLink is a store (posted: no round trip on the critical path), except in the
// zero-copy reduce, which has to read the peers' tensors; those loads are batched (several
// packs from every rank in flight per thread before the first add).
//
// kSymmetricInput (zero-copy: the tensor lies in symmetric memory and is reduced in place; one
// call):
//   barrier kInputsReady   every rank's tensor holds its input
//   reduce                 part b of slice `rank`: loaded from every rank's tensor, reduced in
//                          rank order, stored into every rank's tensor (own one included)
//   barrier kPeersDone     the peers' reduced slices have landed here and nobody reads this
//                          tensor any more, so the caller may overwrite it
//   Only rank q touches slice q of any tensor, and each thread loads a pack before storing it.
//
// kWorkspace (copy-in from a user tensor): the message runs as chunks of at most one workspace
// half; chunk c is call `call + c` of this launch and uses half (call + c) & 1 (Note [tree slots]):
//   push                   part b of every other slice q of the input into rank q's RS slot for
//                          this rank
//   (copy-out of chunk c - 1, see below: it overlaps this chunk's NVLink stores)
//   barrier kInputsReady
//   reduce                 part b of slice `rank`: own values from the input, the peers' from this
//                          rank's RS slots; stored to the output and into every peer's AG slot
//                          `rank`
//   barrier kSlicesReduced
//   copy-out               part b of every other slice q: this rank's AG slot q -> the output
//   No trailing barrier: halves alternate. Within the launch, block b's barriers of chunk c only
//   say that block b of every peer finished its part of chunk c - 1; that suffices because block
//   b's workspace positions are the same in every chunk (fixed slot stride and per_block):
//   - pushing chunk c overwrites RS slots the peer reduced from in chunk c - 2, before the peer's
//     barrier kSlicesReduced of chunk c - 2, which this block has passed;
//   - the AG slots copied out for chunk c - 1 are next written by the peers in chunk c + 1, after
//     barrier kInputsReady of chunk c + 1, which this block reaches only after that copy-out.
//
// Note [tree barriers]
// Every barrier is Note [flag barrier]'s: release arrival, acquire wait, system scope. One
// exception: the zero-copy kernel's kInputsReady publishes no write of this kernel (it is the kernel's first
// step), only the tensor that earlier work on this GPU wrote into this GPU's own memory. That work
// finished before this kernel started (stream order, or the caller's event for another stream), so
// its writes are in this GPU's L2, which is where the peers' NVLink loads of this tensor are
// served; the arrival is a relaxed store, without the block-wide sync and the system-scope fence
// of a release (torch's in-place two-shot arrives the same way). The wait still acquires. The
// copy-in kernel's barriers publish its own NVLink stores, so they always release.
#include <algorithm>
#include <type_traits>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "kernels/all_reduce_common.cuh"

namespace commlib::kernels {
namespace {

// Note [tree geometry]
// Built-in launch geometry (TreeLaunchConfig's zero fields; COMMLIB_TREE_* replace each part):
// blocks = ceil(slice packs / min packs per block), capped at the max blocks; each block owns
// per_block packs of every slice (whole 512-byte spans), threads = per_block rounded up to a warp,
// capped at the threads per block. A constant, not the device's SM count, so every rank picks the
// same grid (block b must meet block b). The kernel is compiled for up to kTreeMaxThreads threads
// (128 registers per thread), whatever the cap, so one binary serves every geometry.
// The defaults are the best of a sweep on 2x H200 (docs/gpu-allreduce.md, Knobs):
// 256-thread blocks of at least 256 packs, up to one block per SM (132), were as fast as or faster
// than 512 x 512 / 128 blocks at 256 KiB - 16 MiB with a copy-in (8.3 vs 9.1 µs at 256 KiB).
constexpr int kTreeThreads = 512;  // the most threads per block (the kernels' launch bounds)
constexpr int kTreeDefaultThreads = 256;
// Fewer packs per block than this and a block's barriers cost more than its share of the data.
constexpr size_t kTreeMinPacksPerBlock = 256;
// Default grid cap: one block per SM of an H100/H200 (132 SMs).
constexpr int kTreeMaxBlocks = 132;
static_assert(kTreeDefaultThreads <= kTreeThreads && kTreeThreads <= kTreeMaxThreads);
// Packs per thread in flight in copies (one load each before the first store). With nvcc 13.0, 8
// leaves the generic-world bf16/fp16 copy-in kernels without the spills 4 had.
constexpr int kCopyUnroll = 8;

// Packs per thread reduced per iteration (all ranks' values loaded before the first add): as many
// as fit the 128 registers that 512-thread blocks allow without spilling in the world-2/4/8 kernels
// (4 at world 2, 2 at world 4 spill 8-100 bytes in the copy-in kernels: ptxas, nvcc 13.0).
constexpr int reduce_unroll(int world_size) { return world_size == 2 ? 2 : 1; }

// Note [tree slots]
// Each workspace half holds slots of `slot_packs` packs (the slice of a full chunk; the same in
// every chunk). In rank q's half:
//   AG slot of rank s (s != q): rank s's reduced slice s   -> slot s
//   RS slot of sender s (s != q), i = (s - q) mod world:   -> slot q if i == 1, else world + i - 2
// i.e. the RS slot of the next rank reuses the slot no AG data needs: world slots for world <= 2,
// 2 * world - 2 beyond.
constexpr size_t tree_num_slots(size_t world) { return world <= 2 ? world : 2 * world - 2; }

__device__ __forceinline__ int rs_slot(int owner, int sender, int world) {
  const int i = sender >= owner ? sender - owner : sender - owner + world;
  return i == 1 ? owner : world + i - 2;
}

// Chosen by the launcher; the same for every chunk.
struct TreeGeometry {
  size_t half_bytes = 0;   // kWorkspace: bytes of one workspace half
  size_t chunk_count = 0;  // elements per chunk (whole packs); kSymmetricInput: the whole message
  size_t slot_packs = 0;   // kWorkspace: packs per slot, >= every chunk's slice
  size_t per_block = 0;    // packs of each slice that one block owns
  uint64_t num_chunks = 1;
};

struct Range {
  size_t begin, end;
};

// One chunk of the message: its slices are `slice_packs` packs (the last one shorter or empty).
template <typename T>
struct Chunk {
  const T* in;
  T* out;
  size_t count;  // elements
  size_t num_packs;
  size_t slice_packs;
};

template <typename T>
__device__ __forceinline__ Chunk<T> chunk_at(const T* in, T* out, size_t total, size_t first, size_t chunk_count,
                                             int world) {
  constexpr int N = Pack<T>::kNumElems;
  Chunk<T> c;
  c.in = in + first;
  c.out = out + first;
  c.count = min(chunk_count, total - first);
  c.num_packs = (c.count + N - 1) / N;
  c.slice_packs = (c.num_packs + world - 1) / world;
  return c;
}

// Part `blockIdx.x` of slice q (in packs of the chunk).
template <typename T>
__device__ __forceinline__ Range part_of(const Chunk<T>& c, int q, size_t per_block) {
  const size_t slice_begin = static_cast<size_t>(q) * c.slice_packs;
  const size_t slice_end = min(slice_begin + c.slice_packs, c.num_packs);
  const size_t begin = min(slice_begin + per_block * blockIdx.x, slice_end);
  return {begin, min(begin + per_block, slice_end)};
}

// Whether a load/store lambda may use whole 16-byte accesses (Fast) or must go element by element
// (tails, unaligned user tensors): the lambdas take it as their first argument, so one lambda
// serves both paths and the slow one never costs the fast loop registers.
using Fast = std::true_type;
using Exact = std::false_type;

// store(v, load(v)) for every pack v of `part` this thread owns: below fast_end kCopyUnroll at a
// time, all loads in flight before the first store; from fast_end on, one at a time, exactly.
template <typename T, typename Load, typename Store>
__device__ __forceinline__ void copy_packs(Range part, size_t fast_end, Load load, Store store) {
  const size_t stride = blockDim.x;
  const size_t split = max(part.begin, min(part.end, fast_end));
  for (size_t base = part.begin + threadIdx.x; base < split; base += kCopyUnroll * stride) {
    Pack<T> xs[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (base + u * stride < split) xs[u] = load(Fast{}, base + u * stride);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (base + u * stride < split) store(Fast{}, base + u * stride, xs[u]);
    }
  }
  for (size_t v = split + threadIdx.x; v < part.end; v += stride) store(Exact{}, v, load(Exact{}, v));
}

// store(v, sum over r of load(v, r)) for every pack v of `part` this thread owns (Note [reduction
// order], through reduce_loaded): below fast_end reduce_unroll packs at a time, every rank's
// values loaded before the first add; from fast_end on, one at a time, exactly. `load` is called
// with unrolled constant ranks only.
template <typename T, int kWorldSize, ReduceOp kOp, typename Load, typename Store>
__device__ __forceinline__ void reduce_packs(Range part, size_t fast_end, int world, Load load, Store store) {
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  constexpr int kUnroll = reduce_unroll(kWorldSize);
  const size_t stride = blockDim.x;
  const size_t split = max(part.begin, min(part.end, fast_end));
  for (size_t base = part.begin + threadIdx.x; base < split; base += kUnroll * stride) {
    Pack<T> xs[kUnroll][kCap];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < split) {
#pragma unroll
        for (int r = 0; r < kCap; ++r) {
          if (kWorldSize > 0 || r < world) xs[u][r] = load(Fast{}, base + u * stride, r);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < split) store(Fast{}, base + u * stride, reduce_loaded<T, kWorldSize, kOp>(xs[u], world));
    }
  }
  for (size_t v = split + threadIdx.x; v < part.end; v += stride) {
    Pack<T> xs[kCap];
#pragma unroll
    for (int r = 0; r < kCap; ++r) {
      if (kWorldSize > 0 || r < world) xs[r] = load(Exact{}, v, r);
    }
    store(Exact{}, v, reduce_loaded<T, kWorldSize, kOp>(xs, world));
  }
}

// Element-exact access to pack v of a user tensor on the Exact path; whole 16 bytes on the Fast one.
template <typename T, typename Path>
__device__ __forceinline__ Pack<T> load_user(Path, const T* base, size_t v, size_t count, bool aligned) {
  if constexpr (Path::value) return Pack<T>::load(base + v * Pack<T>::kNumElems);
  return load_pack(base, v, count, aligned);
}

template <typename T, typename Path>
__device__ __forceinline__ void store_user(Path, T* base, size_t v, size_t count, bool aligned, const Pack<T>& x) {
  if constexpr (Path::value) {
    x.store(base + v * Pack<T>::kNumElems);
  } else {
    store_pack(base, v, count, aligned, x);
  }
}

__device__ __forceinline__ int peer_after(int rank, int i, int world) {
  return rank + i < world ? rank + i : rank + i - world;  // staggered: the ranks start on different peers
}

template <typename T, int kWorldSize, ReduceOp kOp>
__device__ __forceinline__ bool tree_symmetric(const AllReduceTreeParams& p, uint64_t call, const TreeGeometry& g) {
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  constexpr int N = Pack<T>::kNumElems;
  const int rank = p.barrier.rank;
  const Chunk<T> c = chunk_at(static_cast<const T*>(p.input), static_cast<T*>(p.output), p.count, 0, p.count, world);
  // Every rank's tensor holds its input (with this, the peers'). The inputs were written by earlier
  // work, not by this kernel, so the arrival may be relaxed (Note [tree barriers]).
  if (!device::barrier_block<Phase::kInputsReady>(p.barrier, call, device::BarrierArrival::kRelaxed)) {
    return false;
  }
  // The tensors are 16-byte aligned (checked by the launcher); the tail pack is element-exact.
  reduce_packs<T, kWorldSize, kOp>(
      part_of(c, rank, g.per_block), c.count / N, world,
      [&](auto path, size_t v, int r) { return load_user(path, p.source.peer<const T>(r), v, c.count, true); },
      [&](auto path, size_t v, const Pack<T>& x) {
        for (int i = 0; i < world; ++i) store_user(path, p.source.peer<T>(peer_after(rank, i, world)), v, c.count, true, x);
      });
  // The peers' reduced slices are in this tensor, and the peers are done reading it.
  return device::barrier_block<Phase::kPeersDone>(p.barrier, call);
}

template <typename T, int kWorldSize, ReduceOp kOp>
__device__ __forceinline__ bool tree_workspace(const AllReduceTreeParams& p, uint64_t call, const TreeGeometry& g) {
  constexpr int N = Pack<T>::kNumElems;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const T* in = static_cast<const T*>(p.input);
  T* out = static_cast<T*>(p.output);
  const bool in_aligned = (reinterpret_cast<uintptr_t>(in) & 15u) == 0;  // chunks keep it: whole packs
  const bool out_aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  const size_t slot_elems = g.slot_packs * N;
  // Runtime rank indices read the pointer from the parameter (an indexed local array would spill).
  auto half_of = [&](int r, uint64_t c) -> T* {
    return reinterpret_cast<T*>(p.workspace.peer<char>(r) + ((call + c) & 1) * g.half_bytes);
  };

  auto copy_out = [&](const Chunk<T>& prev, uint64_t c) {
    const T* mine = half_of(rank, c);
    for (int i = 1; i < world; ++i) {
      const int q = peer_after(rank, i, world);
      const T* slot = mine + q * slot_elems;  // AG slot q
      const size_t slice_begin = static_cast<size_t>(q) * prev.slice_packs;
      copy_packs<T>(
          part_of(prev, q, g.per_block), out_aligned ? prev.count / N : 0,
          [&](auto, size_t v) { return Pack<T>::load(slot + (v - slice_begin) * N); },
          [&](auto path, size_t v, const Pack<T>& x) { store_user(path, prev.out, v, prev.count, out_aligned, x); });
    }
  };

  Chunk<T> prev{};
  for (uint64_t c = 0; c < g.num_chunks; ++c) {
    const uint64_t call_c = call + c;
    const Chunk<T> cur = chunk_at(in, out, p.count, c * g.chunk_count, g.chunk_count, world);
    for (int i = 1; i < world; ++i) {
      const int q = peer_after(rank, i, world);
      T* slot = half_of(q, c) + rs_slot(q, rank, world) * slot_elems;  // rank q's RS slot for this rank
      const size_t slice_begin = static_cast<size_t>(q) * cur.slice_packs;
      copy_packs<T>(
          part_of(cur, q, g.per_block), in_aligned ? cur.count / N : 0,
          [&](auto path, size_t v) { return load_user(path, cur.in, v, cur.count, in_aligned); },
          [&](auto, size_t v, const Pack<T>& x) { x.store(slot + (v - slice_begin) * N); });
    }
    if (c > 0) copy_out(prev, c - 1);
    if (!device::barrier_block<Phase::kInputsReady>(p.barrier, call_c)) return false;

    const T* mine = half_of(rank, c);
    const size_t slice_begin = static_cast<size_t>(rank) * cur.slice_packs;
    reduce_packs<T, kWorldSize, kOp>(
        part_of(cur, rank, g.per_block), in_aligned && out_aligned ? cur.count / N : 0, world,
        [&](auto path, size_t v, int r) {
          return r == rank ? load_user(path, cur.in, v, cur.count, in_aligned)
                           : Pack<T>::load(mine + rs_slot(rank, r, world) * slot_elems + (v - slice_begin) * N);
        },
        [&](auto path, size_t v, const Pack<T>& x) {
          store_user(path, cur.out, v, cur.count, out_aligned, x);
          for (int i = 1; i < world; ++i) {
            const int q = peer_after(rank, i, world);
            x.store(half_of(q, c) + rank * slot_elems + (v - slice_begin) * N);  // rank q's AG slot `rank`
          }
        });
    if (!device::barrier_block<Phase::kSlicesReduced>(p.barrier, call_c)) return false;
    prev = cur;
  }
  copy_out(prev, g.num_chunks - 1);
  return true;
}

template <typename T, int kWorldSize, ReduceOp kOp, AllReduceSource kSource>
__global__ void __launch_bounds__(kTreeThreads) all_reduce_tree_kernel(AllReduceTreeParams p, TreeGeometry g) {
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  if constexpr (kSource == AllReduceSource::kSymmetricInput) {
    if (!tree_symmetric<T, kWorldSize, kOp>(p, call.call, g)) return;
    device::call_end(p.barrier);
  } else {
    if (!tree_workspace<T, kWorldSize, kOp>(p, call.call, g)) return;
    device::call_end(p.barrier, g.num_chunks);
  }
}

template <typename T, int kWorldSize, ReduceOp kOp>
Status launch_typed(const char* what, const AllReduceTreeParams& p, const TreeGeometry& g, int blocks, int threads,
                    Stream stream) {
  const LaunchShape shape{dim3(blocks), dim3(threads)};
  if (p.source_kind == AllReduceSource::kSymmetricInput) {
    return launch_kernel(what, all_reduce_tree_kernel<T, kWorldSize, kOp, AllReduceSource::kSymmetricInput>, shape,
                         stream, LaunchOrder::kStream, p, g);
  }
  return launch_kernel(what, all_reduce_tree_kernel<T, kWorldSize, kOp, AllReduceSource::kWorkspace>, shape, stream,
                       LaunchOrder::kStream, p, g);
}

}  // namespace

Status launch_all_reduce_tree(const AllReduceTreeParams& params, Stream stream) {
  const char* what = "all_reduce(tree)";
  Status status = check_common(what, params.dtype, params.op, params.barrier);
  if (!status.is_ok() || params.count == 0) return status;
  const size_t esize = dtype_size(params.dtype);
  const size_t pack_elems = 16 / esize;
  const size_t world = static_cast<size_t>(params.barrier.world_size);
  const bool symmetric = params.source_kind == AllReduceSource::kSymmetricInput;
  if (symmetric && (params.input != params.output || !is_aligned16(params.output) ||
                    params.source.peers[params.barrier.rank] != params.output)) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": a symmetric source must be the 16-byte aligned output itself"));
  }
  const size_t num_packs = (params.count + pack_elems - 1) / pack_elems;
  TreeGeometry g;
  size_t chunk_packs = num_packs;
  if (!symmetric) {
    g.half_bytes = params.workspace.bytes / 2 / 16 * 16;
    // A full chunk is world slices of the largest slot that fits the half (Note [tree slots]).
    const size_t max_chunk_packs = g.half_bytes / 16 / tree_num_slots(world) * world;
    if (max_chunk_packs == 0) return Status(StatusCode::kInvalidArgument, detail::concat(what, ": workspace too small"));
    chunk_packs = std::min(num_packs, max_chunk_packs);
  }
  g.chunk_count = chunk_packs * pack_elems;  // whole packs: later chunks keep the tensor's alignment
  g.num_chunks = (params.count + g.chunk_count - 1) / g.chunk_count;
  const size_t slice_packs = (chunk_packs + world - 1) / world;  // of a full chunk
  g.slot_packs = slice_packs;

  // Note [tree geometry]; the host validated the config's ranges, these clamps only keep it safe.
  const TreeLaunchConfig& cfg = params.config;
  const int cap = cfg.max_blocks > 0 ? cfg.max_blocks : params.max_blocks > 0 ? params.max_blocks : kTreeMaxBlocks;
  const size_t max_blocks = static_cast<size_t>(std::clamp(cap, 1, kMaxBarrierBlocks));
  const size_t max_threads =
      cfg.threads > 0 ? static_cast<size_t>(std::clamp(cfg.threads, 32, kTreeThreads)) / 32 * 32 : kTreeDefaultThreads;
  const size_t min_packs =
      cfg.min_packs_per_block > 0 ? static_cast<size_t>(cfg.min_packs_per_block) : kTreeMinPacksPerBlock;
  const size_t blocks = std::clamp<size_t>((slice_packs + min_packs - 1) / min_packs, 1, max_blocks);
  // Whole 512-byte spans per block, so no cache line is split between two blocks.
  g.per_block = ((slice_packs + blocks - 1) / blocks + 31) / 32 * 32;
  const size_t threads = std::clamp<size_t>((g.per_block + 31) / 32 * 32, 32, max_threads);
  COMMLIB_DISPATCH_FLOAT_DTYPE(params.dtype, T, what, [&] {
    COMMLIB_DISPATCH_WORLD_SIZE(params.barrier.world_size, kWorldSize, [&] {
      if (params.op == ReduceOp::kAvg) {
        status = launch_typed<T, kWorldSize, ReduceOp::kAvg>(what, params, g, static_cast<int>(blocks),
                                                              static_cast<int>(threads), stream);
      } else {
        status = launch_typed<T, kWorldSize, ReduceOp::kSum>(what, params, g, static_cast<int>(blocks),
                                                              static_cast<int>(threads), stream);
      }
    });
  });
  return status;
}

}  // namespace commlib::kernels
