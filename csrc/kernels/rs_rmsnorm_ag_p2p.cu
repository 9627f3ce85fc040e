// Fused reduce-scatter -> residual add + RMSNorm -> all-gather over peer memory (TokenWeave's
// kernel, P2P variant). Per call (one chunk of rows of every rank's slice, Note [token slices]):
//   phase 0  block b copies the rows i = b (mod grid) of every rank's chunk from x into this
//            rank's workspace half, region X, at (owner, i); barrier kInputsReady.
//   phase 1  block b reduces its own rows i from every rank's region X (direct peer loads, rank
//            order), adds the residual, keeps the row in registers for the sum of squares,
//            normalises, writes out (and residual) locally and stores the normalised row (and,
//            replicated, the residual row) into every peer's region O (R) at (rank, i);
//            barrier kRowsPushed.
//   phase 2  block b copies the rows i of the other owners from its own regions O (R) to out
//            (residual).
// Block b only ever exchanges rows i = b (mod grid) with block b of the peers, which is what the
// per-block barrier (Note [flag barrier]) orders. Halves alternate by call parity: no end barrier.
// Arithmetic: Note [fused rmsnorm arithmetic] (explicit _rn intrinsics: no contraction).
#include <algorithm>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "commlib/env.hpp"
#include "kernels/rs_rmsnorm_ag_common.cuh"

namespace commlib::kernels {
namespace {
using namespace fused_detail;

template <typename T, int kWorldSize, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads)
    rs_rmsnorm_ag_p2p_kernel(RsRmsNormAgP2pParams p, FusedChunk chunk) {
  __shared__ float scratch[kMaxThreads + 1];
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const FusedRmsNormArgs& a = p.args;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const int64_t hidden = a.hidden;
  const int num_packs = static_cast<int>(hidden / kGroup);
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(T);
  const size_t region_bytes = static_cast<size_t>(world) * chunk.capacity * row_bytes;
  const size_t half = (call.call & 1) * chunk.half_bytes;
  const bool replicated = a.mode == ResidualMode::kReplicated;
  auto region = [&](int owner_rank, int which) {  // which: 0 X, 1 O, 2 R
    return p.workspace.peer<char>(owner_rank) + half + which * region_bytes;
  };
  auto chunk_rows = [&](int d) { return fused_detail::chunk_rows(a, chunk, world, d); };
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  T* residual = static_cast<T*>(a.residual);
  const T* weight = static_cast<const T*>(a.weight);
  const int64_t own_begin = token_slice(a.num_tokens, world, rank).begin;
  auto residual_row = [&](int64_t token) {
    return residual + (a.residual_layout == ResidualLayout::kSlice ? token - own_begin : token) * hidden;
  };

  // Phase 0: copy-in of the rows block b's peers will reduce.
  for (int d = 0; d < world; ++d) {
    const TokenSlice rows = chunk_rows(d);
    for (int64_t i = blockIdx.x; i < rows.size(); i += gridDim.x) {
      const T* src = x + (rows.begin + i) * hidden;
      char* dst = region(rank, 0) + (d * chunk.capacity + i) * row_bytes;
      for (int k = threadIdx.x; k < num_packs; k += blockDim.x) Pack<T>::load(src + k * kGroup).store(dst + k * 16);
    }
  }
  // Publishes this block's copy-in to the peers' block b; acquires theirs.
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(FusedRmsNormPhase::kInputsReady))) return;

  // Phase 1: reduce, add, normalise and push this rank's rows.
  const TokenSlice mine = chunk_rows(rank);
  for (int64_t i = blockIdx.x; i < mine.size(); i += gridDim.x) {
    const int64_t token = mine.begin + i;
    const size_t row_off = (rank * chunk.capacity + i) * row_bytes;
    T* res_row = residual_row(token);
    float r[kVecsPerThread][kGroup];
    float q[kVecsPerThread];
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int k = threadIdx.x + j * blockDim.x;
      q[j] = 0.0f;
      if (k >= num_packs) continue;
      constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
      Pack<T> xs[kCap];
#pragma unroll
      for (int s = 0; s < kCap; ++s) {
        if (kWorldSize > 0 || s < world) xs[s] = Pack<T>::load(region(s, 0) + row_off + k * 16);
      }
      auto acc = device::acc_init(xs[0]);
#pragma unroll
      for (int s = 1; s < kCap; ++s) {
        if (kWorldSize > 0 || s < world) device::acc_add(acc, xs[s]);
      }
      const Pack<T> sum = device::acc_cast<T>(acc);  // all_reduce's rounding
      const Pack<T> old = Pack<T>::load(res_row + k * kGroup);
      Pack<T> updated;
#pragma unroll
      for (int e = 0; e < kGroup; ++e) {
        updated.elems[e] = device::from_float<T>(
            __fadd_rn(device::to_float<T>(old.elems[e]), device::to_float<T>(sum.elems[e])));
        r[j][e] = device::to_float<T>(updated.elems[e]);
      }
      updated.store(res_row + k * kGroup);
      if (replicated) {
        for (int s = 0; s < world; ++s) {
          if (s != rank) updated.store(region(s, 2) + row_off + k * 16);
        }
      }
      q[j] = sum_squares(r[j]);
    }
    const float sumsq = block_sum_squares<kVecsPerThread>(q, scratch);
    const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sumsq, static_cast<float>(hidden)), a.eps)));
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int k = threadIdx.x + j * blockDim.x;
      if (k >= num_packs) continue;
      const Pack<T> w = Pack<T>::load(weight + k * kGroup);
      Pack<T> y;
#pragma unroll
      for (int e = 0; e < kGroup; ++e) {
        y.elems[e] = device::from_float<T>(__fmul_rn(__fmul_rn(r[j][e], rstd), device::to_float<T>(w.elems[e])));
      }
      y.store(out + token * hidden + k * kGroup);
      for (int s = 0; s < world; ++s) {
        if (s != rank) y.store(region(s, 1) + row_off + k * 16);
      }
    }
  }
  // Publishes this block's pushed rows to the peers' block b; acquires the rows they pushed here.
  if (!device::barrier_block(p.barrier, call.call, static_cast<int>(FusedRmsNormPhase::kRowsPushed))) return;

  // Phase 2: the other owners' rows, from this rank's own regions.
  for (int d = 0; d < world; ++d) {
    if (d == rank) continue;
    const TokenSlice rows = chunk_rows(d);
    for (int64_t i = blockIdx.x; i < rows.size(); i += gridDim.x) {
      const size_t row_off = (d * chunk.capacity + i) * row_bytes;
      T* dst = out + (rows.begin + i) * hidden;
      for (int k = threadIdx.x; k < num_packs; k += blockDim.x) {
        Pack<T>::load(region(rank, 1) + row_off + k * 16).store(dst + k * kGroup);
      }
      if (replicated) {
        T* rdst = residual + (rows.begin + i) * hidden;
        for (int k = threadIdx.x; k < num_packs; k += blockDim.x) {
          Pack<T>::load(region(rank, 2) + row_off + k * 16).store(rdst + k * kGroup);
        }
      }
    }
  }
  device::call_end(p.barrier);
}

template <typename T, int kWorldSize>
Status launch_typed(const RsRmsNormAgP2pParams& params, const FusedChunk& chunk, int blocks, Stream stream) {
  const int threads = fused_threads(params.args.hidden);
  const int64_t per_thread = fused_packs_per_thread(params.args.hidden);
  auto go = [&](auto kernel) {
    kernel<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(params, chunk);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      return Status(StatusCode::kCudaError,
                    detail::concat("fused_allreduce_rmsnorm(p2p): kernel launch failed: ", cudaGetErrorString(err)));
    }
    return Status::ok();
  };
  switch (per_thread) {
    case 1: return go(rs_rmsnorm_ag_p2p_kernel<T, kWorldSize, 1>);
    case 2: return go(rs_rmsnorm_ag_p2p_kernel<T, kWorldSize, 2>);
    case 4: return go(rs_rmsnorm_ag_p2p_kernel<T, kWorldSize, 4>);
    default: break;
  }
  return Status(StatusCode::kInvalidArgument,
                detail::concat("fused_allreduce_rmsnorm(p2p): hidden size ", params.args.hidden, " not supported"));
}

}  // namespace

const char* fused_rmsnorm_phase_name(int phase) {
  switch (static_cast<FusedRmsNormPhase>(phase)) {
    case FusedRmsNormPhase::kInputsReady: return "inputs ready (after copy-in)";
    case FusedRmsNormPhase::kRowsPushed: return "normalised rows pushed (before gather)";
  }
  return "unknown phase";
}

int fused_rmsnorm_num_blocks(int requested, int64_t rows_per_rank) {
  if (requested <= 0) requested = static_cast<int>(env::get_int("COMMLIB_FUSED_NUM_SMS"));
  if (requested > 0) return std::min(requested, std::min(kFusedMaxBlocks, kMaxBarrierBlocks));
  // By size: one CTA per row up to the default cap (a CTA normalises one row at a time).
  return static_cast<int>(std::clamp<int64_t>(rows_per_rank, 1, kFusedDefaultMaxBlocks));
}

Status launch_rs_rmsnorm_ag_p2p(const RsRmsNormAgP2pParams& params, Stream stream) {
  const char* what = "fused_allreduce_rmsnorm(p2p)";
  const FusedRmsNormArgs& a = params.args;
  const int world = params.barrier.world_size;
  if (a.dtype != DataType::kBFloat16 && a.dtype != DataType::kFloat16) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": dtype ", dtype_name(a.dtype),
                                                               " not supported on GPU; supported: bfloat16, float16"));
  }
  if (a.hidden < kGroup || a.hidden % kGroup != 0 || a.hidden > kFusedMaxHidden) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": hidden size ", a.hidden, " not supported; supported: multiples of ", kGroup,
                                 " up to ", kFusedMaxHidden));
  }
  if (world < 1 || world > kMaxDeviceRanks || params.barrier.rank < 0 || params.barrier.rank >= world) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": world_size ", world, " / rank ",
                                                               params.barrier.rank, " invalid; supported: 1..",
                                                               kMaxDeviceRanks));
  }
  if (a.num_tokens == 0) return Status::ok();
  if (!aligned16(a.x) || !aligned16(a.out) || !aligned16(a.residual) || !aligned16(a.weight)) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": x, residual, weight and out must be 16-byte aligned"));
  }
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtype_size(a.dtype);
  const size_t regions = a.mode == ResidualMode::kReplicated ? 3 : 2;
  FusedChunk chunk{};
  chunk.half_bytes = params.workspace.bytes / 2 / 256 * 256;
  const int64_t per_rank = (a.num_tokens + world - 1) / world;
  const int64_t fit = static_cast<int64_t>(chunk.half_bytes / (regions * world * row_bytes));
  if (fit < 1) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": one row needs ", 2 * regions * world * row_bytes,
                                 " bytes of GPU workspace but it has ", params.workspace.bytes,
                                 "; raise COMMLIB_GPU_WORKSPACE_BYTES"));
  }
  chunk.capacity = std::min(fit, per_rank);
  const int blocks = fused_rmsnorm_num_blocks(params.num_blocks, chunk.capacity);
  for (chunk.offset = 0; chunk.offset < per_rank; chunk.offset += chunk.capacity) {
    Status status;
    const auto launch = [&]<typename T>() {
      return COMMLIB_DISPATCH_WORLD_SIZE(world, kWorldSize, [&] { return launch_typed<T, kWorldSize>(params, chunk, blocks, stream); });
    };
    status = a.dtype == DataType::kBFloat16 ? launch.template operator()<__nv_bfloat16>()
                                            : launch.template operator()<__half>();
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

}  // namespace commlib::kernels
