// Built only without CUDA: GPU operations raise a clear error.
#include "commlib/communicator.hpp"
#include "commlib/errors.hpp"
#include "commlib/gpu.hpp"
#include "common/multicast_guard.hpp"

namespace commlib {

CudaComm& Communicator::cuda(int) {
  check_open("cuda transport");
  throw InvalidArgument("commlib was built without CUDA (nvcc was not found at build time); GPU tensors are not supported");
}

MulticastWorkspace& Communicator::multicast(int) {
  check_open("multicast transport");
  require_multicast("multicast transport");
  throw InvalidArgument("multicast workspace: commlib was built without CUDA (nvcc was not found at build time)");
}

namespace {
[[noreturn]] void no_gpu() {
  throw InvalidArgument("commlib was built without CUDA (nvcc was not found at build time); GPU operations are not "
                        "supported");
}
}  // namespace

bool gpu_built() { return false; }
void all_reduce_gpu(Communicator&, int, const void*, void*, size_t, DataType, ReduceOp, Algorithm, GpuStream) {
  no_gpu();
}
void fused_allreduce_rmsnorm_gpu(Communicator&, int, const FusedRmsNormArgs&, int, FusedAlgo, GpuStream) { no_gpu(); }
void reduce_scatter_gpu(Communicator&, int, const void*, void*, size_t, DataType, ReduceOp, GpuStream) { no_gpu(); }
void all_gather_gpu(Communicator&, int, const void*, void*, size_t, GpuStream) { no_gpu(); }
void broadcast_gpu(Communicator&, int, void*, size_t, int, GpuStream) { no_gpu(); }
void all_to_all_gpu(Communicator&, int, const void*, void*, size_t, GpuStream) { no_gpu(); }
void check_gpu_error(Communicator&) {}
std::vector<int64_t> ep_trace_snapshot_gpu() { return {}; }

struct EPBufferGpu::Impl {};
EPBufferGpu::EPBufferGpu(Communicator&, const EPConfig&, int, EPTransport) { no_gpu(); }
std::pair<int, int> ep_nvshmem_attach(const std::string&, int) { no_gpu(); }
EPBufferGpu::~EPBufferGpu() = default;
void EPBufferGpu::set_local(void*, int32_t*, int32_t*) { no_gpu(); }
EPState EPBufferGpu::state() const { no_gpu(); }
int64_t EPBufferGpu::meta_num_tokens_stride() const { no_gpu(); }
std::shared_ptr<void> EPBufferGpu::symmetric_keepalive() const { no_gpu(); }
const EPConfig& EPBufferGpu::config() const { no_gpu(); }
int EPBufferGpu::device() const { no_gpu(); }
const char* EPBufferGpu::kernels() const { no_gpu(); }
void EPBufferGpu::dispatch(const void*, int64_t, const int64_t*, const float*, EPPhase, GpuStream) { no_gpu(); }
void EPBufferGpu::combine(const void*, void*, EPPhase, GpuStream) { no_gpu(); }

}  // namespace commlib
