// Push exchange (Note [push exchange]): all_gather, all_to_all with equal splits and broadcast.
// One call (one chunk of at most one slot per source):
//   push      each sending rank stores its block for peer q into slot `rank` of q's workspace
//             half (and, all_gather / all_to_all, its own block straight into its own output)
//   barrier   kInputsReady: the pushes into this rank's half have landed
//   copy-out  slot s of this rank's half -> output block s, for every source s != rank
// No trailing barrier: halves alternate by call parity; a rank that pushes into half h again
// (call k + 2) has passed a barrier of call k + 1, so every peer finished call k's copy-out.
#include "commlib/device/barrier.cuh"
#include "kernels/exchange_common.cuh"

namespace commlib::kernels {
namespace {

struct ExchangeChunk {
  size_t offset;      // bytes into each block
  size_t bytes;       // bytes of this chunk of each block
  size_t slot_bytes;  // stride between the slots of a half
  size_t half_bytes;
};

__global__ void __launch_bounds__(kExchangeThreads, kExchangeMinBlocksPerSm)
    exchange_kernel(ExchangeParams p, ExchangeChunk c, size_t per_block) {
  pdl_begin(p.order);  // before call_begin reads the counter the previous kernel advanced
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const int world = p.barrier.world_size;
  const int rank = p.barrier.rank;
  const size_t num_packs = (c.bytes + 15) / 16;
  size_t begin, end;
  block_range(num_packs, per_block, &begin, &end);
  const size_t half = (call.call & 1) * c.half_bytes;
  const uint8_t* in = static_cast<const uint8_t*>(p.input) + c.offset;
  uint8_t* out = static_cast<uint8_t*>(p.output) + c.offset;
  const bool sends = p.root < 0 || p.root == rank;
  const int my_slot = p.root < 0 ? rank : 0;

  if (sends) {
    for (int i = 1; i < world; ++i) {
      const int q = exchange_peer_after(rank, i, world);
      const uint8_t* src = in + q * p.in_stride;
      const bool src_aligned = (reinterpret_cast<uintptr_t>(src) & 15u) == 0;
      uint8_t* slot = p.workspace.peer<uint8_t>(q) + half + my_slot * c.slot_bytes;
      // The slot holds whole packs: full-width stores even in the tail.
      exchange_copy<BytePack>(
          begin, end, [&](size_t v) { return load_bytes(src, v, c.bytes, src_aligned); },
          [&](size_t v, const BytePack& x) { x.store(slot + v * 16); });
    }
    if (p.root < 0) {
      const uint8_t* src = in + rank * p.in_stride;
      uint8_t* dst = out + rank * p.out_stride;
      if (src != dst) {  // all_gather with the input already in place: nothing to copy
        const bool src_aligned = (reinterpret_cast<uintptr_t>(src) & 15u) == 0;
        const bool dst_aligned = (reinterpret_cast<uintptr_t>(dst) & 15u) == 0;
        exchange_copy<BytePack>(
            begin, end, [&](size_t v) { return load_bytes(src, v, c.bytes, src_aligned); },
            [&](size_t v, const BytePack& x) { store_bytes(dst, v, c.bytes, dst_aligned, x); });
      }
    }
  }
  // The pushes of every peer's block b into this half have landed (release/acquire, system scope).
  if (!device::barrier_block<Phase::kInputsReady>(p.barrier, call.call)) return;
  const uint8_t* mine = p.workspace.peer<uint8_t>(rank) + half;
  for (int i = 1; i < world; ++i) {
    const int s = exchange_peer_after(rank, i, world);
    if (p.root >= 0 && (s != p.root || rank == p.root)) continue;
    const uint8_t* slot = mine + (p.root < 0 ? s : 0) * c.slot_bytes;
    uint8_t* dst = out + s * p.out_stride;
    const bool dst_aligned = (reinterpret_cast<uintptr_t>(dst) & 15u) == 0;
    exchange_copy<BytePack>(
        begin, end, [&](size_t v) { return BytePack::load(slot + v * 16); },
        [&](size_t v, const BytePack& x) { store_bytes(dst, v, c.bytes, dst_aligned, x); });
  }
  device::call_end(p.barrier);
}

}  // namespace

Status launch_exchange(const ExchangeParams& params, Stream stream) {
  const char* what = params.what;
  Status status = check_barrier(what, params.barrier);
  if (!status.is_ok() || params.bytes == 0) return status;
  const int world = params.barrier.world_size;
  if (params.root >= world) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": root ", params.root, " out of range; valid: 0..", world - 1));
  }
  ExchangeChunk c{};
  c.half_bytes = params.workspace.bytes / 2 / 16 * 16;
  const size_t slots = params.root < 0 ? static_cast<size_t>(world) : 1;
  const size_t max_chunk = c.half_bytes / slots / 16 * 16;
  if (max_chunk == 0) return Status(StatusCode::kInvalidArgument, detail::concat(what, ": workspace too small"));
  const size_t chunk = std::min(max_chunk, (params.bytes + 15) / 16 * 16);
  c.slot_bytes = chunk;
  for (size_t first = 0; first < params.bytes; first += chunk) {
    c.offset = first;
    c.bytes = std::min(chunk, params.bytes - first);
    const ExchangeGeometry g = exchange_geometry((c.bytes + 15) / 16, params.max_blocks);
    status = launch_kernel(what, exchange_kernel, {dim3(g.blocks), dim3(g.threads)}, stream, params.order, params, c,
                           g.per_block);
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

}  // namespace commlib::kernels
