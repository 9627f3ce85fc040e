// Fused reduce-scatter -> residual add + RMSNorm -> all-gather with NVLink SHARP (NVLS):
// multimem.ld_reduce sums a pack over every rank's copy in the switch, multimem.st writes a pack
// to every rank at once. Same phases and workspace regions as rs_rmsnorm_ag_p2p.cu (X copy-in,
// O gather), but phase 1 reads region X once through the multicast address instead of n peer
// loads, and pushes the normalised row with one multicast store instead of n - 1 peer stores.
//
// SAFETY: never launched unless the multicast guard allowed it (csrc/common/multicast_guard.hpp:
// explicit COMMLIB_ENABLE_MULTICAST set to 1 and no kill switch); nothing in this file creates a
// multicast object. On the lent machines it is compiled and its SASS inspected only.
//
// Bitwise note: the switch accumulates in fp32 (.acc::f32) and rounds the sum once, but adds the
// ranks in its own order, so unlike p2p this variant is not bitwise equal to the rank-order
// reduction of Note [reduction order] in general (at world 2, where a + b == b + a, it should be;
// unchecked: the kernel has never run); the norm arithmetic after the sum is the same. Replicated mode gathers the residual rows through region R
// with multimem.st as well.
//
// Note [multimem proxy fences]
// The workspace is written and read through two addresses: this rank's unicast mapping and the
// multicast one (Note [multicast workspace]). The memory model orders accesses through different
// virtual aliases of the same bytes only across fence.proxy.alias, so each phase change has one on
// both sides of its barrier: after the unicast copy-in (before the release) and before the
// multimem loads (after the acquire); after the multimem stores and before the unicast reads of
// what they wrote.
#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "kernels/rs_rmsnorm_ag_common.cuh"

namespace commlib::kernels {
namespace {
using namespace fused_detail;

// PTX wrappers named after the instruction. Kept in this file, not device/ptx.cuh, so that the
// headers every other kernel includes cannot issue multicast (tests/cpu/test_all_reduce_selection.py).
// multimem.ld_reduce: the sum over every rank's copy of the 16 bytes at the multicast address,
// accumulated in fp32 and rounded once (.acc::f32).
__device__ __forceinline__ uint4 multimem_ld_reduce_add_acc_f32_v4_bf16x2(const void* mc_addr) {
  uint4 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc_addr)
               : "memory");
  return v;
}
__device__ __forceinline__ uint4 multimem_ld_reduce_add_acc_f32_v4_f16x2(const void* mc_addr) {
  uint4 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc_addr)
               : "memory");
  return v;
}
// multimem.st: stores the 16 bytes to every rank's copy.
__device__ __forceinline__ void multimem_st_v4_f32(void* mc_addr, uint4 v) {
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(mc_addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// fence.proxy.alias: orders this thread's accesses through one virtual alias of some bytes with
// its accesses through another (Note [multimem proxy fences]).
__device__ __forceinline__ void fence_proxy_alias() { asm volatile("fence.proxy.alias;" ::: "memory"); }

template <typename T>
__device__ __forceinline__ Pack<T> multimem_sum(const void* mc_addr) {
  uint4 raw;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    raw = multimem_ld_reduce_add_acc_f32_v4_bf16x2(mc_addr);
  } else {
    raw = multimem_ld_reduce_add_acc_f32_v4_f16x2(mc_addr);
  }
  Pack<T> x;
  *reinterpret_cast<uint4*>(&x) = raw;
  return x;
}

template <typename T>
__device__ __forceinline__ void multimem_store(void* mc_addr, const Pack<T>& x) {
  multimem_st_v4_f32(mc_addr, *reinterpret_cast<const uint4*>(&x));
}

template <typename T, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads)
    rs_rmsnorm_ag_multimem_kernel(RsRmsNormAgMultimemParams p, FusedChunk chunk) {
  __shared__ float scratch[kMaxThreads + 1];
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const FusedRmsNormArgs& a = p.args;
  const int world = p.barrier.world_size;
  const int rank = p.barrier.rank;
  const int64_t hidden = a.hidden;
  const int num_packs = static_cast<int>(hidden / kGroup);
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(T);
  const size_t region_bytes = static_cast<size_t>(world) * chunk.capacity * row_bytes;
  const size_t half = (call.call & 1) * chunk.half_bytes;
  const bool replicated = a.mode == ResidualMode::kReplicated;
  char* local = p.workspace.local<char>() + half;
  char* mc = static_cast<char*>(p.multicast_workspace) + half;
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  T* residual = static_cast<T*>(a.residual);
  const T* weight = static_cast<const T*>(a.weight);
  const int64_t own_begin = token_slice(a.num_tokens, world, rank).begin;

  for (int d = 0; d < world; ++d) {
    const TokenSlice rows = chunk_rows(a, chunk, world, d);
    for (int64_t i = blockIdx.x; i < rows.size(); i += gridDim.x) {
      const T* src = x + (rows.begin + i) * hidden;
      char* dst = local + (d * chunk.capacity + i) * row_bytes;
      for (int k = threadIdx.x; k < num_packs; k += blockDim.x) Pack<T>::load(src + k * kGroup).store(dst + k * 16);
    }
  }
  // The unicast copy-in, ordered before multicast reads of the same bytes (Note [multimem proxy fences]).
  fence_proxy_alias();
  // Publishes this block's copy-in to the peers' block b (whose multimem loads read it).
  if (!device::barrier_block<Phase::kInputsReady>(p.barrier, call.call)) return;
  // The peers' copy-ins, acquired through the unicast flags, ordered before the multicast loads.
  fence_proxy_alias();

  const TokenSlice mine = chunk_rows(a, chunk, world, rank);
  for (int64_t i = blockIdx.x; i < mine.size(); i += gridDim.x) {
    const int64_t token = mine.begin + i;
    const size_t row_off = (rank * chunk.capacity + i) * row_bytes;
    T* res_row = residual + (a.residual_layout == ResidualLayout::kSlice ? token - own_begin : token) * hidden;
    float r[kVecsPerThread][kGroup];
    float q[kVecsPerThread];
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int k = threadIdx.x + j * blockDim.x;
      q[j] = 0.0f;
      if (k >= num_packs) continue;
      const Pack<T> sum = multimem_sum<T>(mc + row_off + k * 16);
      const Pack<T> old = Pack<T>::load(res_row + k * kGroup);
      Pack<T> updated;
#pragma unroll
      for (int e = 0; e < kGroup; ++e) {
        updated.elems[e] = device::from_float<T>(
            __fadd_rn(device::to_float<T>(old.elems[e]), device::to_float<T>(sum.elems[e])));
        r[j][e] = device::to_float<T>(updated.elems[e]);
      }
      updated.store(res_row + k * kGroup);
      if (replicated) multimem_store(mc + 2 * region_bytes + row_off + k * 16, updated);
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
      multimem_store(mc + region_bytes + row_off + k * 16, y);
    }
  }
  // Orders the multimem stores before the barrier's release for every observer, and before unicast
  // accesses to the same bytes (Note [multimem proxy fences]).
  fence_proxy_alias();
  device::fence_acq_rel_sys();
  if (!device::barrier_block<Phase::kRowsPushed>(p.barrier, call.call)) return;
  // What the peers' multimem stores wrote, ordered before this rank's unicast reads of it.
  fence_proxy_alias();

  for (int d = 0; d < world; ++d) {
    const TokenSlice rows = chunk_rows(a, chunk, world, d);
    for (int64_t i = blockIdx.x; i < rows.size(); i += gridDim.x) {
      const size_t row_off = (d * chunk.capacity + i) * row_bytes;
      T* dst = out + (rows.begin + i) * hidden;
      for (int k = threadIdx.x; k < num_packs; k += blockDim.x) {
        Pack<T>::load(local + region_bytes + row_off + k * 16).store(dst + k * kGroup);
      }
      if (replicated && d != rank) {
        T* rdst = residual + (rows.begin + i) * hidden;
        for (int k = threadIdx.x; k < num_packs; k += blockDim.x) {
          Pack<T>::load(local + 2 * region_bytes + row_off + k * 16).store(rdst + k * kGroup);
        }
      }
    }
  }
  device::call_end(p.barrier);
}

template <typename T>
Status launch_typed(const RsRmsNormAgMultimemParams& params, const FusedChunk& chunk, int blocks, Stream stream) {
  const int threads = fused_threads(params.args.hidden);
  auto go = [&](auto kernel) {
    return launch_kernel("fused_allreduce_rmsnorm(multimem)", kernel, {dim3(blocks), dim3(threads)},
                         reinterpret_cast<cudaStream_t>(stream), LaunchOrder::kStream, params, chunk);
  };
  switch (fused_packs_per_thread(params.args.hidden)) {
    case 1: return go(rs_rmsnorm_ag_multimem_kernel<T, 1>);
    case 2: return go(rs_rmsnorm_ag_multimem_kernel<T, 2>);
    case 4: return go(rs_rmsnorm_ag_multimem_kernel<T, 4>);
    default: break;
  }
  return Status(StatusCode::kInvalidArgument, "fused_allreduce_rmsnorm(multimem): hidden size not supported");
}

}  // namespace

Status launch_rs_rmsnorm_ag_multimem(const RsRmsNormAgMultimemParams& params, Stream stream) {
  const char* what = "fused_allreduce_rmsnorm(multimem)";
  const FusedRmsNormArgs& a = params.args;
  const int world = params.barrier.world_size;
  if (params.multicast_workspace == nullptr) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": no multicast workspace"));
  }
  if (a.dtype != DataType::kBFloat16 && a.dtype != DataType::kFloat16) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": dtype ", dtype_name(a.dtype),
                                                               " not supported; supported: bfloat16, float16"));
  }
  if (a.hidden < kGroup || a.hidden % kGroup != 0 || a.hidden > kFusedMaxHidden || world < 1 ||
      world > kMaxDeviceRanks) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": hidden ", a.hidden, " / world ", world,
                                                               " not supported"));
  }
  if (a.num_tokens == 0) return Status::ok();
  if (!aligned16(a.x) || !aligned16(a.out) || !aligned16(a.residual) || !aligned16(a.weight)) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": tensors must be 16-byte aligned"));
  }
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtype_size(a.dtype);
  const size_t regions = a.mode == ResidualMode::kReplicated ? 3 : 2;
  FusedChunk chunk{};
  chunk.half_bytes = params.workspace.bytes / 2 / 256 * 256;
  const int64_t per_rank = (a.num_tokens + world - 1) / world;
  const int64_t fit = static_cast<int64_t>(chunk.half_bytes / (regions * world * row_bytes));
  if (fit < 1) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": GPU workspace too small for one row"));
  }
  chunk.capacity = std::min(fit, per_rank);
  const int blocks = fused_rmsnorm_num_blocks(params.num_blocks, 0, chunk.capacity);  // commlib-tune measures P2P only
  for (chunk.offset = 0; chunk.offset < per_rank; chunk.offset += chunk.capacity) {
    const Status status = a.dtype == DataType::kBFloat16 ? launch_typed<__nv_bfloat16>(params, chunk, blocks, stream)
                                                         : launch_typed<__half>(params, chunk, blocks, stream);
    if (!status.is_ok()) return status;
  }
  return Status::ok();
}

}  // namespace commlib::kernels
