#include "transport/cuda_ipc.hpp"

#include <cuda_runtime.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>

#include "bootstrap/bootstrap.hpp"
#include "commlib/errors.hpp"
#include "transport/cuda_driver.hpp"
#include "transport/fd_server.hpp"

namespace commlib {
namespace {

constexpr uint64_t kMagic = 0x636f6d6d6c696231ull;  // "commlib1"
constexpr int kAwaitedFd = -2;  // receive_fds: a slot whose descriptor is still to come

struct FdHeader {
  uint64_t magic;
  uint64_t sequence;
  uint64_t bytes;
  int32_t rank;
  int32_t pad;
};

// One header and room for one descriptor, laid out as sendmsg / recvmsg take them.
struct FdMessage {
  FdHeader header{};
  iovec iov{&header, sizeof(header)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete;  // msg points into the object itself
  FdMessage& operator=(const FdMessage&) = delete;
};

struct AllocInfo {
  uint64_t sequence;
  uint64_t bytes;
};

struct DeviceInfo {
  char bus_id[32];
  int32_t can_reach_all;  // filled in a second round
};

void cuda_check(cudaError_t err, const char* what, const char* call) {
  COMMLIB_CHECK(err == cudaSuccess, CudaError, what, ": ", call, " failed: ", cudaGetErrorString(err));
}

}  // namespace

CudaIpc::CudaIpc(Store& store, std::string prefix, int rank, int world_size, int device, int64_t rank0_pid,
                 std::chrono::milliseconds timeout, std::string unreachable)
    : store_(store),
      prefix_(std::move(prefix)),
      rank_(rank),
      world_size_(world_size),
      device_(device),
      rank0_pid_(rank0_pid),
      timeout_(timeout) {
  const char* what = "cuda ipc";
  if (unreachable.empty() && world_size_ > kMaxDeviceRanks) {
    unreachable = detail::concat("world_size ", world_size_, " above the ", kMaxDeviceRanks,
                                 " ranks GPU peer memory supports");
  }
  if (!unreachable.empty()) {
    p2p_ok_ = false;
    problem_ = std::move(unreachable);
    return;
  }
  Bootstrap bootstrap(store_, prefix_ + "/cuda", rank_, world_size_, timeout_);

  // P2P reachability of every pair, agreed by all ranks.
  DeviceInfo mine{};
  cuda_check(cudaDeviceGetPCIBusId(mine.bus_id, sizeof(mine.bus_id), device_), what, "cudaDeviceGetPCIBusId");
  auto infos = bootstrap.all_gather("busid", to_bytes(mine));
  std::string local_problem;
  for (int r = 0; r < world_size_ && local_problem.empty(); ++r) {
    const auto theirs = from_bytes<DeviceInfo>(infos[r]);
    if (r == rank_ || std::strncmp(theirs.bus_id, mine.bus_id, sizeof(mine.bus_id)) == 0) continue;
    int peer_device = -1;
    if (cudaDeviceGetByPCIBusId(&peer_device, theirs.bus_id) != cudaSuccess) {
      cudaGetLastError();  // not visible here: cuMemSetAccess decides at the first allocation
      continue;
    }
    int can = 0;
    cuda_check(cudaDeviceCanAccessPeer(&can, device_, peer_device), what, "cudaDeviceCanAccessPeer");
    if (!can) {
      local_problem = detail::concat("rank ", rank_, " (GPU ", mine.bus_id, ") cannot access the memory of rank ", r,
                                     " (GPU ", theirs.bus_id, "): no P2P path");
    }
  }
  auto problems = bootstrap.all_gather("p2p", std::vector<uint8_t>(local_problem.begin(), local_problem.end()));
  for (const auto& p : problems) {
    if (!p.empty() && p2p_ok_) {
      p2p_ok_ = false;
      problem_.assign(p.begin(), p.end());
    }
  }

  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  COMMLIB_CHECK(listen_fd_ >= 0, Error, what, ": socket() failed: ", std::strerror(errno));
  socklen_t len = 0;
  sockaddr_un addr = abstract_socket_address(socket_name(rank_), len);
  COMMLIB_CHECK(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) == 0, Error, what,
                ": bind() of the abstract socket '", socket_name(rank_), "' failed: ", std::strerror(errno));
  COMMLIB_CHECK(::listen(listen_fd_, world_size_ + 8) == 0, Error, what, ": listen() failed: ", std::strerror(errno));
  bootstrap.barrier("listening");
}

CudaIpc::~CudaIpc() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

std::string CudaIpc::socket_name(int rank) const {
  return detail::concat("commlib-ipc-", rank0_pid_, "-", std::hash<std::string>{}(prefix_), "-", rank);
}

void CudaIpc::send_fd(int r, int my_fd, uint64_t sequence, size_t bytes, const char* what) {
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  COMMLIB_CHECK(s >= 0, Error, what, ": socket() failed: ", std::strerror(errno));
  socklen_t len = 0;
  sockaddr_un addr = abstract_socket_address(socket_name(r), len);
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    const int e = errno;
    ::close(s);
    throw PeerError(detail::concat(what, ": rank ", rank_, " cannot connect to rank ", r, "'s socket: ",
                                   std::strerror(e), " (is rank ", r, " on this node?)"));
  }
  FdMessage m;
  m.header = FdHeader{kMagic, sequence, bytes, rank_, 0};
  cmsghdr* cmsg = CMSG_FIRSTHDR(&m.msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &my_fd, sizeof(int));
  const ssize_t sent = ::sendmsg(s, &m.msg, MSG_NOSIGNAL);
  const int e = errno;
  ::close(s);
  COMMLIB_CHECK(sent == static_cast<ssize_t>(sizeof(m.header)), PeerError, what, ": sending the handle to rank ", r,
                " failed: ", std::strerror(e));
}

void CudaIpc::receive_fds(uint64_t sequence, size_t bytes, std::vector<int>& peer_fds, const char* what) {
  const int expected = static_cast<int>(std::count(peer_fds.begin(), peer_fds.end(), kAwaitedFd));
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (int received = 0; received < expected; ++received) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    COMMLIB_CHECK(ready > 0, Timeout, what, ": Timed out after ", timeout_.count(), " ms: rank ", rank_,
                  " waiting for peers' memory handles (allocation #", sequence, ", received ", received, " of ",
                  expected, ")");
    const int s = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    COMMLIB_CHECK(s >= 0, Error, what, ": accept() failed: ", std::strerror(errno));
    FdMessage m;
    const ssize_t got = ::recvmsg(s, &m.msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    ::close(s);
    const FdHeader& header = m.header;
    cmsghdr* cmsg = CMSG_FIRSTHDR(&m.msg);
    COMMLIB_CHECK(got == static_cast<ssize_t>(sizeof(header)) && header.magic == kMagic && cmsg != nullptr &&
                      cmsg->cmsg_type == SCM_RIGHTS,
                  PeerError, what, ": rank ", rank_, " received a malformed handle message");
    int fd = -1;
    std::memcpy(&fd, CMSG_DATA(cmsg), sizeof(int));
    const int from = header.rank;
    if (from < 0 || from >= world_size_ || peer_fds[from] != kAwaitedFd || header.sequence != sequence ||
        header.bytes != bytes) {
      ::close(fd);
      throw PeerError(detail::concat(what, ": allocation mismatch: rank ", rank_, " is at allocation #", sequence,
                                     " of ", bytes, " bytes but rank ", from, " sent allocation #", header.sequence,
                                     " of ", header.bytes, " bytes"));
    }
    peer_fds[from] = fd;
  }
}

int CudaIpc::broadcast_fd(int root, int fd, const char* what) {
  COMMLIB_CHECK(root >= 0 && root < world_size_, InvalidArgument, what, ": root ", root, " out of range; valid: 0..",
                world_size_ - 1);
  const uint64_t sequence = sequence_++;  // shares the allocations' numbering, so messages never cross
  if (rank_ == root) {
    for (int r = 0; r < world_size_; ++r) {
      if (r != rank_) send_fd(r, fd, sequence, 0, what);
    }
    return fd;
  }
  std::vector<int> fds(world_size_, -1);
  fds[root] = kAwaitedFd;
  receive_fds(sequence, 0, fds, what);
  return fds[root];
}

std::shared_ptr<SymmetricBuffer> CudaIpc::allocate(size_t bytes, ZeroFill zero, const char* what, size_t alignment) {
  COMMLIB_CHECK(p2p_ok_, PeerError, what, ": GPU peer memory unavailable: ", problem_);
  COMMLIB_CHECK(bytes > 0, InvalidArgument, what, ": symmetric allocation of 0 bytes; must be > 0");
  COMMLIB_CHECK((alignment & (alignment - 1)) == 0, InvalidArgument, what, ": alignment ", alignment,
                " must be a power of two");
  const auto& drv = cuda::driver();
  cuda_check(cudaSetDevice(device_), what, "cudaSetDevice");
  const uint64_t sequence = sequence_++;
  Bootstrap bootstrap(store_, prefix_ + "/cuda/alloc/" + std::to_string(sequence), rank_, world_size_,
                      timeout_);

  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device_;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  cuda::check(drv.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), what,
              "cuMemGetAllocationGranularity");
  // Both powers of two in practice; a multiple of the larger is a multiple of both.
  granularity = std::max(granularity, alignment);
  const size_t rounded = (bytes + granularity - 1) / granularity * granularity;

  // Sizes first, through the store: a mismatch is reported on every rank before any mapping.
  const AllocInfo mine{sequence, rounded};
  auto all = bootstrap.all_gather("size", to_bytes(mine));
  for (int r = 0; r < world_size_; ++r) {
    const auto theirs = from_bytes<AllocInfo>(all[r]);
    COMMLIB_CHECK(theirs.sequence == sequence && theirs.bytes == rounded, PeerError, what,
                  ": symmetric allocation mismatch: rank ", rank_, " allocates #", sequence, " of ", bytes,
                  " bytes (", rounded, " rounded) but rank ", r, " allocates #", theirs.sequence, " of ", theirs.bytes,
                  " bytes (rounded); every rank must allocate the same sizes in the same order");
  }

  CUmemGenericAllocationHandle handle{};
  cuda::check(drv.cuMemCreate(&handle, rounded, &prop, 0), what, "cuMemCreate");
  int my_fd = -1;
  std::vector<int> peer_fds(world_size_, -1);
  std::vector<CUmemGenericAllocationHandle> handles(world_size_, 0);
  std::vector<CUdeviceptr> ptrs(world_size_, 0);
  auto cleanup = [&, rounded] {
    for (int r = 0; r < world_size_; ++r) {
      if (ptrs[r] != 0) {
        drv.cuMemUnmap(ptrs[r], rounded);
        drv.cuMemAddressFree(ptrs[r], rounded);
      }
      if (handles[r] != 0) drv.cuMemRelease(handles[r]);
      if (peer_fds[r] >= 0) ::close(peer_fds[r]);
    }
    if (my_fd >= 0) ::close(my_fd);
  };
  handles[rank_] = handle;
  try {
    cuda::check(drv.cuMemExportToShareableHandle(&my_fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), what,
                "cuMemExportToShareableHandle");
    for (int r = 0; r < world_size_; ++r) {
      if (r != rank_) send_fd(r, my_fd, sequence, rounded, what);
    }
    for (int r = 0; r < world_size_; ++r) peer_fds[r] = r == rank_ ? -1 : kAwaitedFd;
    receive_fds(sequence, rounded, peer_fds, what);
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (int r = 0; r < world_size_; ++r) {
      if (r != rank_) {
        cuda::check(drv.cuMemImportFromShareableHandle(&handles[r], reinterpret_cast<void*>(static_cast<intptr_t>(peer_fds[r])),
                                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    what, "cuMemImportFromShareableHandle");
        ::close(peer_fds[r]);
        peer_fds[r] = -1;
      }
      cuda::check(drv.cuMemAddressReserve(&ptrs[r], rounded, granularity, 0, 0), what, "cuMemAddressReserve");
      cuda::check(drv.cuMemMap(ptrs[r], rounded, 0, handles[r], 0), what, "cuMemMap");
      const CUresult res = drv.cuMemSetAccess(ptrs[r], rounded, &access, 1);
      if (res != CUDA_SUCCESS && r != rank_) {
        throw PeerError(detail::concat(what, ": rank ", rank_, " cannot map the memory of rank ", r,
                                       " (cuMemSetAccess failed with ", static_cast<int>(res),
                                       "): no P2P path between their GPUs"));
      }
      cuda::check(res, what, "cuMemSetAccess");
    }
    // The mappings keep the memory alive; the handles are no longer needed.
    for (int r = 0; r < world_size_; ++r) {
      drv.cuMemRelease(handles[r]);
      handles[r] = 0;
    }
    ::close(my_fd);
    my_fd = -1;
    if (zero == ZeroFill::kYes) {
      cuda_check(cudaMemset(reinterpret_cast<void*>(ptrs[rank_]), 0, rounded), what, "cudaMemset");
      cuda_check(cudaDeviceSynchronize(), what, "cudaDeviceSynchronize");
    }
  } catch (...) {
    cleanup();
    throw;
  }
  bootstrap.barrier("mapped");

  std::vector<void*> peers(world_size_);
  for (int r = 0; r < world_size_; ++r) peers[r] = reinterpret_cast<void*>(ptrs[r]);
  auto release = [ptrs, rounded] {
    const auto& d = cuda::driver();
    for (CUdeviceptr p : ptrs) {
      d.cuMemUnmap(p, rounded);
      d.cuMemAddressFree(p, rounded);
    }
  };
  return std::make_shared<SymmetricBuffer>(std::move(peers), rank_, rounded, sequence, std::move(release));
}

}  // namespace commlib
