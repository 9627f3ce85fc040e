// The KV copy's split of a launch over its CTAs (kv_cta_first_layer / kv_cta_layer in
// csrc/kernels/kv_copy_params.hpp, Note [kv copy geometry]), walked on the host exactly as the
// kernel walks it: for unit counts, layer counts and CTA counts up to the launch's units, every
// unit of every layer is owned by exactly one CTA, every part a CTA visits is non-empty, and the
// parts' counts of each layer add up to the layer's units, the value at which the kernel's last
// contributor publishes the layer's flags (once). Prints OK, or the first violation.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/kv_copy_params.hpp"

namespace {

bool check(int64_t units, int layers, int64_t ctas) {
  using commlib::kernels::kv_cta_first_layer;
  using commlib::kernels::kv_cta_layer;
  std::vector<int> owner(static_cast<size_t>(units * layers), 0);
  std::vector<int64_t> counted(static_cast<size_t>(layers), 0);
  std::vector<int> published(static_cast<size_t>(layers), 0);
  for (int64_t cta = 0; cta < ctas; ++cta) {
    int visited = 0;
    for (int li = kv_cta_first_layer(units, layers, cta, ctas); li < layers; ++li) {
      const auto part = kv_cta_layer(units, layers, cta, ctas, li);
      if (part.first >= part.last) break;
      if (part.first < 0 || part.last > units) {
        std::printf("units %lld layers %d ctas %lld: CTA %lld's part of layer %d is [%lld, %lld)\n",
                    static_cast<long long>(units), layers, static_cast<long long>(ctas), static_cast<long long>(cta),
                    li, static_cast<long long>(part.first), static_cast<long long>(part.last));
        return false;
      }
      for (int64_t u = part.first; u < part.last; ++u) ++owner[static_cast<size_t>(li * units + u)];
      counted[static_cast<size_t>(li)] += part.last - part.first;
      if (counted[static_cast<size_t>(li)] == units) ++published[static_cast<size_t>(li)];
      ++visited;
    }
    if (visited == 0) {
      std::printf("units %lld layers %d ctas %lld: CTA %lld owns nothing\n", static_cast<long long>(units), layers,
                  static_cast<long long>(ctas), static_cast<long long>(cta));
      return false;
    }
  }
  for (int64_t i = 0; i < units * layers; ++i) {
    if (owner[static_cast<size_t>(i)] != 1) {
      std::printf("units %lld layers %d ctas %lld: unit %lld of layer %lld owned %d times\n",
                  static_cast<long long>(units), layers, static_cast<long long>(ctas),
                  static_cast<long long>(i % units), static_cast<long long>(i / units), owner[static_cast<size_t>(i)]);
      return false;
    }
  }
  for (int li = 0; li < layers; ++li) {
    if (published[static_cast<size_t>(li)] != 1) {
      std::printf("units %lld layers %d ctas %lld: layer %d published %d times\n", static_cast<long long>(units),
                  layers, static_cast<long long>(ctas), li, published[static_cast<size_t>(li)]);
      return false;
    }
  }
  return true;
}

}  // namespace

int main() {
  for (int64_t units : {1, 2, 3, 7, 64, 236, 1000}) {
    for (int layers : {1, 2, 3, 5, 80, 256}) {
      const int64_t most = units * layers;
      for (int64_t ctas : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{15}, int64_t{132}, int64_t{1024}}) {
        if (ctas > most) continue;  // the launcher's clamp: at most one CTA per unit of the launch
        if (!check(units, layers, ctas)) return 1;
      }
      if (most <= 1024 && !check(units, layers, most)) return 1;
    }
  }
  std::printf("OK\n");
  return 0;
}
