// CPU expert-parallel dispatch / combine over host shared memory (Note [EP layout]).
// Dispatch: all-gather every rank's routing (the meta rows), then one all_to_all_v of token rows
// (each token once per owner rank, in token order) that the owner expands into its expert rows.
// Combine: each owner sends one partial row per (source, token) back, in token order; the source
// sums them in rank order.
#include <algorithm>
#include <cstring>
#include <vector>

#include "commlib/communicator.hpp"
#include "commlib/ep.hpp"
#include "commlib/errors.hpp"
#include "core/plan.hpp"
#include "host/reduce.hpp"

namespace commlib {
namespace {

// True when token row `idx` (topk entries) has a route to an expert of rank d.
bool routes_to(const int32_t* idx, int64_t topk, int64_t num_local, int d) {
  for (int64_t k = 0; k < topk; ++k) {
    if (idx[k] >= 0 && idx[k] / num_local == d) return true;
  }
  return false;
}

float load_float(const uint8_t* row, int64_t i, DataType dtype) {
  if (dtype == DataType::kFloat32) {
    float v;
    std::memcpy(&v, row + i * 4, 4);
    return v;
  }
  uint16_t bits;
  std::memcpy(&bits, row + i * 2, 2);
  return host::to_float(bits, dtype);
}

void store_float(uint8_t* row, int64_t i, float v, DataType dtype) {
  if (dtype == DataType::kFloat32) {
    std::memcpy(row + i * 4, &v, 4);
    return;
  }
  const uint16_t bits = host::from_float(v, dtype);
  std::memcpy(row + i * 2, &bits, 2);
}

// The CPU path has one variant (Note [plan]); recorded for the counters and COMMLIB_LOG_PLAN.
void record_ep_plan(Communicator& comm, const EPConfig& config, const char* op) {
  EPShape shape;
  shape.placement = Placement::kCpu;
  shape.bytes = static_cast<size_t>(config.max_tokens_per_rank * config.hidden) * dtype_size(config.dtype);
  Plan plan = plan_ep(comm.config(), shape);
  plan.op = op;
  plan_executed(plan, comm.rank());
}

}  // namespace

void ep_dispatch_host(Communicator& comm, const EPConfig& config, const EPState& st, const void* x,
                      int64_t num_tokens, const int64_t* topk_idx, const float* topk_weights) {
  const char* what = "EPBuffer.dispatch";
  const int n = comm.world_size();
  const int me = comm.rank();
  record_ep_plan(comm, config, "ep_dispatch");
  const int64_t num_experts = config.num_experts;
  const int64_t num_local = config.num_local_experts(n);
  const int64_t topk = config.topk;
  const int64_t cap = config.capacity;
  const int64_t max_tokens = config.max_tokens_per_rank;
  const size_t row_bytes = static_cast<size_t>(config.hidden) * dtype_size(config.dtype);

  // Checked before any communication, so a bad id raises on this rank and the communicator stays usable.
  for (int64_t i = 0; i < num_tokens * topk; ++i) {
    const int64_t e = topk_idx[i];
    COMMLIB_CHECK(e >= -1 && e < num_experts, InvalidArgument, what, ": topk_idx[", i / topk, "][", i % topk,
                  "] = ", e, " out of range; valid: -1 (no expert) or 0..", num_experts - 1);
  }

  // Step 1: every rank's routing to every rank (fixed-size blobs: [num_tokens, pad, idx..., w...]).
  const size_t slots = static_cast<size_t>(max_tokens * topk);
  const size_t blob = 8 + slots * (sizeof(int32_t) + sizeof(float));
  std::vector<uint8_t> mine(blob, 0), all(blob * n);
  const int32_t t32 = static_cast<int32_t>(num_tokens);
  std::memcpy(mine.data(), &t32, 4);
  auto* my_idx = reinterpret_cast<int32_t*>(mine.data() + 8);
  for (int64_t i = 0; i < num_tokens * topk; ++i) my_idx[i] = static_cast<int32_t>(topk_idx[i]);
  std::memcpy(mine.data() + 8 + slots * 4, topk_weights, num_tokens * topk * sizeof(float));
  comm.all_gather_host(all.data(), mine.data(), blob);
  for (int s = 0; s < n; ++s) {
    const uint8_t* b = all.data() + s * blob;
    std::memcpy(&st.meta_num_tokens[s], b, 4);
    std::memcpy(st.meta_idx + s * slots, b + 8, slots * 4);
    std::memcpy(st.meta_w + s * slots, b + 8 + slots * 4, slots * 4);
  }

  // Step 2: token rows, once per owner rank, in token order.
  std::vector<size_t> in_bytes(n, 0), out_bytes(n, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int d = 0; d < n; ++d) in_bytes[d] += routes_to(my_idx + t * topk, topk, num_local, d) ? row_bytes : 0;
  }
  for (int s = 0; s < n; ++s) {
    for (int64_t t = 0; t < st.meta_num_tokens[s]; ++t) {
      out_bytes[s] += routes_to(st.meta_idx + s * slots + t * topk, topk, num_local, me) ? row_bytes : 0;
    }
  }
  std::vector<size_t> cursor(n, 0);
  for (int d = 1; d < n; ++d) cursor[d] = cursor[d - 1] + in_bytes[d - 1];
  std::vector<uint8_t> send(cursor[n - 1] + in_bytes[n - 1]);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int d = 0; d < n; ++d) {
      if (!routes_to(my_idx + t * topk, topk, num_local, d)) continue;
      std::memcpy(send.data() + cursor[d], static_cast<const uint8_t*>(x) + t * row_bytes, row_bytes);
      cursor[d] += row_bytes;
    }
  }
  size_t total_in = 0;
  for (int s = 0; s < n; ++s) total_in += out_bytes[s];
  std::vector<uint8_t> recv(total_in);
  comm.all_to_all_v_host(recv.data(), send.data(), in_bytes, out_bytes);

  // Step 3: expand into expert rows; iterating (s, t, k) in order gives the documented positions.
  std::vector<int64_t> rows(num_local, 0);
  const uint8_t* landed = recv.data();
  for (int s = 0; s < n; ++s) {
    for (int64_t t = 0; t < st.meta_num_tokens[s]; ++t) {
      const int32_t* idx = st.meta_idx + s * slots + t * topk;
      if (!routes_to(idx, topk, num_local, me)) continue;
      for (int64_t k = 0; k < topk; ++k) {
        if (idx[k] < 0 || idx[k] / num_local != me) continue;
        const int64_t l = idx[k] - me * num_local;
        const int64_t pos = rows[l]++;
        int32_t& rp = st.recv_pos[(s * max_tokens + t) * topk + k];
        rp = pos < cap ? static_cast<int32_t>(pos) : -1;
        if (rp >= 0) std::memcpy(static_cast<uint8_t*>(st.expert_x) + (l * cap + pos) * row_bytes, landed, row_bytes);
      }
      landed += row_bytes;
    }
  }
  for (int64_t l = 0; l < num_local; ++l) st.expert_counts[l] = static_cast<int32_t>(std::min(rows[l], cap));

  // Overflow, from the gathered routing: identical on every rank.
  std::vector<int64_t> totals(num_experts, 0);
  for (int s = 0; s < n; ++s) {
    for (int64_t i = 0; i < st.meta_num_tokens[s] * topk; ++i) {
      if (st.meta_idx[s * slots + i] >= 0) ++totals[st.meta_idx[s * slots + i]];
    }
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    if (totals[e] <= cap) continue;
    st.overflow[0] += totals[e] - cap;
    st.overflow[1] = std::max(st.overflow[1], (totals[e] << 24) | e);
  }
}

void ep_combine_host(Communicator& comm, const EPConfig& config, const EPState& st, const void* expert_out,
                     void* out) {
  const int n = comm.world_size();
  const int me = comm.rank();
  record_ep_plan(comm, config, "ep_combine");
  const int64_t num_local = config.num_local_experts(n);
  const int64_t topk = config.topk;
  const int64_t cap = config.capacity;
  const int64_t hidden = config.hidden;
  const int64_t max_tokens = config.max_tokens_per_rank;
  const size_t slots = static_cast<size_t>(max_tokens * topk);
  const size_t row_bytes = static_cast<size_t>(hidden) * dtype_size(config.dtype);
  const DataType dtype = config.dtype;

  // Owner side: one partial per (source, token routed here), in token order per source.
  std::vector<size_t> in_bytes(n, 0), out_bytes(n, 0);
  for (int s = 0; s < n; ++s) {
    for (int64_t t = 0; t < st.meta_num_tokens[s]; ++t) {
      if (routes_to(st.meta_idx + s * slots + t * topk, topk, num_local, me)) in_bytes[s] += row_bytes;
      if (s == me) {
        for (int d = 0; d < n; ++d) {
          out_bytes[d] += routes_to(st.meta_idx + me * slots + t * topk, topk, num_local, d) ? row_bytes : 0;
        }
      }
    }
  }
  std::vector<size_t> cursor(n, 0);
  for (int s = 1; s < n; ++s) cursor[s] = cursor[s - 1] + in_bytes[s - 1];
  std::vector<uint8_t> send(cursor[n - 1] + in_bytes[n - 1]);
  std::vector<float> acc(hidden);
  for (int s = 0; s < n; ++s) {
    for (int64_t t = 0; t < st.meta_num_tokens[s]; ++t) {
      const int32_t* idx = st.meta_idx + s * slots + t * topk;
      if (!routes_to(idx, topk, num_local, me)) continue;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < topk; ++k) {
        if (idx[k] < 0 || idx[k] / num_local != me) continue;
        const int32_t pos = st.recv_pos[(s * max_tokens + t) * topk + k];
        if (pos < 0) continue;
        const float w = st.meta_w[s * slots + t * topk + k];
        const uint8_t* y = static_cast<const uint8_t*>(expert_out) + ((idx[k] - me * num_local) * cap + pos) * row_bytes;
        for (int64_t i = 0; i < hidden; ++i) {
          const volatile float prod = w * load_float(y, i, dtype);  // volatile: no contraction into an FMA
          acc[i] += prod;
        }
      }
      uint8_t* dst = send.data() + cursor[s];
      for (int64_t i = 0; i < hidden; ++i) store_float(dst, i, acc[i], dtype);
      cursor[s] += row_bytes;
    }
  }
  size_t total_in = 0;
  for (int d = 0; d < n; ++d) total_in += out_bytes[d];
  std::vector<uint8_t> recv(total_in);
  comm.all_to_all_v_host(recv.data(), send.data(), in_bytes, out_bytes);

  // Source side: partials in owner-rank order.
  std::vector<size_t> from(n, 0);
  for (int d = 1; d < n; ++d) from[d] = from[d - 1] + out_bytes[d - 1];
  for (int64_t t = 0; t < st.meta_num_tokens[me]; ++t) {
    const int32_t* idx = st.meta_idx + me * slots + t * topk;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int d = 0; d < n; ++d) {
      if (!routes_to(idx, topk, num_local, d)) continue;
      const uint8_t* p = recv.data() + from[d];
      for (int64_t i = 0; i < hidden; ++i) acc[i] += load_float(p, i, dtype);
      from[d] += row_bytes;
    }
    uint8_t* dst = static_cast<uint8_t*>(out) + t * row_bytes;
    for (int64_t i = 0; i < hidden; ++i) store_float(dst, i, acc[i], dtype);
  }
}

}  // namespace commlib
