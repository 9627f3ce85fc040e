// Push reduce-scatter (Note [push exchange]). One call (one chunk of at most one slot per rank):
//   push      slice q of this rank's input -> slot `rank` of rank q's workspace half (q != rank)
//   barrier   kInputsReady: every peer's slice for this rank has landed in this rank's half
//   reduce    output = slot 0 + ... + slot n-1 in rank order, fp32, one rounding (this rank's own
//             term read straight from its input): Note [reduction order], so the result has the
//             bits of the same slice of all_reduce (flat, tree or CPU) on the same inputs.
// No trailing barrier: halves alternate by call parity (as in exchange.cu).
#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "kernels/exchange_common.cuh"

namespace commlib::kernels {
namespace {

struct ReduceScatterChunk {
  size_t first;       // first element of the chunk in each slice
  size_t count;       // elements of this chunk of each slice
  size_t slot_bytes;  // stride between the slots of a half (whole packs)
  size_t half_bytes;
};

template <typename T, int kWorldSize, ReduceOp kOp>
__global__ void __launch_bounds__(kExchangeThreads, kExchangeMinBlocksPerSm)
    reduce_scatter_kernel(ReduceScatterParams p, ReduceScatterChunk c, size_t per_block) {
  pdl_begin(p.order);
  constexpr int N = Pack<T>::kNumElems;
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const size_t esize = sizeof(T);
  const size_t chunk_bytes = c.count * esize;
  const size_t num_packs = (c.count + N - 1) / N;
  size_t begin, end;
  block_range(num_packs, per_block, &begin, &end);
  const size_t half = (call.call & 1) * c.half_bytes;
  const T* in = static_cast<const T*>(p.input) + c.first;

  for (int i = 1; i < world; ++i) {
    const int q = exchange_peer_after(rank, i, world);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(in + q * p.count);
    const bool src_aligned = (reinterpret_cast<uintptr_t>(src) & 15u) == 0;
    uint8_t* slot = p.workspace.peer<uint8_t>(q) + half + rank * c.slot_bytes;
    exchange_copy<BytePack>(
        begin, end, [&](size_t v) { return load_bytes(src, v, chunk_bytes, src_aligned); },
        [&](size_t v, const BytePack& x) { x.store(slot + v * 16); });
  }
  // Every peer's slice of block b's packs has landed in this half (release/acquire, system scope).
  if (!device::barrier_block<Phase::kInputsReady>(p.barrier, call.call)) return;
  const uint8_t* mine = p.workspace.peer<uint8_t>(rank) + half;
  const T* own = in + rank * p.count;
  const bool own_aligned = (reinterpret_cast<uintptr_t>(own) & 15u) == 0;
  T* out = static_cast<T*>(p.output) + c.first;
  const bool out_aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  for (size_t v = begin + threadIdx.x; v < end; v += blockDim.x) {
    Pack<T> xs[kCap];
    if (own_aligned && c.count - v * N >= static_cast<size_t>(N)) {  // whole packs: Note [loads before use]
      const void* src[kCap];
#pragma unroll
      for (int r = 0; r < kCap; ++r) {
        src[r] = (kWorldSize > 0 || r < world) ? (r == rank ? static_cast<const void*>(own + v * N)
                                                            : mine + r * c.slot_bytes + v * 16)
                                               : nullptr;
      }
      load_whole_packs<T, kWorldSize>(src, world, xs);
    } else {
#pragma unroll
      for (int r = 0; r < kCap; ++r) {
        if (kWorldSize > 0 || r < world) {
          xs[r] = r == rank ? load_pack(own, v, c.count, own_aligned)
                            : Pack<T>::load(mine + r * c.slot_bytes + v * 16);
        }
      }
    }
    store_pack(out, v, c.count, out_aligned, reduce_loaded<T, kWorldSize, kOp>(xs, world));
  }
  device::call_end(p.barrier);
}

}  // namespace

Status launch_reduce_scatter(const ReduceScatterParams& params, Stream stream) {
  const char* what = "reduce_scatter";
  Status status = check_common(what, params.dtype, params.op, params.barrier);
  if (!status.is_ok() || params.count == 0) return status;
  const size_t esize = dtype_size(params.dtype);
  const size_t world = static_cast<size_t>(params.barrier.world_size);
  ReduceScatterChunk c{};
  c.half_bytes = params.workspace.bytes / 2 / 16 * 16;
  const size_t max_chunk = c.half_bytes / world / 16 * 16 / esize;  // whole packs: chunks keep alignment
  if (max_chunk == 0) return Status(StatusCode::kInvalidArgument, detail::concat(what, ": workspace too small"));
  const size_t pack_elems = 16 / esize;
  const size_t chunk = std::min(max_chunk, (params.count + pack_elems - 1) / pack_elems * pack_elems);
  c.slot_bytes = chunk * esize;
  for (size_t first = 0; first < params.count; first += chunk) {
    c.first = first;
    c.count = std::min(chunk, params.count - first);
    const ExchangeGeometry g = exchange_geometry((c.count + pack_elems - 1) / pack_elems, params.max_blocks);
    const LaunchShape shape{dim3(g.blocks), dim3(g.threads)};
    COMMLIB_DISPATCH_FLOAT_DTYPE(params.dtype, T, what, [&] {
      COMMLIB_DISPATCH_WORLD_SIZE(params.barrier.world_size, kWorldSize, [&] {
        if (params.op == ReduceOp::kAvg) {
          status = launch_kernel(what, reduce_scatter_kernel<T, kWorldSize, ReduceOp::kAvg>, shape, stream,
                                 params.order, params, c, g.per_block);
        } else {
          status = launch_kernel(what, reduce_scatter_kernel<T, kWorldSize, ReduceOp::kSum>, shape, stream,
                                 params.order, params, c, g.per_block);
        }
      });
    });
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

}  // namespace commlib::kernels
