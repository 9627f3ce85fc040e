// COMMLIB_HD: a function both the kernels and the host call (the host checks and tests walk the same
// arithmetic the device runs). Host-compilable; no CUDA.
#pragma once

#if defined(__CUDACC__)
#define COMMLIB_HD __host__ __device__ __forceinline__
#else
#define COMMLIB_HD inline
#endif
