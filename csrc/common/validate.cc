// The pure argument validators of the public operations (no state, no communication): every engine
// and the torch layer call the same checks, so a bad argument raises the same error on every path.
#include <algorithm>
#include <cmath>

#include "commlib/ep.hpp"
#include "commlib/errors.hpp"
#include "commlib/fused_rmsnorm.hpp"

namespace commlib {

void check_peer_rank(const char* what, const char* arg, int peer, int world_size, int rank) {
  COMMLIB_CHECK(peer >= 0 && peer < world_size && peer != rank, InvalidArgument, what, ": ", arg, " ", peer,
                " out of range; valid: 0..", world_size - 1, " except this rank (", rank, ")");
}

void check_fused_rmsnorm_args(const FusedRmsNormArgs& a, int world_size, int rank) {
  const char* what = "fused_allreduce_rmsnorm";
  COMMLIB_CHECK(is_reducible(a.dtype), TypeMismatch, what, ": dtype ", dtype_name(a.dtype),
                " not supported; supported: float32, float16, bfloat16");
  COMMLIB_CHECK(a.num_tokens >= 0, InvalidArgument, what, ": num_tokens ", a.num_tokens, " must be >= 0");
  COMMLIB_CHECK(a.hidden > 0 && a.hidden % kFusedHiddenAlign == 0 && a.hidden <= kFusedMaxHidden, InvalidArgument,
                what, ": hidden size ", a.hidden, " not supported; supported: multiples of ", kFusedHiddenAlign,
                " from ", kFusedHiddenAlign, " to ", kFusedMaxHidden);
  COMMLIB_CHECK(std::isfinite(a.eps) && a.eps >= 0.0f, InvalidArgument, what, ": eps ", a.eps,
                " must be finite and >= 0");
  COMMLIB_CHECK(a.residual_layout == ResidualLayout::kFull || a.mode == ResidualMode::kSharded, InvalidArgument,
                what, ": a residual holding only this rank's slice needs residual_mode='sharded'");
}

EPConfig validate_ep_config(const EPConfig& config, int world_size) {
  const char* what = "EPBuffer";
  EPConfig c = config;
  COMMLIB_CHECK(c.max_tokens_per_rank >= 1, InvalidArgument, what, ": max_tokens_per_rank ", c.max_tokens_per_rank,
                " must be >= 1");
  COMMLIB_CHECK(c.hidden >= 1, InvalidArgument, what, ": hidden ", c.hidden, " must be >= 1");
  COMMLIB_CHECK(c.num_experts >= 1 && c.num_experts % world_size == 0, InvalidArgument, what, ": num_experts ",
                c.num_experts, " must be a positive multiple of world_size ", world_size,
                " (experts are split contiguously across ranks)");
  COMMLIB_CHECK(c.topk >= 1 && c.topk <= std::min(c.num_experts, kEPMaxTopk), InvalidArgument, what, ": topk ", c.topk,
                " out of range; valid: 1..", std::min(c.num_experts, kEPMaxTopk), " (at most num_experts and ",
                kEPMaxTopk, ")");
  COMMLIB_CHECK(c.dtype == DataType::kFloat32 || c.dtype == DataType::kFloat16 || c.dtype == DataType::kBFloat16,
                TypeMismatch, what, ": dtype ", dtype_name(c.dtype),
                " not supported; supported: float32, float16, bfloat16");
  const int64_t full = c.max_tokens_per_rank * world_size;
  if (c.capacity == 0) c.capacity = full;
  COMMLIB_CHECK(c.capacity >= 1 && c.capacity <= full * c.topk, InvalidArgument, what, ": capacity ", c.capacity,
                " out of range; valid: 1..", full * c.topk, " (max_tokens_per_rank * world_size * topk)");
  COMMLIB_CHECK(c.num_experts <= kEPMaxExperts, InvalidArgument, what, ": num_experts ", c.num_experts,
                " too large; valid: up to ", kEPMaxExperts);
  COMMLIB_CHECK(full * c.topk < (int64_t{1} << 31), InvalidArgument, what,
                ": max_tokens_per_rank * world_size * topk = ", full * c.topk, " must be < 2^31");
  return c;
}

}  // namespace commlib
