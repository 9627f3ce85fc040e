// EPBufferGpu (include/commlib/gpu.hpp): the GPU side of an expert-parallel buffer. The ranks
// agree on the grid and on the LL kernels here, the buffer owns its symmetric piece and the
// protocol state (the call the kernels' sequence numbers expect next: Note [EP GPU protocol]), and
// each call picks the flag or LL launcher the buffer was set up for.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "commlib/errors.hpp"
#include "commlib/gpu.hpp"
#include "core/algorithm_selector.hpp"
#include "core/plan.hpp"
#include "cuda/cuda_comm.hpp"
#include "cuda/cuda_ep_nvshmem.hpp"
#include "kernels/ep_params.hpp"

namespace commlib {

struct EPBufferGpu::Impl {
  Communicator* comm = nullptr;
  CudaComm* cuda = nullptr;
  int device = -1;  // kept apart from cuda: the communicator may be closed before the buffer
  EPConfig config{};
  std::shared_ptr<SymmetricBuffer> sym;
  EPTransport transport = EPTransport::kPeerMemory;
  std::shared_ptr<void> heap;  // kNvshmem: the buffer on the NVSHMEM symmetric heap
  nvshmem_ep::Params nv;       // kNvshmem: the fixed part of the kernels' params
  kernels::EPParams params;  // the fixed part; per-call fields are filled by each call
  Plan plan;                 // plan_ep, once per buffer: every call runs it
  const void* pending_x = nullptr;  // the last dispatch send's x (the caller keeps it alive until kRecv)
  // The call the protocol expects next: the kernels' flags are sequence-numbered per
  // dispatch/combine pair, so out-of-order calls would read stale rows (Note [EP GPU protocol]).
  enum class Next { kDispatch, kDispatchRecv, kCombine, kCombineRecv } next = Next::kDispatch;
};

namespace {

const char* expected_call(EPBufferGpu::Impl::Next next) {
  using Next = EPBufferGpu::Impl::Next;
  switch (next) {
    case Next::kDispatch: return "dispatch or dispatch_send";
    case Next::kDispatchRecv: return "dispatch_recv";
    case Next::kCombine: return "combine or combine_send";
    default: return "combine_recv";
  }
}

// Raises unless `phase` of `what` is the call the protocol expects next.
void check_order(const EPBufferGpu::Impl& s, const char* what, EPPhase phase, EPBufferGpu::Impl::Next first,
                 EPBufferGpu::Impl::Next second) {
  const EPBufferGpu::Impl::Next wanted = phase == EPPhase::kRecv ? second : first;
  COMMLIB_CHECK(s.next == wanted, InvalidArgument, what, "(phase ",
                phase == EPPhase::kRecv ? "recv" : (phase == EPPhase::kSend ? "send" : "both"),
                ") out of order: expected ", expected_call(s.next),
                "; on CUDA dispatch and combine alternate, each split phase followed by its recv");
}

void launch_nvshmem(const EPBufferGpu::Impl& s, const kernels::EPParams& p, bool dispatch, kernels::EPMode mode,
                    cudaStream_t stream, const char* what) {
  const nvshmem_ep::Api& api = ep_nvshmem_api(what);
  nvshmem_ep::Params q = s.nv;
  q.base = p;
  char message[512] = {};
  const int rc = (dispatch ? api.dispatch : api.combine)(&q, static_cast<int>(mode), stream, message, sizeof(message));
  COMMLIB_CHECK(rc == 0, CudaError, what, ": ", message);
}

// Around each call: the peer-memory kernels need the communicator's peer mappings (begin_op
// checks them); the NVSHMEM kernels reach their peers through NVSHMEM, so they only check the error
// word (a peer may be on another host, where the communicator has no peer memory).
void begin_call(const EPBufferGpu::Impl& s, cudaStream_t stream, const char* what) {
  if (s.transport == EPTransport::kNvshmem) {
    s.cuda->check_error(what);
  } else {
    s.cuda->begin_op(stream, what);
  }
}

void end_call(const EPBufferGpu::Impl& s, cudaStream_t stream, const char* what) {
  if (s.transport != EPTransport::kNvshmem) s.cuda->end_op(stream, what);
}

kernels::EPMode mode_of(EPPhase phase) {
  switch (phase) {
    case EPPhase::kSend: return kernels::EPMode::kSend;
    case EPPhase::kRecv: return kernels::EPMode::kRecv;
    default: return kernels::EPMode::kBoth;
  }
}

}  // namespace

// Note [EP NVSHMEM protocol] (csrc/kernels/ep_nvshmem_params.hpp): a grid of at most
// nvshmem_ep::kMaxBlocks blocks, each owning a fixed token range of every source.
static void setup_nvshmem(EPBufferGpu::Impl& s, Communicator& comm, const EPConfig& config, int min_sms) {
  const char* what = "EPBuffer";
  const int n = comm.world_size();
  const int num_blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({min_sms, nvshmem_ep::kMaxBlocks, config.max_tokens_per_rank})));
  const nvshmem_ep::Layout layout = nvshmem_ep::make_layout(config, n, num_blocks, dtype_size(config.dtype));
  s.heap = ep_nvshmem_allocate(comm, layout.total, what);  // collective
  // Only the control words and signals must start at zero; the host barrier keeps peers from
  // signalling before that.
  cuda_check(cudaMemset(s.heap.get(), 0, layout.control_end), what, "cudaMemset");
  cuda_check(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
  comm.control_barrier();
  s.nv.heap = static_cast<char*>(s.heap.get());
  s.nv.layout = layout;
  s.nv.num_blocks = num_blocks;
  s.nv.tokens_per_block = (config.max_tokens_per_rank + num_blocks - 1) / num_blocks;
}

EPBufferGpu::EPBufferGpu(Communicator& comm, const EPConfig& config_in, int device, EPTransport transport)
    : impl_(std::make_unique<Impl>()) {
  const char* what = "EPBuffer";
  const int n = comm.world_size();
  const EPConfig config = validate_ep_config(config_in, n);
  const int max_ranks = transport == EPTransport::kNvshmem ? nvshmem_ep::kMaxRanks : kMaxDeviceRanks;
  COMMLIB_CHECK(n <= max_ranks, InvalidArgument, what, ": world_size ", n, " not supported on CUDA with transport '",
                transport == EPTransport::kNvshmem ? "nvshmem" : "peer", "'; valid: 1..", max_ranks);
  COMMLIB_CHECK(config.num_experts <= kernels::kEPMaxExpertsCuda, InvalidArgument, what, ": num_experts ",
                config.num_experts, " not supported on CUDA; valid: up to ", kernels::kEPMaxExpertsCuda);
  CudaComm& cuda = comm.cuda(device);
  DeviceGuard guard(cuda.device());
  // Block b of every rank pairs with block b of the peers (Note [EP GPU protocol]), so every rank
  // launches the same grid (chunks x column parts), at most one block per SM of the smallest GPU
  // (all blocks resident). The LL path (Note [EP LL protocol]) only when every rank asks for it
  // (COMMLIB_EP_LL, in the communicator's configuration).
  int num_sms = 0;
  cuda_check(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, cuda.device()), what,
             "cudaDeviceGetAttribute");
  struct Wish {
    int32_t sms, ll;
  };
  std::vector<Wish> wishes(n);
  const Wish mine{num_sms, cuda.config().ep.want_ll ? 1 : 0};
  comm.control_all_gather(wishes.data(), &mine, sizeof(Wish));  // collective
  int32_t min_sms = num_sms;
  bool all_ll = true;
  for (const Wish& w : wishes) {
    min_sms = std::min(min_sms, w.sms);
    all_ll = all_ll && w.ll != 0;
  }
  const kernels::EPGrid grid = kernels::ep_grid(config, min_sms);
  EPShape shape;
  shape.placement = Placement::kCuda;
  shape.transport = transport;
  shape.agreement = all_ll ? LLAgreement::kEveryRank : LLAgreement::kNotEveryRank;
  shape.fit = kernels::ep_ll_eligible(config, grid) ? LLFit::kYes : LLFit::kNo;
  shape.grid = grid.num_blocks();
  const Plan plan = plan_ep(cuda.config(), shape);
  const kernels::EPPath path = plan.variant == Variant::kEpLL ? kernels::EPPath::kLL : kernels::EPPath::kFlags;
  const kernels::EPLLGeometry ll = kernels::ep_ll_geometry(config, n, grid, path);
  const kernels::EPSymmetricLayout layout = kernels::ep_symmetric_layout(config, n, grid, ll);
  Impl& s = *impl_;
  s.comm = &comm;
  s.cuda = &cuda;
  s.device = cuda.device();
  s.config = config;
  s.plan = plan;
  s.transport = transport;
  if (transport == EPTransport::kNvshmem) {
    setup_nvshmem(s, comm, config, min_sms);  // collective
  } else {
    s.sym = cuda.allocate_symmetric(layout.total);  // collective
    // Only the control words, overflow word, flags and LL lines must start at zero (every other
    // region is written before it is read); the host barrier keeps peers from raising flags before that.
    cuda_check(cudaMemset(s.sym->local(), 0, layout.control_end), what, "cudaMemset");
    cuda_check(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
    comm.control_barrier();
  }

  kernels::EPParams& p = s.params;
  p.config = config;
  p.rank = comm.rank();
  p.world_size = n;
  p.grid = grid;
  p.path = path;
  p.order = cuda.config().ep.order;
  p.ll = ll;
  if (s.sym) p.sym = s.sym->device_handle();
  p.layout = layout;
  p.barrier = cuda.barrier_handle();
}

EPBufferGpu::~EPBufferGpu() {
  // A buffer dropped right after its combine is enqueued: its kernels still use the mappings
  // released below.
  if (impl_ != nullptr && impl_->device >= 0) wait_device_before_release(impl_->device);
}

void EPBufferGpu::set_local(void* expert_x, int32_t* expert_counts, int32_t* recv_pos) {
  impl_->params.expert_x = expert_x;
  impl_->params.expert_counts = expert_counts;
  impl_->params.recv_pos = recv_pos;
}

EPState EPBufferGpu::state() const {
  const kernels::EPParams& p = impl_->params;
  EPState st;
  st.expert_x = p.expert_x;
  st.expert_counts = p.expert_counts;
  st.recv_pos = p.recv_pos;
  if (impl_->transport == EPTransport::kNvshmem) {
    const nvshmem_ep::Params& q = impl_->nv;
    st.meta_idx = reinterpret_cast<int32_t*>(q.heap + q.layout.meta_idx);
    st.meta_w = reinterpret_cast<float*>(q.heap + q.layout.meta_w);
    st.meta_num_tokens = reinterpret_cast<int32_t*>(q.heap + q.layout.num_tokens);
    st.overflow = reinterpret_cast<int64_t*>(q.heap + q.layout.overflow);
    return st;
  }
  char* base = static_cast<char*>(impl_->sym->local());
  st.meta_idx = reinterpret_cast<int32_t*>(base + p.layout.meta_idx);
  st.meta_w = reinterpret_cast<float*>(base + p.layout.meta_w);
  // Each chunk's lead block of a source writes its token count into the chunk's slot; column 0 is one of them.
  st.meta_num_tokens = reinterpret_cast<int32_t*>(base + p.layout.num_tokens);
  st.overflow = reinterpret_cast<int64_t*>(base + p.layout.overflow);
  return st;
}

int64_t EPBufferGpu::meta_num_tokens_stride() const {
  return impl_->transport == EPTransport::kNvshmem ? 1 : impl_->params.grid.num_chunks;
}

std::shared_ptr<void> EPBufferGpu::symmetric_keepalive() const {
  if (impl_->transport == EPTransport::kNvshmem) return impl_->heap;
  return impl_->sym;
}

const EPConfig& EPBufferGpu::config() const { return impl_->config; }

int EPBufferGpu::device() const { return impl_->cuda->device(); }

const char* EPBufferGpu::kernels() const {
  if (impl_->transport == EPTransport::kNvshmem) return "nvshmem";
  return impl_->params.path == kernels::EPPath::kLL ? "ll" : "flags";
}

void EPBufferGpu::dispatch(const void* x, int64_t num_tokens, const int64_t* topk_idx, const float* topk_weights,
                           EPPhase phase, GpuStream stream_in) {
  const char* what = "EPBuffer.dispatch";
  Impl& s = *impl_;
  check_order(s, what, phase, Impl::Next::kDispatch, Impl::Next::kDispatchRecv);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_in);
  DeviceGuard guard(s.cuda->device());
  begin_call(s, stream, what);
  kernels::EPParams p = s.params;
  if (phase != EPPhase::kRecv) {
    s.pending_x = x;  // the receive part expands this rank's own rows from x
    p.topk_idx = topk_idx;
    p.topk_weights = topk_weights;
    p.num_tokens = num_tokens;
  }
  p.x = s.pending_x;
  Plan plan = s.plan;
  plan.op = "ep_dispatch";
  plan_executed(plan, p.rank);
  if (s.transport == EPTransport::kNvshmem) {
    launch_nvshmem(s, p, /*dispatch=*/true, mode_of(phase), stream, what);
  } else {
    throw_if_error(kernels::launch_ep(p, kernels::EPOp::kDispatch, mode_of(phase), stream));
  }
  end_call(s, stream, what);
  s.next = phase == EPPhase::kSend ? Impl::Next::kDispatchRecv : Impl::Next::kCombine;
}

void EPBufferGpu::combine(const void* expert_out, void* out, EPPhase phase, GpuStream stream_in) {
  const char* what = "EPBuffer.combine";
  Impl& s = *impl_;
  check_order(s, what, phase, Impl::Next::kCombine, Impl::Next::kCombineRecv);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_in);
  DeviceGuard guard(s.cuda->device());
  begin_call(s, stream, what);
  kernels::EPParams p = s.params;
  p.out = out;
  if (phase != EPPhase::kRecv) p.expert_out = expert_out;
  Plan plan = s.plan;
  plan.op = "ep_combine";
  plan_executed(plan, p.rank);
  if (s.transport == EPTransport::kNvshmem) {
    launch_nvshmem(s, p, /*dispatch=*/false, mode_of(phase), stream, what);
  } else {
    throw_if_error(kernels::launch_ep(p, kernels::EPOp::kCombine, mode_of(phase), stream));
  }
  end_call(s, stream, what);
  s.next = phase == EPPhase::kSend ? Impl::Next::kCombineRecv : Impl::Next::kDispatch;
}

std::vector<int64_t> ep_trace_snapshot_gpu() { return kernels::ep_trace_snapshot(); }

}  // namespace commlib
