// The CUDA driver API, reached only through cudaGetDriverEntryPointByVersion: libcuda is never
// linked, so commlib loads (and its CPU paths run) on machines with no driver.
// driver() resolves the entry points on first call (thread-safe) and throws CudaError when the
// driver or an entry point is missing. CU_CHECK-style errors go through check().
#pragma once

#include <cuda.h>

#include <cstdint>

namespace commlib::cuda {

struct DriverApi {
  decltype(&::cuGetErrorString) cuGetErrorString;
  decltype(&::cuMemCreate) cuMemCreate;
  decltype(&::cuMemRelease) cuMemRelease;
  decltype(&::cuMemExportToShareableHandle) cuMemExportToShareableHandle;
  decltype(&::cuMemImportFromShareableHandle) cuMemImportFromShareableHandle;
  decltype(&::cuMemAddressReserve) cuMemAddressReserve;
  decltype(&::cuMemAddressFree) cuMemAddressFree;
  decltype(&::cuMemMap) cuMemMap;
  decltype(&::cuMemUnmap) cuMemUnmap;
  decltype(&::cuMemSetAccess) cuMemSetAccess;
  decltype(&::cuMemGetAllocationGranularity) cuMemGetAllocationGranularity;
};

const DriverApi& driver();

// The driver's entry point `symbol` in the ABI of CUDA `api_version` (e.g. 12010 for 12.1);
// throws CudaError when the driver or the symbol is missing. For modules that resolve entry
// points of their own, only when they need them.
void* entry_point(const char* symbol, int api_version);

// Throws CudaError("<what>: <call> failed: <driver message>") unless result is CUDA_SUCCESS.
void check(CUresult result, const char* what, const char* call);

// 32-bit stream memory operations (the CUDA 12 ABI; resolved on first use), for the copy-engine
// transports (commlib.cp's ring, CUDA point-to-point): no kernel, no SM.
// stream_write_value32: stores `value` at `address` once the stream reaches it, the stream's
// earlier writes visible first (flags 0: these v2 entry points refuse
// CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER with "invalid argument").
void stream_write_value32(CUstream stream, CUdeviceptr address, uint32_t value, unsigned flags, const char* what);
// stream_wait_value32: the stream waits (unbounded, on the device) until the word at `address`
// satisfies `flags` (CU_STREAM_WAIT_VALUE_EQ, _GEQ, ...) against `value`.
void stream_wait_value32(CUstream stream, CUdeviceptr address, uint32_t value, unsigned flags, const char* what);

}  // namespace commlib::cuda
