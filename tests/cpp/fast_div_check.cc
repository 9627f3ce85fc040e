// device::FastDiv (include/commlib/device/fast_div.cuh) on the host, against n / d: every divisor
// up to 4096 and a spread of larger ones (powers of two and their neighbours, primes, 2^31 - 1),
// at the numerators where a multiply-and-shift goes wrong first (around multiples of d, and the
// top of the range) and at pseudo-random ones. Prints OK, or the first wrong quotient.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "commlib/device/fast_div.cuh"

namespace {

bool check(uint32_t d, uint32_t n) {
  const commlib::device::FastDiv f(d);
  if (f.div(n) == n / d) return true;
  std::printf("FastDiv(%u).div(%u) = %u, expected %u\n", d, n, f.div(n), n / d);
  return false;
}

}  // namespace

int main() {
  constexpr uint32_t kTop = 0x7fffffffu;  // the range's last numerator (2^31 - 1)
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (uint32_t k = 12; k <= 30; ++k) {
    for (int64_t delta = -3; delta <= 3; ++delta) divisors.push_back(static_cast<uint32_t>((int64_t{1} << k) + delta));
  }
  for (uint32_t d : {65521u, 1000003u, 16777213u, 2147483629u, kTop, 0x80000000u}) divisors.push_back(d);
  uint64_t state = 88172645463325252ull;  // xorshift64
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<uint32_t>(state) & kTop;
  };
  for (uint32_t d : divisors) {
    std::vector<uint32_t> ns = {0, 1, kTop, kTop - 1, d - 1, d, d + 1};
    for (uint32_t m : {2u, 3u, 7u, 1000u, kTop / d}) {
      const uint64_t md = uint64_t{m} * d;
      for (int64_t delta = -1; delta <= 1; ++delta) {
        const int64_t n = static_cast<int64_t>(md) + delta;
        if (n >= 0 && n <= kTop) ns.push_back(static_cast<uint32_t>(n));
      }
    }
    for (int i = 0; i < 64; ++i) ns.push_back(next());
    for (uint32_t n : ns) {
      if (n <= kTop && !check(d, n)) return 1;
    }
  }
  std::printf("OK\n");
  return 0;
}
