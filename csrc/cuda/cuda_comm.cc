#include "cuda/cuda_comm.hpp"

#include <atomic>
#include <cstring>

#include "commlib/env.hpp"
#include "commlib/errors.hpp"
#include "commlib/gpu.hpp"
#include "commlib/phase.hpp"
#include "core/algorithm_selector.hpp"
#include "cuda/cuda_p2p.hpp"
#include "kernels/all_reduce_params.hpp"
#include "kernels/all_to_all_v_params.hpp"
#include "kernels/exchange_params.hpp"
#include "transport/cuda_driver.hpp"
#include "transport/cuda_ipc.hpp"

namespace commlib {

// Communicator's GPU state is the GPU engine's to create and destroy: the core knows CudaComm only by
// name (layers: docs/architecture.md).
CudaComm& Communicator::cuda(int device) {
  check_open("cuda transport");
  if (!cuda_) {
    cuda_ = decltype(cuda_)(new CudaComm(*this, device), [](CudaComm* c) { delete c; });
    cuda_abort_hook = [](CudaComm& c) { c.abort(); };
    cuda_failed_hook = [](const CudaComm& c) { return c.failed(); };
  } else {
    COMMLIB_CHECK(device == cuda_->device(), InvalidArgument, "communicator '", name_, "': device cuda:", device,
                  " but its GPU state lives on cuda:", cuda_->device(), "; use one device per communicator");
  }
  return *cuda_;
}

namespace {

// The fields every all-reduce kernel's params take.
template <typename P>
P all_reduce_params(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                    const BarrierDevice& barrier, int64_t max_blocks) {
  P p;
  p.input = input;
  p.output = output;
  p.count = count;
  p.dtype = dtype;
  p.op = op;
  p.barrier = barrier;
  p.max_blocks = static_cast<int>(max_blocks);
  return p;
}

}  // namespace

void cuda_check(cudaError_t err, const char* what, const char* call) {
  COMMLIB_CHECK(err == cudaSuccess, CudaError, what, ": ", call, " failed: ", cudaGetErrorString(err));
}

DeviceGuard::DeviceGuard(int device) {
  cudaGetDevice(&previous_);
  changed_ = previous_ != device;
  if (changed_) cudaSetDevice(device);
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(previous_);
}

CudaComm::CudaComm(Communicator& comm, int device)
    : comm_(comm), config_(comm.config()), device_(device), rank_(comm.rank()), world_size_(comm.world_size()) {
  const char* what = "cuda communicator";
  int count = 0;
  cuda_check(cudaGetDeviceCount(&count), what, "cudaGetDeviceCount");
  COMMLIB_CHECK(device >= 0 && device < count, InvalidArgument, what, ": device ", device,
                " out of range; valid: 0..", count - 1);
  DeviceGuard guard(device_);
  cuda_check(cudaFree(nullptr), what, "cudaFree(0) (context creation)");
  ipc_ = std::make_unique<CudaIpc>(comm.store(), comm.prefix(), rank_, world_size_, device_, comm.peer_pids()[0],
                                   comm.timeout(), comm.hosts_problem());
  cuda_check(cudaMalloc(&state_, sizeof(BarrierCallState)), what, "cudaMalloc");
  cuda_check(cudaMemset(state_, 0, sizeof(BarrierCallState)), what, "cudaMemset");
  cuda_check(cudaHostAlloc(&error_host_, sizeof(DeviceErrorWord), cudaHostAllocMapped), what, "cudaHostAlloc");
  std::memset(error_host_, 0, sizeof(DeviceErrorWord));
  cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), error_host_, 0), what,
             "cudaHostGetDevicePointer");
  cuda_check(cudaEventCreateWithFlags(&last_done_, cudaEventDisableTiming), what, "cudaEventCreate");
  if (ipc_->p2p_ok()) {
    signal_pad_ = ipc_->allocate(sizeof(uint64_t) * kMaxBarrierBlocks * kMaxDeviceRanks, ZeroFill::kYes, what);
    const int64_t ws = env::get_int("COMMLIB_GPU_WORKSPACE_BYTES");
    COMMLIB_CHECK(ws >= (1 << 16), InvalidArgument, "COMMLIB_GPU_WORKSPACE_BYTES=", ws, " too small; minimum 65536");
    workspace_ = ipc_->allocate(static_cast<size_t>(ws), ZeroFill::kNo, what);
    ll_lines_ = ipc_->allocate(kernels::ll_buffer_bytes(world_size_, kLLBytesPerCall), ZeroFill::kYes, what);
    const int64_t slot = env::get_int("COMMLIB_P2P_SLOT_BYTES");
    COMMLIB_CHECK(slot >= 4096 && slot % 256 == 0, InvalidArgument, "COMMLIB_P2P_SLOT_BYTES=", slot,
                  " not supported; valid: a multiple of 256, at least 4096");
    p2p_ = std::make_unique<CudaP2p>(comm_, *ipc_, device_, static_cast<size_t>(slot));
  }
  cuda_check(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
}

void wait_device_before_release(int device) noexcept {
  DeviceGuard guard(device);
  cudaDeviceSynchronize();
  cudaGetLastError();
}

CudaComm::~CudaComm() {
  wait_device_before_release(device_);
  DeviceGuard guard(device_);
  p2p_.reset();
  user_buffers_.clear();
  a2a_control_.reset();
  ll_lines_.reset();
  workspace_.reset();
  signal_pad_.reset();
  ipc_.reset();
  if (last_done_ != nullptr) cudaEventDestroy(last_done_);
  if (state_ != nullptr) cudaFree(state_);
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  cudaGetLastError();
}

bool CudaComm::p2p_ok() const { return ipc_->p2p_ok(); }

CudaP2p& CudaComm::p2p() {
  COMMLIB_CHECK(p2p_ != nullptr, PeerError, "send/recv: GPU peer memory unavailable: ", ipc_->problem());
  return *p2p_;
}
const std::string& CudaComm::peer_problem() const { return ipc_->problem(); }

std::shared_ptr<SymmetricBuffer> CudaComm::allocate_symmetric(size_t bytes) {
  DeviceGuard guard(device_);
  auto buffer = ipc_->allocate(bytes, ZeroFill::kNo, "symmetric_empty");
  std::erase_if(user_buffers_, [](const std::weak_ptr<SymmetricBuffer>& w) { return w.expired(); });
  user_buffers_.push_back(buffer);
  return buffer;
}

std::shared_ptr<SymmetricBuffer> CudaComm::find_symmetric(const void* ptr, size_t bytes, size_t* offset) const {
  for (const auto& weak : user_buffers_) {
    auto buffer = weak.lock();
    if (buffer && buffer->contains(ptr, bytes)) {
      *offset = static_cast<size_t>(static_cast<const char*>(ptr) - static_cast<const char*>(buffer->local()));
      return buffer;
    }
  }
  return nullptr;
}

BarrierDevice CudaComm::barrier_handle() const {
  BarrierDevice bar{};
  // Without peer memory (Note [communicator hosts]) no flags: the NVSHMEM EP kernels use the rest.
  for (int r = 0; signal_pad_ != nullptr && r < std::min(world_size_, kMaxDeviceRanks); ++r) {
    bar.flags[r] = static_cast<uint64_t*>(signal_pad_->peer(r));
  }
  bar.state = state_;
  bar.error = error_device_;
  // The communicator's timeout now (set_timeout may have changed it since creation).
  bar.timeout_ns = static_cast<uint64_t>(comm_.timeout().count()) * 1000000ull;
  bar.rank = rank_;
  bar.world_size = world_size_;
  return bar;
}

SymmetricBufferDevice CudaComm::ll_lines_handle() const {
  SymmetricBufferDevice lines = ll_lines_->device_handle();
  lines.bytes = kernels::ll_buffer_bytes(world_size_, kLLBytesPerCall);
  return lines;
}

void CudaComm::check_error(const char* what) const {
  const auto* word = static_cast<volatile DeviceErrorWord*>(error_host_);
  if (word->failed == 0) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  throw Timeout(detail::concat(
      what, ": Timed out in an earlier GPU wait of this communicator: rank ", word->rank, " waited ",
      word->elapsed_ns / 1000000, " ms for rank ", word->peer, " at phase '",
      phase_name(word->phase), "' (block ", word->block, ", collective call #", word->call,
      "); the communicator is unusable, create a new one"));
}

bool CudaComm::failed() const { return static_cast<volatile DeviceErrorWord*>(error_host_)->failed != 0; }

void CudaComm::abort() noexcept {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device_) != cudaSuccess) return;
  cudaStream_t side = nullptr;
  if (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess) {
    try {
      cuda::stream_write_value32(reinterpret_cast<CUstream>(side), reinterpret_cast<CUdeviceptr>(&state_->poisoned),
                                 1u, 0, "abort");
    } catch (const std::exception&) {
      // the communicator is being given up: a driver that refuses leaves the device waits to their timeout
    }
    cudaStreamDestroy(side);  // returns at once; the write still happens
  }
  cudaSetDevice(previous);
}

void CudaComm::begin_op(cudaStream_t stream, const char* what) {
  check_error(what);
  COMMLIB_CHECK(ipc_->p2p_ok(), PeerError, what, ": GPU peer memory unavailable: ", ipc_->problem());
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &capture), what, "cudaStreamIsCapturing");
  capturing_ = capture != cudaStreamCaptureStatusNone;
  if (!capturing_ && has_last_ && stream != last_stream_) {
    // Keeps this communicator's calls in call order across streams (the barrier counts calls).
    // The event is recorded only here, when the stream changes, not after every call: recorded
    // now on the previous stream, it covers that stream's earlier collectives all the same.
    cuda_check(cudaEventRecord(last_done_, last_stream_), what, "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream, last_done_, 0), what, "cudaStreamWaitEvent");
  }
}

void CudaComm::end_op(cudaStream_t stream, const char* /*what*/) {
  if (capturing_) return;
  last_stream_ = stream;
  has_last_ = true;
}

Residence CudaComm::residence(const void* input, const void* output, size_t bytes) const {
  if (input != output || user_buffers_.empty() || (reinterpret_cast<uintptr_t>(output) & 15u) != 0) {
    return Residence::kPlain;
  }
  size_t offset = 0;
  return find_symmetric(output, bytes, &offset) != nullptr ? Residence::kSymmetricInPlace : Residence::kPlain;
}

namespace {

// One rank's collective: the copy engine, or nothing in place.
void copy_local(void* dst, const void* src, size_t bytes, cudaStream_t stream, const char* what) {
  if (dst != src) cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), what, "cudaMemcpyAsync");
}

}  // namespace

void CudaComm::all_reduce(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                          Algorithm algo, cudaStream_t stream) {
  const size_t bytes = count * dtype_size(dtype);
  AllReduceShape shape;
  shape.bytes = bytes;
  shape.dtype = dtype;
  shape.placement = Placement::kCuda;
  shape.requested = algo;
  shape.nccl = NcclEngine::kNone;
  shape.residence = residence(input, output, bytes);
  all_reduce(input, output, count, dtype, op, plan_all_reduce(config_, shape), stream);
}

void CudaComm::all_reduce(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                          const Plan& plan, cudaStream_t stream) {
  const char* what = "all_reduce";
  COMMLIB_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, InvalidArgument, what, ": op ", reduce_op_name(op),
                " not supported for CUDA tensors; supported: sum, avg");
  COMMLIB_CHECK(is_reducible(dtype), TypeMismatch, what, ": dtype ", dtype_name(dtype),
                " not supported; supported: float32, float16, bfloat16");
  const Variant v = plan.variant;
  COMMLIB_CHECK(v == Variant::kFlatLL || v == Variant::kFlat || v == Variant::kTree || v == Variant::kTreeZeroCopy ||
                    v == Variant::kLocalCopy,
                InvalidArgument, what, ": plan '", variant_name(v),
                "' is not a CUDA all-reduce; supported: flat_ll, flat, tree, tree_zero_copy, local_copy");
  if (count == 0) {
    check_error(what);
    return;
  }
  const size_t bytes = count * dtype_size(dtype);
  DeviceGuard guard(device_);
  begin_op(stream, what);
  Status status;
  const Geometry& geo = plan.geometry;
  plan_executed(plan, rank_);
  if (v == Variant::kLocalCopy) {  // one rank (world_size 1): the input is the result
    copy_local(output, input, bytes, stream, what);
    end_op(stream, what);
    return;
  }
  const BarrierDevice barrier = barrier_handle();
  if (v == Variant::kFlatLL) {
    auto p = all_reduce_params<kernels::AllReduceFlatLLParams>(input, output, count, dtype, op, barrier, geo.grid);
    p.lines = ll_lines_->device_handle();
    p.max_bytes_per_call = geo.chunk_bytes;
    p.order = geo.order;
    status = kernels::launch_all_reduce_flat_ll(p, stream);
  } else if (v == Variant::kFlat) {
    auto p = all_reduce_params<kernels::AllReduceFlatParams>(input, output, count, dtype, op, barrier, geo.grid);
    p.workspace = workspace_->device_handle();
    p.order = geo.order;
    status = kernels::launch_all_reduce_flat(p, stream);
  } else {
    auto p = all_reduce_params<kernels::AllReduceTreeParams>(input, output, count, dtype, op, barrier,
                                                             config_.all_reduce.max_blocks);
    p.workspace = workspace_->device_handle();
    p.config = config_.all_reduce.tree;
    if (v == Variant::kTreeZeroCopy) {
      size_t offset = 0;
      std::shared_ptr<SymmetricBuffer> sym = find_symmetric(output, bytes, &offset);
      COMMLIB_CHECK(input == output && sym != nullptr, InvalidArgument, what,
                    ": plan 'tree_zero_copy' for a tensor that is not a symmetric tensor reduced in place");
      p.source_kind = kernels::AllReduceSource::kSymmetricInput;
      p.source = sym->device_handle_at(offset);
    }
    status = kernels::launch_all_reduce_tree(p, stream);
  }
  throw_if_error(status);
  end_op(stream, what);
}

namespace {

Plan exchange_plan(const CommConfig& config, CollectiveOp op, size_t message_bytes, DataType dtype) {
  ExchangeShape shape;
  shape.op = op;
  shape.message_bytes = message_bytes;
  shape.dtype = dtype;
  shape.placement = Placement::kCuda;
  shape.nccl = NcclEngine::kNone;
  return plan_exchange(config, shape);
}

}  // namespace

void CudaComm::reduce_scatter(const void* input, void* output, size_t count, DataType dtype, ReduceOp op,
                              cudaStream_t stream) {
  const char* what = "reduce_scatter";
  COMMLIB_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, InvalidArgument, what, ": op ", reduce_op_name(op),
                " not supported for CUDA tensors; supported: sum, avg");
  COMMLIB_CHECK(is_reducible(dtype), TypeMismatch, what, ": dtype ", dtype_name(dtype),
                " not supported; supported: float32, float16, bfloat16");
  if (count == 0) {
    check_error(what);
    return;
  }
  const Plan plan = exchange_plan(config_, CollectiveOp::kReduceScatter,
                                  count * static_cast<size_t>(world_size_) * dtype_size(dtype), dtype);
  DeviceGuard guard(device_);
  begin_op(stream, what);
  plan_executed(plan, rank_);
  if (plan.variant == Variant::kLocalCopy) {  // the sum (and avg: / 1, exact) of one rank: a copy-engine copy
    copy_local(output, input, count * dtype_size(dtype), stream, what);
    end_op(stream, what);
    return;
  }
  kernels::ReduceScatterParams p;
  p.input = input;
  p.output = output;
  p.count = count;
  p.dtype = dtype;
  p.op = op;
  p.workspace = workspace_->device_handle();
  p.barrier = barrier_handle();
  p.order = plan.geometry.order;
  if (plan.variant == Variant::kReduceScatterLL) {
    p.lines = ll_lines_handle();
    p.max_bytes_per_call = plan.geometry.chunk_bytes;
    throw_if_error(kernels::launch_reduce_scatter_ll(p, stream));
  } else {
    throw_if_error(kernels::launch_reduce_scatter(p, stream));
  }
  end_op(stream, what);
}

namespace {

// `message_bytes`: the op's whole message (Note [collective crossovers]), which the plan reads.
void run_exchange(CudaComm& cuda, kernels::ExchangeParams& p, CollectiveOp op, size_t message_bytes,
                  cudaStream_t stream) {
  if (p.bytes == 0) {
    cuda.check_error(p.what);
    return;
  }
  const Plan plan = exchange_plan(cuda.config(), op, message_bytes, DataType::kUInt8);
  DeviceGuard guard(cuda.device());
  cuda.begin_op(stream, p.what);
  plan_executed(plan, cuda.rank());
  if (plan.variant == Variant::kLocalCopy) {  // no peers: the own block, by the copy engine (broadcast: nothing)
    if (p.root < 0) copy_local(p.output, p.input, p.bytes, stream, p.what);
    cuda.end_op(stream, p.what);
    return;
  }
  p.workspace = cuda.workspace().device_handle();
  p.barrier = cuda.barrier_handle();
  p.order = plan.geometry.order;
  if (plan.variant == Variant::kExchangeLL) {
    p.lines = cuda.ll_lines_handle();
    p.max_bytes_per_call = plan.geometry.chunk_bytes;
    throw_if_error(kernels::launch_exchange_ll(p, stream));
  } else {
    throw_if_error(kernels::launch_exchange(p, stream));
  }
  cuda.end_op(stream, p.what);
}

}  // namespace

void CudaComm::all_gather(const void* input, void* output, size_t bytes, cudaStream_t stream) {
  kernels::ExchangeParams p;
  p.what = "all_gather";
  p.input = input;
  p.output = output;
  p.bytes = bytes;
  p.out_stride = bytes;
  run_exchange(*this, p, CollectiveOp::kAllGather, bytes * static_cast<size_t>(world_size_), stream);
}

void CudaComm::broadcast(void* data, size_t bytes, int root, cudaStream_t stream) {
  COMMLIB_CHECK(root >= 0 && root < world_size_, InvalidArgument, "broadcast: src ", root, " out of range; valid: 0..",
                world_size_ - 1);
  kernels::ExchangeParams p;
  p.what = "broadcast";
  p.input = data;
  p.output = data;
  p.bytes = bytes;
  p.root = root;
  run_exchange(*this, p, CollectiveOp::kBroadcast, bytes, stream);
}

void CudaComm::all_to_all(const void* input, void* output, size_t block_bytes, cudaStream_t stream) {
  kernels::ExchangeParams p;
  p.what = "all_to_all";
  p.input = input;
  p.output = output;
  p.bytes = block_bytes;
  p.in_stride = block_bytes;
  p.out_stride = block_bytes;
  run_exchange(*this, p, CollectiveOp::kAllToAll, block_bytes * static_cast<size_t>(world_size_), stream);
}

const SymmetricBuffer& CudaComm::all_to_all_control() {
  if (!a2a_control_) {
    const char* what = "all_to_all_v";
    DeviceGuard guard(device_);
    a2a_control_ = allocate_symmetric(kernels::kAllToAllVControlBytes);
    cuda_check(cudaMemset(a2a_control_->local(), 0, kernels::kAllToAllVControlBytes), what, "cudaMemset");
    cuda_check(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
    comm_.barrier_host();  // nobody writes a peer's control area before the peer cleared it
  }
  return *a2a_control_;
}

void CudaComm::all_to_all_v(const void* input, void* output, int64_t row_bytes, int64_t in_rows, int64_t out_rows,
                            const int64_t* in_splits, const int64_t* out_splits, cudaStream_t stream) {
  const char* what = "all_to_all_v";
  DeviceGuard guard(device_);
  const SymmetricBuffer& control = all_to_all_control();  // collective on first use
  begin_op(stream, what);
  kernels::AllToAllVParams p;
  p.input = input;
  p.output = output;
  p.row_bytes = row_bytes;
  p.in_rows = in_rows;
  p.out_rows = out_rows;
  p.in_splits = in_splits;
  p.out_splits = out_splits;
  p.control = control.device_handle();
  p.barrier = barrier_handle();
  size_t offset = 0;
  const size_t out_bytes = static_cast<size_t>(out_rows * row_bytes);
  std::shared_ptr<SymmetricBuffer> sym = find_symmetric(output, std::max<size_t>(out_bytes, 1), &offset);
  if (sym != nullptr) {
    p.target = kernels::AllToAllVTarget::kSymmetricOutput;
    p.recv = sym->device_handle_at(offset);
  } else {
    p.target = kernels::AllToAllVTarget::kWorkspace;
    p.recv = workspace_->device_handle();
    COMMLIB_CHECK(out_bytes <= p.recv.bytes / 2 / 16 * 16, InvalidArgument, what, ": output of ", out_bytes,
                  " bytes exceeds the workspace half (", p.recv.bytes / 2 / 16 * 16,
                  " bytes); allocate the output with comm.symmetric_empty or raise COMMLIB_GPU_WORKSPACE_BYTES");
  }
  throw_if_error(kernels::launch_all_to_all_v(p, stream));
  end_op(stream, what);
}

void CudaComm::check_all_to_all() {
  const char* what = "all_to_all_v";
  DeviceGuard guard(device_);
  const SymmetricBuffer& control = all_to_all_control();
  uint64_t errors = 0;
  char* word = static_cast<char*>(control.local()) + kernels::kAllToAllVErrorOffset;
  cuda_check(cudaMemcpy(&errors, word, sizeof(errors), cudaMemcpyDeviceToHost), what, "cudaMemcpy");
  if (errors == 0) return;
  cuda_check(cudaMemset(word, 0, sizeof(errors)), what, "cudaMemset");
  throw InvalidArgument(detail::concat(
      "all_to_all_v: ", errors, " block(s) of CUDA calls since the last check found invalid device splits: a negative "
      "split, splits summing past the tensor's rows, output beyond the workspace, or output_split_sizes[q] on one "
      "rank != input_split_sizes[r] on rank q; the rows between those ranks were not sent"));
}

// ---- include/commlib/gpu.hpp ----

bool gpu_built() { return true; }

void all_reduce_gpu(Communicator& comm, int device, const void* input, void* output, size_t count, DataType dtype,
                    ReduceOp op, Algorithm algo, GpuStream stream) {
  comm.cuda(device).all_reduce(input, output, count, dtype, op, algo, reinterpret_cast<cudaStream_t>(stream));
}

void reduce_scatter_gpu(Communicator& comm, int device, const void* input, void* output, size_t count,
                        DataType dtype, ReduceOp op, GpuStream stream) {
  comm.cuda(device).reduce_scatter(input, output, count, dtype, op, reinterpret_cast<cudaStream_t>(stream));
}

void all_gather_gpu(Communicator& comm, int device, const void* input, void* output, size_t bytes,
                    GpuStream stream) {
  comm.cuda(device).all_gather(input, output, bytes, reinterpret_cast<cudaStream_t>(stream));
}

void broadcast_gpu(Communicator& comm, int device, void* data, size_t bytes, int root, GpuStream stream) {
  comm.cuda(device).broadcast(data, bytes, root, reinterpret_cast<cudaStream_t>(stream));
}

void all_to_all_gpu(Communicator& comm, int device, const void* input, void* output, size_t block_bytes,
                    GpuStream stream) {
  comm.cuda(device).all_to_all(input, output, block_bytes, reinterpret_cast<cudaStream_t>(stream));
}

void check_gpu_error(Communicator& comm) {
  if (comm.has_cuda()) comm.cuda().check_error("check_gpu_error");
}

}  // namespace commlib
