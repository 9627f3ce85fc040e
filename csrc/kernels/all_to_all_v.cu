// Dynamic all-to-all with device-resident splits: the split sizes never visit the host.
// Note [all_to_all_v protocol]
// Phase A: every block b of rank r writes, into every peer d's control area at [b][r], where r
//   wants d's rows (the prefix of r's out_splits) and how many it expects; then the flag barrier
//   (block-paired, Note [flag barrier]).
// Phase B: block b of rank r reads [b][d] of its own control area (written by d's block b), checks
//   that d expects exactly in_splits[d] rows (a mismatch or a bad split is counted in the error
//   word and nothing is sent), and stores its 1/B slice of those rows straight into d's receive
//   buffer at that offset: the output itself when it is symmetric memory, else the workspace half
//   of this call's parity. Then the barrier again: block b of the receiver now sees the slices of
//   every peer's block b, which are exactly the rows it copies out of the workspace (if used).
// The workspace halves alternate by call parity, so no trailing barrier is needed (Note [flag barrier]).
#include <cuda_runtime.h>

#include <algorithm>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "kernels/all_to_all_v_params.hpp"
#include "kernels/launch.cuh"

namespace commlib::kernels {
namespace {

constexpr int kThreads = 512;

struct ControlSlot {
  int64_t offset;  // row offset in the receiver's buffer; -1: the receiver rejected its splits
  int64_t rows;
};

__device__ __forceinline__ void copy_bytes(char* dst, const char* src, int64_t n) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(n)) & 15u) == 0) {
    for (int64_t i = threadIdx.x; i < n / 16; i += blockDim.x) {
      device::st_v4_u32(dst + i * 16, device::ld_v4_u32(src + i * 16));
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

template <int kWorldSize>
__global__ void __launch_bounds__(kThreads) all_to_all_v_kernel(AllToAllVParams p, size_t half_bytes) {
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  constexpr int kMax = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  int64_t in_rows[kMax], in_off[kMax], out_rows[kMax], out_off[kMax];
  int64_t in_total = 0, out_total = 0;
  bool splits_ok = true;
#pragma unroll
  for (int r = 0; r < kMax; ++r) {
    if (r >= world) break;
    in_rows[r] = p.in_splits != nullptr ? p.in_splits[r] : p.in_rows / world;
    out_rows[r] = p.out_splits != nullptr ? p.out_splits[r] : p.out_rows / world;
    splits_ok = splits_ok && in_rows[r] >= 0 && out_rows[r] >= 0;
    in_off[r] = in_total;
    out_off[r] = out_total;
    in_total += in_rows[r];
    out_total += out_rows[r];
  }
  splits_ok = splits_ok && in_total <= p.in_rows && out_total <= p.out_rows &&
              (p.target == AllToAllVTarget::kSymmetricOutput ||
               static_cast<size_t>(out_total * p.row_bytes) <= half_bytes);
  const int64_t b = blockIdx.x, nb = gridDim.x;
  auto* errors = reinterpret_cast<unsigned long long*>(p.control.local<char>() + kAllToAllVErrorOffset);
  if (!splits_ok && b == 0 && threadIdx.x == 0) atomicAdd(errors, 1ull);

  // Phase A: tell every peer where its rows go here.
  if (threadIdx.x < world) {
    const int d = threadIdx.x;
    ControlSlot* slot = p.control.peer<ControlSlot>(d) + b * kMaxDeviceRanks + rank;
    slot->offset = splits_ok ? out_off[d] : -1;
    slot->rows = splits_ok ? out_rows[d] : 0;
  }
  if (!device::barrier_block<Phase::kAllToAllOffsetsPublished>(p.barrier, call.call)) return;

  // Phase B: this block's slice of the rows for every peer, straight into the peer's buffer.
  const size_t half = (call.call & 1) * half_bytes;
  for (int d = 0; d < world; ++d) {
    const ControlSlot slot = p.control.local<ControlSlot>()[b * kMaxDeviceRanks + d];
    if (!splits_ok || slot.offset < 0) continue;
    if (slot.rows != in_rows[d]) {
      if (b == 0 && threadIdx.x == 0) atomicAdd(errors, 1ull);
      continue;
    }
    const int64_t lo = in_rows[d] * b / nb, hi = in_rows[d] * (b + 1) / nb;
    char* dst = p.target == AllToAllVTarget::kSymmetricOutput ? p.recv.peer<char>(d) : p.recv.peer<char>(d) + half;
    copy_bytes(dst + (slot.offset + lo) * p.row_bytes,
               static_cast<const char*>(p.input) + (in_off[d] + lo) * p.row_bytes, (hi - lo) * p.row_bytes);
  }
  if (!device::barrier_block<Phase::kAllToAllRowsLanded>(p.barrier, call.call)) return;

  if (p.target == AllToAllVTarget::kWorkspace && splits_ok) {
    for (int s = 0; s < world; ++s) {
      const int64_t lo = out_rows[s] * b / nb, hi = out_rows[s] * (b + 1) / nb;
      copy_bytes(static_cast<char*>(p.output) + (out_off[s] + lo) * p.row_bytes,
                 p.recv.local<char>() + half + (out_off[s] + lo) * p.row_bytes, (hi - lo) * p.row_bytes);
    }
  }
  device::call_end(p.barrier);
}

}  // namespace


Status launch_all_to_all_v(const AllToAllVParams& p, Stream stream) {
  const char* what = "all_to_all_v(cuda)";
  if (p.barrier.world_size < 1 || p.barrier.world_size > kMaxDeviceRanks) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": world_size ", p.barrier.world_size,
                                                               " not supported; valid: 1..", kMaxDeviceRanks));
  }
  if (p.control.bytes < kAllToAllVControlBytes) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": control area too small"));
  }
  const size_t half_bytes = p.target == AllToAllVTarget::kWorkspace ? p.recv.bytes / 2 / 16 * 16 : 0;
  const int blocks = std::clamp(p.num_blocks, 1, kMaxBarrierBlocks);
  return COMMLIB_DISPATCH_WORLD_SIZE(p.barrier.world_size, kWorldSize, [&] {
    return launch_kernel(what, all_to_all_v_kernel<kWorldSize>, {dim3(blocks), dim3(kThreads)}, stream,
                         LaunchOrder::kStream, p, half_bytes);
  });
}

}  // namespace commlib::kernels
