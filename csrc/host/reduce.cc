#include "host/reduce.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "commlib/errors.hpp"

#if defined(__x86_64__)
#include <immintrin.h>  // SSE2 streaming stores: baseline x86-64, so usable in every clone below
#define COMMLIB_HAVE_STREAMING 1
#else
#define COMMLIB_HAVE_STREAMING 0
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// Built for the baseline, x86-64-v3 (AVX2, F16C, FMA) and x86-64-v4 (AVX-512); picked at load by
// CPU features. Not "arch=haswell": GCC's resolver selects an arch= clone only on that exact CPU
// model, so every newer core (Sapphire Rapids included) ran the scalar SSE2 / soft-fp16 clone.
#if __GNUC__ >= 12  // the first GCC whose resolver knows the x86-64-vN levels
#define COMMLIB_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define COMMLIB_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#endif
#else
#define COMMLIB_MULTIVERSION
#endif
// Helpers of the multiversioned loops must be inlined into each clone: GCC does not inline a
// default-target function into a target_clones clone on its own, and an out-of-line call per
// element would keep the loops scalar.
#define COMMLIB_ALWAYS_INLINE __attribute__((always_inline)) inline

namespace commlib::host {
namespace {

constexpr size_t kTile = 64;  // elements per register-resident accumulator tile

// Note [host reduce prefetch]
// The sources of a large all_reduce come from DRAM (the input) and from the peer core's cache
// (its shm copy), and a core's hardware prefetcher stops at every 4 KiB page. Prefetching each
// source a fixed distance ahead keeps more of those slow reads in flight across page boundaries:
// 1 KiB ahead took the 2-rank 32 MiB in-place all_reduce from 7.8 to 7.3 ms median on the 2-core VM
// (4 and 16 KiB ahead gained less; bench/results/cpu-all-reduce-2026-11-30-e.md).
constexpr size_t kPrefetchBytes = 1024;
constexpr size_t kCacheLine = 64;

COMMLIB_ALWAYS_INLINE float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

COMMLIB_ALWAYS_INLINE uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

struct F32 {
  using Storage = float;
  COMMLIB_ALWAYS_INLINE static float load(float v) { return v; }
  COMMLIB_ALWAYS_INLINE static float store(float v) { return v; }
};
struct F16 {
  using Storage = _Float16;
  COMMLIB_ALWAYS_INLINE static float load(_Float16 v) { return static_cast<float>(v); }
  COMMLIB_ALWAYS_INLINE static _Float16 store(float v) { return static_cast<_Float16>(v); }
};
struct BF16 {
  using Storage = uint16_t;
  COMMLIB_ALWAYS_INLINE static float load(uint16_t v) { return bf16_to_float(v); }
  COMMLIB_ALWAYS_INLINE static uint16_t store(float v) { return float_to_bf16(v); }
};

template <ReduceOp kOp>
COMMLIB_ALWAYS_INLINE float combine(float a, float b) {
  if constexpr (kOp == ReduceOp::kSum || kOp == ReduceOp::kAvg) return a + b;
  if constexpr (kOp == ReduceOp::kProd) return a * b;
  if constexpr (kOp == ReduceOp::kMin) return std::isnan(a) || a <= b ? a : b;
  if constexpr (kOp == ReduceOp::kMax) return std::isnan(a) || a >= b ? a : b;
}

// out[i] = reduce(srcs[0][i], ..., srcs[n - 1][i]) for i < num, for up to kTile elements: the
// accumulator is a fixed-size array that the compiler keeps in vector registers, so every source
// is read once and `out` written once, with no staging buffer. A tile is read fully before it is
// written, which is what lets `out` alias a source (and keeps the loops free of alias checks).
constexpr size_t kStreamUnit = 16;  // bytes per streaming store

// Copies `bytes` (a multiple of kStreamUnit) to a kStreamUnit-aligned `dst` with streaming stores.
COMMLIB_ALWAYS_INLINE void stream_block(void* dst, const void* src, size_t bytes) {
#if COMMLIB_HAVE_STREAMING
  auto* d = static_cast<__m128i*>(dst);
  const auto* s = static_cast<const __m128i*>(src);
  for (size_t i = 0; i < bytes / kStreamUnit; ++i) _mm_stream_si128(d + i, _mm_loadu_si128(s + i));
#else
  std::memcpy(dst, src, bytes);
#endif
}

template <typename E, ReduceOp kOp, StoreMode kMode, size_t kTile>
COMMLIB_ALWAYS_INLINE void reduce_tile(typename E::Storage* out, typename E::Storage* copy, const void* const* srcs,
                                       int num_srcs, size_t base, size_t num, float divisor) {
  using T = typename E::Storage;
  float acc[kTile];
  for (int r = 0; r < num_srcs; ++r) {  // Note [host reduce prefetch]; never faults, even past the end
    const char* ahead = reinterpret_cast<const char*>(static_cast<const T*>(srcs[r]) + base) + kPrefetchBytes;
    for (size_t b = 0; b < num * sizeof(T); b += kCacheLine) __builtin_prefetch(ahead + b, 0, 3);
  }
  const T* s0 = static_cast<const T*>(srcs[0]) + base;
  for (size_t i = 0; i < num; ++i) acc[i] = E::load(s0[i]);
  for (int r = 1; r < num_srcs; ++r) {
    const T* s = static_cast<const T*>(srcs[r]) + base;
    for (size_t i = 0; i < num; ++i) acc[i] = combine<kOp>(acc[i], E::load(s[i]));
  }
  if constexpr (kOp == ReduceOp::kAvg) {
    for (size_t i = 0; i < num; ++i) acc[i] = acc[i] / divisor;
  }
  if (copy != nullptr) {
    for (size_t i = 0; i < num; ++i) copy[base + i] = E::store(acc[i]);
  }
  // Streaming stores need whole kStreamUnit pieces: a short last tile is stored as usual.
  if (kMode == StoreMode::kStreaming && num * sizeof(T) % kStreamUnit == 0) {
    alignas(64) T result[kTile];
    for (size_t i = 0; i < num; ++i) result[i] = E::store(acc[i]);
    stream_block(out + base, result, num * sizeof(T));
  } else {
    for (size_t i = 0; i < num; ++i) out[base + i] = E::store(acc[i]);
  }
}

template <typename E, ReduceOp kOp, StoreMode kMode>
COMMLIB_MULTIVERSION void reduce_typed(void* out_v, void* copy_v, const void* const* srcs, int num_srcs, size_t count,
                                       float divisor) {
  using T = typename E::Storage;
  T* out = static_cast<T*>(out_v);
  T* copy = static_cast<T*>(copy_v);
  size_t base = 0;
  for (; base + kTile <= count; base += kTile) {
    reduce_tile<E, kOp, kMode, kTile>(out, copy, srcs, num_srcs, base, kTile, divisor);
  }
  if (base < count) reduce_tile<E, kOp, kMode, kTile>(out, copy, srcs, num_srcs, base, count - base, divisor);
}

template <typename E, StoreMode kMode>
void reduce_op(void* out, void* copy, const void* const* srcs, int num_srcs, size_t count, ReduceOp op,
               float divisor) {
  switch (op) {
    case ReduceOp::kSum: return reduce_typed<E, ReduceOp::kSum, kMode>(out, copy, srcs, num_srcs, count, divisor);
    case ReduceOp::kAvg: return reduce_typed<E, ReduceOp::kAvg, kMode>(out, copy, srcs, num_srcs, count, divisor);
    case ReduceOp::kMin: return reduce_typed<E, ReduceOp::kMin, kMode>(out, copy, srcs, num_srcs, count, divisor);
    case ReduceOp::kMax: return reduce_typed<E, ReduceOp::kMax, kMode>(out, copy, srcs, num_srcs, count, divisor);
    case ReduceOp::kProd: return reduce_typed<E, ReduceOp::kProd, kMode>(out, copy, srcs, num_srcs, count, divisor);
    default: break;
  }
  throw TypeMismatch(detail::concat("reduce: op ", reduce_op_name(op), " not supported for a floating dtype"));
}

template <typename E>
void reduce_mode(void* out, void* copy, const void* const* srcs, int num_srcs, size_t count, ReduceOp op,
                 float divisor, StoreMode mode) {
  if (mode == StoreMode::kStreaming) {
    return reduce_op<E, StoreMode::kStreaming>(out, copy, srcs, num_srcs, count, op, divisor);
  }
  reduce_op<E, StoreMode::kCached>(out, copy, srcs, num_srcs, count, op, divisor);
}

// Note [host exact reduction]
// Types without an fp32 accumulator (Note [reduction order]) reduce in their own type, like gloo:
// float64 in float64; integers in two's complement, wrapping on overflow (computed in the unsigned
// type, at least 32 bits wide, so no step is undefined behaviour); bool on the bytes torch stores,
// as gloo does: sum adds the bytes (wrapping, so it counts the ranks holding true: 2 at two ranks
// where both hold true, which torch reads as true), max and bor are or, prod, min and band are and,
// bxor is xor.
template <typename T, ReduceOp kOp, bool kIsBool>
COMMLIB_ALWAYS_INLINE T combine_exact(T a, T b) {
  if constexpr (kIsBool) {
    if constexpr (kOp == ReduceOp::kProd || kOp == ReduceOp::kMin || kOp == ReduceOp::kBand) return a & b;
    if constexpr (kOp == ReduceOp::kBxor) return a ^ b;
    if constexpr (kOp == ReduceOp::kSum) return static_cast<T>(a + b);  // gloo's byte sum
    return a | b;
  } else if constexpr (std::is_floating_point_v<T>) {
    if constexpr (kOp == ReduceOp::kProd) return a * b;
    if constexpr (kOp == ReduceOp::kMin) return std::isnan(a) || a <= b ? a : b;
    if constexpr (kOp == ReduceOp::kMax) return std::isnan(a) || a >= b ? a : b;
    return a + b;  // sum, avg
  } else {
    using W = std::conditional_t<sizeof(T) < 4, uint32_t, std::make_unsigned_t<T>>;
    if constexpr (kOp == ReduceOp::kSum) return static_cast<T>(static_cast<W>(a) + static_cast<W>(b));
    if constexpr (kOp == ReduceOp::kProd) return static_cast<T>(static_cast<W>(a) * static_cast<W>(b));
    if constexpr (kOp == ReduceOp::kMin) return a < b ? a : b;
    if constexpr (kOp == ReduceOp::kMax) return a > b ? a : b;
    if constexpr (kOp == ReduceOp::kBand) return a & b;
    if constexpr (kOp == ReduceOp::kBor) return a | b;
    return a ^ b;  // bxor
  }
}

template <typename T, ReduceOp kOp, bool kIsBool>
COMMLIB_MULTIVERSION void reduce_exact_typed(void* out_v, void* copy_v, const void* const* srcs, int num_srcs,
                                             size_t count, double divisor) {
  T* out = static_cast<T*>(out_v);
  T* copy = static_cast<T*>(copy_v);
  for (size_t base = 0; base < count; base += kTile) {  // a tile is read fully before it is written
    const size_t num = std::min(kTile, count - base);
    T acc[kTile];
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    for (size_t i = 0; i < num; ++i) acc[i] = s0[i];
    for (int r = 1; r < num_srcs; ++r) {
      const T* s = static_cast<const T*>(srcs[r]) + base;
      for (size_t i = 0; i < num; ++i) acc[i] = combine_exact<T, kOp, kIsBool>(acc[i], s[i]);
    }
    if constexpr (kOp == ReduceOp::kAvg && std::is_floating_point_v<T>) {
      for (size_t i = 0; i < num; ++i) acc[i] = static_cast<T>(acc[i] / divisor);
    }
    if (copy != nullptr) {
      for (size_t i = 0; i < num; ++i) copy[base + i] = acc[i];
    }
    for (size_t i = 0; i < num; ++i) out[base + i] = acc[i];
  }
}

template <typename T, bool kIsBool = false>
void reduce_exact(void* out, void* copy, const void* const* srcs, int num_srcs, size_t count, ReduceOp op,
                  double divisor) {
  switch (op) {
    case ReduceOp::kSum: return reduce_exact_typed<T, ReduceOp::kSum, kIsBool>(out, copy, srcs, num_srcs, count, divisor);
    case ReduceOp::kAvg: return reduce_exact_typed<T, ReduceOp::kAvg, kIsBool>(out, copy, srcs, num_srcs, count, divisor);
    case ReduceOp::kMin: return reduce_exact_typed<T, ReduceOp::kMin, kIsBool>(out, copy, srcs, num_srcs, count, divisor);
    case ReduceOp::kMax: return reduce_exact_typed<T, ReduceOp::kMax, kIsBool>(out, copy, srcs, num_srcs, count, divisor);
    case ReduceOp::kProd: return reduce_exact_typed<T, ReduceOp::kProd, kIsBool>(out, copy, srcs, num_srcs, count, divisor);
    case ReduceOp::kBand: case ReduceOp::kBor: case ReduceOp::kBxor:
      if constexpr (!std::is_floating_point_v<T>) {
        if (op == ReduceOp::kBand) return reduce_exact_typed<T, ReduceOp::kBand, kIsBool>(out, copy, srcs, num_srcs, count, divisor);
        if (op == ReduceOp::kBor) return reduce_exact_typed<T, ReduceOp::kBor, kIsBool>(out, copy, srcs, num_srcs, count, divisor);
        return reduce_exact_typed<T, ReduceOp::kBxor, kIsBool>(out, copy, srcs, num_srcs, count, divisor);
      }
      break;
  }
  throw TypeMismatch(detail::concat("reduce: op ", reduce_op_name(op), " not supported for a floating dtype"));
}

bool stream_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kStreamUnit == 0; }

}  // namespace

void reduce(void* out, const void* const* srcs, int num_srcs, size_t count, DataType dtype, ReduceOp op,
            int divisor, StoreMode out_mode, void* copy) {
  if (count == 0) return;
  const float d = static_cast<float>(divisor);
  if (!COMMLIB_HAVE_STREAMING || !stream_aligned(out)) out_mode = StoreMode::kCached;
  switch (dtype) {
    case DataType::kFloat32: return reduce_mode<F32>(out, copy, srcs, num_srcs, count, op, d, out_mode);
    case DataType::kFloat16: return reduce_mode<F16>(out, copy, srcs, num_srcs, count, op, d, out_mode);
    case DataType::kBFloat16: return reduce_mode<BF16>(out, copy, srcs, num_srcs, count, op, d, out_mode);
    case DataType::kFloat64: return reduce_exact<double>(out, copy, srcs, num_srcs, count, op, divisor);
    case DataType::kInt64: return reduce_exact<int64_t>(out, copy, srcs, num_srcs, count, op, divisor);
    case DataType::kInt32: return reduce_exact<int32_t>(out, copy, srcs, num_srcs, count, op, divisor);
    case DataType::kInt16: return reduce_exact<int16_t>(out, copy, srcs, num_srcs, count, op, divisor);
    case DataType::kInt8: return reduce_exact<int8_t>(out, copy, srcs, num_srcs, count, op, divisor);
    case DataType::kUInt8: return reduce_exact<uint8_t>(out, copy, srcs, num_srcs, count, op, divisor);
    case DataType::kBool: return reduce_exact<uint8_t, true>(out, copy, srcs, num_srcs, count, op, divisor);
  }
  throw TypeMismatch(detail::concat("reduce: dtype ", static_cast<int>(dtype), " unknown"));
}

bool supports(DataType dtype, ReduceOp op) {
  const bool floating = dtype == DataType::kFloat32 || dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
                        dtype == DataType::kFloat64;
  if (op == ReduceOp::kAvg) return floating;
  if (op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor) return !floating;
  return true;
}

void copy(void* dst, const void* src, size_t bytes, StoreMode mode) {
  if (mode == StoreMode::kCached || !COMMLIB_HAVE_STREAMING || bytes < 4 * kStreamUnit) {
    std::memcpy(dst, src, bytes);
    return;
  }
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  // Ordinary stores up to the first aligned byte of dst and after its last whole unit.
  const size_t head = (kStreamUnit - reinterpret_cast<uintptr_t>(d) % kStreamUnit) % kStreamUnit;
  const size_t body = (bytes - head) / kStreamUnit * kStreamUnit;
  std::memcpy(d, s, head);
  stream_block(d + head, s + head, body);
  std::memcpy(d + head + body, s + head + body, bytes - head - body);
}

void store_fence() {
#if COMMLIB_HAVE_STREAMING
  _mm_sfence();
#endif
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
