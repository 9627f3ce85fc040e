// Host-side checks of csrc/kernels/ep_nvshmem_params.hpp (Note [EP NVSHMEM protocol]) at every world
// size up to nvshmem_ep::kMaxRanks: the rank-set helpers the kernels use against sets built bit by
// bit, the launchers' parameter check (accepts every valid world, refuses each bad field with a
// message naming it) and the buffer layout (regions in order, aligned, disjoint, each as large as
// its contents). Prints "OK" and exits 0, or names the first failed check and exits 1.
// Built and run by tests/cpu/test_ep_nvshmem_params.py with the host compiler (no CUDA needed).
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ep_nvshmem_params.hpp"

namespace {

using commlib::EPConfig;
namespace nv = commlib::nvshmem_ep;

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok && failures++ == 0) std::fprintf(stderr, "FAILED: %s\n", what.c_str());
}

// The set of ranks {r : r < n, r != skip}, one bit at a time.
uint64_t reference_set(int n, int skip) {
  uint64_t set = 0;
  for (int r = 0; r < n; ++r) {
    if (r != skip) set |= uint64_t{1} << r;
  }
  return set;
}

void check_rank_sets() {
  for (int n = 1; n <= nv::kMaxRanks; ++n) {
    expect(nv::all_ranks(n) == reference_set(n, -1), "all_ranks(" + std::to_string(n) + ")");
    for (int me = 0; me < n; ++me) {
      const uint64_t others = nv::other_ranks(n, me);
      expect(others == reference_set(n, me), "other_ranks(" + std::to_string(n) + ", " + std::to_string(me) + ")");
      expect((others & nv::rank_bit(me)) == 0 && __builtin_popcountll(others) == n - 1,
             "other_ranks(" + std::to_string(n) + ", " + std::to_string(me) + ") has n - 1 ranks, not me");
    }
  }
}

EPConfig config_of(int64_t max_tokens, int64_t hidden, int64_t num_experts, int64_t topk) {
  EPConfig c;
  c.max_tokens_per_rank = max_tokens;
  c.hidden = hidden;
  c.num_experts = num_experts;
  c.topk = topk;
  c.capacity = max_tokens;
  c.dtype = commlib::DataType::kBFloat16;
  return c;
}

nv::Params params_of(const EPConfig& c, int world, int rank, int num_blocks) {
  nv::Params q;
  q.base.config = c;
  q.base.world_size = world;
  q.base.rank = rank;
  q.base.num_tokens = c.max_tokens_per_rank;
  q.num_blocks = num_blocks;
  q.tokens_per_block = (c.max_tokens_per_rank + num_blocks - 1) / num_blocks;
  return q;
}

// The check refuses `q` and its message names every string of `words`.
void expect_refused(const nv::Params& q, const std::vector<std::string>& words, const std::string& what) {
  char message[512] = {};
  const bool ok = nv::check_params(q, "EPBuffer.dispatch (nvshmem)", message, sizeof(message));
  expect(!ok, what + ": refused");
  for (const std::string& w : words) {
    expect(std::strstr(message, w.c_str()) != nullptr, what + ": message '" + message + "' names '" + w + "'");
  }
  expect(std::strncmp(message, "EPBuffer.dispatch (nvshmem): ", 29) == 0, what + ": message names the operation");
}

void check_params() {
  char message[512] = {};
  for (int n : {1, 2, 8, 9, 16, 31, 32, 33, 48, 63, 64}) {
    const EPConfig c = config_of(128, 7168, 4 * n, 8);
    for (int rank : {0, n / 2, n - 1}) {
      expect(nv::check_params(params_of(c, n, rank, 64), "x", message, sizeof(message)),
             "world " + std::to_string(n) + " rank " + std::to_string(rank) + " accepted: " + message);
    }
  }
  const EPConfig c = config_of(128, 7168, 256, 8);
  expect_refused(params_of(c, nv::kMaxRanks + 1, 0, 64), {"world_size 65", "1..64"}, "world 65");
  expect_refused(params_of(c, 0, 0, 64), {"world_size 0", "1..64"}, "world 0");
  expect_refused(params_of(c, 64, 64, 64), {"rank 64", "0..63"}, "rank 64 of 64");
  expect_refused(params_of(c, 64, -1, 64), {"rank -1", "0..63"}, "rank -1");
  expect_refused(params_of(config_of(128, 7168, 100, 8), 64, 0, 64), {"num_experts", "100", "64..4096"},
                 "100 experts over 64 ranks");
  expect_refused(params_of(config_of(128, 7168, 32, 8), 64, 0, 64), {"num_experts", "32"}, "fewer experts than ranks");
  expect_refused(params_of(config_of(128, 7168, 256, 17), 64, 0, 64), {"topk 17", "1..16"}, "topk 17");
  expect_refused(params_of(c, 64, 0, nv::kMaxBlocks + 1), {"num_blocks 65", "1..64"}, "65 blocks");
  nv::Params short_grid = params_of(c, 64, 0, 64);
  short_grid.tokens_per_block = 1;
  expect_refused(short_grid, {"64 blocks x 1 tokens", "max_tokens_per_rank 128"}, "grid short of max_tokens");
  nv::Params too_many = params_of(c, 64, 0, 64);
  too_many.base.num_tokens = 129;
  expect_refused(too_many, {"num_tokens 129", "0..128"}, "129 tokens");
}

void check_layout() {
  for (int n : {1, 8, 33, 64}) {
    for (int blocks : {1, 64}) {
      const EPConfig c = config_of(17, 100, 4 * n, 3);
      const size_t elem = 2;
      const nv::Layout l = nv::make_layout(c, n, blocks, elem);
      const size_t N = static_cast<size_t>(n), B = static_cast<size_t>(blocks);
      const size_t routes = N * 17 * 3, rows = N * 17 * 100 * elem;
      // (offset, bytes) in layout order; control_end closes the control words.
      const std::vector<std::pair<size_t, size_t>> regions = {
          {l.seq, B * 8},           {l.data_expected, B * N * 8}, {l.combine_expected, B * N * 8},
          {l.overflow, 4 * 8},      {l.meta_signal, N * 8},       {l.data_signal, N * B * 8},
          {l.combine_signal, N * B * 8}, {l.num_tokens, N * 4},   {l.meta_idx, routes * 4},
          {l.meta_w, routes * 4},   {l.land_x, rows},             {l.land_y, rows},
          {l.send_y, rows}};
      const std::string at = "layout world " + std::to_string(n) + " blocks " + std::to_string(blocks);
      expect(regions[0].first == 0, at + ": starts at 0");
      for (size_t i = 0; i < regions.size(); ++i) {
        expect(regions[i].first % 256 == 0, at + ": region " + std::to_string(i) + " aligned");
        const size_t end = regions[i].first + regions[i].second;
        const size_t next = i + 1 < regions.size() ? regions[i + 1].first : l.total;
        expect(end <= next, at + ": region " + std::to_string(i) + " fits before the next");
      }
      expect(l.control_end >= l.combine_signal + N * B * 8 && l.control_end <= l.num_tokens,
             at + ": control_end closes the signals");
    }
  }
}

}  // namespace

int main() {
  check_rank_sets();
  check_params();
  check_layout();
  if (failures != 0) {
    std::fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
