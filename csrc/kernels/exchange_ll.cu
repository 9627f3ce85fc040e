// Push exchange without a barrier, for the smallest messages (all_gather, all_to_all,
// reduce_scatter): each rank pushes every peer's data as flag-carrying LL lines into slot `rank` of
// the peer's line buffer (Note [LL lines] in all_reduce_params.hpp), then waits for the peers'
// lines in its own buffer, pack by pack, and copies (or reduces, in rank order) them into the
// output. One NVLink write latency instead of a write, a barrier round trip and a local pass.
// The parity of the line buffer is reused safely because every rank receives from every peer in
// every call (so broadcast, where only the root sends, keeps the barrier kernel).
#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "commlib/device/ll.cuh"
#include "kernels/exchange_common.cuh"

namespace commlib::kernels {
namespace {

// Small blocks, many SMs (as the LL all-reduce): more SMs issue NVLink stores and polls at once.
constexpr int kLLThreads = 128;
constexpr int kLLMaxBlocks = 64;

struct LLCall {
  size_t offset;  // bytes (exchange) or elements (reduce_scatter) into each block
  size_t size;    // bytes (exchange) or elements (reduce_scatter) of each block in this call
};

__global__ void __launch_bounds__(kLLThreads) exchange_ll_kernel(ExchangeParams p, LLCall c) {
  pdl_begin(p.order);
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const int world = p.barrier.world_size;
  const int rank = p.barrier.rank;
  const uint32_t flag = static_cast<uint32_t>(call.call + 1);
  const size_t slot_bytes = 2 * p.max_bytes_per_call;  // lines of one source rank
  const size_t parity = (call.call & 1) * static_cast<size_t>(world) * slot_bytes;
  const uint8_t* in = static_cast<const uint8_t*>(p.input) + c.offset;
  uint8_t* out = static_cast<uint8_t*>(p.output) + c.offset;
  const size_t num_packs = (c.size + 15) / 16;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  for (size_t v = first; v < num_packs; v += stride) {
    for (int i = 1; i < world; ++i) {
      const int q = exchange_peer_after(rank, i, world);
      const uint8_t* src = in + q * p.in_stride;
      const BytePack x = load_bytes(src, v, c.size, aligned16(src));
      uint4* dst = reinterpret_cast<uint4*>(p.lines.peer<uint8_t>(q) + parity + rank * slot_bytes) + 2 * v;
      device::ll_store(dst, *reinterpret_cast<const uint4*>(&x), flag);
    }
    const uint8_t* src = in + rank * p.in_stride;
    uint8_t* dst = out + rank * p.out_stride;
    if (src != dst) store_bytes(dst, v, c.size, aligned16(dst), load_bytes(src, v, c.size, aligned16(src)));
  }
  int failed = 0;
  const uint8_t* mine = p.lines.local<uint8_t>() + parity;
  for (size_t v = first; v < num_packs && !failed; v += stride) {
    uint4 lo[kMaxDeviceRanks], hi[kMaxDeviceRanks];  // every source's lines of pack v, polled at once
    ll_wait_ranks<0>(mine, slot_bytes, v, rank, world, flag, p.barrier, call.call, failed, lo, hi);
    if (failed) break;
#pragma unroll
    for (int r = 0; r < kMaxDeviceRanks; ++r) {
      if (r >= world || r == rank) continue;
      uint8_t* dst = out + r * p.out_stride;
      const uint4 raw = device::ll_payload(lo[r], hi[r]);
      store_bytes(dst, v, c.size, aligned16(dst), *reinterpret_cast<const BytePack*>(&raw));
    }
  }
  if (__syncthreads_or(failed)) return;
  device::call_end(p.barrier);
}

template <typename T, int kWorldSize, ReduceOp kOp>
__global__ void __launch_bounds__(kLLThreads) reduce_scatter_ll_kernel(ReduceScatterParams p, LLCall c) {
  pdl_begin(p.order);
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const uint32_t flag = static_cast<uint32_t>(call.call + 1);
  const size_t slot_bytes = 2 * p.max_bytes_per_call;
  const size_t parity = (call.call & 1) * static_cast<size_t>(world) * slot_bytes;
  const T* in = static_cast<const T*>(p.input) + c.offset;
  T* out = static_cast<T*>(p.output) + c.offset;
  const bool out_aligned = aligned16(out);
  const size_t num_packs = (c.size + Pack<T>::kNumElems - 1) / Pack<T>::kNumElems;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  for (size_t v = first; v < num_packs; v += stride) {
    for (int i = 1; i < world; ++i) {
      const int q = exchange_peer_after(rank, i, world);
      const T* src = in + q * p.count;
      const Pack<T> x = load_pack(src, v, c.size, aligned16(src));
      uint4* dst = reinterpret_cast<uint4*>(p.lines.peer<uint8_t>(q) + parity + rank * slot_bytes) + 2 * v;
      device::ll_store(dst, *reinterpret_cast<const uint4*>(&x), flag);
    }
  }
  int failed = 0;
  const T* own = in + rank * p.count;
  const bool own_aligned = aligned16(own);
  const uint8_t* mine = p.lines.local<uint8_t>() + parity;
  for (size_t v = first; v < num_packs && !failed; v += stride) {
    uint4 lo[kCap], hi[kCap];  // every peer's lines of pack v, polled at once (Note [loads before use])
    ll_wait_ranks<kWorldSize>(mine, slot_bytes, v, rank, world, flag, p.barrier, call.call, failed, lo, hi);
    if (failed) break;
    Pack<T> xs[kCap];
#pragma unroll
    for (int r = 0; r < kCap; ++r) {
      if (kWorldSize == 0 && r >= world) continue;
      xs[r] = r == rank ? load_pack(own, v, c.size, own_aligned) : ll_pack<T>(lo[r], hi[r]);
    }
    store_pack(out, v, c.size, out_aligned, reduce_loaded<T, kWorldSize, kOp>(xs, world));
  }
  if (__syncthreads_or(failed)) return;
  device::call_end(p.barrier);
}

Status check_lines(const char* what, const SymmetricBufferDevice& lines, size_t max_bytes_per_call, int world) {
  if (max_bytes_per_call < 16 || lines.bytes < ll_buffer_bytes(world, max_bytes_per_call)) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": LL buffer too small"));
  }
  return Status::ok();
}

LaunchShape ll_shape(size_t num_packs, int max_blocks_param) {
  const int max_blocks = max_blocks_param > 0 ? std::min(max_blocks_param, kMaxBarrierBlocks) : kLLMaxBlocks;
  const int threads = static_cast<int>(std::min<size_t>(kLLThreads, std::max<size_t>(32, (num_packs + 31) / 32 * 32)));
  const int blocks = static_cast<int>(std::clamp<size_t>((num_packs + threads - 1) / threads, 1, max_blocks));
  return {dim3(blocks), dim3(threads)};
}

}  // namespace

Status launch_exchange_ll(const ExchangeParams& params, Stream stream) {
  const char* what = params.what;
  Status status = check_barrier(what, params.barrier);
  if (!status.is_ok() || params.bytes == 0) return status;
  if (params.root >= 0) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": the LL exchange needs every rank to send"));
  }
  status = check_lines(what, params.lines, params.max_bytes_per_call, params.barrier.world_size);
  if (!status.is_ok()) return status;
  const size_t chunk = params.max_bytes_per_call / 16 * 16;
  for (size_t first = 0; first < params.bytes; first += chunk) {
    const LLCall c{first, std::min(chunk, params.bytes - first)};
    status = launch_kernel(what, exchange_ll_kernel, ll_shape((c.size + 15) / 16, params.max_blocks), stream,
                           params.order, params, c);
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

Status launch_reduce_scatter_ll(const ReduceScatterParams& params, Stream stream) {
  const char* what = "reduce_scatter(LL)";
  Status status = check_common(what, params.dtype, params.op, params.barrier);
  if (!status.is_ok() || params.count == 0) return status;
  status = check_lines(what, params.lines, params.max_bytes_per_call, params.barrier.world_size);
  if (!status.is_ok()) return status;
  const size_t esize = dtype_size(params.dtype);
  const size_t chunk = params.max_bytes_per_call / 16 * 16 / esize;  // whole packs: chunks keep alignment
  for (size_t first = 0; first < params.count; first += chunk) {
    const LLCall c{first, std::min(chunk, params.count - first)};
    const LaunchShape shape = ll_shape((c.size * esize + 15) / 16, params.max_blocks);
    COMMLIB_DISPATCH_FLOAT_DTYPE(params.dtype, T, what, [&] {
      COMMLIB_DISPATCH_WORLD_SIZE(params.barrier.world_size, kWorldSize, [&] {
        if (params.op == ReduceOp::kAvg) {
          status = launch_kernel(what, reduce_scatter_ll_kernel<T, kWorldSize, ReduceOp::kAvg>, shape, stream,
                                 params.order, params, c);
        } else {
          status = launch_kernel(what, reduce_scatter_ll_kernel<T, kWorldSize, ReduceOp::kSum>, shape, stream,
                                 params.order, params, c);
        }
      });
    });
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

}  // namespace commlib::kernels
