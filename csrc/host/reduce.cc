#include "host/reduce.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "commlib/errors.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// Built once for the baseline and once for Haswell-class cores (AVX2, F16C, FMA); picked at load.
#define COMMLIB_MULTIVERSION __attribute__((target_clones("arch=haswell", "default")))
#else
#define COMMLIB_MULTIVERSION
#endif

namespace commlib::host {
namespace {

constexpr size_t kBlock = 512;

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

struct F32 {
  using Storage = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct F16 {
  using Storage = _Float16;
  static float load(_Float16 v) { return static_cast<float>(v); }
  static _Float16 store(float v) { return static_cast<_Float16>(v); }
};
struct BF16 {
  using Storage = uint16_t;
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float v) { return float_to_bf16(v); }
};

template <ReduceOp kOp>
inline float combine(float a, float b) {
  if constexpr (kOp == ReduceOp::kSum || kOp == ReduceOp::kAvg) return a + b;
  if constexpr (kOp == ReduceOp::kProd) return a * b;
  if constexpr (kOp == ReduceOp::kMin) return std::isnan(a) || a <= b ? a : b;
  if constexpr (kOp == ReduceOp::kMax) return std::isnan(a) || a >= b ? a : b;
}

template <typename E, ReduceOp kOp>
COMMLIB_MULTIVERSION void reduce_typed(void* out_v, const void* const* srcs_v, int num_srcs, size_t count,
                                       float divisor) {
  using T = typename E::Storage;
  T* out = static_cast<T*>(out_v);
  float acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    const T* s0 = static_cast<const T*>(srcs_v[0]) + base;
    for (size_t i = 0; i < n; ++i) acc[i] = E::load(s0[i]);
    for (int r = 1; r < num_srcs; ++r) {
      const T* s = static_cast<const T*>(srcs_v[r]) + base;
      for (size_t i = 0; i < n; ++i) acc[i] = combine<kOp>(acc[i], E::load(s[i]));
    }
    if constexpr (kOp == ReduceOp::kAvg) {
      for (size_t i = 0; i < n; ++i) acc[i] = acc[i] / divisor;
    }
    T* o = out + base;
    for (size_t i = 0; i < n; ++i) o[i] = E::store(acc[i]);
  }
}

template <typename E>
void reduce_op(void* out, const void* const* srcs, int num_srcs, size_t count, ReduceOp op, float divisor) {
  switch (op) {
    case ReduceOp::kSum: return reduce_typed<E, ReduceOp::kSum>(out, srcs, num_srcs, count, divisor);
    case ReduceOp::kAvg: return reduce_typed<E, ReduceOp::kAvg>(out, srcs, num_srcs, count, divisor);
    case ReduceOp::kMin: return reduce_typed<E, ReduceOp::kMin>(out, srcs, num_srcs, count, divisor);
    case ReduceOp::kMax: return reduce_typed<E, ReduceOp::kMax>(out, srcs, num_srcs, count, divisor);
    case ReduceOp::kProd: return reduce_typed<E, ReduceOp::kProd>(out, srcs, num_srcs, count, divisor);
  }
}

}  // namespace

void reduce(void* out, const void* const* srcs, int num_srcs, size_t count, DataType dtype, ReduceOp op,
            int divisor) {
  if (count == 0) return;
  const float d = static_cast<float>(divisor);
  switch (dtype) {
    case DataType::kFloat32: return reduce_op<F32>(out, srcs, num_srcs, count, op, d);
    case DataType::kFloat16: return reduce_op<F16>(out, srcs, num_srcs, count, op, d);
    case DataType::kBFloat16: return reduce_op<BF16>(out, srcs, num_srcs, count, op, d);
    default:
      throw TypeMismatch(detail::concat("reduce: dtype ", dtype_name(dtype),
                                        " not supported; supported: float32, float16, bfloat16"));
  }
}

float to_float(uint16_t bits, DataType dtype) {
  if (dtype == DataType::kBFloat16) return bf16_to_float(bits);
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

uint16_t from_float(float value, DataType dtype) {
  if (dtype == DataType::kBFloat16) return float_to_bf16(value);
  _Float16 h = static_cast<_Float16>(value);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

}  // namespace commlib::host
