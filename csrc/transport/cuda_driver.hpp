// The CUDA driver API, reached only through cudaGetDriverEntryPointByVersion: libcuda is never
// linked, so commlib loads (and its CPU paths run) on machines with no driver.
// driver() resolves the entry points on first call (thread-safe) and throws CudaError when the
// driver or an entry point is missing. CU_CHECK-style errors go through check().
#pragma once

#include <cuda.h>

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

}  // namespace commlib::cuda
