// Note [multicast workspace] (cuda_multicast.hpp). SAFETY: the guard comes before every CUDA call.
#include "transport/cuda_multicast.hpp"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "bootstrap/bootstrap.hpp"
#include "commlib/errors.hpp"
#include "transport/cuda_driver.hpp"
#include "common/multicast_guard.hpp"
#include "transport/cuda_ipc.hpp"

namespace commlib {
namespace {

constexpr const char* kWhat = "multicast workspace";
constexpr int kMulticastApiVersion = 12010;  // CUDA 12.1: the first ABI with the multicast calls

std::atomic<int64_t> g_objects_created{0};

// The multicast entry points, resolved on first use, which is always after the guard allowed it.
struct MulticastDriverApi {
  decltype(&::cuDeviceGet) cuDeviceGet;
  decltype(&::cuDeviceGetAttribute) cuDeviceGetAttribute;
  decltype(&::cuMulticastGetGranularity) cuMulticastGetGranularity;
  decltype(&::cuMulticastCreate) cuMulticastCreate;
  decltype(&::cuMulticastAddDevice) cuMulticastAddDevice;
  decltype(&::cuMulticastBindAddr) cuMulticastBindAddr;
  decltype(&::cuMulticastUnbind) cuMulticastUnbind;
};

template <typename Fn>
void resolve(Fn& fn, const char* symbol, int version) {
  fn = reinterpret_cast<Fn>(cuda::entry_point(symbol, version));
}

const MulticastDriverApi& multicast_driver() {
  static MulticastDriverApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    resolve(api.cuDeviceGet, "cuDeviceGet", 2000);
    resolve(api.cuDeviceGetAttribute, "cuDeviceGetAttribute", 2000);
    resolve(api.cuMulticastGetGranularity, "cuMulticastGetGranularity", kMulticastApiVersion);
    resolve(api.cuMulticastCreate, "cuMulticastCreate", kMulticastApiVersion);
    resolve(api.cuMulticastAddDevice, "cuMulticastAddDevice", kMulticastApiVersion);
    resolve(api.cuMulticastBindAddr, "cuMulticastBindAddr", kMulticastApiVersion);
    resolve(api.cuMulticastUnbind, "cuMulticastUnbind", kMulticastApiVersion);
  });
  return api;
}

struct Support {
  int32_t multicast;
  int32_t rank;
};

}  // namespace

MulticastWorkspace::MulticastWorkspace(CudaIpc& ipc, int rank, int world, int device, Store& store,
                                       const std::string& prefix, size_t bytes) {
  // SAFETY: first, before any CUDA call (docs/architecture.md, Safety).
  require_multicast(kWhat);
  device_ = device;
  const auto& drv = cuda::driver();
  const auto& mc = multicast_driver();
  Bootstrap bootstrap(store, prefix, rank, world);

  CUdevice dev = 0;
  cuda::check(mc.cuDeviceGet(&dev, device_), kWhat, "cuDeviceGet");
  int supported = 0;
  cuda::check(mc.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev), kWhat,
              "cuDeviceGetAttribute(MULTICAST_SUPPORTED)");
  for (const auto& bytes_of : bootstrap.all_gather("support", to_bytes(Support{supported, rank}))) {
    const auto theirs = from_bytes<Support>(bytes_of);
    COMMLIB_CHECK(theirs.multicast != 0, InvalidArgument, kWhat, ": the GPU of rank ", theirs.rank,
                  " does not support NVLink multicast (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0); "
                  "use algo 'auto' or 'p2p'");
  }

  CUmulticastObjectProp prop{};
  prop.numDevices = static_cast<unsigned int>(world);
  prop.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  cuda::check(mc.cuMulticastGetGranularity(&granularity, &prop, CU_MULTICAST_GRANULARITY_MINIMUM), kWhat,
              "cuMulticastGetGranularity");
  unicast_ = ipc.allocate(bytes, ZeroFill::kNo, kWhat, granularity);
  bytes_ = unicast_->bytes();
  prop.size = bytes_;

  int fd = -1;
  try {
    // Rank 0's outcome reaches every rank through the store first, so a failed create raises
    // everywhere at once instead of after the peers' descriptor wait times out.
    std::string failure;
    if (rank == 0) {
      try {
        CUmemGenericAllocationHandle handle = 0;
        cuda::check(mc.cuMulticastCreate(&handle, &prop), kWhat, "cuMulticastCreate");
        mc_handle_ = handle;
        g_objects_created.fetch_add(1);
        cuda::check(drv.cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                    kWhat, "cuMemExportToShareableHandle");
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    const auto outcome = bootstrap.broadcast("created", std::vector<uint8_t>(failure.begin(), failure.end()), 0);
    COMMLIB_CHECK(outcome.empty(), PeerError, kWhat, ": rank 0 could not create the multicast object: ",
                  std::string(outcome.begin(), outcome.end()));
    fd = ipc.broadcast_fd(0, fd, kWhat);
    if (rank != 0) {
      CUmemGenericAllocationHandle handle = 0;
      cuda::check(drv.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                  kWhat, "cuMemImportFromShareableHandle");
      mc_handle_ = handle;
    }
    ::close(fd);
    fd = -1;
    cuda::check(mc.cuMulticastAddDevice(mc_handle_, dev), kWhat, "cuMulticastAddDevice");
    // Every device is in the team before anyone binds (the bind would otherwise block unbounded).
    bootstrap.barrier("added");
    cuda::check(mc.cuMulticastBindAddr(mc_handle_, 0, reinterpret_cast<CUdeviceptr>(unicast_->local()), bytes_, 0),
                kWhat, "cuMulticastBindAddr");
    bound_ = true;
    CUdeviceptr ptr = 0;
    cuda::check(drv.cuMemAddressReserve(&ptr, bytes_, granularity, 0, 0), kWhat, "cuMemAddressReserve");
    mc_ptr_ = ptr;
    cuda::check(drv.cuMemMap(ptr, bytes_, 0, mc_handle_, 0), kWhat, "cuMemMap");
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    cuda::check(drv.cuMemSetAccess(ptr, bytes_, &access, 1), kWhat, "cuMemSetAccess");
  } catch (...) {
    if (fd >= 0) ::close(fd);
    release();
    throw;
  }
  bootstrap.barrier("mapped");
}

MulticastWorkspace::~MulticastWorkspace() { release(); }

void MulticastWorkspace::release() noexcept {
  // Nothing to undo unless the constructor got past the guard and allocated.
  if (unicast_ == nullptr) return;
  const auto& drv = cuda::driver();
  const auto& mc = multicast_driver();
  cudaSetDevice(device_);
  // In-flight multimem kernels may still use the mapping; their waits are bounded, so this returns.
  cudaDeviceSynchronize();
  if (mc_ptr_ != 0) {
    drv.cuMemUnmap(mc_ptr_, bytes_);
    drv.cuMemAddressFree(mc_ptr_, bytes_);
    mc_ptr_ = 0;
  }
  if (bound_) {
    CUdevice dev = 0;
    if (mc.cuDeviceGet(&dev, device_) == CUDA_SUCCESS) mc.cuMulticastUnbind(mc_handle_, dev, 0, bytes_);
    bound_ = false;
  }
  if (mc_handle_ != 0) {
    drv.cuMemRelease(mc_handle_);
    mc_handle_ = 0;
  }
  unicast_.reset();
  cudaGetLastError();
}

void destroy_multicast_workspace(MulticastWorkspace* workspace) { delete workspace; }

int64_t multicast_objects_created() { return g_objects_created.load(); }

}  // namespace commlib
