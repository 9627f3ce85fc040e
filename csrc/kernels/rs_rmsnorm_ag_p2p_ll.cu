// Fused reduce-scatter -> residual add + RMSNorm -> all-gather without barriers, for the smallest
// token counts (decode), where two barrier round trips cost more than the data. The data flow is
// rs_rmsnorm_ag_p2p.cu's, but every transfer is a flag-carrying LL line (Note [LL lines]) in the
// communicator's LL buffer (Note [fused LL layout]), so each consumer waits only for the bytes it
// needs, and one kernel call does the whole op:
//   1. push: every thread stores packs of the x rows each peer d owns into d's region X (slot of
//      this rank) as LL lines.
//   2. own rows: block b takes rows b, b + grid, ... of this rank's slice; it loads its own x, the
//      residual and the weight first, then waits for each peer's lines in rank order and reduces,
//      adds the residual, sums the squares over the block (Note [fused rmsnorm arithmetic]),
//      normalises, stores locally and pushes the normalised row (and, replicated, the residual
//      row) into every peer's region O (R) as LL lines.
//   3. gather: every thread waits for packs of the other owners' rows in its own regions O (R)
//      and stores them to out (residual).
// Every block pushes before it waits, so waits only depend on other ranks. Waits are bounded
// (COMMLIB timeout); a timeout records rank, peer and phase and the kernel returns. Single call:
// the launcher only picks this kernel when every rank's slice fits one region
// (fused_rmsnorm_use_ll). Call parity and flag = call + 1 come from the shared call counter, so the
// kernel is graph-replay safe like every other.
#include <algorithm>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "commlib/env.hpp"
#include "kernels/rs_rmsnorm_ag_common.cuh"

namespace commlib::kernels {
namespace {
using namespace fused_detail;

constexpr int kLLMaxThreads = 512;  // one row per block: up to 4 packs per thread, 128 registers
constexpr int kLLMinBlocks = 4;      // default floor: spreads the push and gather stores over SMs

enum LLRegion : int { kLLRegionX = 0, kLLRegionO = 1, kLLRegionR = 2 };

// Stores a raw pack as the two LL lines at dst: {word 0, flag, word 1, flag}, {word 2, flag, ...}.
__device__ __forceinline__ void ll_store(uint4* dst, const uint4& raw, uint32_t flag) {
  device::st_volatile_v4_u32(dst, uint4{raw.x, flag, raw.y, flag});
  device::st_volatile_v4_u32(dst + 1, uint4{raw.z, flag, raw.w, flag});
}

// Waits until both lines at src carry `flag` and returns their payload (a raw pack). On timeout it
// records (rank, peer, phase) in the error word, sets `failed` and returns garbage; a thread that
// has failed does not wait again.
__device__ __forceinline__ uint4 ll_wait(const uint4* src, uint32_t flag, const BarrierDevice& bar, int peer,
                                           FusedRmsNormPhase phase, uint64_t call, int& failed) {
  uint4 lo = device::ld_volatile_v4_u32(src), hi = device::ld_volatile_v4_u32(src + 1);
  auto ready = [&] { return lo.y == flag && lo.w == flag && hi.y == flag && hi.w == flag; };
  if (!ready() && !failed) {
    const uint64_t start = device::globaltimer_ns();
    while (!ready()) {
      lo = device::ld_volatile_v4_u32(src);
      hi = device::ld_volatile_v4_u32(src + 1);
      const uint64_t elapsed = device::globaltimer_ns() - start;
      if (elapsed > bar.timeout_ns) {
        device::record_timeout(bar, peer, static_cast<int>(phase), elapsed, call);
        failed = 1;
        break;
      }
    }
  }
  return uint4{lo.x, lo.z, hi.x, hi.z};
}

template <typename T, int kWorldSize, int kVecs>
__global__ void __launch_bounds__(kLLMaxThreads)
    rs_rmsnorm_ag_p2p_ll_kernel(RsRmsNormAgP2pParams p, size_t region_bytes) {
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  __shared__ float scratch[kLLMaxThreads];
  __shared__ float totals[kLLMaxThreads / 32];
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const FusedRmsNormArgs& a = p.args;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const int num_packs = static_cast<int>(a.hidden / kGroup);
  const uint32_t flag = static_cast<uint32_t>(call.call + 1);
  const size_t half = (call.call & 1) * (p.lines.bytes / 2);
  const bool replicated = a.mode == ResidualMode::kReplicated;
  const char* x = static_cast<const char*>(a.x);
  const size_t row_bytes = static_cast<size_t>(a.hidden) * sizeof(T);
  // First line of (row i, pack k) of rank s's slot, region `which`, in rank `owner`'s LL buffer.
  auto line = [&](int owner, int which, int s, int64_t i, int k) {
    char* region = p.lines.peer<char>(owner) + half + (peer_slot(s, owner, world) * 3 + which) * region_bytes;
    return reinterpret_cast<uint4*>(region) + 2 * (i * num_packs + k);
  };
  const int64_t num_threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int failed = 0;

  // 1. Push the x rows every peer owns.
  for (int step = 1; step < world; ++step) {
    const int d = (rank + step) % world;
    const TokenSlice rows = token_slice(a.num_tokens, world, d);
    const int64_t total = rows.size() * num_packs;
    for (int64_t idx = first; idx < total; idx += num_threads) {
      const int64_t i = idx / num_packs;
      const int k = static_cast<int>(idx % num_packs);
      ll_store(line(d, kLLRegionX, rank, i, k), device::ld_v4_u32(x + (rows.begin + i) * row_bytes + k * 16), flag);
    }
  }

  // 2. This rank's rows, one per block at a time. Packs stay raw (Note [raw packs]).
  const TokenSlice mine = token_slice(a.num_tokens, world, rank);
  const char* weight = static_cast<const char*>(a.weight);
  for (int64_t i = blockIdx.x; i < mine.size(); i += gridDim.x) {  // block-uniform
    const int64_t token = mine.begin + i;
    char* res_row = reinterpret_cast<char*>(residual_row<T>(a, mine.begin, token));
    uint4 own[kVecs], old[kVecs], w[kVecs], r[kVecs];
    float acc[kVecs][kGroup];
    float q[kVecs];
    // Local loads first: their latency overlaps the wait for the peers' lines.
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int k = static_cast<int>(threadIdx.x) + j * static_cast<int>(blockDim.x);
      if (k >= num_packs) continue;
      own[j] = device::ld_v4_u32(x + token * row_bytes + k * 16);
      old[j] = device::ld_v4_u32(res_row + k * 16);
      w[j] = device::ld_v4_u32(weight + k * 16);
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int k = static_cast<int>(threadIdx.x) + j * static_cast<int>(blockDim.x);
      if (k >= num_packs) continue;
#pragma unroll
      for (int s = 0; s < kCap; ++s) {  // rank order (Note [reduction order])
        if (kWorldSize == 0 && s >= world) continue;
        const uint4 xs = s == rank ? own[j]
                                   : ll_wait(line(rank, kLLRegionX, s, i, k), flag, p.barrier, s,
                                             FusedRmsNormPhase::kLLInputs, call.call, failed);
#pragma unroll
        for (int e = 0; e < kGroup; ++e) acc[j][e] = s == 0 ? raw_elem<T>(xs, e) : __fadd_rn(acc[j][e], raw_elem<T>(xs, e));
      }
    }
    // Nothing is pushed from garbage: a block with a failed wait stops here.
    if (__syncthreads_or(failed)) return;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int k = static_cast<int>(threadIdx.x) + j * static_cast<int>(blockDim.x);
      q[j] = 0.0f;
      if (k >= num_packs) continue;
      float rf[kGroup];
      r[j] = new_residual<T>(old[j], acc[j], rf);
      q[j] = sum_squares(rf);
      device::st_v4_u32(res_row + k * 16, r[j]);
      if (replicated) {
        for (int step = 1; step < world; ++step) {
          const int d = (rank + step) % world;
          ll_store(line(d, kLLRegionR, rank, i, k), r[j], flag);
        }
      }
    }
    const float rstd = row_rstd(group_sum_squares<kVecs>(q, scratch, totals, static_cast<int>(blockDim.x)), a.hidden,
                                a.eps);
    char* out_row = static_cast<char*>(a.out) + token * row_bytes;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int k = static_cast<int>(threadIdx.x) + j * static_cast<int>(blockDim.x);
      if (k >= num_packs) continue;
      const uint4 y = normalised<T>(r[j], rstd, w[j]);
      device::st_v4_u32(out_row + k * 16, y);
      for (int step = 1; step < world; ++step) {
        const int d = (rank + step) % world;
        ll_store(line(d, kLLRegionO, rank, i, k), y, flag);
      }
    }
  }

  // 3. Gather the other owners' rows from this rank's own regions O (and R).
  char* out = static_cast<char*>(a.out);
  char* residual = static_cast<char*>(a.residual);  // full layout whenever replicated
  for (int step = 1; step < world && !failed; ++step) {
    const int d = (rank + step) % world;
    const TokenSlice rows = token_slice(a.num_tokens, world, d);
    const int64_t total = rows.size() * num_packs;
    for (int64_t idx = first; idx < total && !failed; idx += num_threads) {
      const int64_t i = idx / num_packs;
      const int k = static_cast<int>(idx % num_packs);
      const size_t offset = (rows.begin + i) * row_bytes + k * 16;
      device::st_v4_u32(out + offset, ll_wait(line(rank, kLLRegionO, d, i, k), flag, p.barrier, d,
                                              FusedRmsNormPhase::kLLRows, call.call, failed));
      if (replicated) {
        device::st_v4_u32(residual + offset, ll_wait(line(rank, kLLRegionR, d, i, k), flag, p.barrier, d,
                                                     FusedRmsNormPhase::kLLRows, call.call, failed));
      }
    }
  }
  if (__syncthreads_or(failed)) return;
  device::call_end(p.barrier);
}

}  // namespace

bool fused_rmsnorm_use_ll(const RsRmsNormAgP2pParams& params) {
  const FusedRmsNormArgs& a = params.args;
  const int world = params.barrier.world_size;
  if (world < 2 || params.lines.bytes == 0 || a.num_tokens <= 0) return false;
  const int64_t slice_bytes = (a.num_tokens + world - 1) / world * a.hidden * static_cast<int64_t>(dtype_size(a.dtype));
  const int64_t limit = env::get_int("COMMLIB_FUSED_LL_MAX_BYTES");
  // Lines carry 8 payload bytes in 16.
  return slice_bytes <= limit && 2 * static_cast<size_t>(slice_bytes) <= fused_ll_region_bytes(params.lines.bytes, world);
}

Status launch_rs_rmsnorm_ag_p2p_ll(const RsRmsNormAgP2pParams& params, Stream stream) {
  const char* what = "fused_allreduce_rmsnorm(p2p, LL)";
  const FusedRmsNormArgs& a = params.args;
  const int world = params.barrier.world_size;
  Status status = check_p2p_args(what, a, params.barrier);
  if (!status.is_ok() || a.num_tokens == 0) return status;
  const size_t region_bytes = fused_ll_region_bytes(params.lines.bytes, world);
  const int64_t per_rank = (a.num_tokens + world - 1) / world;
  const size_t slice_bytes = static_cast<size_t>(per_rank * a.hidden) * dtype_size(a.dtype);
  if (world < 2 || 2 * slice_bytes > region_bytes) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": a slice of ", slice_bytes, " bytes needs ", 2 * slice_bytes,
                                 " bytes of LL region; the LL buffer has ", region_bytes, " per region (world ", world,
                                 ")"));
  }
  // One row per block: threads = the row's packs rounded up to a power of two (32..512); hidden
  // 8192 has 1024 packs, two per thread, hidden 16384 four.
  const int64_t padded = next_pow2(a.hidden / kGroup);
  const int threads = static_cast<int>(std::clamp<int64_t>(padded, 32, kLLMaxThreads));
  const int64_t vecs = std::max<int64_t>(1, padded / threads);
  // The tuned count (measured on the barrier kernel at a large batch) does not apply here: tuned_max_blocks 0.
  const int blocks = fused_rmsnorm_num_blocks(params.num_blocks, 0, std::max<int64_t>(per_rank, kLLMinBlocks));
  auto go = [&](auto kernel) {
    kernel<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(params, region_bytes);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      return Status(StatusCode::kCudaError, detail::concat(what, ": kernel launch failed: ", cudaGetErrorString(err)));
    }
    return Status::ok();
  };
  const auto launch = [&]<typename T>() {
    return COMMLIB_DISPATCH_WORLD_SIZE(world, kWorldSize, [&] {
      switch (vecs) {
        case 1: return go(rs_rmsnorm_ag_p2p_ll_kernel<T, kWorldSize, 1>);
        case 2: return go(rs_rmsnorm_ag_p2p_ll_kernel<T, kWorldSize, 2>);
        default: return go(rs_rmsnorm_ag_p2p_ll_kernel<T, kWorldSize, 4>);
      }
    });
  };
  return a.dtype == DataType::kBFloat16 ? launch.template operator()<__nv_bfloat16>()
                                        : launch.template operator()<__half>();
}

}  // namespace commlib::kernels
