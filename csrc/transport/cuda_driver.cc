#include "transport/cuda_driver.hpp"

#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "commlib/errors.hpp"

namespace commlib::cuda {
namespace {

// 12.0 is the ABI of every entry point used here; newer drivers keep serving it.
constexpr int kDriverApiVersion = 12000;

template <typename Fn>
void resolve(Fn& fn, const char* symbol) {
  fn = reinterpret_cast<Fn>(entry_point(symbol, kDriverApiVersion));
}

}  // namespace

void* entry_point(const char* symbol, int api_version) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &ptr, api_version, cudaEnableDefault, &query);
  COMMLIB_CHECK(err == cudaSuccess && query == cudaDriverEntryPointSuccess && ptr != nullptr, CudaError,
                "cuda driver: entry point ", symbol, " (ABI ", api_version, ") unavailable (", cudaGetErrorString(err),
                ", query result ", static_cast<int>(query), "); is an NVIDIA driver >= ", api_version / 1000, ".",
                api_version % 1000 / 10, " installed?");
  return ptr;
}

const DriverApi& driver() {
  static DriverApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    resolve(api.cuGetErrorString, "cuGetErrorString");
    resolve(api.cuMemCreate, "cuMemCreate");
    resolve(api.cuMemRelease, "cuMemRelease");
    resolve(api.cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
    resolve(api.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
    resolve(api.cuMemAddressReserve, "cuMemAddressReserve");
    resolve(api.cuMemAddressFree, "cuMemAddressFree");
    resolve(api.cuMemMap, "cuMemMap");
    resolve(api.cuMemUnmap, "cuMemUnmap");
    resolve(api.cuMemSetAccess, "cuMemSetAccess");
    resolve(api.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  });
  return api;
}

void check(CUresult result, const char* what, const char* call) {
  if (result == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  if (driver().cuGetErrorString(result, &msg) != CUDA_SUCCESS || msg == nullptr) msg = "unknown error";
  throw CudaError(detail::concat(what, ": ", call, " failed: ", msg, " (", static_cast<int>(result), ")"));
}

}  // namespace commlib::cuda
