// FastDiv: n / d for 0 <= n < 2^31 by a multiply-high and a shift, the divisor fixed per launch
// (computed on the host, passed as a kernel argument): a 64-bit division is a called routine of
// about 70 instructions, a 32-bit one about 20, this about 4. Callable on the host too (the same
// arithmetic; tests/cpp/fast_div_check.cc checks it against n / d).
#pragma once

#include <cstdint>

#include "commlib/device/host_device.hpp"

namespace commlib::device {

struct FastDiv {
  uint32_t divisor = 1;
  uint32_t mul = 1;
  uint32_t shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t d) : divisor(d) {
    while ((1ull << shift) < d) ++shift;
    mul = static_cast<uint32_t>(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  }
  COMMLIB_HD uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * mul) >> 32);
#endif
    return static_cast<uint32_t>((static_cast<uint64_t>(hi) + n) >> shift);
  }
};

}  // namespace commlib::device
