// DdaBackend: the c10d::Backend behind `init_process_group(backend="ddacomm")`.
//
// One instance serves both devices of a process group (registered for "cpu" and "cuda"). Each
// call takes commlib's fast path when it can and otherwise goes, unchanged, to an inner backend
// built from the same store (Note [ddacomm routing]):
//   CPU tensors  -> commlib's shared-memory collectives, else gloo;
//   CUDA tensors -> commlib's GPU all-reduce where built in, else NCCL (created on first CUDA use,
//                   so a CPU-only process never touches NCCL).
// Semantics follow NCCL and gloo: CPU calls complete before they return (their Work and Future
// are already completed); CUDA calls are ordered on the caller's current stream, and with
// async_op=True run on an internal stream whose Work::wait() makes the current stream wait.
//
// Errors: invalid arguments raise c10::ValueError / c10::TypeError (Python ValueError /
// TypeError) on the calling rank before any peer is involved, so the group stays usable; failures
// of the communication raise c10::DistBackendError (torch.distributed.DistBackendError).
// Thread-safety: like the communicator, one thread drives a backend at a time.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commlib/communicator.hpp"
#include "core/algorithm_selector.hpp"
#include "torch/flight_recorder.hpp"
#include "torch/hierarchy.hpp"
#include "torch/p2p.hpp"

namespace commlib::torch_layer {

class DdaBackend final : public c10d::Backend {
 public:
  // Creates the NCCL backend on first CUDA use (Python side; see backend_registration.py).
  using InnerFactory = torch_layer::InnerFactory;

  struct Config {
    std::chrono::milliseconds timeout{std::chrono::minutes(30)};
    std::string group_name;
    std::vector<uint64_t> global_ranks_in_group;
  };

  // `comm` is null when the group spans several hosts: then every call goes to an inner backend or,
  // once attach_hierarchy was called, two-level (Note [hierarchical collectives]).
  // `gloo` must be a backend of the same ranks; `nccl_factory` may be empty (no CUDA).
  DdaBackend(int rank, int size, std::shared_ptr<Communicator> comm, c10::intrusive_ptr<c10d::Backend> gloo,
             InnerFactory nccl_factory, Config config);
  ~DdaBackend() override;

  const std::string getBackendName() const override { return "ddacomm"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  // Not `override`: torch 2.11's Backend has no such virtual (2.14 has; the signature matches).
  void setBoundDeviceId(std::optional<at::Device> device);
  void shutdown() override;
  void abort() override;
  // SUCCESS / TIMEOUT / REMOTE_ERROR / COMM_ERROR (aborted): the first failure of commlib's calls
  // of this group (a timeout, a peer that failed or left); a fall-back call's are the inner backend's.
  // abort() ends the pending commlib waits (Note [abort]) and makes every later call raise.
  c10d::ErrorType getError() override;

  // torch's shrink_group: a new backend over the ranks not in `ranks_to_exclude`, made by the
  // factory the Python side set (backend_registration: a new communicator, gloo and NCCL factory
  // under the group's store; only the survivors call it). With SHRINK_ABORT this backend is aborted
  // first. Not `override`: torch 2.11's Backend has neither (2.14 has; the signatures match).
  using ShrinkFactory = std::function<c10::intrusive_ptr<c10d::Backend>(const std::vector<int64_t>&)>;
  void set_shrink_factory(ShrinkFactory factory) { shrink_factory_ = std::move(factory); }
  bool supportsShrinking() const { return comm_ != nullptr && static_cast<bool>(shrink_factory_); }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags = 0,
                                           const c10::intrusive_ptr<Options>& opts_override = nullptr);

  // What the Python side can inspect (tests, docs): is the shm path live; has NCCL been created.
  bool has_fast_path() const { return comm_ != nullptr; }
  bool nccl_created() const { return nccl_ != nullptr; }
  // Number of calls served by commlib / by an inner backend (for tests of the routing rules).
  int64_t num_fast_calls() const { return num_fast_calls_; }
  int64_t num_fallback_calls() const { return num_fallback_calls_; }
  // A group spanning several hosts of equal size: its two-level paths (Note [hierarchical
  // collectives]); attached once, right after construction, before any call.
  void attach_hierarchy(std::unique_ptr<Hierarchy> hierarchy);
  Hierarchy* hierarchy() const { return hier_.get(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  uint64_t getSequenceNumberForGroup() override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Coalescing regions (batch_isend_irecv, _coalescing_manager): NCCL ops inside one are grouped by
  // the inner NCCL backend; gloo's works are joined into the work endCoalescing returns.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

 private:
  // The inner backend for tensors on `device` (gloo for CPU, NCCL for CUDA).
  c10d::Backend& inner(const at::Device& device, const char* what);
  c10d::Backend& nccl(const char* what);
  // True when `tensors` are all dense CPU tensors and commlib's shm path is live.
  bool cpu_fast(const std::vector<at::Tensor>& tensors) const;
  // For a CPU reduction that cpu_fast() admits: true when commlib takes it (every dtype and the op
  // handled); otherwise the ranks first check they all make the same call (host::agree) and the
  // caller hands it to gloo. Refuses the op/dtype pairs gloo refuses, as gloo does.
  bool cpu_reduction(const char* what, c10d::OpType kind, const std::vector<at::Tensor>& tensors,
                     const c10d::ReduceOp& reduce_op);
  // For a CPU data movement that cpu_fast() admits: true when commlib moves every dtype; otherwise
  // the ranks first check they all make the same call (host::agree), so a rank whose dtype differs
  // from its peers' raises "ranks disagree" instead of meeting them in another library.
  bool cpu_movable(const char* what, c10d::OpType kind, const std::vector<at::Tensor>& tensors);
  // Before a CPU call goes to the inner backend: every rank confirms it makes the same call (one
  // host::agree round), so a rank that differs raises "ranks disagree" instead of hanging in gloo.
  void agree_before_inner(const char* what, c10d::OpType kind, const at::Tensor& t, uint32_t reduction);
  c10::intrusive_ptr<c10d::Work> fallback(c10::intrusive_ptr<c10d::Work> work);
  // `list` has world_size tensors of `one`'s dtype and element count (ValueError / TypeError).
  void check_gather_list(const char* what, const std::vector<at::Tensor>& list, const at::Tensor& one) const;
  // A send or receive on commlib's path (collected when inside a coalescing region).
  c10::intrusive_ptr<c10d::Work> p2p_work(c10d::OpType op, P2pWork::Item item);
  // A CUDA send or receive on peer memory (Note [cuda p2p routing]), or null when it is not taken.
  c10::intrusive_ptr<c10d::Work> cuda_p2p(c10d::OpType op, P2pRequest::Kind kind, std::vector<at::Tensor>& tensors,
                                          int peer, int tag);
  c10::intrusive_ptr<c10d::Work> completed(c10d::OpType op, std::vector<at::Tensor> outputs);
  // Runs `body` (a synchronous commlib CPU call) recorded in the flight recorder, and returns its
  // completed Work (Note [flight recorder]).
  c10::intrusive_ptr<c10d::Work> run_host(c10d::OpType op, const char* what, std::vector<at::Tensor> outputs,
                                          const std::vector<at::Tensor>& inputs, const std::function<void()>& body);
  // The flight-recorder entry of a call on `device`'s route (no-op while the recorder is off).
  fr::Group::Call fr_record(c10d::OpType op, const at::Device& device, const char* variant,
                            const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                            int peer = -1);
  // run_fast (backend_internal.hpp) for a recorded call: a communication error marks it failed.
  template <typename F>
  void run_recorded(fr::Group::Call& call, const char* what, F&& body);
  // A commlib call failed: the error state, the entry's note and, for a timeout or a peer's failure,
  // this rank's flight-recorder dump (TORCH_FR_DUMP_TEMP_FILE + rank).
  void failed(fr::Group::Call& call, const char* error_class, const char* what);
  // The one route for CUDA all-reduce: commlib's kernels where built in and eligible, else NCCL.
  c10::intrusive_ptr<c10d::Work> route_cuda_all_reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts);

  // A group spanning several hosts: whether this call runs two-level (its plan in *plan, counted
  // by run_two_level once the call's checks pass). A call the plan gives the group's own gloo /
  // NCCL (inner) is counted here, as it goes there next. False without a hierarchy or for tensors
  // the two-level path does not take.
  bool two_level(HierOp op, const std::vector<at::Tensor>& tensors, size_t bytes, Plan* plan) const;
  // Counts `plan`, runs a two-level call and returns its Work (completed on CPU; on the current
  // stream on CUDA).
  c10::intrusive_ptr<c10d::Work> run_two_level(const Plan& plan, c10d::OpType op, const at::Device& device,
                                               std::vector<at::Tensor> outputs, const std::function<void()>& body);

  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<Hierarchy> hier_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> nccl_;
  InnerFactory nccl_factory_;
  ShrinkFactory shrink_factory_;
  std::mutex nccl_mutex_;
  Config config_;
  int64_t num_fast_calls_ = 0;
  int64_t num_fallback_calls_ = 0;
  bool cuda_used_ = false;
  bool shut_down_ = false;
  bool coalescing_ = false;
  bool nccl_coalescing_ = false;    // the inner NCCL backend's startCoalescing was called
  bool collect_next_work_ = false;  // the next fallback() work is gloo's, inside a coalescing region
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_cpu_works_;
  std::unique_ptr<fr::Group> fr_;  // this group in torch's flight recorder
  // While the recorder is on: a thread that writes this rank's dump once another rank of the group
  // has failed and asked for dumps through the store (Note [flight recorder]).
  void start_dump_watcher();
  void stop_dump_watcher();
  void dump_once();
  std::string dump_key_;
  std::thread dump_watcher_;
  std::mutex dump_mutex_;
  std::condition_variable dump_stop_cv_;
  bool dump_stop_ = false;
  bool dumped_ = false;
  std::atomic<c10d::ErrorType> error_{c10d::ErrorType::SUCCESS};
#if defined(COMMLIB_TORCH_CUDA)
  struct CudaState;
  std::unique_ptr<CudaState> cuda_state_;
  // Whether a CUDA collective `op` of `bytes` takes commlib's kernel: dense CUDA tensors on one
  // device, the fast path live and the communicator's crossover (Note [ddacomm routing]).
  bool cuda_collective(CollectiveOp op, const std::vector<at::Tensor>& tensors, size_t bytes) const;
  // Runs `body` (commlib GPU calls on the current stream of `outputs[0]`'s device) with NCCL's stream
  // semantics, as the all-reduce route does, and counts a fast call.
  c10::intrusive_ptr<c10d::Work> run_cuda(const char* what, c10d::OpType op, std::vector<at::Tensor> outputs,
                                          const std::vector<at::Tensor>& inputs, bool async_op,
                                          const std::function<void()>& body);
#endif
};

}  // namespace commlib::torch_layer
