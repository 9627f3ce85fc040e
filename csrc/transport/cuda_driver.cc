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

namespace {

using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct StreamMemOps {
  StreamValue32 write;
  StreamValue32 wait;
};

const StreamMemOps& stream_memops() {
  // The CUDA 12 ABI of both calls (the _v2 entry points); resolved once, on first use.
  static const StreamMemOps ops{reinterpret_cast<StreamValue32>(entry_point("cuStreamWriteValue32", kDriverApiVersion)),
                                reinterpret_cast<StreamValue32>(entry_point("cuStreamWaitValue32", kDriverApiVersion))};
  return ops;
}

}  // namespace

void stream_write_value32(CUstream stream, CUdeviceptr address, uint32_t value, unsigned flags, const char* what) {
  check(stream_memops().write(stream, address, value, flags), what, "cuStreamWriteValue32");
}

void stream_wait_value32(CUstream stream, CUdeviceptr address, uint32_t value, unsigned flags, const char* what) {
  check(stream_memops().wait(stream, address, value, flags), what, "cuStreamWaitValue32");
}

}  // namespace commlib::cuda
