// ncclGroupStart / ncclGroupEnd. The operations commlib serves are enqueued when called (a group
// changes nothing for a collective, which every rank calls in the same order); what a group must
// add is that its sends and receives progress together: their streams join the caller's at the
// group's end, not after each call (join_streams). The real NCCL's group is opened only when a
// call of the group goes to it, so a real communicator created inside a shim group (a blocking
// ncclCommInitRankConfig) is made before that group opens.
#include <algorithm>
#include <vector>

#include "cuda/cuda_comm.hpp"
#include "nccl_shim/shim.hpp"

namespace commlib::nccl_shim {
namespace {

struct Join {
  cudaStream_t waiter;
  cudaStream_t signaller;
  int device;
  bool operator==(const Join&) const = default;
};

// NCCL's groups are per thread; so are the shim's.
thread_local int group_depth = 0;
thread_local bool real_group_open = false;
thread_local std::vector<Join> pending_joins;

void join_now(const Join& join) {
  DeviceGuard guard(join.device);
  cudaEvent_t event = nullptr;
  cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "nccl shim: join streams",
             "cudaEventCreateWithFlags");
  // The event marks what `signaller` has enqueued so far; `waiter`'s later work waits for it.
  const cudaError_t recorded = cudaEventRecord(event, join.signaller);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(join.waiter, event, 0) : recorded;
  cudaEventDestroy(event);
  cuda_check(waited, "nccl shim: join streams", "cudaEventRecord / cudaStreamWaitEvent");
}

ncclResult_t group_start() {
  ++group_depth;
  return ncclSuccess;
}

// Closes one level; at the outermost, runs the pending joins and ends the real NCCL's group.
// `simulate` (ncclGroupSimulateEnd) ends the real group with its simulation instead.
ncclResult_t group_end(const char* what, ncclSimInfo_t* sim_info) {
  if (group_depth == 0) return fail(ncclInvalidUsage, std::string(what) + ": no group is open (call ncclGroupStart first)");
  if (--group_depth > 0) return ncclSuccess;
  std::vector<Join> joins;
  joins.swap(pending_joins);
  ncclResult_t result = guarded(what, [&] {
    for (const Join& join : joins) join_now(join);
    return ncclSuccess;
  });
  if (real_group_open) {
    real_group_open = false;
    const ncclResult_t r = sim_info != nullptr ? real::ncclGroupSimulateEnd(sim_info) : real::ncclGroupEnd();
    if (result == ncclSuccess) result = r;
  } else if (sim_info != nullptr) {
    sim_info->estimatedTime = 0.0f;  // nothing of the group reaches the real NCCL's model
  }
  return result;
}

}  // namespace

bool in_group() { return group_depth > 0; }

void enter_real_group() {
  if (group_depth > 0 && !real_group_open) {
    real::ncclGroupStart();
    real_group_open = true;
  }
}

void join_streams(cudaStream_t waiter, cudaStream_t signaller, int device, JoinAt at) {
  const Join join{waiter, signaller, device};
  if (group_depth == 0 || at == JoinAt::kNow) {
    join_now(join);
  } else if (std::find(pending_joins.begin(), pending_joins.end(), join) == pending_joins.end()) {
    pending_joins.push_back(join);
  }
}

}  // namespace commlib::nccl_shim

namespace shim = commlib::nccl_shim;

NCCL_SHIM_API ncclResult_t ncclGroupStart() { return shim::group_start(); }
NCCL_SHIM_API ncclResult_t pncclGroupStart() { return shim::group_start(); }
NCCL_SHIM_API ncclResult_t ncclGroupEnd() { return shim::group_end("ncclGroupEnd", nullptr); }
NCCL_SHIM_API ncclResult_t pncclGroupEnd() { return shim::group_end("pncclGroupEnd", nullptr); }
NCCL_SHIM_API ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* simInfo) {
  if (simInfo == nullptr) return shim::fail(ncclInvalidArgument, "ncclGroupSimulateEnd: simInfo is NULL");
  return shim::group_end("ncclGroupSimulateEnd", simInfo);
}
NCCL_SHIM_API ncclResult_t pncclGroupSimulateEnd(ncclSimInfo_t* simInfo) {
  if (simInfo == nullptr) return shim::fail(ncclInvalidArgument, "pncclGroupSimulateEnd: simInfo is NULL");
  return shim::group_end("pncclGroupSimulateEnd", simInfo);
}
