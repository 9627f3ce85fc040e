// CPU fused all-reduce + residual add + RMSNorm over HostShm (Note [host shm protocol]).
// Arithmetic: Note [fused rmsnorm arithmetic]; slicing: Note [token slices] (fused_rmsnorm.hpp).
//
// Each token-chunk j takes two rounds. Round A (reduce-scatter): every rank copies, for each rank
// d, the rows of d's j-th sub-slice of its own x into block d of its slot; after the barrier each
// rank sums its block of every slot (rank order), adds its residual rows and normalises them
// straight into its slot of the next buffer. Round B (all-gather): after the barrier every rank
// copies every owner's normalised rows (and, replicated, residual rows) out. Only the owner ever
// touches a residual row, so the sharded mode never needs the other ranks' residual.
#if defined(__GNUC__) && !defined(__clang__)
// Products must be rounded before they are added (no FMA contraction), as on the GPU.
#pragma GCC optimize("fp-contract=off")
#endif

#include "commlib/fused_rmsnorm.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "commlib/communicator.hpp"
#include "commlib/errors.hpp"
#include "core/plan.hpp"
#include "host/reduce.hpp"
#include "transport/host_shm.hpp"

#if defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace commlib {
namespace {

constexpr const char* kWhat = "fused_allreduce_rmsnorm";

struct F32 {
  using T = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
template <DataType kType>
struct Half16 {
  using T = uint16_t;
  static float load(uint16_t v) { return host::to_float(v, kType); }
  static uint16_t store(float v) { return host::from_float(v, kType); }
};

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// One row: residual_row = round(residual + sum); out_row = round((r * rstd) * w).
// `r` and `q` are scratch of hidden and P floats.
template <typename E>
void add_rmsnorm_row(const typename E::T* sum, typename E::T* residual_row, const typename E::T* weight,
                     typename E::T* out_row, int64_t hidden, float eps, float* r, float* q, int64_t num_partials) {
  for (int64_t h = 0; h < hidden; ++h) {
    const typename E::T rounded = E::store(E::load(residual_row[h]) + E::load(sum[h]));
    residual_row[h] = rounded;
    r[h] = E::load(rounded);
  }
  const int64_t num_groups = hidden / kFusedHiddenAlign;
  for (int64_t k = 0; k < num_groups; ++k) {
    const float* g = r + k * kFusedHiddenAlign;
    float acc = g[0] * g[0];
    for (int64_t i = 1; i < kFusedHiddenAlign; ++i) {
      const float sq = g[i] * g[i];
      acc = acc + sq;
    }
    q[k] = acc;
  }
  std::fill(q + num_groups, q + num_partials, 0.0f);
  for (int64_t half = num_partials / 2; half >= 1; half /= 2) {
    for (int64_t k = 0; k < half; ++k) q[k] = q[k] + q[k + half];
  }
  const float variance = q[0] / static_cast<float>(hidden);
  const float rstd = 1.0f / std::sqrt(variance + eps);
  for (int64_t h = 0; h < hidden; ++h) {
    const float normed = r[h] * rstd;
    out_row[h] = E::store(normed * E::load(weight[h]));
  }
}

template <typename E>
void run(Communicator& comm, const FusedRmsNormArgs& a) {
  using T = typename E::T;
  HostShm& shm = comm.host();
  const int n = comm.world_size();
  const int rank = comm.rank();
  const int64_t hidden = a.hidden;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(T);
  // Round A needs n blocks of q rows in a slot, round B two (out, residual).
  const size_t blocks = static_cast<size_t>(std::max(n, 2));
  const int64_t q = row_bytes == 0 ? 1 : static_cast<int64_t>(shm.slot_bytes() / (blocks * row_bytes));
  COMMLIB_CHECK(q >= 1, InvalidArgument, kWhat, ": a row of ", row_bytes, " bytes needs ", blocks * row_bytes,
                " bytes of shared-memory slot but COMMLIB_SHM_SLOT_BYTES is ", shm.slot_bytes(),
                "; raise COMMLIB_SHM_SLOT_BYTES");
  const int64_t per_rank = (a.num_tokens + n - 1) / n;
  const int64_t num_chunks = std::max<int64_t>(1, (per_rank + q - 1) / q);
  const OpTag tag{static_cast<uint32_t>(HostOp::kFused), static_cast<uint32_t>(a.dtype),
                  static_cast<uint64_t>(a.num_tokens),
                  static_cast<uint64_t>(hidden) << 8 | static_cast<uint64_t>(a.mode)};

  const T* x = static_cast<const T*>(a.x);
  const T* weight = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out);
  T* residual = static_cast<T*>(a.residual);
  const TokenSlice mine = token_slice(a.num_tokens, n, rank);
  // Row i of this rank's residual (a slice-layout residual starts at the slice's first row).
  auto residual_row = [&](int64_t token) {
    const int64_t row = a.residual_layout == ResidualLayout::kSlice ? token - mine.begin : token;
    return residual + row * hidden;
  };
  const bool gather_residual = a.mode == ResidualMode::kReplicated;

  const int64_t num_partials = next_pow2(std::max<int64_t>(1, hidden / kFusedHiddenAlign));
  std::vector<float> r(static_cast<size_t>(hidden)), partials(static_cast<size_t>(num_partials));
  std::vector<T> sum(static_cast<size_t>(hidden));
  std::vector<const void*> srcs(n);

  // Rows [begin, end) of rank d's slice handled in chunk j.
  auto chunk_rows = [&](int d, int64_t j) {
    const TokenSlice s = token_slice(a.num_tokens, n, d);
    const int64_t begin = std::min(s.end, s.begin + j * q);
    return TokenSlice{begin, std::min(s.end, begin + q)};
  };

  for (int64_t j = 0; j < num_chunks; ++j) {
    const int buf_a = shm.next_buffer();
    uint8_t* slot_a = shm.slot(rank, buf_a);
    for (int d = 0; d < n; ++d) {
      const TokenSlice rows = chunk_rows(d, j);
      std::memcpy(slot_a + d * q * row_bytes, x + rows.begin * hidden, rows.size() * row_bytes);
    }
    shm.barrier(kWhat, "reduce-scatter", tag);

    const int buf_b = shm.next_buffer();
    uint8_t* slot_b = shm.slot(rank, buf_b);
    const TokenSlice own = chunk_rows(rank, j);
    for (int64_t i = 0; i < own.size(); ++i) {
      for (int s = 0; s < n; ++s) srcs[s] = shm.slot(s, buf_a) + (rank * q + i) * row_bytes;
      host::reduce(sum.data(), srcs.data(), n, static_cast<size_t>(hidden), a.dtype, ReduceOp::kSum, n);
      T* res = residual_row(own.begin + i);
      T* normed = reinterpret_cast<T*>(slot_b + i * row_bytes);
      add_rmsnorm_row<E>(sum.data(), res, weight, normed, hidden, a.eps, r.data(), partials.data(), num_partials);
      if (gather_residual) std::memcpy(slot_b + (q + i) * row_bytes, res, row_bytes);
    }
    shm.barrier(kWhat, "all-gather", tag);

    for (int d = 0; d < n; ++d) {
      const TokenSlice rows = chunk_rows(d, j);
      const uint8_t* theirs = shm.slot(d, buf_b);
      std::memcpy(out + rows.begin * hidden, theirs, rows.size() * row_bytes);
      if (gather_residual && d != rank) {
        std::memcpy(residual + rows.begin * hidden, theirs + q * row_bytes, rows.size() * row_bytes);
      }
    }
  }
}

}  // namespace

void fused_allreduce_rmsnorm_host(Communicator& comm, const FusedRmsNormArgs& args) {
  check_fused_rmsnorm_args(args, comm.world_size(), comm.rank());
  FusedShape shape;
  shape.num_tokens = args.num_tokens;
  shape.hidden = args.hidden;
  shape.dtype = args.dtype;
  shape.mode = args.mode;
  shape.placement = Placement::kCpu;
  plan_executed(plan_fused(comm.config(), shape), comm.rank());  // one variant on CPU (Note [plan])
  switch (args.dtype) {
    case DataType::kFloat32: return run<F32>(comm, args);
    case DataType::kFloat16: return run<Half16<DataType::kFloat16>>(comm, args);
    case DataType::kBFloat16: return run<Half16<DataType::kBFloat16>>(comm, args);
    default: break;
  }
}

}  // namespace commlib
