// DdaBackend (see backend.hpp) and its Python binding commlib._C.DdaBackend.
//
// Note [ddacomm routing]
// A call takes commlib's path only when every rank is sure to decide the same way from what all
// ranks share: the operation, the device type, the reduce op, the number of tensors and whether the
// group is on one host (decided once at creation, collectively, in backend_registration.py).
// Nothing rank-local may change the route, or the ranks would meet in different libraries and hang:
// not contiguity, not a size threshold, and on CPU not the dtype either.
//   CPU:  all_reduce / reduce / reduce_scatter (+ coalesced) of every dtype gloo reduces (and
//         int16) with every reduction gloo has (sum, avg, product, min, max, band, bor, bxor);
//         broadcast / all_gather / all_to_all (+ coalesced) / gather / scatter / barrier /
//         send / recv of any dtype commlib moves as bytes -> commlib shm.
//         Left to gloo: dtypes commlib has no type for (complex, ...), PREMUL_SUM, sparse tensors.
//         Before such a call leaves, host::agree checks that every rank makes it (one tag round),
//         so a rank whose dtype differs from its peers' raises "ranks disagree" on every rank
//         instead of waiting in another library. Every commlib path starts with the same tag
//         check (Note [host shm protocol]), which is what catches op, dtype, size and reduction
//         mismatches between ranks on the fast path.
//   CUDA: all_reduce (sum/avg, float32/float16/bfloat16, contiguous, where the selector picks
//         flat or tree for the byte count) -> torch_layer::all_reduce_cuda;
//         reduce_scatter(_tensor) (sum/avg, float32/float16/bfloat16), all_gather(_into_tensor),
//         broadcast and all_to_all_single with equal splits (every dtype commlib moves), up to the
//         op's crossover (Note [collective crossovers]) -> commlib's push kernels
//         (docs/gpu-collectives.md); non-contiguous tensors are copied, so layout never changes
//         the route. send / recv (and so batch_isend_irecv) of dense tensors once the GPU state
//         exists -> peer memory (Note [cuda p2p routing]). Everything else (larger sizes, uneven
//         splits, the coalesced forms, receives from any source) -> NCCL.
//   Several hosts (no communicator): all_reduce / reduce_scatter / all_gather / broadcast / barrier
//         of one dense tensor -> two-level (Note [hierarchical collectives]) when the hosts are of
//         equal size and the crossover admits the byte count; the rest -> gloo / NCCL of the group.
#include "torch/backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>

#include <cstring>
#include <optional>

#include "commlib/env.hpp"
#include "core/algorithm_selector.hpp"
#include "commlib/errors.hpp"
#include "host/host_ops.hpp"
#include "torch/bindings.hpp"
#include "torch/p2p.hpp"
#include "torch/torch_common.hpp"
#include "torch/work.hpp"

#if defined(COMMLIB_TORCH_CUDA)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <unordered_map>
#endif

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

std::optional<ReduceOp> to_reduce_op(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::kProd;
    case c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case c10d::ReduceOp::MAX: return ReduceOp::kMax;
    case c10d::ReduceOp::BAND: return ReduceOp::kBand;
    case c10d::ReduceOp::BOR: return ReduceOp::kBor;
    case c10d::ReduceOp::BXOR: return ReduceOp::kBxor;
    default: return std::nullopt;
  }
}

[[maybe_unused]] bool is_reducible_type(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// The dtypes of commlib's CPU reductions (every one gloo reduces, and int16).
std::optional<DataType> host_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::kFloat32;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kDouble: return DataType::kFloat64;
    case at::kLong: return DataType::kInt64;
    case at::kInt: return DataType::kInt32;
    case at::kShort: return DataType::kInt16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kBool: return DataType::kBool;
    default: return std::nullopt;
  }
}

// The op/dtype pairs gloo refuses, refused the same way (RuntimeError), before any peer is involved.
void check_reduction(const char* what, at::ScalarType type, ReduceOp op) {
  const bool floating = at::isFloatingType(type);
  TORCH_CHECK(op != ReduceOp::kAvg || floating, what, ": ReduceOp.AVG is not supported on ", dtype_str(type),
              " tensors (neither is it by gloo); AVG needs float32, float64, float16 or bfloat16");
  TORCH_CHECK(!(op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor) || !floating, what,
              ": Cannot use ReduceOp.", op == ReduceOp::kBand ? "BAND" : op == ReduceOp::kBor ? "BOR" : "BXOR",
              " with non-integral dtype ", dtype_str(type), "; supported: integer and bool tensors");
}

// An all-reduce of one CPU tensor on commlib's shared memory (any host_type dtype).
void host_all_reduce(Communicator& comm, at::Tensor& t, DataType dtype, ReduceOp op) {
  with_contiguous(t, [&](at::Tensor& c) {
    comm.all_reduce_host(c.data_ptr(), c.data_ptr(), static_cast<size_t>(c.numel()), dtype, op, Algorithm::kAuto);
  });
}

void host_reduce_scatter(Communicator& comm, at::Tensor& out, const at::Tensor& in, DataType dtype, ReduceOp op) {
  // Called inside run_fast, which raises InvalidArgument / TypeMismatch as ValueError / TypeError.
  const char* what = "reduce_scatter";
  check_same_dtype(out, in, what);
  check_world_multiple(what, "input", in, "output", out, comm.world_size());
  const at::Tensor src = in.contiguous();
  with_contiguous(out, [&](at::Tensor& c) {
    comm.reduce_scatter_host(c.data_ptr(), src.data_ptr(), static_cast<size_t>(c.numel()), dtype, op);
  });
}

// dtypes commlib moves (as bytes): the DataType set of torch_common.cpp's to_data_type.
bool is_movable_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kHalf: case at::kBFloat16: case at::kDouble: case at::kInt: case at::kLong:
    case at::kByte: case at::kChar: case at::kBool:
      return true;
    default:
      return false;
  }
}

bool all_of(const std::vector<at::Tensor>& ts, bool (*pred)(at::ScalarType)) {
  for (const auto& t : ts) {
    if (!pred(t.scalar_type())) return false;
  }
  return true;
}

at::Device device_of(const std::vector<at::Tensor>& ts, const char* what) {
  TORCH_CHECK_VALUE(!ts.empty() && ts[0].defined(), what, ": expected at least one defined tensor");
  return ts[0].device();
}

// Runs a fast-path call, translating commlib's errors (translate_errors). A wait of the lazy
// transport set-up reports only its phase ("Timed out after ... at set-up phase 'shm/created'"):
// the operation that triggered it is named in front.
template <typename F>
void run_fast(const char* what, F&& body) {
  translate_errors([&] {
    try {
      body();
    } catch (const Timeout& e) {
      if (std::strncmp(e.what(), "Timed out", 9) != 0) throw;
      throw Timeout(detail::concat(what, ": ", e.what()));
    }
  });
}

}  // namespace

#if defined(COMMLIB_TORCH_CUDA)
struct DdaBackend::CudaState {
  // One internal stream per device for async_op=True calls.
  std::unordered_map<int, c10::cuda::CUDAStream> streams;
  c10::cuda::CUDAStream stream_for(int device) {
    auto it = streams.find(device);
    if (it == streams.end()) {
      it = streams.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)).first;
    }
    return it->second;
  }
};
#endif

DdaBackend::DdaBackend(int rank, int size, std::shared_ptr<Communicator> comm, c10::intrusive_ptr<c10d::Backend> gloo,
                       InnerFactory nccl_factory, Config config)
    : Backend(rank, size),
      comm_(std::move(comm)),
      gloo_(std::move(gloo)),
      nccl_factory_(std::move(nccl_factory)),
      config_(std::move(config)) {
  TORCH_CHECK_VALUE(gloo_, "ddacomm: the inner gloo backend is required");
  TORCH_CHECK_VALUE(!comm_ || (comm_->rank() == rank && comm_->world_size() == size), "ddacomm: communicator is rank ",
                    comm_ ? comm_->rank() : -1, " of ", comm_ ? comm_->world_size() : -1, " but the group is rank ",
                    rank, " of ", size);
#if defined(COMMLIB_TORCH_CUDA)
  cuda_state_ = std::make_unique<CudaState>();
#endif
  init();
}

DdaBackend::~DdaBackend() {
  if (comm_) comm_->close();
}

c10::intrusive_ptr<c10d::Backend::Options> DdaBackend::getBackendOptions() {
  auto options = c10::make_intrusive<Options>("ddacomm", config_.timeout);
  options->group_name = config_.group_name;
  options->global_ranks_in_group = config_.global_ranks_in_group;
  return options;
}

void DdaBackend::setTimeout(std::chrono::milliseconds timeout) {
  config_.timeout = timeout;
  if (comm_ && !comm_->closed()) translate_errors([&] { comm_->set_timeout(timeout); });
  if (hier_) hier_->set_timeout(timeout);
  gloo_->setTimeout(timeout);
  if (nccl_) nccl_->setTimeout(timeout);
}

void DdaBackend::setBoundDeviceId(std::optional<at::Device> device) {
  Backend::setBoundDeviceId(device);
  if (nccl_) nccl_->setBoundDeviceId(device);
}

void DdaBackend::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  // Closing the communicator is local (never waits for peers), so destroy_process_group is prompt.
  if (comm_) comm_->close();
  if (hier_) hier_->shutdown();
  if (nccl_) nccl_->shutdown();
  gloo_->shutdown();
}

void DdaBackend::abort() {
  shut_down_ = true;
  if (comm_) comm_->close();
  if (hier_) hier_->abort();
  if (nccl_) nccl_->abort();
  gloo_->abort();
}

void DdaBackend::attach_hierarchy(std::unique_ptr<Hierarchy> hierarchy) {
  TORCH_CHECK_VALUE(!comm_ && !hier_, "ddacomm: a hierarchy is attached once, to a group spanning several hosts");
  TORCH_CHECK_VALUE(hierarchy && hierarchy->layout().world_size() == getSize(), "ddacomm: the hierarchy covers ",
                    hierarchy ? hierarchy->layout().world_size() : 0, " ranks but the group has ", getSize());
  hier_ = std::move(hierarchy);
}

bool DdaBackend::two_level(HierOp op, const std::vector<at::Tensor>& tensors, size_t bytes) const {
  if (!hier_ || shut_down_ || tensors.empty()) return false;
  for (const auto& t : tensors) {
    if (!t.defined() || t.layout() != at::kStrided || t.device().type() != tensors[0].device().type() ||
        !(t.device().is_cpu() || t.device().is_cuda())) {
      return false;
    }
  }
  return hier_->two_level(op, bytes);
}

c10::intrusive_ptr<c10d::Work> DdaBackend::run_two_level(c10d::OpType op, const at::Device& device,
                                                         std::vector<at::Tensor> outputs,
                                                         const std::function<void()>& body) {
  if (device.is_cuda()) {
    cuda_used_ = true;
#if defined(COMMLIB_TORCH_CUDA)
    c10::cuda::CUDAGuard device_guard(device.index());
    body();
    return c10::make_intrusive<CudaWork>(getRank(), op, std::move(outputs),
                                         c10::cuda::getCurrentCUDAStream(device.index()));
#endif
  }
  body();
  return c10::make_intrusive<CompletedWork>(getRank(), op, std::move(outputs));
}

c10d::Backend& DdaBackend::nccl(const char* what) {
  std::lock_guard<std::mutex> lock(nccl_mutex_);
  if (!nccl_) {
    nccl_ = create_nccl(nccl_factory_, what, "inner");
    if (auto device = getBoundDeviceId()) nccl_->setBoundDeviceId(device);
  }
  if (coalescing_ && !nccl_coalescing_) {
    // The first NCCL op of a coalescing region: NCCL groups it and the rest (ncclGroupStart/End),
    // which batch_isend_irecv needs (two ranks sending to each other would otherwise deadlock).
    nccl_->startCoalescing();
    nccl_coalescing_ = true;
  }
  return *nccl_;
}

void DdaBackend::startCoalescing() {
  // A region left by an exception never reached endCoalescing; its collected works are dropped.
  coalesced_cpu_works_.clear();
  coalescing_ = true;
}

c10::intrusive_ptr<c10d::Work> DdaBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "endCoalescing: the ddacomm process group is not coalescing");
  coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> works = std::move(coalesced_cpu_works_);
  coalesced_cpu_works_.clear();
  if (nccl_coalescing_) {
    nccl_coalescing_ = false;
    if (auto work = nccl_->endCoalescing()) works.push_back(std::move(work));
  }
  if (works.size() == 1) return works[0];
  return c10::make_intrusive<JoinedWork>(getRank(), std::move(works));
}

c10d::Backend& DdaBackend::inner(const at::Device& device, const char* what) {
  TORCH_CHECK(!shut_down_, what, ": the ddacomm process group was shut down");
  // Only gloo's works are collected in a coalescing region; NCCL returns its own at the end.
  collect_next_work_ = coalescing_ && device.is_cpu();
  if (device.is_cuda()) {
    cuda_used_ = true;
    return nccl(what);
  }
  TORCH_CHECK_TYPE(device.is_cpu(), what, ": tensors on device ", device.str(),
                   " are not supported; supported: cpu, cuda");
  return *gloo_;
}

bool DdaBackend::cpu_fast(const std::vector<at::Tensor>& tensors) const {
  if (!comm_ || shut_down_ || tensors.empty()) return false;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided) return false;
  }
  return true;
}

c10::intrusive_ptr<c10d::Work> DdaBackend::fallback(c10::intrusive_ptr<c10d::Work> work) {
  ++num_fallback_calls_;
  if (collect_next_work_ && work) coalesced_cpu_works_.push_back(work);  // gloo inside a coalescing region
  collect_next_work_ = false;
  return work;
}

c10::intrusive_ptr<c10d::Work> DdaBackend::completed(c10d::OpType op, std::vector<at::Tensor> outputs) {
  ++num_fast_calls_;
  return c10::make_intrusive<CompletedWork>(getRank(), op, std::move(outputs));
}

// ---- all-reduce family ----

bool DdaBackend::cpu_reduction(const char* what, c10d::OpType kind, const std::vector<at::Tensor>& tensors,
                               const c10d::ReduceOp& reduce_op) {
  const auto op = to_reduce_op(reduce_op);
  bool handled = op.has_value();
  for (const auto& t : tensors) {
    if (!host_type(t.scalar_type())) {
      handled = false;
    } else if (op) {
      check_reduction(what, t.scalar_type(), *op);
    }
  }
  if (handled) return true;
  // The inner backend takes it; first every rank confirms it makes the same call.
  const at::Tensor& t = tensors[0];
  run_fast(what, [&] {
    host::agree(*comm_, what, static_cast<uint32_t>(kind), static_cast<uint32_t>(t.scalar_type()),
                static_cast<uint64_t>(t.numel()), static_cast<uint32_t>(reduce_op.op_));
  });
  return false;
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && Hierarchy::splits(opts.reduceOp, tensors[0].scalar_type()) &&
      two_level(HierOp::kAllReduce, tensors, tensors[0].numel() * tensors[0].element_size())) {
    if (auto op = to_reduce_op(opts.reduceOp)) check_reduction("allreduce", tensors[0].scalar_type(), *op);
    return run_two_level(c10d::OpType::ALLREDUCE, tensors[0].device(), tensors,
                         [&] { hier_->all_reduce(tensors[0], opts.reduceOp); });
  }
  if (tensors.size() == 1 && cpu_fast(tensors) &&
      cpu_reduction("allreduce", c10d::OpType::ALLREDUCE, tensors, opts.reduceOp)) {
    at::Tensor& t = tensors[0];
    run_fast("allreduce", [&] { host_all_reduce(*comm_, t, *host_type(t.scalar_type()), *to_reduce_op(opts.reduceOp)); });
    return completed(c10d::OpType::ALLREDUCE, tensors);
  }
  const at::Device device = device_of(tensors, "allreduce");
  if (device.is_cuda() && tensors.size() == 1) return route_cuda_all_reduce(tensors, opts);
  return fallback(inner(device, "allreduce").allreduce(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::route_cuda_all_reduce(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceOptions& opts) {
  cuda_used_ = true;
#if defined(COMMLIB_TORCH_CUDA)
  at::Tensor& t = tensors[0];
  const auto op = to_reduce_op(opts.reduceOp);
  // Every rank sees the same dtype, op and byte count (a matching collective), so this decision
  // is the same everywhere (Note [ddacomm routing]).
  const bool candidate = comm_ && !shut_down_ && op && (*op == ReduceOp::kSum || *op == ReduceOp::kAvg) &&
                         is_reducible_type(t.scalar_type()) && t.layout() == at::kStrided;
  // The communicator's configuration, as for the Python and C++ APIs (Note [communicator configuration]).
  const Algorithm algo = candidate ? comm_->config().all_reduce.selector.select(
                                         static_cast<size_t>(t.numel()) * t.element_size(),
                                         to_data_type(t.scalar_type(), "allreduce"))
                                   : Algorithm::kNccl;
  const bool eligible = algo != Algorithm::kNccl;
  if (eligible && t.is_contiguous()) {
    const int device = t.device().index();
    c10::cuda::CUDAGuard device_guard(device);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
    if (!opts.asyncOp) {
      run_fast("allreduce", [&] { torch_layer::all_reduce_cuda(*comm_, t, *op, algo); });
      ++num_fast_calls_;
      return c10::make_intrusive<CudaWork>(getRank(), c10d::OpType::ALLREDUCE, tensors, current);
    }
    // async_op: the internal stream starts after the caller's pending work, and the caller's
    // allocator must not reuse `t` before the internal stream is done with it.
    c10::cuda::CUDAStream internal = cuda_state_->stream_for(device);
    StreamEvent start(device);
    start.record(current);
    start.block(internal);
    {
      c10::cuda::CUDAStreamGuard stream_guard(internal);
      run_fast("allreduce", [&] { torch_layer::all_reduce_cuda(*comm_, t, *op, algo); });
    }
    t.record_stream(internal);
    ++num_fast_calls_;
    return c10::make_intrusive<CudaWork>(getRank(), c10d::OpType::ALLREDUCE, tensors, internal);
  }
#endif
  return fallback(nccl("allreduce").allreduce(tensors, opts));
}

#if defined(COMMLIB_TORCH_CUDA)
bool DdaBackend::cuda_collective(CollectiveOp op, const std::vector<at::Tensor>& tensors, size_t bytes) const {
  if (!comm_ || shut_down_ || tensors.empty()) return false;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.is_cuda() || t.layout() != at::kStrided || t.device() != tensors[0].device()) return false;
  }
  return comm_->config().collectives.use_commlib(op, bytes);
}

c10::intrusive_ptr<c10d::Work> DdaBackend::run_cuda(const char* what, c10d::OpType op, std::vector<at::Tensor> outputs,
                                                    const std::vector<at::Tensor>& inputs, bool async_op,
                                                    const std::function<void()>& body) {
  cuda_used_ = true;
  const int device = outputs[0].device().index();
  c10::cuda::CUDAGuard device_guard(device);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
  if (!async_op) {
    run_fast(what, body);
    ++num_fast_calls_;
    return c10::make_intrusive<CudaWork>(getRank(), op, std::move(outputs), current);
  }
  // async_op: as route_cuda_all_reduce (the internal stream starts after the caller's pending work;
  // the caller's allocator must not reuse the tensors before it is done with them).
  c10::cuda::CUDAStream internal = cuda_state_->stream_for(device);
  StreamEvent start(device);
  start.record(current);
  start.block(internal);
  {
    c10::cuda::CUDAStreamGuard stream_guard(internal);
    run_fast(what, body);
  }
  for (const auto& t : outputs) t.record_stream(internal);
  for (const auto& t : inputs) t.record_stream(internal);
  ++num_fast_calls_;
  return c10::make_intrusive<CudaWork>(getRank(), op, std::move(outputs), internal);
}
#endif

namespace {

[[maybe_unused]] size_t nbytes_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

[[maybe_unused]] bool cuda_reducible(const c10d::ReduceOp& reduce_op, at::ScalarType type) {
  const auto op = to_reduce_op(reduce_op);
  return op && (*op == ReduceOp::kSum || *op == ReduceOp::kAvg) && is_reducible_type(type);
}

// The list forms of reduce_scatter / all_gather / gather run the tensor form on one flat buffer:
// the inputs concatenated, or the output rows copied out.
at::Tensor cat_flat(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> flat;
  flat.reserve(list.size());
  for (const auto& t : list) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

void copy_rows(const at::Tensor& rows, std::vector<at::Tensor>& outs) {
  for (size_t r = 0; r < outs.size(); ++r) outs[r].copy_(rows[static_cast<int64_t>(r)].view(outs[r].sizes()));
}

}  // namespace

c10::intrusive_ptr<c10d::Work> DdaBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  return fallback(inner(device_of(tensors, "allreduce_sparse"), "allreduce_sparse").allreduce_sparse(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceCoalescedOptions& opts) {
  if (cpu_fast(tensors) && cpu_reduction("allreduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors,
                                         opts.reduceOp)) {
    const ReduceOp op = *to_reduce_op(opts.reduceOp);
    run_fast("allreduce_coalesced", [&] {
      for (auto& t : tensors) host_all_reduce(*comm_, t, *host_type(t.scalar_type()), op);
    });
    return completed(c10d::OpType::ALLREDUCE_COALESCED, tensors);
  }
  const at::Device device = device_of(tensors, "allreduce_coalesced");
  return fallback(inner(device, "allreduce_coalesced").allreduce_coalesced(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  if (tensors.size() == 1 && cpu_fast(tensors)) {
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < getSize(), "reduce: root rank ", opts.rootRank,
                      " out of range; valid: 0..", getSize() - 1);
  }
  if (tensors.size() == 1 && cpu_fast(tensors) && cpu_reduction("reduce", c10d::OpType::REDUCE, tensors, opts.reduceOp)) {
    const ReduceOp op = *to_reduce_op(opts.reduceOp);
    const DataType dtype = *host_type(tensors[0].scalar_type());
    // An all-reduce: the root keeps the result; the other ranks' tensors stay unchanged.
    run_fast("reduce", [&] {
      if (opts.rootRank == getRank()) {
        host_all_reduce(*comm_, tensors[0], dtype, op);
      } else {
        at::Tensor scratch = tensors[0].clone(at::MemoryFormat::Contiguous);
        host_all_reduce(*comm_, scratch, dtype, op);
      }
    });
    return completed(c10d::OpType::REDUCE, tensors);
  }
  return fallback(inner(device_of(tensors, "reduce"), "reduce").reduce(tensors, opts));
}

// ---- broadcast / all-gather ----

c10::intrusive_ptr<c10d::Work> DdaBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  if (tensors.size() == 1 && two_level(HierOp::kBroadcast, tensors, tensors[0].numel() * tensors[0].element_size())) {
    return run_two_level(c10d::OpType::BROADCAST, tensors[0].device(), tensors,
                         [&] { hier_->broadcast(tensors[0], static_cast<int>(opts.rootRank)); });
  }
  if (tensors.size() == 1 && cpu_fast(tensors) && all_of(tensors, is_movable_type)) {
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < getSize(), "broadcast: root rank ", opts.rootRank,
                      " out of range; valid: 0..", getSize() - 1);
    run_fast("broadcast", [&] { torch_layer::broadcast(*comm_, tensors[0], static_cast<int>(opts.rootRank)); });
    return completed(c10d::OpType::BROADCAST, tensors);
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (tensors.size() == 1 && all_of(tensors, is_movable_type) &&
      cuda_collective(CollectiveOp::kBroadcast, tensors, nbytes_of(tensors[0]))) {
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < getSize(), "broadcast: root rank ", opts.rootRank,
                      " out of range; valid: 0..", getSize() - 1);
    at::Tensor& t = tensors[0];
    return run_cuda("broadcast", c10d::OpType::BROADCAST, tensors, {}, opts.asyncOp,
                    [&] { broadcast_cuda(*comm_, t, static_cast<int>(opts.rootRank)); });
  }
#endif
  return fallback(inner(device_of(tensors, "broadcast"), "broadcast").broadcast(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  if (inputs.size() == 1 && outputs.size() == 1 &&
      two_level(HierOp::kAllGather, inputs, inputs[0].numel() * inputs[0].element_size())) {
    std::vector<at::Tensor>& outs = outputs[0];
    check_gather_list("allgather", outs, inputs[0]);
    return run_two_level(c10d::OpType::ALLGATHER, inputs[0].device(), outs, [&] {
      at::Tensor flat = at::empty({getSize(), inputs[0].numel()}, inputs[0].options());
      hier_->all_gather(flat, inputs[0]);
      copy_rows(flat, outs);
    });
  }
  if (inputs.size() == 1 && outputs.size() == 1 && cpu_fast(inputs) && cpu_fast(outputs[0]) &&
      all_of(inputs, is_movable_type)) {
    const at::Tensor& in = inputs[0];
    std::vector<at::Tensor>& outs = outputs[0];
    TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == getSize(), "allgather: got ", outs.size(),
                      " output tensors; expected world_size = ", getSize());
    for (size_t r = 0; r < outs.size(); ++r) {
      TORCH_CHECK_TYPE(outs[r].scalar_type() == in.scalar_type(), "allgather: output ", r, " is ",
                       dtype_str(outs[r].scalar_type()), " but input is ", dtype_str(in.scalar_type()));
      TORCH_CHECK_VALUE(outs[r].numel() == in.numel(), "allgather: output ", r, " has ", outs[r].numel(),
                        " elements but input has ", in.numel(), "; they must match");
    }
    run_fast("all_gather", [&] {
      at::Tensor flat = at::empty({getSize(), in.numel()}, in.options());
      all_gather(*comm_, flat, in);
      copy_rows(flat, outs);
    });
    return completed(c10d::OpType::ALLGATHER, outputs[0]);
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (inputs.size() == 1 && outputs.size() == 1 && all_of(inputs, is_movable_type) &&
      cuda_collective(CollectiveOp::kAllGather, {inputs[0]}, nbytes_of(inputs[0]) * getSize())) {
    const at::Tensor& in = inputs[0];
    std::vector<at::Tensor>& outs = outputs[0];
    check_gather_list("allgather", outs, in);
    for (const auto& o : outs) {
      TORCH_CHECK_TYPE(o.is_cuda() && o.device() == in.device(), "allgather: every output must be on ",
                       in.device().str(), "; got ", o.device().str());
    }
    return run_cuda("all_gather", c10d::OpType::ALLGATHER, outs, inputs, opts.asyncOp, [&] {
      at::Tensor flat = at::empty({getSize(), in.numel()}, in.options());
      all_gather_cuda(*comm_, flat, in);
      copy_rows(flat, outs);
    });
  }
#endif
  return fallback(inner(device_of(inputs, "allgather"), "allgather").allgather(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> both{output, input};
  if (two_level(HierOp::kAllGather, both, input.numel() * input.element_size())) {
    return run_two_level(c10d::OpType::_ALLGATHER_BASE, input.device(), {output},
                         [&] { hier_->all_gather(output, input); });
  }
  if (cpu_fast(both) && all_of(both, is_movable_type)) {
    run_fast("all_gather_into_tensor", [&] { all_gather(*comm_, output, input); });
    return completed(c10d::OpType::_ALLGATHER_BASE, {output});
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (all_of(both, is_movable_type) && cuda_collective(CollectiveOp::kAllGather, both, nbytes_of(output))) {
    return run_cuda("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {output}, {input}, opts.asyncOp,
                    [&] { all_gather_cuda(*comm_, output, input); });
  }
#endif
  return fallback(inner(input.device(), "all_gather_into_tensor")._allgather_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  // outputs[r][i] receives rank r's inputs[i] (gloo's layout).
  bool fast = cpu_fast(inputs) && all_of(inputs, is_movable_type);
  for (size_t r = 0; fast && r < outputs.size(); ++r) fast = cpu_fast(outputs[r]);
  if (fast) {
    TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == getSize(), "allgather_coalesced: got ", outputs.size(),
                      " output lists; expected world_size = ", getSize());
    for (int r = 0; r < getSize(); ++r) {
      TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), "allgather_coalesced: output list ", r, " has ",
                        outputs[r].size(), " tensors; expected one per input (", inputs.size(), ")");
      for (size_t i = 0; i < inputs.size(); ++i) {
        TORCH_CHECK_TYPE(outputs[r][i].scalar_type() == inputs[i].scalar_type(), "allgather_coalesced: output ", r,
                         "/", i, " is ", dtype_str(outputs[r][i].scalar_type()), " but input ", i, " is ",
                         dtype_str(inputs[i].scalar_type()));
        TORCH_CHECK_VALUE(outputs[r][i].numel() == inputs[i].numel(), "allgather_coalesced: output ", r, "/", i,
                          " has ", outputs[r][i].numel(), " elements but input ", i, " has ", inputs[i].numel());
      }
    }
    run_fast("allgather_coalesced", [&] {
      for (size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor& in = inputs[i];
        at::Tensor flat = at::empty({getSize(), in.numel()}, in.options());
        all_gather(*comm_, flat, in);
        for (int r = 0; r < getSize(); ++r) outputs[r][i].copy_(flat[r].view(outputs[r][i].sizes()));
      }
    });
    std::vector<at::Tensor> all;
    for (auto& list : outputs) all.insert(all.end(), list.begin(), list.end());
    return completed(c10d::OpType::ALLGATHER_COALESCED, std::move(all));
  }
  return fallback(inner(device_of(inputs, "allgather_coalesced"), "allgather_coalesced")
                      .allgather_coalesced(outputs, inputs, opts));
}

void DdaBackend::check_gather_list(const char* what, const std::vector<at::Tensor>& list, const at::Tensor& one) const {
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == getSize(), what, ": got ", list.size(),
                    " tensors in the list; expected world_size = ", getSize());
  for (size_t r = 0; r < list.size(); ++r) {
    TORCH_CHECK_TYPE(list[r].scalar_type() == one.scalar_type(), what, ": list tensor ", r, " is ",
                     dtype_str(list[r].scalar_type()), " but the tensor is ", dtype_str(one.scalar_type()));
    TORCH_CHECK_VALUE(list[r].numel() == one.numel(), what, ": list tensor ", r, " has ", list[r].numel(),
                      " elements but the tensor has ", one.numel(), "; they must match");
  }
}

c10::intrusive_ptr<c10d::Work> DdaBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::AllgatherOptions& opts) {
  if (outputs.size() == inputs.size() && cpu_fast(inputs) && cpu_fast(outputs) && all_of(inputs, is_movable_type) &&
      all_of(outputs, is_movable_type)) {
    run_fast("allgather_into_tensor_coalesced", [&] {
      for (size_t i = 0; i < inputs.size(); ++i) all_gather(*comm_, outputs[i], inputs[i]);
    });
    return completed(c10d::OpType::COALESCED, outputs);
  }
  return fallback(inner(device_of(inputs, "all_gather_into_tensor_coalesced"), "all_gather_into_tensor_coalesced")
                      .allgather_into_tensor_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  // Only the root passes an output list; the route depends on the input alone, which every rank has.
  if (inputs.size() == 1 && cpu_fast(inputs) && all_of(inputs, is_movable_type)) {
    const int root = static_cast<int>(opts.rootRank);
    TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "gather: dst ", root, " out of range; valid: 0..", getSize() - 1);
    const at::Tensor in = inputs[0].contiguous();
    const bool is_root = root == getRank();
    if (is_root) {
      TORCH_CHECK_VALUE(outputs.size() == 1, "gather: the root needs one output list; got ", outputs.size());
      TORCH_CHECK_TYPE(cpu_fast(outputs[0]), "gather: the root's output list must hold dense cpu tensors");
      check_gather_list("gather", outputs[0], in);
    }
    const size_t bytes = static_cast<size_t>(in.numel()) * in.element_size();
    run_fast("gather", [&] {
      at::Tensor flat = is_root ? at::empty({getSize(), in.numel()}, in.options()) : at::Tensor();
      host::gather(*comm_, is_root ? flat.data_ptr() : nullptr, in.data_ptr(), bytes, root);
      if (is_root) copy_rows(flat, outputs[0]);
    });
    return completed(c10d::OpType::GATHER, is_root ? outputs[0] : std::vector<at::Tensor>{});
  }
  return fallback(inner(device_of(inputs, "gather"), "gather").gather(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  if (outputs.size() == 1 && cpu_fast(outputs) && all_of(outputs, is_movable_type)) {
    const int root = static_cast<int>(opts.rootRank);
    TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "scatter: src ", root, " out of range; valid: 0..", getSize() - 1);
    at::Tensor& out = outputs[0];
    const bool is_root = root == getRank();
    at::Tensor packed;
    if (is_root) {
      TORCH_CHECK_VALUE(inputs.size() == 1, "scatter: the root needs one input list; got ", inputs.size());
      TORCH_CHECK_TYPE(cpu_fast(inputs[0]), "scatter: the root's input list must hold dense cpu tensors");
      check_gather_list("scatter", inputs[0], out);
      std::vector<at::Tensor> flat;
      for (const auto& t : inputs[0]) flat.push_back(t.reshape({-1}));
      packed = at::cat(flat);
    }
    const size_t bytes = static_cast<size_t>(out.numel()) * out.element_size();
    run_fast("scatter", [&] {
      with_contiguous(out, [&](at::Tensor& c) {
        host::scatter(*comm_, c.data_ptr(), is_root ? packed.data_ptr() : nullptr, bytes, root);
      });
    });
    return completed(c10d::OpType::SCATTER, outputs);
  }
  return fallback(inner(device_of(outputs, "scatter"), "scatter").scatter(outputs, inputs, opts));
}

// ---- reduce-scatter ----

c10::intrusive_ptr<c10d::Work> DdaBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ReduceScatterOptions& opts) {
  if (outputs.size() == 1 && inputs.size() == 1 && Hierarchy::splits(opts.reduceOp, outputs[0].scalar_type()) &&
      two_level(HierOp::kReduceScatter, outputs, outputs[0].numel() * outputs[0].element_size())) {
    at::Tensor& out = outputs[0];
    check_gather_list("reduce_scatter", inputs[0], out);
    if (auto op = to_reduce_op(opts.reduceOp)) check_reduction("reduce_scatter", out.scalar_type(), *op);
    return run_two_level(c10d::OpType::REDUCE_SCATTER, out.device(), outputs, [&] {
      hier_->reduce_scatter(out, cat_flat(inputs[0]), opts.reduceOp);
    });
  }
  if (outputs.size() == 1 && inputs.size() == 1 && cpu_fast(outputs) && cpu_fast(inputs[0]) &&
      cpu_reduction("reduce_scatter", c10d::OpType::REDUCE_SCATTER, outputs, opts.reduceOp)) {
    at::Tensor& out = outputs[0];
    const std::vector<at::Tensor>& ins = inputs[0];
    TORCH_CHECK_VALUE(static_cast<int>(ins.size()) == getSize(), "reduce_scatter: got ", ins.size(),
                      " input tensors; expected world_size = ", getSize());
    for (size_t r = 0; r < ins.size(); ++r) {
      TORCH_CHECK_TYPE(ins[r].scalar_type() == out.scalar_type(), "reduce_scatter: input ", r, " is ",
                       dtype_str(ins[r].scalar_type()), " but output is ", dtype_str(out.scalar_type()));
      TORCH_CHECK_VALUE(ins[r].numel() == out.numel(), "reduce_scatter: input ", r, " has ", ins[r].numel(),
                        " elements but output has ", out.numel(), "; they must match");
    }
    run_fast("reduce_scatter", [&] {
      host_reduce_scatter(*comm_, out, cat_flat(ins), *host_type(out.scalar_type()),
                          *to_reduce_op(opts.reduceOp));
    });
    return completed(c10d::OpType::REDUCE_SCATTER, outputs);
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (outputs.size() == 1 && inputs.size() == 1 && cuda_reducible(opts.reduceOp, outputs[0].scalar_type()) &&
      cuda_collective(CollectiveOp::kReduceScatter, outputs, nbytes_of(outputs[0]) * getSize())) {
    at::Tensor& out = outputs[0];
    const std::vector<at::Tensor>& ins = inputs[0];
    check_gather_list("reduce_scatter", ins, out);
    for (const auto& t : ins) {
      TORCH_CHECK_TYPE(t.is_cuda() && t.device() == out.device(), "reduce_scatter: every input must be on ",
                       out.device().str(), "; got ", t.device().str());
    }
    return run_cuda("reduce_scatter", c10d::OpType::REDUCE_SCATTER, outputs, ins, opts.asyncOp, [&] {
      reduce_scatter_cuda(*comm_, out, cat_flat(ins), *to_reduce_op(opts.reduceOp));
    });
  }
#endif
  return fallback(
      inner(device_of(outputs, "reduce_scatter"), "reduce_scatter").reduce_scatter(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> both{output, input};
  if (Hierarchy::splits(opts.reduceOp, output.scalar_type()) &&
      two_level(HierOp::kReduceScatter, both, output.numel() * output.element_size())) {
    if (auto op = to_reduce_op(opts.reduceOp)) check_reduction("reduce_scatter_tensor", output.scalar_type(), *op);
    return run_two_level(c10d::OpType::_REDUCE_SCATTER_BASE, input.device(), {output},
                         [&] { hier_->reduce_scatter(output, input, opts.reduceOp); });
  }
  if (cpu_fast(both) &&
      cpu_reduction("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, both, opts.reduceOp)) {
    run_fast("reduce_scatter_tensor", [&] {
      host_reduce_scatter(*comm_, output, input, *host_type(output.scalar_type()), *to_reduce_op(opts.reduceOp));
    });
    return completed(c10d::OpType::_REDUCE_SCATTER_BASE, {output});
  }
#if defined(COMMLIB_TORCH_CUDA)
  if (cuda_reducible(opts.reduceOp, input.scalar_type()) &&
      cuda_collective(CollectiveOp::kReduceScatter, both, nbytes_of(input))) {
    return run_cuda("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, {output}, {input}, opts.asyncOp,
                    [&] { reduce_scatter_cuda(*comm_, output, input, *to_reduce_op(opts.reduceOp)); });
  }
#endif
  return fallback(inner(input.device(), "reduce_scatter_tensor")._reduce_scatter_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::ReduceScatterOptions& opts) {
  if (outputs.size() == inputs.size() && cpu_fast(outputs) && cpu_fast(inputs) &&
      cpu_reduction("reduce_scatter_tensor_coalesced", c10d::OpType::COALESCED, inputs, opts.reduceOp)) {
    const ReduceOp op = *to_reduce_op(opts.reduceOp);
    run_fast("reduce_scatter_tensor_coalesced", [&] {
      for (size_t i = 0; i < inputs.size(); ++i) {
        host_reduce_scatter(*comm_, outputs[i], inputs[i], *host_type(inputs[i].scalar_type()), op);
      }
    });
    return completed(c10d::OpType::COALESCED, outputs);
  }
  return fallback(inner(device_of(inputs, "reduce_scatter_tensor_coalesced"), "reduce_scatter_tensor_coalesced")
                      .reduce_scatter_tensor_coalesced(outputs, inputs, opts));
}

// ---- all-to-all ----

c10::intrusive_ptr<c10d::Work> DdaBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_split_sizes,
                                                         std::vector<int64_t>& input_split_sizes,
                                                         const c10d::AllToAllOptions& opts) {
  std::vector<at::Tensor> both{output, input};
  if (cpu_fast(both) && all_of(both, is_movable_type)) {
    run_fast("all_to_all_single", [&] { all_to_all_v(*comm_, output, input, output_split_sizes, input_split_sizes); });
    return completed(c10d::OpType::ALLTOALL_BASE, {output});
  }
#if defined(COMMLIB_TORCH_CUDA)
  // Equal splits only (empty split lists: every rank passes the same form for one call).
  if (output_split_sizes.empty() && input_split_sizes.empty() && all_of(both, is_movable_type) &&
      cuda_collective(CollectiveOp::kAllToAll, both, nbytes_of(input))) {
    return run_cuda("all_to_all_single", c10d::OpType::ALLTOALL_BASE, {output}, {input}, opts.asyncOp,
                    [&] { all_to_all_cuda(*comm_, output, input); });
  }
#endif
  return fallback(inner(input.device(), "all_to_all_single")
                      .alltoall_base(output, input, output_split_sizes, input_split_sizes, opts));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  if (cpu_fast(outputs) && cpu_fast(inputs) && all_of(outputs, is_movable_type) && all_of(inputs, is_movable_type)) {
    const int n = getSize();
    TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == n && static_cast<int>(outputs.size()) == n,
                      "all_to_all: got ", inputs.size(), " inputs and ", outputs.size(),
                      " outputs; expected world_size = ", n, " of each");
    // Every block travels as bytes: one packed buffer each way, split by byte counts.
    std::vector<at::Tensor> in_bytes;
    std::vector<int64_t> in_splits(n), out_splits(n);
    for (int r = 0; r < n; ++r) {
      TORCH_CHECK_TYPE(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                           outputs[r].scalar_type() == inputs[0].scalar_type(),
                       "all_to_all: every input and output must have the same dtype; input 0 is ",
                       dtype_str(inputs[0].scalar_type()), ", input ", r, " is ", dtype_str(inputs[r].scalar_type()),
                       ", output ", r, " is ", dtype_str(outputs[r].scalar_type()));
      in_bytes.push_back(inputs[r].contiguous().reshape({-1}).view(at::kByte));
      in_splits[r] = in_bytes.back().numel();
      out_splits[r] = outputs[r].numel() * outputs[r].element_size();
    }
    run_fast("all_to_all", [&] {
      at::Tensor packed_in = at::cat(in_bytes);
      int64_t total_out = 0;
      for (int64_t s : out_splits) total_out += s;
      at::Tensor packed_out = at::empty({total_out}, packed_in.options());
      all_to_all_v(*comm_, packed_out, packed_in, out_splits, in_splits);
      int64_t offset = 0;
      for (int r = 0; r < n; ++r) {
        at::Tensor block = packed_out.narrow(0, offset, out_splits[r]).view(outputs[r].scalar_type());
        outputs[r].copy_(block.view(outputs[r].sizes()));
        offset += out_splits[r];
      }
    });
    return completed(c10d::OpType::ALLTOALL, outputs);
  }
  return fallback(inner(device_of(inputs, "all_to_all"), "all_to_all").alltoall(outputs, inputs, opts));
}

// ---- point-to-point (Note [host p2p]) and synchronisation ----

c10::intrusive_ptr<c10d::Work> DdaBackend::p2p_work(c10d::OpType op, P2pWork::Item item) {
  auto work = c10::make_intrusive<P2pWork>(getRank(), op, comm_, std::vector<P2pWork::Item>{std::move(item)});
  ++num_fast_calls_;
  if (coalescing_) coalesced_cpu_works_.push_back(work);  // batch_isend_irecv: finished together
  return work;
}

c10::intrusive_ptr<c10d::Work> DdaBackend::cuda_p2p(c10d::OpType op, P2pRequest::Kind kind,
                                                    std::vector<at::Tensor>& tensors, int peer, int tag) {
#if defined(COMMLIB_TORCH_CUDA)
  if (!comm_ || shut_down_ || tensors.size() != 1 || !tensors[0].is_cuda()) return {};
  cuda_used_ = true;
  if (!cuda_p2p_available(*comm_, tensors[0])) return {};
  auto work = post_cuda_p2p(comm_, op, {{kind, tensors[0], peer, tag}});
  ++num_fast_calls_;
  if (coalescing_) coalesced_cpu_works_.push_back(work);  // batch_isend_irecv: one work for the region
  return work;
#else
  return {};
#endif
}

c10::intrusive_ptr<c10d::Work> DdaBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  if (tensors.size() == 1 && cpu_fast(tensors)) {
    return p2p_work(c10d::OpType::SEND, post_send(*comm_, tensors[0], dst_rank, tag));
  }
  if (auto work = cuda_p2p(c10d::OpType::SEND, P2pRequest::Kind::kSend, tensors, dst_rank, tag)) return work;
  return fallback(inner(device_of(tensors, "send"), "send").send(tensors, dst_rank, tag));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  if (tensors.size() == 1 && cpu_fast(tensors)) {
    return p2p_work(c10d::OpType::RECV, post_recv(*comm_, tensors[0], src_rank, tag));
  }
  if (auto work = cuda_p2p(c10d::OpType::RECV, P2pRequest::Kind::kRecv, tensors, src_rank, tag)) return work;
  return fallback(inner(device_of(tensors, "recv"), "recv").recv(tensors, src_rank, tag));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  // On commlib's path too: a sender cannot know that its receiver takes any source, so both ends
  // must be on the same path whatever the receiver posts.
  if (tensors.size() == 1 && cpu_fast(tensors)) {
    return p2p_work(c10d::OpType::RECVANYSOURCE, post_recv(*comm_, tensors[0], HostP2p::kAnySource, tag));
  }
  return fallback(inner(device_of(tensors, "recv"), "recv").recvAnysource(tensors, tag));
}

c10::intrusive_ptr<c10d::Work> DdaBackend::barrier(const c10d::BarrierOptions& opts) {
  TORCH_CHECK(!shut_down_, "barrier: the ddacomm process group was shut down");
  if (hier_ && hier_->two_level(HierOp::kBarrier, 0)) {
#if defined(COMMLIB_TORCH_CUDA)
    if (cuda_used_) c10::cuda::device_synchronize();  // as below: queued GPU work is done after it
#endif
    hier_->barrier();
    return c10::make_intrusive<CompletedWork>(getRank(), c10d::OpType::BARRIER, std::vector<at::Tensor>{});
  }
  if (!comm_) return fallback(gloo_->barrier(opts));
#if defined(COMMLIB_TORCH_CUDA)
  // Like NCCL's barrier, the GPU work this rank queued before the barrier is finished after it.
  if (cuda_used_) c10::cuda::device_synchronize();
#endif
  run_fast("barrier", [&] { comm_->barrier_host(); });
  return completed(c10d::OpType::BARRIER, {});
}

void DdaBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  gloo_->monitoredBarrier(opts, wait_all_ranks);
}

uint64_t DdaBackend::getSequenceNumberForGroup() { return gloo_->getSequenceNumberForGroup(); }

// ---- Python binding ----
namespace {

// Holds a Python callable; takes the GIL to call and to release it.
DdaBackend::InnerFactory python_factory(py::object fn) {
  if (fn.is_none()) return {};
  std::shared_ptr<py::object> holder(new py::object(std::move(fn)), [](py::object* p) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete p;
    } else {
      p->release();  // the interpreter is gone: leak the reference rather than touch it
      delete p;
    }
  });
  return [holder]() -> c10::intrusive_ptr<c10d::Backend> {
    py::gil_scoped_acquire gil;
    return (*holder)().cast<c10::intrusive_ptr<c10d::Backend>>();
  };
}

void bind_backend(py::module_& m) {
  // torch's Backend must be registered with pybind11 before a class can derive from it.
  py::module_::import("torch._C._distributed_c10d");
  py::class_<DdaBackend, c10d::Backend, c10::intrusive_ptr<DdaBackend>>(
      m, "DdaBackend", "The c10d backend of \"ddacomm\" (see commlib.backend_registration).")
      .def(py::init([](int rank, int size, py::object comm, const c10::intrusive_ptr<c10d::Backend>& gloo,
                       py::object nccl_factory, std::chrono::milliseconds timeout, std::string group_name,
                       std::vector<uint64_t> global_ranks) {
             DdaBackend::Config config;
             config.timeout = timeout;
             config.group_name = std::move(group_name);
             config.global_ranks_in_group = std::move(global_ranks);
             std::shared_ptr<Communicator> native = comm.is_none() ? nullptr : communicator_from_python(comm);
             return c10::make_intrusive<DdaBackend>(rank, size, std::move(native), gloo,
                                                    python_factory(std::move(nccl_factory)), std::move(config));
           }),
           py::arg("rank"), py::arg("size"), py::arg("comm"), py::arg("gloo"), py::arg("nccl_factory"),
           py::arg("timeout"), py::arg("group_name"), py::arg("global_ranks_in_group"))
      .def_property_readonly("has_fast_path", &DdaBackend::has_fast_path)
      .def_property_readonly("nccl_created", &DdaBackend::nccl_created)
      .def_property_readonly("num_fast_calls", &DdaBackend::num_fast_calls)
      .def_property_readonly("num_fallback_calls", &DdaBackend::num_fallback_calls)
      .def(
          "_attach_hierarchy",
          [](DdaBackend& self, int num_hosts, int local_size, int host_index, int local_rank, std::vector<int> rank_of,
             const c10::intrusive_ptr<c10d::Backend>& intra, const c10::intrusive_ptr<c10d::Backend>& inter_gloo,
             py::object inter_nccl_factory, std::chrono::milliseconds timeout, bool inter_cuda_via_host) {
            HostLayout layout{num_hosts, local_size, host_index, local_rank, std::move(rank_of)};
            self.attach_hierarchy(std::make_unique<Hierarchy>(
                std::move(layout), intra, inter_gloo, python_factory(std::move(inter_nccl_factory)), timeout,
                inter_cuda_via_host ? Hierarchy::InterCuda::kGlooViaHost : Hierarchy::InterCuda::kNccl));
          },
          py::arg("num_hosts"), py::arg("local_size"), py::arg("host_index"), py::arg("local_rank"),
          py::arg("rank_of"), py::arg("intra"), py::arg("inter_gloo"), py::arg("inter_nccl_factory"),
          py::arg("timeout"), py::arg("inter_cuda_via_host") = false,
          "Makes this multi-host group run two-level collectives (Note [hierarchical collectives]); "
          "backend_registration calls it once, at group creation.")
      .def(
          "_inter_host_all_reduce",
          [](DdaBackend& self, at::Tensor tensor) {
            TORCH_CHECK_VALUE(self.hierarchy() != nullptr, "ddacomm: this group has no hierarchy");
            self.hierarchy()->inter_all_reduce(tensor, c10d::ReduceOp(c10d::ReduceOp::SUM));
          },
          py::arg("tensor"),
          "Sums `tensor` in place over the ranks of the other hosts with this rank's local index (the "
          "inter-host leg of a two-level all-reduce); blocking on CPU, on the current stream on CUDA.")
      .def_property_readonly("hierarchical", [](const DdaBackend& self) { return self.hierarchy() != nullptr; })
      .def_property_readonly("host_layout",
                             [](const DdaBackend& self) -> py::object {
                               const Hierarchy* h = self.hierarchy();
                               if (h == nullptr) return py::none();
                               const HostLayout& l = h->layout();
                               return py::make_tuple(l.num_hosts, l.local_size, l.host_index, l.local_rank);
                             })
      .def_property_readonly("num_hierarchical_calls", [](const DdaBackend& self) -> int64_t {
        return self.hierarchy() ? self.hierarchy()->num_calls() : 0;
      });
}

BindingRegistrar registrar("backend", bind_backend);

}  // namespace
}  // namespace commlib::torch_layer
