// Fused all-reduce + residual add + RMSNorm (TokenWeave's RS -> norm -> AG), the contract shared by
// the CPU path (csrc/host/fused_rmsnorm.cc), the P2P kernel (csrc/kernels/rs_rmsnorm_ag_p2p.cu)
// and the multimem kernel (csrc/kernels/rs_rmsnorm_ag_multimem.cu).
//
//   residual += all_reduce(x)          (x, residual: [num_tokens, hidden])
//   out = rms_norm(residual) * weight  (weight: [hidden]; out: [num_tokens, hidden] on every rank)
//
// Collective: every rank calls it with the same num_tokens, hidden, dtype, residual mode and eps.
// Each rank reduces and normalises only the tokens of its slice (Note [token slices]); the
// normalised rows are then gathered so every rank holds all of `out`. (On GPU two variants let a
// rank normalise other rows as well, with the same bits: Note [fused one-shot] and Note [fused p2p
// residual gather].)
//
// Note [token slices]
// Tokens are ceil-split: with c = ceil(num_tokens / world_size), rank r owns the rows
// [min(num_tokens, r * c), min(num_tokens, (r + 1) * c)). Trailing ranks may own fewer rows or
// none (e.g. 5 tokens on 4 ranks: 2, 2, 1, 0). token_slice() is the one definition; Python exposes
// it as commlib.fused.token_slice.
//
// Note [residual modes]
// kReplicated (vLLM's fused_add_rms_norm): residual is [num_tokens, hidden] on every rank, identical
//   on entry; on return every rank holds the full updated residual (the owners' rows are gathered
//   along with `out`).
// kSharded (TokenWeave): only this rank's slice of the residual is read and updated. `residual`
//   is either the full [num_tokens, hidden] tensor (rows outside the slice are neither read nor
//   written) or just the slice [slice rows, hidden] (ResidualLayout::kSlice).
// In both modes the owned rows of residual and all of `out` are bitwise identical.
//
// Note [fused rmsnorm arithmetic]
// Defined once so that CPU, P2P and multimem give the same bits as commlib's all_reduce followed
// by this arithmetic. Per element h of a row (fp32 unless said otherwise, every operation IEEE
// round-to-nearest, no fused multiply-add):
//   s    = round_dtype(x_0[h] + x_1[h] + ... + x_{n-1}[h])  summed left to right (Note [reduction order])
//   r[h] = round_dtype(residual[h] + s)                      the new residual
// Per row, over the rounded residual:
//   q_k  = ((r[8k]^2 + r[8k+1]^2) + ... ) + r[8k+7]^2        k < hidden / 8, left to right
//   q is padded with zeros to P = next power of two >= hidden / 8, then halved in place:
//   for half = P/2, P/4, ..., 1: q_k = q_k + q_{k+half} for k < half; sumsq = q_0
//   rstd = 1 / sqrt(sumsq / hidden + eps)                    (eps rounded to fp32 once)
//   out[h] = round_dtype((r[h] * rstd) * weight[h])
// The pairwise tree is what a GPU block computes with any power-of-two thread count <= P (each
// thread's registers, then shared memory, then warp shuffles), and it is cheap on the CPU.
#pragma once

#include <cstdint>

#include "commlib/types.hpp"

namespace commlib {

class Communicator;

struct TokenSlice {
  int64_t begin = 0;
  int64_t end = 0;
  constexpr int64_t size() const { return end - begin; }
};

// Note [token slices]. constexpr, so kernels call it too (nvcc --expt-relaxed-constexpr).
constexpr TokenSlice token_slice(int64_t num_tokens, int world_size, int rank) {
  const int64_t per_rank = (num_tokens + world_size - 1) / world_size;
  const int64_t begin = per_rank * rank < num_tokens ? per_rank * rank : num_tokens;
  const int64_t end = per_rank * (rank + 1) < num_tokens ? per_rank * (rank + 1) : num_tokens;
  return {begin, end};
}

// Whether `residual` holds all rows or only this rank's slice (kSharded only).
enum class ResidualLayout : int { kFull = 0, kSlice = 1 };

// Hidden sizes the fused op accepts: multiples of kFusedHiddenAlign (one 16-byte pack of 16-bit
// elements), at most kFusedMaxHidden.
inline constexpr int64_t kFusedHiddenAlign = 8;
inline constexpr int64_t kFusedMaxHidden = 16384;

// Which kernel runs the op on GPU: kAuto and kP2p the peer-to-peer kernels (LL or barrier, chosen
// by size), kMultimem the NVLS kernel (only where the multicast guard allows it).
enum class FusedAlgo : int { kAuto = 0, kP2p = 1, kMultimem = 2 };

struct FusedRmsNormArgs {
  const void* x = nullptr;     // [num_tokens, hidden], row-major, contiguous
  void* residual = nullptr;    // see Note [residual modes]
  const void* weight = nullptr;  // [hidden]
  void* out = nullptr;         // [num_tokens, hidden]
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  DataType dtype = DataType::kBFloat16;
  float eps = 1e-6f;
  ResidualMode mode = ResidualMode::kReplicated;
  ResidualLayout residual_layout = ResidualLayout::kFull;
};

// Throws InvalidArgument / TypeMismatch naming "fused_allreduce_rmsnorm", the value and the valid
// set. Local: checks only this rank's sizes and types, not the data pointers (the collective
// itself checks that ranks agree).
void check_fused_rmsnorm_args(const FusedRmsNormArgs& args, int world_size, int rank);

// CPU path over the host shm transport. Collective; float32, float16 and bfloat16.
void fused_allreduce_rmsnorm_host(Communicator& comm, const FusedRmsNormArgs& args);

}  // namespace commlib
