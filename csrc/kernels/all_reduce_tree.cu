// Two-shot ("tree") all-reduce: reduce-scatter then all-gather, both by direct peer access.
// The message is cut into world slices; block b owns part b of every slice on every rank, so it
// only ever meets block b of the peers (Note [flag barrier]).
//   push      (kWorkspace only) block b writes its part of every other slice q straight into
//             rank q's half, slot `rank` (remote stores; this rank's own slice is not copied)
//   barrier   kInputsReady
//   reduce    its part of slice `rank`, from every rank in rank order (own values from the input,
//             the peers' from this rank's slots); stored to the output and (kWorkspace) to slot
//             `rank` of this rank's half, where the peers gather it
// Workspace layout per half, in packs of 16 bytes: slot r = [r * S, (r + 1) * S), S = slice_packs.
// Slot r of rank q holds rank r's values of slice q; slot q holds rank q's reduced slice q, at
// the same position the slice has in the message (so the gather reads natural offsets).
//   barrier   kSlicesReduced
//   gather    its part of every other slice q from rank q's half (or tensor)
//   barrier   kPeersDone (kSymmetricInput only: the caller may overwrite its tensor afterwards;
//             with the workspace the halves alternate instead)
#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "kernels/all_reduce_common.cuh"

namespace commlib::kernels {
namespace {

constexpr int kTreeThreads = 512;
constexpr int kTreeMaxBlocks = 64;

struct Range {
  size_t begin, end;
};

// Part `block` of slice `q` (in packs).
__device__ __forceinline__ Range part_of(int q, size_t slice_packs, size_t per_block, size_t num_packs) {
  const size_t slice_begin = q * slice_packs;
  const size_t slice_end = min(slice_begin + slice_packs, num_packs);
  const size_t begin = min(slice_begin + per_block * blockIdx.x, slice_end);
  return {begin, min(begin + per_block, slice_end)};
}

template <typename T, int kWorldSize, ReduceOp kOp, AllReduceSource kSource>
__global__ void __launch_bounds__(kTreeThreads) all_reduce_tree_kernel(AllReduceTreeParams p, size_t half_bytes) {
  constexpr int N = Pack<T>::kNumElems;
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const size_t num_packs = (p.count + N - 1) / N;
  const size_t slice_packs = (num_packs + world - 1) / world;
  const size_t per_block = (slice_packs + gridDim.x - 1) / gridDim.x;

  // With the workspace, sources hold whole packs (full-width reads); a symmetric tensor is read
  // element-exact in its tail.
  const size_t src_count = kSource == AllReduceSource::kWorkspace ? num_packs * N : p.count;
  T* out = static_cast<T*>(p.output);
  const bool out_aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  // Rank-indexed sources come from the parameter (runtime indices into srcs would use local memory).
  const size_t half = kSource == AllReduceSource::kWorkspace ? (call.call & 1) * half_bytes : 0;
  auto source_of = [&](int r) -> T* {
    if constexpr (kSource == AllReduceSource::kWorkspace) return reinterpret_cast<T*>(p.workspace.peer<char>(r) + half);
    return p.source.peer<T>(r);
  };

  const T* srcs[kCap];  // kSymmetricInput's reduce_pack sources, indexed only by unrolled constants
#pragma unroll
  for (int r = 0; r < kCap; ++r) {
    if (kWorldSize > 0 || r < world) srcs[r] = source_of(r);
  }

  const T* in = static_cast<const T*>(p.input);
  const bool in_aligned = (reinterpret_cast<uintptr_t>(in) & 15u) == 0;
  if constexpr (kSource == AllReduceSource::kWorkspace) {
#pragma unroll 1
    for (int i = 1; i < world; ++i) {
      const int q = (rank + i) % world;
      T* slot = source_of(q) + static_cast<size_t>(rank) * slice_packs * N;  // rank q's slot `rank`
      const Range part = part_of(q, slice_packs, per_block, num_packs);
      for (size_t v = part.begin + threadIdx.x; v < part.end; v += blockDim.x) {
        load_pack(in, v, p.count, in_aligned).store(slot + (v - q * slice_packs) * N);
      }
    }
  }
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(AllReducePhase::kInputsReady))) return;

  {
    const Range part = part_of(rank, slice_packs, per_block, num_packs);
    T* mine = source_of(rank);
    for (size_t v = part.begin + threadIdx.x; v < part.end; v += blockDim.x) {
      Pack<T> x;
      if constexpr (kSource == AllReduceSource::kWorkspace) {
        const size_t j = v - static_cast<size_t>(rank) * slice_packs;  // position in the slice
        Pack<T> xs[kCap];
#pragma unroll
        for (int r = 0; r < kCap; ++r) {
          if (kWorldSize == 0 && r >= world) continue;
          xs[r] = r == rank ? load_pack(in, v, p.count, in_aligned)
                            : Pack<T>::load(mine + (static_cast<size_t>(r) * slice_packs + j) * N);
        }
        auto acc = device::acc_init(xs[0]);
#pragma unroll
        for (int r = 1; r < kCap; ++r) {
          if (kWorldSize > 0 || r < world) device::acc_add(acc, xs[r]);
        }
        if constexpr (kOp == ReduceOp::kAvg) device::acc_div(acc, static_cast<float>(world));
        x = device::acc_cast<T>(acc);
        x.store(mine + v * N);  // slot `rank`, natural position: the peers gather it from here
      } else {
        x = reduce_pack<T, kWorldSize, kOp>(srcs, world, v, src_count, true);
      }
      store_pack(out, v, p.count, out_aligned, x);
    }
  }
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(AllReducePhase::kSlicesReduced))) return;

#pragma unroll 1
  for (int i = 1; i < world; ++i) {
    const int q = (rank + i) % world;  // staggered so the ranks do not all read one peer at once
    const Range part = part_of(q, slice_packs, per_block, num_packs);
    for (size_t v = part.begin + threadIdx.x; v < part.end; v += blockDim.x) {
      store_pack(out, v, p.count, out_aligned, load_pack<T>(source_of(q), v, src_count, true));
    }
  }
  if constexpr (kSource == AllReduceSource::kSymmetricInput) {
    if (!device::barrier_block(p.barrier, call.call, static_cast<int>(AllReducePhase::kPeersDone))) return;
  }
  device::call_end(p.barrier);
}

template <typename T, int kWorldSize, ReduceOp kOp>
void launch_typed(const AllReduceTreeParams& p, size_t half_bytes, int blocks, int threads, Stream stream) {
  if (p.source_kind == AllReduceSource::kSymmetricInput) {
    all_reduce_tree_kernel<T, kWorldSize, kOp, AllReduceSource::kSymmetricInput>
        <<<blocks, threads, 0, stream>>>(p, half_bytes);
  } else {
    all_reduce_tree_kernel<T, kWorldSize, kOp, AllReduceSource::kWorkspace><<<blocks, threads, 0, stream>>>(p, half_bytes);
  }
}

}  // namespace

Status launch_all_reduce_tree(const AllReduceTreeParams& params, Stream stream) {
  const char* what = "all_reduce(tree)";
  Status status = check_common(what, params.dtype, params.op, params.barrier);
  if (!status.is_ok() || params.count == 0) return status;
  const size_t esize = dtype_size(params.dtype);
  const bool symmetric = params.source_kind == AllReduceSource::kSymmetricInput;
  if (symmetric && (params.input != params.output || !is_aligned16(params.output) ||
                    params.source.peers[params.barrier.rank] != params.output)) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": a symmetric source must be the 16-byte aligned output itself"));
  }
  const size_t half_bytes = params.workspace.bytes / 2 / 16 * 16;
  // World slots of ceil(packs / world) packs must fit in one half.
  const size_t world = static_cast<size_t>(params.barrier.world_size);
  const size_t chunk = symmetric ? params.count : (half_bytes / 16 / world * world) * (16 / esize);
  if (chunk == 0) return Status(StatusCode::kInvalidArgument, detail::concat(what, ": workspace too small"));
  const int max_blocks = params.max_blocks > 0 ? std::min(params.max_blocks, kMaxBarrierBlocks) : kTreeMaxBlocks;
  for (size_t first = 0; first < params.count; first += chunk) {
    AllReduceTreeParams p = params;
    p.count = std::min(chunk, params.count - first);
    p.input = static_cast<const char*>(params.input) + first * esize;
    p.output = static_cast<char*>(params.output) + first * esize;
    const size_t num_packs = (p.count * esize + 15) / 16;
    const size_t slice_packs = (num_packs + p.barrier.world_size - 1) / p.barrier.world_size;
    const int threads =
        static_cast<int>(std::min<size_t>(kTreeThreads, std::max<size_t>(32, (slice_packs + 31) / 32 * 32)));
    const int blocks = static_cast<int>(
        std::max<size_t>(1, std::min<size_t>(max_blocks, (slice_packs + threads - 1) / threads)));
    COMMLIB_DISPATCH_FLOAT_DTYPE(p.dtype, T, return Status(StatusCode::kInvalidArgument, what), [&] {
      COMMLIB_DISPATCH_WORLD_SIZE(p.barrier.world_size, kWorldSize, [&] {
        if (p.op == ReduceOp::kAvg) {
          launch_typed<T, kWorldSize, ReduceOp::kAvg>(p, half_bytes, blocks, threads, stream);
        } else {
          launch_typed<T, kWorldSize, ReduceOp::kSum>(p, half_bytes, blocks, threads, stream);
        }
      });
    });
    status = cuda_status(what);
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

}  // namespace commlib::kernels
