// Two-shot ("tree") all-reduce: reduce-scatter then all-gather, both by direct peer access.
// The message is cut into world slices; block b owns part b of every slice on every rank, so it
// only ever meets block b of the peers (Note [flag barrier]).
//   copy-in   (kWorkspace only) block b copies its part of every slice into this rank's half
//   barrier   kInputsReady
//   reduce    its part of slice `rank`, from every rank in rank order; stored to the output and
//             (kWorkspace) to this rank's half, where the peers gather it
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

  const T* srcs[kCap];
  if constexpr (kSource == AllReduceSource::kWorkspace) {
    const size_t half = (call.call & 1) * half_bytes;
#pragma unroll
    for (int r = 0; r < kCap; ++r) {
      if (kWorldSize > 0 || r < world) srcs[r] = reinterpret_cast<const T*>(p.workspace.peer<char>(r) + half);
    }
  } else {
#pragma unroll
    for (int r = 0; r < kCap; ++r) {
      if (kWorldSize > 0 || r < world) srcs[r] = p.source.peer<const T>(r);
    }
  }
  // With the workspace, sources hold whole packs (full-width reads); a symmetric tensor is read
  // element-exact in its tail.
  const size_t src_count = kSource == AllReduceSource::kWorkspace ? num_packs * N : p.count;
  T* out = static_cast<T*>(p.output);
  const bool out_aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;

  if constexpr (kSource == AllReduceSource::kWorkspace) {
    const T* in = static_cast<const T*>(p.input);
    const bool in_aligned = (reinterpret_cast<uintptr_t>(in) & 15u) == 0;
    T* mine = const_cast<T*>(srcs[rank]);
    for (int q = 0; q < world; ++q) {
      const Range part = part_of(q, slice_packs, per_block, num_packs);
      for (size_t v = part.begin + threadIdx.x; v < part.end; v += blockDim.x) {
        load_pack(in, v, p.count, in_aligned).store(mine + v * N);
      }
    }
  }
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(AllReducePhase::kInputsReady))) return;

  {
    const Range part = part_of(rank, slice_packs, per_block, num_packs);
    T* mine = const_cast<T*>(srcs[rank]);
    for (size_t v = part.begin + threadIdx.x; v < part.end; v += blockDim.x) {
      const Pack<T> x = reduce_pack<T, kWorldSize, kOp>(srcs, world, v, src_count, true);
      if constexpr (kSource == AllReduceSource::kWorkspace) x.store(mine + v * N);
      store_pack(out, v, p.count, out_aligned, x);
    }
  }
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(AllReducePhase::kSlicesReduced))) return;

#pragma unroll 1
  for (int i = 1; i < world; ++i) {
    const int q = (rank + i) % world;  // staggered so the ranks do not all read one peer at once
    const Range part = part_of(q, slice_packs, per_block, num_packs);
    for (size_t v = part.begin + threadIdx.x; v < part.end; v += blockDim.x) {
      store_pack(out, v, p.count, out_aligned, load_pack(srcs[q], v, src_count, true));
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
  const size_t chunk = symmetric ? params.count : half_bytes / esize;
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
