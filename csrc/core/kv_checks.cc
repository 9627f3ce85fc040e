// The pure rules of the KV transfer that both of its paths use (the native agent, csrc/core/kv_agent.cc,
// and commlib.kv's NIXL path through the bindings): which destination ranks a sending rank writes and
// which heads (Note [kv tensor parallelism]), and a request's argument checks (Note [kv request checks]).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "commlib/errors.hpp"
#include "core/kv_agent_internal.hpp"

namespace commlib {
namespace {

// Heads of `rank` of a TP `size` split of `total` heads: [first, first + count).
std::pair<int, int> head_range(int total, int rank, int size) { return {rank * (total / size), total / size}; }

}  // namespace

std::vector<KvRoute> kv_routes(int heads, bool mla, int tp_rank, int tp_size, int tp_dest) {
  std::vector<KvRoute> routes;
  // Whether sending rank s writes to destination d, and the heads they share.
  auto shared = [&](int s, int d, int* lo, int* hi) {
    if (mla) {
      *lo = 0;
      *hi = 1;
      return d % tp_size == s;
    }
    const auto [s0, sn] = head_range(heads, s, tp_size);
    const auto [d0, dn] = head_range(heads, d, tp_dest);
    *lo = std::max(s0, d0);
    *hi = std::min(s0 + sn, d0 + dn);
    return *lo < *hi;
  };
  for (int d = 0; d < tp_dest; ++d) {
    int lo = 0, hi = 0;
    if (!shared(tp_rank, d, &lo, &hi)) continue;
    KvRoute r;
    r.rank = d;
    r.src_head = mla ? 0 : lo - head_range(heads, tp_rank, tp_size).first;
    r.dst_head = mla ? 0 : lo - head_range(heads, d, tp_dest).first;
    r.heads = hi - lo;
    for (int s = 0; s < tp_size; ++s) {
      int l2 = 0, h2 = 0;
      if (!shared(s, d, &l2, &h2)) continue;
      if (r.num_contributors == 0) r.first_sender = s;
      if (s == tp_rank) r.contributor = r.num_contributors;
      ++r.num_contributors;
    }
    routes.push_back(r);
  }
  return routes;
}

// Note [kv request checks]
// A request's arguments, checked before anything is announced or moved, by KvAgent::begin and by
// the NIXL path of commlib.kv (Note [kv over nixl]) alike: one set of rules and messages. Source
// and destination counts must cover num_tokens (< 0: every token of the source blocks), ids lie in
// range, no destination block appears twice (a stamp per destination block, this check's number
// where it saw the block: no clearing between requests), layers in range and listed once.
int64_t kv_check_request(const char* what, const std::string& request_id, const int32_t* src_blocks, size_t num_src,
                         int64_t src_num_blocks, int64_t bs, const int32_t* dst_blocks, size_t num_dst,
                         int64_t dst_num_blocks, int64_t bd, int64_t num_tokens, const std::vector<int>& layers,
                         int num_layers, std::vector<uint32_t>& stamp, uint32_t& stamp_now) {
  COMMLIB_CHECK(!request_id.empty() && request_id.size() < sizeof(KvRecord::id), InvalidArgument, what,
                ": request id '", request_id, "' must be 1..", sizeof(KvRecord::id) - 1, " characters");
  if (num_tokens < 0) num_tokens = static_cast<int64_t>(num_src) * bs;
  COMMLIB_CHECK(static_cast<int64_t>(num_src) == (num_tokens + bs - 1) / bs &&
                    static_cast<int64_t>(num_dst) == (num_tokens + bd - 1) / bd,
                InvalidArgument, what, ": request '", request_id, "' of ", num_tokens, " tokens needs ",
                (num_tokens + bs - 1) / bs, " source blocks of ", bs, " tokens and ", (num_tokens + bd - 1) / bd,
                " destination blocks of ", bd, " tokens; got ", num_src, " and ", num_dst);
  int32_t lo = 0, hi = 0;
  for (size_t i = 0; i < num_src; ++i) {  // min / max first: one vectorised pass
    lo = std::min(lo, src_blocks[i]);
    hi = std::max(hi, src_blocks[i]);
  }
  for (size_t i = 0; (lo < 0 || hi >= src_num_blocks) && i < num_src; ++i) {
    COMMLIB_CHECK(src_blocks[i] >= 0 && src_blocks[i] < src_num_blocks, InvalidArgument, what, ": request '",
                  request_id, "': source block id ", src_blocks[i], " (position ", i, ") out of range; valid: 0..",
                  src_num_blocks - 1);
  }
  if (stamp.size() != static_cast<size_t>(dst_num_blocks) || ++stamp_now == 0) {
    stamp.assign(static_cast<size_t>(dst_num_blocks), 0);
    stamp_now = 1;
  }
  const uint32_t now = stamp_now;
  for (size_t i = 0; i < num_dst; ++i) {
    const int32_t id = dst_blocks[i];
    COMMLIB_CHECK(id >= 0 && id < dst_num_blocks, InvalidArgument, what, ": request '", request_id,
                  "': destination block id ", id, " (position ", i, ") out of range; valid: 0..", dst_num_blocks - 1);
    if (stamp[static_cast<size_t>(id)] == now) {
      size_t first = 0;
      while (dst_blocks[first] != id) ++first;
      throw InvalidArgument(detail::concat(what, ": request '", request_id, "': destination block ", id,
                                           " appears twice (positions ", first, " and ", i, ")"));
    }
    stamp[static_cast<size_t>(id)] = now;
  }
  std::vector<uint64_t> seen(static_cast<size_t>((std::max(num_layers, 1) + 63) / 64), 0);
  for (int l : layers) {
    COMMLIB_CHECK(l >= 0 && l < num_layers, InvalidArgument, what, ": layer ", l, " out of range; valid: 0..",
                  num_layers - 1);
    COMMLIB_CHECK(!kv_has_layer(seen.data(), l), InvalidArgument, what, ": layer ", l, " listed twice");
    kv_set_layer(seen.data(), l);
  }
  return num_tokens;
}

}  // namespace commlib
