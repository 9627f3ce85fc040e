// One-shot ("flat") all-reduce: each block copies its part of the input into this rank's
// workspace half, meets the same block on every peer (one barrier), then reads that part from
// every rank's half and reduces it locally. Latency O(1) in ranks; traffic O(n^2).
// The workspace half alternates with the call's parity (Note [flag barrier]): no end barrier.
#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "kernels/all_reduce_common.cuh"
#include "kernels/launch.cuh"

namespace commlib::kernels {
namespace {

constexpr int kFlatThreads = 256;
constexpr int kFlatMaxBlocks = 48;

template <typename T, int kWorldSize, ReduceOp kOp>
__global__ void __launch_bounds__(kFlatThreads) all_reduce_flat_kernel(AllReduceFlatParams p, size_t half_bytes, LaunchOrder order) {
  pdl_begin(order);  // before call_begin reads the counter the previous kernel advanced
  constexpr int N = Pack<T>::kNumElems;
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const size_t num_packs = (p.count + N - 1) / N;
  const size_t per_block = (num_packs + gridDim.x - 1) / gridDim.x;
  const size_t begin = per_block * blockIdx.x;
  const size_t end = min(begin + per_block, num_packs);
  const size_t half = (call.call & 1) * half_bytes;

  const T* srcs[kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks];
#pragma unroll
  for (int r = 0; r < (kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks); ++r) {
    if (kWorldSize > 0 || r < world) srcs[r] = reinterpret_cast<const T*>(p.workspace.peer<char>(r) + half);
  }
  // From the parameter, not srcs[rank]: a runtime index into srcs would put it in local memory.
  T* mine = reinterpret_cast<T*>(p.workspace.peer<char>(rank) + half);
  const T* in = static_cast<const T*>(p.input);
  T* out = static_cast<T*>(p.output);
  const bool in_aligned = (reinterpret_cast<uintptr_t>(in) & 15u) == 0;
  const bool out_aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;

  for (size_t v = begin + threadIdx.x; v < end; v += blockDim.x) {
    load_pack(in, v, p.count, in_aligned).store(mine + v * N);
  }
  if (!device::barrier_block<Phase::kInputsReady>(p.barrier, call.call)) return;
  // The workspace always holds whole packs, so the reads are full width even in the tail.
  for (size_t v = begin + threadIdx.x; v < end; v += blockDim.x) {
    const Pack<T> x = reduce_pack<T, kWorldSize, kOp>(srcs, world, v, num_packs * N, true);
    store_pack(out, v, p.count, out_aligned, x);
  }
  device::call_end(p.barrier);
}

}  // namespace


Status launch_all_reduce_flat(const AllReduceFlatParams& params, Stream stream) {
  const char* what = "all_reduce(flat)";
  Status status = check_common(what, params.dtype, params.op, params.barrier);
  if (!status.is_ok() || params.count == 0) return status;
  const size_t esize = dtype_size(params.dtype);
  const size_t half_bytes = params.workspace.bytes / 2 / 16 * 16;
  const size_t chunk = half_bytes / esize;  // a multiple of the pack, so chunks keep alignment
  if (chunk == 0) return Status(StatusCode::kInvalidArgument, detail::concat(what, ": workspace too small"));
  const int max_blocks = params.max_blocks > 0 ? std::min(params.max_blocks, kMaxBarrierBlocks) : kFlatMaxBlocks;
  const LaunchOrder order = params.order;
  for (size_t first = 0; first < params.count; first += chunk) {
    AllReduceFlatParams p = params;
    p.count = std::min(chunk, params.count - first);
    p.input = static_cast<const char*>(params.input) + first * esize;
    p.output = static_cast<char*>(params.output) + first * esize;
    const size_t num_packs = (p.count * esize + 15) / 16;
    const int threads = static_cast<int>(std::min<size_t>(kFlatThreads, std::max<size_t>(32, (num_packs + 31) / 32 * 32)));
    const int blocks = static_cast<int>(std::min<size_t>(max_blocks, (num_packs + threads - 1) / threads));
    COMMLIB_DISPATCH_FLOAT_DTYPE(p.dtype, T, what, [&] {
      COMMLIB_DISPATCH_WORLD_SIZE(p.barrier.world_size, kWorldSize, [&] {
        if (p.op == ReduceOp::kAvg) {
          status = launch_kernel(what, all_reduce_flat_kernel<T, kWorldSize, ReduceOp::kAvg>, {dim3(blocks), dim3(threads)},
                                 stream, order, p, half_bytes, order);
        } else {
          status = launch_kernel(what, all_reduce_flat_kernel<T, kWorldSize, ReduceOp::kSum>, {dim3(blocks), dim3(threads)},
                                 stream, order, p, half_bytes, order);
        }
      });
    });
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

}  // namespace commlib::kernels
