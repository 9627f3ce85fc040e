// One-shot all-reduce without a barrier, for the smallest messages: each rank pushes its input to
// every peer as flag-carrying LL lines (Note [LL lines] in all_reduce_params.hpp), then waits for
// the peers' lines in its own buffer, line by line, and reduces in rank order. One NVLink write
// latency instead of a write + barrier round trip + read.
#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "commlib/device/ll.cuh"
#include "kernels/all_reduce_common.cuh"
#include "kernels/launch.cuh"

namespace commlib::kernels {
namespace {

// Small blocks, many SMs: more SMs issue NVLink stores and polls in parallel (no barrier to pay).
constexpr int kLLThreads = 128;
constexpr int kLLMaxBlocks = 64;

template <typename T, int kWorldSize, ReduceOp kOp>
__global__ void __launch_bounds__(kLLThreads) all_reduce_flat_ll_kernel(AllReduceFlatLLParams p, LaunchOrder order) {
  pdl_begin(order);  // before call_begin reads the counter the previous kernel advanced
  constexpr int N = Pack<T>::kNumElems;
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  const size_t num_packs = (p.count + N - 1) / N;
  const T* in = static_cast<const T*>(p.input);
  const bool in_aligned = (reinterpret_cast<uintptr_t>(in) & 15u) == 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // The thread's first pack is loaded together with call_begin's words: one round trip, not two,
  // before the first push (at decode sizes a thread has only this pack).
  Pack<T> x_first{};
  if (first < num_packs) x_first = load_pack(in, first, p.count, in_aligned);
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const uint32_t flag = static_cast<uint32_t>(call.call + 1);
  const size_t slot_bytes = 2 * p.max_bytes_per_call;  // lines of one source rank
  const size_t parity = (call.call & 1) * static_cast<size_t>(world) * slot_bytes;
  T* out = static_cast<T*>(p.output);
  const bool out_aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  auto own_pack = [&](size_t v) { return v == first ? x_first : load_pack(in, v, p.count, in_aligned); };

  // Push: pack v (16 bytes) becomes lines 2v and 2v + 1 of slot `rank` in every peer's buffer.
  for (size_t v = first; v < num_packs; v += stride) {
    const Pack<T> x = own_pack(v);
    const uint4 raw = *reinterpret_cast<const uint4*>(&x);
    for (int i = 1; i < world; ++i) {
      const int q = (rank + i) % world;
      device::ll_store(reinterpret_cast<uint4*>(p.lines.peer<char>(q) + parity + rank * slot_bytes) + 2 * v, raw, flag);
    }
  }

  int failed = 0;
  for (size_t v = first; v < num_packs && !failed; v += stride) {
    uint4 lo[kCap], hi[kCap];  // every peer's lines of pack v, polled at once (Note [loads before use])
    ll_wait_ranks<kWorldSize>(reinterpret_cast<const uint8_t*>(p.lines.local<char>() + parity), slot_bytes, v, rank,
                              world, flag, p.barrier, call.call, failed, lo, hi);
    if (failed) break;
    Pack<T> xs[kCap];
#pragma unroll
    for (int r = 0; r < kCap; ++r) {
      if (kWorldSize == 0 && r >= world) continue;
      xs[r] = r == rank ? own_pack(v) : ll_pack<T>(lo[r], hi[r]);
    }
    auto acc = device::acc_init(xs[0]);
#pragma unroll
    for (int r = 1; r < kCap; ++r) {
      if (kWorldSize > 0 || r < world) device::acc_add(acc, xs[r]);
    }
    if constexpr (kOp == ReduceOp::kAvg) device::acc_div(acc, static_cast<float>(world));
    store_pack(out, v, p.count, out_aligned, device::acc_cast<T>(acc));
  }
  if (__syncthreads_or(failed)) return;
  device::call_end(p.barrier);
}

}  // namespace

Status launch_all_reduce_flat_ll(const AllReduceFlatLLParams& params, Stream stream) {
  const char* what = "all_reduce(flat, LL)";
  Status status = check_common(what, params.dtype, params.op, params.barrier);
  if (!status.is_ok() || params.count == 0) return status;
  const size_t esize = dtype_size(params.dtype);
  const size_t chunk = params.max_bytes_per_call / 16 * 16 / esize;
  if (chunk == 0 || params.lines.bytes < ll_buffer_bytes(params.barrier.world_size, params.max_bytes_per_call)) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": LL buffer too small"));
  }
  const int max_blocks = params.max_blocks > 0 ? std::min(params.max_blocks, kMaxBarrierBlocks) : kLLMaxBlocks;
  const LaunchOrder order = params.order;
  for (size_t first = 0; first < params.count; first += chunk) {
    AllReduceFlatLLParams p = params;
    p.count = std::min(chunk, params.count - first);
    p.input = static_cast<const char*>(params.input) + first * esize;
    p.output = static_cast<char*>(params.output) + first * esize;
    const size_t num_packs = (p.count * esize + 15) / 16;
    const int threads = static_cast<int>(std::min<size_t>(kLLThreads, std::max<size_t>(32, (num_packs + 31) / 32 * 32)));
    const int blocks = static_cast<int>(std::min<size_t>(max_blocks, (num_packs + threads - 1) / threads));
    COMMLIB_DISPATCH_FLOAT_DTYPE(p.dtype, T, what, [&] {
      COMMLIB_DISPATCH_WORLD_SIZE(p.barrier.world_size, kWorldSize, [&] {
        if (p.op == ReduceOp::kAvg) {
          status = launch_kernel(what, all_reduce_flat_ll_kernel<T, kWorldSize, ReduceOp::kAvg>,
                                 {dim3(blocks), dim3(threads)}, stream, order, p, order);
        } else {
          status = launch_kernel(what, all_reduce_flat_ll_kernel<T, kWorldSize, ReduceOp::kSum>,
                                 {dim3(blocks), dim3(threads)}, stream, order, p, order);
        }
      });
    });
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

}  // namespace commlib::kernels
