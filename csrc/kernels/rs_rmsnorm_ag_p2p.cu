// Fused reduce-scatter -> residual add + RMSNorm -> all-gather over peer memory (TokenWeave's
// kernel, P2P variant), for token counts too large for the LL kernel (rs_rmsnorm_ag_p2p_ll.cu).
// Per call (one chunk of rows of every rank's slice, Note [token slices]), block b of every rank
// works on the rows i = b (mod grid) of each owner's chunk:
//   phase A  push: copies those rows of x owned by each peer d into d's workspace, region X, slot
//            of this rank (Note [fused p2p workspace]); barrier kInputsReady.
//   phase B  reduce its own rows i: x from its own tensor and the peers' rows from its own region
//            X (local loads only), in rank order; add the residual; sum of squares in registers
//            (one row per group of threads, several rows per CTA in flight); normalise; store out
//            (and residual) locally and push the normalised row (and, replicated, the residual
//            row) into every peer's region O (R); barrier kRowsPushed.
//   phase C  copy the other owners' rows i from its own regions O (R) to out (residual).
// Every NVLink transfer is a store (no remote load waits on a round trip), and every load is local,
// issued several packs per thread at once so that few SMs keep enough bytes in flight.
// Block b only exchanges rows i = b (mod grid) with block b of the peers, which is what the
// per-block barrier (Note [flag barrier]) orders. Arithmetic: Note [fused rmsnorm arithmetic]
// (explicit _rn intrinsics: no contraction).
//
// Note [fused p2p workspace]
// A call uses the workspace half of its parity (Note [flag barrier]: writes before the first
// barrier must not touch the half a peer may still be reading from the previous call). Rank o's
// half holds three regions, X, O and R, each with world - 1 slots (rank s != o in slot
// peer_slot(s, o, world)) of chunk.capacity rows: X[s][i] is row i of o's chunk of s's x, O[d][i]
// and R[d][i] are row i of d's chunk of out and of the new residual. Only o reads its own half.
#include <algorithm>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "commlib/env.hpp"
#include "kernels/rs_rmsnorm_ag_common.cuh"

namespace commlib::kernels {
namespace {
using namespace fused_detail;

constexpr int kThreads = 512;    // per CTA: several rows in flight, up to 128 registers a thread
constexpr int kVecs = 4;         // packs per thread and row in phase B
constexpr int kCopyUnroll = 8;   // packs in flight per thread in phases A and C

enum Region : int { kRegionX = 0, kRegionO = 1, kRegionR = 2 };

// Threads per row in phase B: a power of two in [32, kThreads] (warp-aligned groups, Note [fused
// rmsnorm arithmetic]'s tree) whose kVecs packs each cover the row's zero-padded pack count.
int row_threads(int64_t hidden) {
  return static_cast<int>(std::clamp<int64_t>(next_pow2(hidden / kGroup) / kVecs, 32, kThreads));
}

// Copies rows m = 0 .. num_rows - 1 (src_row(m) -> dst_row(m), num_packs packs each) with the whole
// block, kCopyUnroll 16-byte loads in flight per thread before their stores.
template <typename SrcRow, typename DstRow>
__device__ __forceinline__ void block_copy_rows(int num_rows, int num_packs, SrcRow src_row, DstRow dst_row) {
  const int total = num_rows * num_packs;
  const int step = static_cast<int>(blockDim.x);
  for (int base = static_cast<int>(threadIdx.x); base < total; base += kCopyUnroll * step) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int idx = base + u * step;
      if (idx < total) v[u] = device::ld_v4_u32(src_row(idx / num_packs) + (idx % num_packs) * 16);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int idx = base + u * step;
      if (idx < total) device::st_v4_u32(dst_row(idx / num_packs) + (idx % num_packs) * 16, v[u]);
    }
  }
}

template <typename T, int kWorldSize>
__global__ void __launch_bounds__(kThreads, 1)
    rs_rmsnorm_ag_p2p_kernel(RsRmsNormAgP2pParams p, FusedChunk chunk, int group) {
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  // Packs of one row loaded per batch in phase B: all kVecs for 2 ranks, fewer for more sources
  // (bounded registers: batch * (sources + residual) loads in flight).
  constexpr int kBatch = kCap <= 2 ? kVecs : (kCap <= 4 ? 2 : 1);
  __shared__ float scratch[kThreads];
  __shared__ float totals[kThreads / 32];
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const FusedRmsNormArgs& a = p.args;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const int num_packs = static_cast<int>(a.hidden / kGroup);
  const size_t row_bytes = static_cast<size_t>(a.hidden) * sizeof(T);
  const size_t slot_bytes = static_cast<size_t>(chunk.capacity) * row_bytes;
  const size_t region_bytes = static_cast<size_t>(world - 1) * slot_bytes;
  const size_t half = (call.call & 1) * chunk.half_bytes;
  const bool replicated = a.mode == ResidualMode::kReplicated;
  const int grid = static_cast<int>(gridDim.x);
  const int b = static_cast<int>(blockIdx.x);
  // Row i of rank s's slot of region `which` in rank `owner`'s workspace (Note [fused p2p workspace]).
  auto ws_row = [&](int owner, int which, int s, int64_t i) {
    return p.workspace.peer<char>(owner) + half + which * region_bytes + peer_slot(s, owner, world) * slot_bytes +
           i * row_bytes;
  };
  // Rows of `rows` this block handles: b, b + grid, ...
  auto block_rows = [&](const TokenSlice& rows) {
    const int64_t n = rows.size();
    return n > b ? static_cast<int>((n - b + grid - 1) / grid) : 0;
  };
  auto row_of = [&](int m) { return b + static_cast<int64_t>(m) * grid; };
  const char* x = static_cast<const char*>(a.x);

  // Phase A: push the rows of x the peers own into their region X.
  for (int step = 1; step < world; ++step) {
    const int d = (rank + step) % world;
    const TokenSlice rows = chunk_rows(a, chunk, world, d);
    block_copy_rows(
        block_rows(rows), num_packs, [&](int m) { return x + (rows.begin + row_of(m)) * row_bytes; },
        [&](int m) { return ws_row(d, kRegionX, rank, row_of(m)); });
  }
  // Publishes this block's pushes to the peers' block b; acquires the rows they pushed here.
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(FusedRmsNormPhase::kInputsReady))) return;

  // Phase B: reduce, add, normalise and push this rank's rows; blockDim / group rows at a time.
  // Packs stay raw (Note [raw packs]).
  const TokenSlice mine = chunk_rows(a, chunk, world, rank);
  const int64_t own_begin = token_slice(a.num_tokens, world, rank).begin;
  const int rows_per_iter = static_cast<int>(blockDim.x) / group;
  const int lane = static_cast<int>(threadIdx.x) & (group - 1);
  const int my_rows = block_rows(mine);
  const char* weight = static_cast<const char*>(a.weight);
  const char* x_peers = ws_row(rank, kRegionX, (rank + 1) % world, 0);  // slot 0; slot s at + s * slot_bytes
  for (int m0 = 0; m0 < my_rows; m0 += rows_per_iter) {  // block-uniform trip count
    const int m = m0 + static_cast<int>(threadIdx.x) / group;
    const bool active = m < my_rows;
    const int64_t i = row_of(m);
    const int64_t token = mine.begin + i;
    char* res_row = active ? reinterpret_cast<char*>(residual_row<T>(a, own_begin, token)) : nullptr;
    uint4 r[kVecs];
    float q[kVecs];
#pragma unroll
    for (int j0 = 0; j0 < kVecs; j0 += kBatch) {
      uint4 xs[kBatch][kCap];
      uint4 old[kBatch];
      // All loads of the batch first (local memory only), then the arithmetic.
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int k = lane + (j0 + j) * group;
        if (!active || k >= num_packs) continue;
        const size_t at = static_cast<size_t>(k) * 16;
#pragma unroll
        for (int s = 0; s < kCap; ++s) {
          if (kWorldSize == 0 && s >= world) continue;
          xs[j][s] = s == rank ? device::ld_v4_u32(x + token * row_bytes + at)
                               : device::ld_v4_u32(x_peers + peer_slot(s, rank, world) * slot_bytes +
                                                   i * row_bytes + at);
        }
        old[j] = device::ld_v4_u32(res_row + at);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int k = lane + (j0 + j) * group;
        q[j0 + j] = 0.0f;
        if (!active || k >= num_packs) continue;
        const size_t at = static_cast<size_t>(k) * 16;
        float acc[kGroup], rf[kGroup];
#pragma unroll
        for (int e = 0; e < kGroup; ++e) acc[e] = raw_elem<T>(xs[j][0], e);
#pragma unroll
        for (int s = 1; s < kCap; ++s) {  // rank order (Note [reduction order])
          if (kWorldSize > 0 || s < world) {
#pragma unroll
            for (int e = 0; e < kGroup; ++e) acc[e] = __fadd_rn(acc[e], raw_elem<T>(xs[j][s], e));
          }
        }
        r[j0 + j] = new_residual<T>(old[j], acc, rf);
        q[j0 + j] = sum_squares(rf);
        device::st_v4_u32(res_row + at, r[j0 + j]);
        if (replicated) {
          for (int step = 1; step < world; ++step) {
            const int d = (rank + step) % world;
            device::st_v4_u32(ws_row(d, kRegionR, rank, i) + at, r[j0 + j]);
          }
        }
      }
    }
    const float sumsq = group_sum_squares<kVecs>(q, scratch, totals, group);
    if (!active) continue;
    const float rstd = row_rstd(sumsq, a.hidden, a.eps);
    char* out_row = static_cast<char*>(a.out) + token * row_bytes;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int k = lane + j * group;
      if (k >= num_packs) continue;
      const size_t at = static_cast<size_t>(k) * 16;
      // The weight is cache-resident (every row reads it): loaded here, not held across the row.
      const uint4 y = normalised<T>(r[j], rstd, device::ld_v4_u32(weight + at));
      device::st_v4_u32(out_row + at, y);
      for (int step = 1; step < world; ++step) {
        const int d = (rank + step) % world;
        device::st_v4_u32(ws_row(d, kRegionO, rank, i) + at, y);
      }
    }
  }
  // Publishes this block's pushed rows to the peers' block b; acquires the rows they pushed here.
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(FusedRmsNormPhase::kRowsPushed))) return;

  // Phase C: the other owners' rows, from this rank's own regions O (and R).
  char* out = static_cast<char*>(a.out);
  char* residual = static_cast<char*>(a.residual);  // full layout whenever replicated
  for (int step = 1; step < world; ++step) {
    const int d = (rank + step) % world;
    const TokenSlice rows = chunk_rows(a, chunk, world, d);
    const int n = block_rows(rows);
    block_copy_rows(
        n, num_packs, [&](int m) { return static_cast<const char*>(ws_row(rank, kRegionO, d, row_of(m))); },
        [&](int m) { return out + (rows.begin + row_of(m)) * row_bytes; });
    if (replicated) {
      block_copy_rows(
          n, num_packs, [&](int m) { return static_cast<const char*>(ws_row(rank, kRegionR, d, row_of(m))); },
          [&](int m) { return residual + (rows.begin + row_of(m)) * row_bytes; });
    }
  }
  device::call_end(p.barrier);
}

template <typename T, int kWorldSize>
Status launch_typed(const RsRmsNormAgP2pParams& params, const FusedChunk& chunk, int blocks, int group,
                    Stream stream) {
  rs_rmsnorm_ag_p2p_kernel<T, kWorldSize><<<blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      params, chunk, group);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return Status(StatusCode::kCudaError,
                  detail::concat("fused_allreduce_rmsnorm(p2p): kernel launch failed: ", cudaGetErrorString(err)));
  }
  return Status::ok();
}

}  // namespace

namespace fused_detail {

Status check_p2p_args(const char* what, const FusedRmsNormArgs& a, const BarrierDevice& barrier) {
  const int world = barrier.world_size;
  if (a.dtype != DataType::kBFloat16 && a.dtype != DataType::kFloat16) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": dtype ", dtype_name(a.dtype),
                                                               " not supported on GPU; supported: bfloat16, float16"));
  }
  if (a.hidden < kGroup || a.hidden % kGroup != 0 || a.hidden > kFusedMaxHidden) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": hidden size ", a.hidden, " not supported; supported: multiples of ", kGroup,
                                 " up to ", kFusedMaxHidden));
  }
  if (world < 1 || world > kMaxDeviceRanks || barrier.rank < 0 || barrier.rank >= world) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": world_size ", world, " / rank ", barrier.rank,
                                                               " invalid; supported: 1..", kMaxDeviceRanks));
  }
  if (a.num_tokens > 0 && (!aligned16(a.x) || !aligned16(a.out) || !aligned16(a.residual) || !aligned16(a.weight))) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": x, residual, weight and out must be 16-byte aligned"));
  }
  return Status::ok();
}

}  // namespace fused_detail

const char* fused_rmsnorm_phase_name(int phase) {
  switch (static_cast<FusedRmsNormPhase>(phase)) {
    case FusedRmsNormPhase::kInputsReady: return "inputs ready (after the x push)";
    case FusedRmsNormPhase::kRowsPushed: return "normalised rows pushed (before gather)";
    case FusedRmsNormPhase::kLLInputs: return "LL x rows from the peer (owner waits)";
    case FusedRmsNormPhase::kLLRows: return "LL normalised rows from the owner";
  }
  return "unknown phase";
}

int fused_rmsnorm_num_blocks(int requested, int max_blocks, int64_t work_units) {
  const int limit = std::min(kFusedMaxBlocks, kMaxBarrierBlocks);
  if (requested <= 0) requested = static_cast<int>(env::get_int("COMMLIB_FUSED_NUM_SMS"));
  if (requested > 0) return std::min(requested, limit);
  // By size: one CTA per unit of work up to the cap (no idle CTAs in the barriers).
  const int cap = max_blocks > 0 ? std::min(max_blocks, limit) : kFusedDefaultMaxBlocks;
  return static_cast<int>(std::clamp<int64_t>(work_units, 1, cap));
}

Status launch_rs_rmsnorm_ag_p2p(const RsRmsNormAgP2pParams& params, Stream stream) {
  const char* what = "fused_allreduce_rmsnorm(p2p)";
  const FusedRmsNormArgs& a = params.args;
  const int world = params.barrier.world_size;
  Status status = check_p2p_args(what, a, params.barrier);
  if (!status.is_ok() || a.num_tokens == 0) return status;
  if (fused_rmsnorm_use_ll(params)) return launch_rs_rmsnorm_ag_p2p_ll(params, stream);
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtype_size(a.dtype);
  const size_t regions = a.mode == ResidualMode::kReplicated ? 3 : 2;
  FusedChunk chunk{};
  chunk.half_bytes = params.workspace.bytes / 2 / 256 * 256;
  const int64_t per_rank = (a.num_tokens + world - 1) / world;
  chunk.capacity = per_rank;
  if (world > 1) {
    const size_t per_row = regions * static_cast<size_t>(world - 1) * row_bytes;
    const int64_t fit = static_cast<int64_t>(chunk.half_bytes / per_row);
    if (fit < 1) {
      return Status(StatusCode::kInvalidArgument,
                    detail::concat(what, ": one row needs ", 2 * per_row, " bytes of GPU workspace but it has ",
                                   params.workspace.bytes, "; raise COMMLIB_GPU_WORKSPACE_BYTES"));
    }
    chunk.capacity = std::min(fit, per_rank);
  }
  const int group = row_threads(a.hidden);
  const int64_t rows_per_block = kThreads / group;
  const int cap = params.tuned_max_blocks > 0 ? params.tuned_max_blocks : kFusedP2pDefaultMaxBlocks;
  const int blocks = fused_rmsnorm_num_blocks(params.num_blocks, cap,
                                              (chunk.capacity + rows_per_block - 1) / rows_per_block);
  for (chunk.offset = 0; chunk.offset < per_rank; chunk.offset += chunk.capacity) {
    const auto launch = [&]<typename T>() {
      return COMMLIB_DISPATCH_WORLD_SIZE(
          world, kWorldSize, [&] { return launch_typed<T, kWorldSize>(params, chunk, blocks, group, stream); });
    };
    status = a.dtype == DataType::kBFloat16 ? launch.template operator()<__nv_bfloat16>()
                                            : launch.template operator()<__half>();
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

}  // namespace commlib::kernels
