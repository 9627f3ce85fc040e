// The operations commlib serves (Note [nccl shim routes] in nccl_shim/shim.hpp): each checks its
// arguments, runs on commlib's GPU engine when the communicator and the call qualify, and
// otherwise hands the same call to the real NCCL communicator inside.
#include <string>

#include "commlib/gpu.hpp"
#include "cuda/cuda_comm.hpp"
#include "cuda/cuda_p2p.hpp"
#include "nccl_shim/shim.hpp"

namespace commlib::nccl_shim {
namespace {

constexpr const char* kTypeNames[] = {"int8",    "uint8",   "int32",    "uint32",   "int64",        "uint64",
                                      "float16", "float32", "float64",  "bfloat16", "float8e4m3",   "float8e5m2"};
constexpr size_t kTypeBytes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
constexpr int kNumTypes = sizeof(kTypeBytes) / sizeof(kTypeBytes[0]);

std::string type_name(uint32_t code) {
  return code < static_cast<uint32_t>(kNumTypes) ? kTypeNames[code] : "type " + std::to_string(code);
}

ncclResult_t check_type(const char* what, ncclDataType_t type) {
  if (static_cast<int>(type) < 0 || static_cast<int>(type) >= kNumTypes) {
    return fail(ncclInvalidArgument, std::string(what) + ": datatype " + std::to_string(static_cast<int>(type)) +
                                         " invalid; valid: 0.." + std::to_string(kNumTypes - 1));
  }
  return ncclSuccess;
}

// Checks the communicator and the type; the call may go on when it returns ncclSuccess.
ncclResult_t check_call(const char* what, ncclComm_t comm, ncclDataType_t type) {
  if (ncclResult_t r = check_comm(comm, what); r != ncclSuccess) return r;
  return check_type(what, type);
}

ncclResult_t check_buffer(const char* what, const char* name, const void* ptr, size_t count) {
  if (ptr == nullptr && count > 0) {
    return fail(ncclInvalidArgument, std::string(what) + ": " + name + " is NULL with count " + std::to_string(count));
  }
  return ncclSuccess;
}

ncclResult_t check_rank(const char* what, const char* name, int value, ncclComm_t comm) {
  if (value < 0 || value >= comm->nranks) {
    return fail(ncclInvalidArgument, std::string(what) + ": " + name + " " + std::to_string(value) + " invalid; valid: 0.." +
                                         std::to_string(comm->nranks - 1));
  }
  return ncclSuccess;
}

// commlib's reductions: sum and avg of float32, float16, bfloat16.
bool reducible(ncclDataType_t type, ncclRedOp_t op, DataType* dtype, ReduceOp* reduce) {
  if (op != ncclSum && op != ncclAvg) return false;
  switch (type) {
    case ncclFloat32: *dtype = DataType::kFloat32; break;
    case ncclFloat16: *dtype = DataType::kFloat16; break;
    case ncclBfloat16: *dtype = DataType::kBFloat16; break;
    default: return false;
  }
  *reduce = op == ncclAvg ? ReduceOp::kAvg : ReduceOp::kSum;
  return true;
}

bool ranges_overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

// The real communicator inside `comm` (made now if need be), for a call commlib does not serve.
// `call` names it `inner`.
#define NCCL_SHIM_FORWARD(what, comm, call)                                                      \
  do {                                                                                           \
    ncclComm_t inner = nullptr;                                                                  \
    if (ncclResult_t r = real_comm(comm, what, RealComm::kCreate, &inner); r != ncclSuccess) return r; \
    return call;                                                                                 \
  } while (0)

ncclResult_t all_reduce(const char* what, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t type,
                        ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t r = check_call(what, comm, type); r != ncclSuccess) return r;
  if (ncclResult_t r = check_buffer(what, "sendbuff", sendbuff, count); r != ncclSuccess) return r;
  if (ncclResult_t r = check_buffer(what, "recvbuff", recvbuff, count); r != ncclSuccess) return r;
  DataType dtype{};
  ReduceOp reduce{};
  if (comm->served && reducible(type, op, &dtype, &reduce)) {
    if (count == 0) return ncclSuccess;
    return guarded(what, [&] {
      all_reduce_gpu(*comm->commlib, comm->device, sendbuff, recvbuff, count, dtype, reduce, Algorithm::kAuto, stream);
      return ncclSuccess;
    });
  }
  NCCL_SHIM_FORWARD(what, comm, real::ncclAllReduce(sendbuff, recvbuff, count, type, op, inner, stream));
}

ncclResult_t reduce_scatter(const char* what, const void* sendbuff, void* recvbuff, size_t recvcount,
                            ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t r = check_call(what, comm, type); r != ncclSuccess) return r;
  if (ncclResult_t r = check_buffer(what, "sendbuff", sendbuff, recvcount); r != ncclSuccess) return r;
  if (ncclResult_t r = check_buffer(what, "recvbuff", recvbuff, recvcount); r != ncclSuccess) return r;
  DataType dtype{};
  ReduceOp reduce{};
  if (comm->served && reducible(type, op, &dtype, &reduce)) {
    if (recvcount == 0) return ncclSuccess;
    return guarded(what, [&] {
      reduce_scatter_gpu(*comm->commlib, comm->device, sendbuff, recvbuff, recvcount, dtype, reduce, stream);
      return ncclSuccess;
    });
  }
  NCCL_SHIM_FORWARD(what, comm, real::ncclReduceScatter(sendbuff, recvbuff, recvcount, type, op, inner, stream));
}

ncclResult_t all_gather(const char* what, const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t type,
                        ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t r = check_call(what, comm, type); r != ncclSuccess) return r;
  if (ncclResult_t r = check_buffer(what, "sendbuff", sendbuff, sendcount); r != ncclSuccess) return r;
  if (ncclResult_t r = check_buffer(what, "recvbuff", recvbuff, sendcount); r != ncclSuccess) return r;
  if (comm->served) {
    if (sendcount == 0) return ncclSuccess;
    return guarded(what, [&] {
      all_gather_gpu(*comm->commlib, comm->device, sendbuff, recvbuff, sendcount * kTypeBytes[type], stream);
      return ncclSuccess;
    });
  }
  NCCL_SHIM_FORWARD(what, comm, real::ncclAllGather(sendbuff, recvbuff, sendcount, type, inner, stream));
}

// ncclBroadcast (sendbuff read on the root) and ncclBcast (in place: sendbuff == recvbuff).
enum class BroadcastApi { kBroadcast, kBcast };

ncclResult_t broadcast(const char* what, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t type,
                       int root, ncclComm_t comm, cudaStream_t stream, BroadcastApi api) {
  if (ncclResult_t r = check_call(what, comm, type); r != ncclSuccess) return r;
  if (ncclResult_t r = check_rank(what, "root", root, comm); r != ncclSuccess) return r;
  if (ncclResult_t r = check_buffer(what, "recvbuff", recvbuff, count); r != ncclSuccess) return r;
  if (comm->rank == root) {
    if (ncclResult_t r = check_buffer(what, "sendbuff", sendbuff, count); r != ncclSuccess) return r;
  }
  if (comm->served) {
    if (count == 0) return ncclSuccess;
    const size_t bytes = count * kTypeBytes[type];
    return guarded(what, [&] {
      if (comm->rank == root && sendbuff != recvbuff) {
        DeviceGuard guard(comm->device);
        // Ordered before the broadcast on the same stream: the root's recvbuff holds the data.
        cuda_check(cudaMemcpyAsync(recvbuff, sendbuff, bytes, cudaMemcpyDeviceToDevice, stream), what, "cudaMemcpyAsync");
      }
      broadcast_gpu(*comm->commlib, comm->device, recvbuff, bytes, root, stream);
      return ncclSuccess;
    });
  }
  if (api == BroadcastApi::kBcast) NCCL_SHIM_FORWARD(what, comm, real::ncclBcast(recvbuff, count, type, root, inner, stream));
  NCCL_SHIM_FORWARD(what, comm, real::ncclBroadcast(sendbuff, recvbuff, count, type, root, inner, stream));
}

#ifdef COMMLIB_NCCL_HAS_ncclAlltoAll
ncclResult_t all_to_all(const char* what, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t type,
                        ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t r = check_call(what, comm, type); r != ncclSuccess) return r;
  if (ncclResult_t r = check_buffer(what, "sendbuff", sendbuff, count); r != ncclSuccess) return r;
  if (ncclResult_t r = check_buffer(what, "recvbuff", recvbuff, count); r != ncclSuccess) return r;
  const size_t block_bytes = count * kTypeBytes[type];
  const size_t total = block_bytes * static_cast<size_t>(comm->nranks);
  // In place (sendbuff == recvbuff) is safe: each block of the exchange kernels reads its packs
  // of every input block before it writes the same packs of the output blocks (Note [push exchange]).
  // Buffers that overlap otherwise go to the real NCCL.
  if (comm->served && (sendbuff == recvbuff || !ranges_overlap(sendbuff, total, recvbuff, total))) {
    if (count == 0) return ncclSuccess;
    return guarded(what, [&] {
      all_to_all_gpu(*comm->commlib, comm->device, sendbuff, recvbuff, block_bytes, stream);
      return ncclSuccess;
    });
  }
  NCCL_SHIM_FORWARD(what, comm, real::ncclAlltoAll(sendbuff, recvbuff, count, type, inner, stream));
}
#endif

// Send and receive over commlib's GPU channels (Note [cuda p2p]): messages of a pair match in
// posting order, as NCCL's do; they run on the channel's own streams, ordered after the caller's
// stream and joined back to it (at the group's end inside a group).
enum class P2pKind { kSend, kRecv };

ncclResult_t p2p(const char* what, P2pKind kind, void* buff, size_t count, ncclDataType_t type, int peer,
                 ncclComm_t comm, cudaStream_t stream) {
  if (ncclResult_t r = check_call(what, comm, type); r != ncclSuccess) return r;
  if (ncclResult_t r = check_rank(what, "peer", peer, comm); r != ncclSuccess) return r;
  const bool sending = kind == P2pKind::kSend;
  if (ncclResult_t r = check_buffer(what, sending ? "sendbuff" : "recvbuff", buff, count); r != ncclSuccess) return r;
  if (comm->served && peer == comm->rank) {
    return guarded(what, [&] {
      const size_t bytes = count * kTypeBytes[type];
      (sending ? comm->self_sends : comm->self_recvs).push_back({buff, bytes, stream});
      while (!comm->self_sends.empty() && !comm->self_recvs.empty()) {
        const ncclComm::SelfMessage send = comm->self_sends.front(), recv = comm->self_recvs.front();
        comm->self_sends.pop_front();
        comm->self_recvs.pop_front();
        COMMLIB_CHECK(send.bytes == recv.bytes, InvalidArgument, "a send of ", send.bytes,
                      " bytes to this rank itself met a receive of ", recv.bytes, " bytes");
        DeviceGuard guard(comm->device);
        // The copy reads the send buffer after the sender's stream wrote it; the send is done
        // when the copy is (at the group's end inside a group, as for a peer).
        join_streams(recv.stream, send.stream, comm->device, JoinAt::kNow);
        if (send.bytes > 0) {
          cuda_check(cudaMemcpyAsync(recv.buffer, send.buffer, send.bytes, cudaMemcpyDeviceToDevice, recv.stream), what,
                     "cudaMemcpyAsync");
        }
        join_streams(send.stream, recv.stream, comm->device, JoinAt::kGroupEnd);
      }
      return ncclSuccess;
    });
  }
  if (comm->served) {
    return guarded(what, [&] {
      static const bool named = [] {
        CudaP2p::set_dtype_namer(type_name);
        return true;
      }();
      (void)named;
      DeviceGuard guard(comm->device);
      CudaP2p& channels = comm->commlib->cuda(comm->device).p2p();
      const cudaStream_t side = sending ? channels.send_stream() : channels.recv_stream();
      join_streams(side, stream, comm->device, JoinAt::kNow);
      const size_t bytes = count * kTypeBytes[type];
      if (sending) {
        channels.send(buff, bytes, static_cast<uint32_t>(type), peer, /*tag=*/0, side);
      } else {
        channels.recv(buff, bytes, static_cast<uint32_t>(type), peer, /*tag=*/0, side);
      }
      join_streams(stream, side, comm->device, JoinAt::kGroupEnd);
      return ncclSuccess;
    });
  }
  if (sending) NCCL_SHIM_FORWARD(what, comm, real::ncclSend(buff, count, type, peer, inner, stream));
  NCCL_SHIM_FORWARD(what, comm, real::ncclRecv(buff, count, type, peer, inner, stream));
}

}  // namespace
}  // namespace commlib::nccl_shim

namespace shim = commlib::nccl_shim;

#define NCCL_SHIM_TWINS(name, params, impl_call) \
  NCCL_SHIM_API ncclResult_t name params { const char* what = #name; return impl_call; } \
  NCCL_SHIM_API ncclResult_t p##name params { const char* what = "p" #name; return impl_call; }

NCCL_SHIM_TWINS(ncclAllReduce,
                (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                 ncclComm_t comm, cudaStream_t stream),
                shim::all_reduce(what, sendbuff, recvbuff, count, datatype, op, comm, stream))
NCCL_SHIM_TWINS(ncclReduceScatter,
                (const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op,
                 ncclComm_t comm, cudaStream_t stream),
                shim::reduce_scatter(what, sendbuff, recvbuff, recvcount, datatype, op, comm, stream))
NCCL_SHIM_TWINS(ncclAllGather,
                (const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm,
                 cudaStream_t stream),
                shim::all_gather(what, sendbuff, recvbuff, sendcount, datatype, comm, stream))
NCCL_SHIM_TWINS(ncclBroadcast,
                (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                 ncclComm_t comm, cudaStream_t stream),
                shim::broadcast(what, sendbuff, recvbuff, count, datatype, root, comm, stream, shim::BroadcastApi::kBroadcast))
NCCL_SHIM_TWINS(ncclBcast,
                (void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream),
                shim::broadcast(what, buff, buff, count, datatype, root, comm, stream, shim::BroadcastApi::kBcast))
#ifdef COMMLIB_NCCL_HAS_ncclAlltoAll
NCCL_SHIM_TWINS(ncclAlltoAll,
                (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
                 cudaStream_t stream),
                shim::all_to_all(what, sendbuff, recvbuff, count, datatype, comm, stream))
#endif
NCCL_SHIM_TWINS(ncclSend,
                (const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                 cudaStream_t stream),
                shim::p2p(what, shim::P2pKind::kSend, const_cast<void*>(sendbuff), count, datatype, peer, comm, stream))
NCCL_SHIM_TWINS(ncclRecv,
                (void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream),
                shim::p2p(what, shim::P2pKind::kRecv, recvbuff, count, datatype, peer, comm, stream))
#undef NCCL_SHIM_TWINS
