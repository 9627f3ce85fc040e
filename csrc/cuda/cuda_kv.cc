// The GPU engine of commlib.kv (csrc/core/kv_agent.hpp): maps a receiver's CUDA caches into the
// sender (Note [kv memory]), stages block ids and launches the copy kernel (csrc/kernels/kv_copy.cu).
//
// Note [kv memory]
// A receiving agent exports each allocation its cache planes live in, found with
// cuMemGetAddressRange: a VMM allocation (cuMemRetainAllocationHandle succeeds: commlib's symmetric
// memory, or any cuMem allocation made with a POSIX-fd handle type) by its POSIX fd, sent over the
// agent's FdServer; any other (torch's caching allocator: cudaMalloc segments) by the legacy IPC
// handle of the allocation's base (cudaIpcGetMemHandle), the plane being base + offset. The sender
// opens the handle once per connect (cudaIpcOpenMemHandle with lazy peer access, or
// cuMemImport + Map + SetAccess) and keeps it until its agent closes; processes sharing one GPU
// work the same way. The notification segment (host memory) is registered with CUDA in the sender
// (cudaHostRegister, mapped) so the copy kernel stores the flags itself.
// Staging: block ids go through one pinned ring and one device ring of COMMLIB_KV_STAGING_BYTES at
// the same offsets (an asynchronous copy on the caller's stream); a request holds its range until
// its last layer is sent and the stream has passed that launch (an event), so layer-wise requests
// keep their ids for as long as they stream. Tile counters: a ring of kContexts zeroed counter
// sets, one per launch; each launch leaves its set zero (Note [kv copy geometry]), and a set is
// reused kContexts launches later (launches of one agent on one stream are ordered; more than
// kContexts launches in flight on different streams at once are not supported).
#include "cuda/cuda_kv.hpp"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <vector>

#include "commlib/env.hpp"
#include "commlib/errors.hpp"
#include "cuda/cuda_comm.hpp"
#include "kernels/kv_copy_params.hpp"
#include "transport/cuda_driver.hpp"

namespace commlib {
namespace {

constexpr int kContexts = 1024;

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using RetainHandle = CUresult (*)(CUmemGenericAllocationHandle*, void*);

class CudaKvEngine final : public KvEngine {
 public:
  explicit CudaKvEngine(int device) : device_(device) {
    const char* what = "KVAgent (cuda)";
    DeviceGuard guard(device_);
    staging_bytes_ = static_cast<size_t>(env::get_int("COMMLIB_KV_STAGING_BYTES"));
    COMMLIB_CHECK(staging_bytes_ >= 4096, InvalidArgument, what, ": COMMLIB_KV_STAGING_BYTES ", staging_bytes_,
                  " too small; at least 4096");
    cuda_check(cudaHostAlloc(&host_staging_, staging_bytes_, cudaHostAllocDefault), what, "cudaHostAlloc");
    cuda_check(cudaMalloc(&device_staging_, staging_bytes_), what, "cudaMalloc");
    const size_t counter_bytes = sizeof(uint32_t) * kContexts * kernels::kKvMaxLayers;
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&counters_), counter_bytes), what, "cudaMalloc");
    cuda_check(cudaMemset(counters_, 0, counter_bytes), what, "cudaMemset");
    cuda_check(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
  }

  ~CudaKvEngine() override {
    wait_device_before_release(device_);  // no copy of ours may still use what is released below
    DeviceGuard guard(device_);
    for (auto& e : ring_) {
      if (e.event != nullptr) cudaEventDestroy(e.event);
    }
    for (void* p : ipc_opened_) cudaIpcCloseMemHandle(p);
    const auto& drv = cuda::driver();
    for (const auto& [p, bytes] : vmm_mapped_) {
      drv.cuMemUnmap(p, bytes);
      drv.cuMemAddressFree(p, bytes);
    }
    for (void* p : host_registered_) cudaHostUnregister(p);
    for (void* p : tables_) cudaFree(p);
    for (int fd : exported_fds_) ::close(fd);
    cudaFree(counters_);
    cudaFree(device_staging_);
    cudaFreeHost(host_staging_);
  }

  const char* device_type() const override { return "cuda"; }
  int device() const override { return device_; }

  KvRegion export_region(uint64_t ptr, uint64_t bytes, const char* what) override {
    DeviceGuard guard(device_);
    static const auto get_range = reinterpret_cast<GetAddressRange>(cuda::entry_point("cuMemGetAddressRange", 12000));
    static const auto retain = reinterpret_cast<RetainHandle>(cuda::entry_point("cuMemRetainAllocationHandle", 12000));
    CUdeviceptr base = 0;
    size_t size = 0;
    cuda::check(get_range(&base, &size, static_cast<CUdeviceptr>(ptr)), what, "cuMemGetAddressRange");
    COMMLIB_CHECK(ptr + bytes <= base + size, InvalidArgument, what, ": the cache plane at 0x", std::hex, ptr,
                  std::dec, " (", bytes, " bytes) spans several CUDA allocations; a plane must lie in one (with "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, allocate the cache before other tensors or "
                  "turn expandable segments off)");
    KvRegion r;
    r.bytes = size;
    r.base = base;
    CUmemGenericAllocationHandle handle{};
    if (retain(&handle, reinterpret_cast<void*>(base)) == CUDA_SUCCESS) {
      int fd = -1;
      const CUresult res =
          cuda::driver().cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      cuda::driver().cuMemRelease(handle);  // the retain's reference
      COMMLIB_CHECK(res == CUDA_SUCCESS, InvalidArgument, what, ": the cache is a cuMem allocation made without a "
                    "POSIX-fd handle type, so no other process can map it (error ", static_cast<int>(res),
                    "); allocate it with torch's default allocator or commlib's symmetric memory");
      exported_fds_.push_back(fd);
      r.kind = KvRegion::Kind::kCudaVmm;
      r.fd = fd;
      return r;
    }
    cudaIpcMemHandle_t h{};
    cuda_check(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)), what, "cudaIpcGetMemHandle");
    static_assert(sizeof(h) <= sizeof(r.handle));
    std::memcpy(r.handle, &h, sizeof(h));
    r.kind = KvRegion::Kind::kCudaIpc;
    return r;
  }

  uint64_t import_region(const KvRegion& region, int fd, const char* what) override {
    DeviceGuard guard(device_);
    if (region.kind == KvRegion::Kind::kCudaIpc) {
      cudaIpcMemHandle_t h{};
      std::memcpy(&h, region.handle, sizeof(h));
      void* p = nullptr;
      cuda_check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), what, "cudaIpcOpenMemHandle");
      ipc_opened_.push_back(p);
      return reinterpret_cast<uint64_t>(p);
    }
    COMMLIB_CHECK(region.kind == KvRegion::Kind::kCudaVmm && fd >= 0, PeerError, what,
                  ": the peer's cache region is not CUDA memory");
    const auto& drv = cuda::driver();
    CUmemGenericAllocationHandle handle{};
    cuda::check(drv.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                what, "cuMemImportFromShareableHandle");
    CUdeviceptr p = 0;
    CUresult res = drv.cuMemAddressReserve(&p, region.bytes, 0, 0, 0);
    if (res == CUDA_SUCCESS) res = drv.cuMemMap(p, region.bytes, 0, handle, 0);
    if (res == CUDA_SUCCESS) {
      CUmemAccessDesc access{};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = device_;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      res = drv.cuMemSetAccess(p, region.bytes, &access, 1);
    }
    drv.cuMemRelease(handle);  // the mapping keeps the memory
    if (res != CUDA_SUCCESS && p != 0) {
      drv.cuMemUnmap(p, region.bytes);
      drv.cuMemAddressFree(p, region.bytes);
    }
    cuda::check(res, what, "mapping the peer's cuMem cache");
    vmm_mapped_.emplace_back(p, region.bytes);
    return static_cast<uint64_t>(p);
  }

  uint32_t* map_flags(void* host, size_t bytes, const char* what) override {
    DeviceGuard guard(device_);
    cuda_check(cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable), what,
               "cudaHostRegister (the peer's notification segment)");
    host_registered_.push_back(host);
    void* device = nullptr;
    cuda_check(cudaHostGetDevicePointer(&device, host, 0), what, "cudaHostGetDevicePointer");
    return static_cast<uint32_t*>(device);
  }

  const uint64_t* upload_table(const std::vector<uint64_t>& values, const char* what) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, std::max<size_t>(8, values.size() * sizeof(uint64_t))), what, "cudaMalloc");
    tables_.push_back(p);
    cuda_check(cudaMemcpy(p, values.data(), values.size() * sizeof(uint64_t), cudaMemcpyHostToDevice), what,
               "cudaMemcpy");
    return static_cast<const uint64_t*>(p);
  }

  KvStagedBlocks stage_blocks(const int32_t* src, size_t num_src, const int32_t* dst, size_t num_dst, void* stream,
                              const char* what) override {
    const size_t src_bytes = (num_src * sizeof(int32_t) + 255) / 256 * 256;
    const size_t bytes = src_bytes + num_dst * sizeof(int32_t);
    const size_t offset = reserve(bytes, what);
    auto* h = static_cast<char*>(host_staging_) + offset;
    std::memcpy(h, src, num_src * sizeof(int32_t));
    std::memcpy(h + src_bytes, dst, num_dst * sizeof(int32_t));
    auto* d = static_cast<char*>(device_staging_) + offset;
    DeviceGuard guard(device_);
    cuda_check(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)), what,
               "cudaMemcpyAsync (block ids)");
    const uint64_t token = next_token_++;
    ring_.back().token = token;
    return {reinterpret_cast<const int32_t*>(d), reinterpret_cast<const int32_t*>(d + src_bytes), token};
  }

  void release_blocks(const KvStagedBlocks& blocks, void* stream) override {
    for (auto& e : ring_) {
      if (e.token != blocks.token) continue;
      DeviceGuard guard(device_);
      if (cudaEventCreateWithFlags(&e.event, cudaEventDisableTiming) == cudaSuccess) {
        cudaEventRecord(e.event, static_cast<cudaStream_t>(stream));
      }
      e.released = true;
    }
  }

  void copy(kernels::KvCopyParams& params, void* stream, const char* what) override {
    DeviceGuard guard(device_);
    params.tile_counters = counters_ + static_cast<size_t>(next_context_) * kernels::kKvMaxLayers;
    next_context_ = (next_context_ + 1) % kContexts;
    // Enough CTAs of 512 threads for 8 accesses each (the kernel's unroll), at most the budget; the
    // launch's layers share the CTAs (Note [kv copy geometry]).
    const int64_t units =
        static_cast<int64_t>(params.num_dests) * params.num_planes * params.num_dst_blocks * params.num_layers;
    const int64_t vectors =
        units * params.dst.block_size * params.num_heads * (params.row_bytes / params.vector_bytes);
    params.num_ctas = static_cast<int32_t>(std::clamp<int64_t>((vectors + 4095) / 4096, 1, std::min<int64_t>(params.num_ctas, units)));
    params.threads = static_cast<int32_t>(std::clamp<int64_t>((vectors / params.num_ctas / 8 + 31) / 32 * 32, 64, 512));
    throw_if_error(kernels::launch_kv_copy(params, static_cast<cudaStream_t>(stream)));
  }

 private:
  struct Range {
    size_t offset;
    size_t bytes;
    uint64_t token = 0;
    bool released = false;
    cudaEvent_t event = nullptr;
  };

  // Offset of `bytes` free in both staging rings (Note [kv memory]).
  size_t reserve(size_t bytes, const char* what) {
    bytes = (bytes + 255) / 256 * 256;
    COMMLIB_CHECK(bytes <= staging_bytes_, InvalidArgument, what, ": the request's block ids need ", bytes,
                  " bytes of staging; COMMLIB_KV_STAGING_BYTES is ", staging_bytes_);
    for (;;) {
      while (!ring_.empty() && ring_.front().released &&
             (ring_.front().event == nullptr || cudaEventQuery(ring_.front().event) == cudaSuccess)) {
        if (ring_.front().event != nullptr) cudaEventDestroy(ring_.front().event);
        ring_.pop_front();
      }
      if (ring_.empty()) head_ = 0;
      const size_t tail = ring_.empty() ? 0 : ring_.front().offset;
      size_t offset = SIZE_MAX;
      if (ring_.empty() || head_ > tail) {
        if (staging_bytes_ - head_ >= bytes) {
          offset = head_;
        } else if (tail >= bytes) {
          offset = 0;
        }
      } else if (head_ < tail && tail - head_ >= bytes) {
        offset = head_;
      }
      if (offset != SIZE_MAX) {
        ring_.push_back({offset, bytes});
        head_ = offset + bytes;
        return offset;
      }
      // Full: the oldest range must be released (its request fully sent) to wait for it.
      COMMLIB_CHECK(ring_.front().released, InvalidArgument, what, ": block-id staging full (",
                    staging_bytes_, " bytes, COMMLIB_KV_STAGING_BYTES) with requests whose layers are not all sent "
                    "yet; send their remaining layers first or raise the knob");
      cuda_check(cudaEventSynchronize(ring_.front().event), what, "cudaEventSynchronize");
    }
  }

  int device_;
  size_t staging_bytes_ = 0;
  void* host_staging_ = nullptr;
  void* device_staging_ = nullptr;
  uint32_t* counters_ = nullptr;
  int next_context_ = 0;
  std::deque<Range> ring_;
  size_t head_ = 0;
  uint64_t next_token_ = 1;
  std::vector<void*> ipc_opened_;
  std::vector<std::pair<CUdeviceptr, size_t>> vmm_mapped_;
  std::vector<void*> host_registered_;
  std::vector<void*> tables_;
  std::vector<int> exported_fds_;
};

}  // namespace

std::unique_ptr<KvEngine> make_cuda_kv_engine(int device) { return std::make_unique<CudaKvEngine>(device); }

}  // namespace commlib
