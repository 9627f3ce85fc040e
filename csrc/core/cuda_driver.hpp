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

// Throws CudaError("<what>: <call> failed: <driver message>") unless result is CUDA_SUCCESS.
void check(CUresult result, const char* what, const char* call);

}  // namespace commlib::cuda
