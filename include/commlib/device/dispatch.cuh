// One dispatch family for kernel specialisation (docs/architecture.md, Conventions).
//
// COMMLIB_DISPATCH_WORLD_SIZE(n, kWorldSize, ...): runs the body with constexpr kWorldSize = 2, 4
// or 8 when n is one of those, else kWorldSize = 0 ("generic": the kernel reads the runtime n).
// COMMLIB_DISPATCH_FLOAT_DTYPE(dtype, T, what, ...): T = float, __half or __nv_bfloat16; any other
// dtype returns unsupported_float_dtype(what, dtype) from the enclosing function (a Status).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "commlib/errors.hpp"
#include "commlib/types.hpp"

namespace commlib {

// "<what>: dtype <dtype> not supported; supported: float32, float16, bfloat16" (docs/architecture.md, Conventions).
inline Status unsupported_float_dtype(const char* what, DataType dtype) {
  return Status(StatusCode::kTypeMismatch, detail::concat(what, ": dtype ", dtype_name(dtype),
                                                          " not supported; supported: float32, float16, bfloat16"));
}

}  // namespace commlib

#define COMMLIB_DISPATCH_WORLD_SIZE(n, kWorldSize, ...) \
  [&] {                                                 \
    switch (n) {                                        \
      case 2: {                                         \
        constexpr int kWorldSize = 2;                   \
        return __VA_ARGS__();                           \
      }                                                 \
      case 4: {                                         \
        constexpr int kWorldSize = 4;                   \
        return __VA_ARGS__();                           \
      }                                                 \
      case 8: {                                         \
        constexpr int kWorldSize = 8;                   \
        return __VA_ARGS__();                           \
      }                                                 \
      default: {                                        \
        constexpr int kWorldSize = 0;                   \
        return __VA_ARGS__();                           \
      }                                                 \
    }                                                   \
  }()

#define COMMLIB_DISPATCH_FLOAT_DTYPE(dtype, T, what, ...)     \
  do {                                                        \
    switch (dtype) {                                          \
      case ::commlib::DataType::kFloat32: {                   \
        using T = float;                                      \
        __VA_ARGS__();                                        \
        break;                                                \
      }                                                       \
      case ::commlib::DataType::kFloat16: {                   \
        using T = __half;                                     \
        __VA_ARGS__();                                        \
        break;                                                \
      }                                                       \
      case ::commlib::DataType::kBFloat16: {                  \
        using T = __nv_bfloat16;                              \
        __VA_ARGS__();                                        \
        break;                                                \
      }                                                       \
      default:                                                \
        return ::commlib::unsupported_float_dtype(what, dtype); \
    }                                                         \
  } while (0)
