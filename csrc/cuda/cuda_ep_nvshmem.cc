// The NVSHMEM side of EPBufferGpu (Note [EP NVSHMEM protocol]): loading libcommlib_nvshmem.so and
// allocating buffers on the NVSHMEM symmetric heap.
#include "cuda/cuda_ep_nvshmem.hpp"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <mutex>
#include <vector>

#include "commlib/errors.hpp"
#include "commlib/gpu.hpp"

namespace commlib {
namespace {

struct Loaded {
  std::mutex mu;
  const nvshmem_ep::Api* api = nullptr;
  std::string path;
  std::pair<int, int> pe{-1, -1};  // (my_pe, n_pes) once attached
};

Loaded& loaded() {
  static Loaded l;
  return l;
}

// Note [NVSHMEM heap blocks]
// nvshmem_malloc and nvshmem_free are collective over every PE, but a buffer is released when the
// last reference goes away, which is not collective (Python's collector runs on each rank at its
// own time). So blocks are never freed: a released block returns to this process's pool, and a
// new buffer reuses one only when every rank proposes the same block (all_gather at creation, which
// is collective); otherwise every rank allocates a new one. Blocks are numbered in allocation
// order, which is the same on every rank (allocation is collective).
struct Block {
  void* ptr;
  size_t bytes;
  bool in_use;
};

struct Pool {
  std::mutex mu;
  std::vector<Block> blocks;
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

std::pair<int, int> ep_nvshmem_attach(const std::string& path, int device) {
  Loaded& l = loaded();
  std::lock_guard<std::mutex> lock(l.mu);
  if (l.api == nullptr) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    COMMLIB_CHECK(handle != nullptr, InvalidArgument, "EPBuffer: transport 'nvshmem': cannot load ", path, ": ",
                  dlerror());
    using Entry = const nvshmem_ep::Api* (*)();
    auto entry = reinterpret_cast<Entry>(dlsym(handle, "commlib_nvshmem_ep_api"));
    COMMLIB_CHECK(entry != nullptr, InvalidArgument, "EPBuffer: transport 'nvshmem': ", path,
                  " has no commlib_nvshmem_ep_api");
    const nvshmem_ep::Api* api = entry();
    COMMLIB_CHECK(api != nullptr && api->version == nvshmem_ep::kApiVersion, InvalidArgument,
                  "EPBuffer: transport 'nvshmem': ", path, " has entry table version ", api ? api->version : -1,
                  "; this build expects ", nvshmem_ep::kApiVersion, " (rebuild commlib)");
    l.api = api;
    l.path = path;
  }
  if (l.pe.first >= 0) return l.pe;  // the kernels' device state is registered once per process
  int my_pe = -1, n_pes = -1;
  char message[512] = {};
  COMMLIB_CHECK(l.api->attach(device, &my_pe, &n_pes, message, sizeof(message)) == 0, InvalidArgument,
                "EPBuffer: transport 'nvshmem': ", message);
  l.pe = {my_pe, n_pes};
  return l.pe;
}

const nvshmem_ep::Api& ep_nvshmem_api(const char* what) {
  Loaded& l = loaded();
  std::lock_guard<std::mutex> lock(l.mu);
  COMMLIB_CHECK(l.api != nullptr, InvalidArgument, what,
                ": transport 'nvshmem' is not attached in this process (commlib.EPBuffer attaches it; C++ callers "
                "call ep_nvshmem_attach after initialising NVSHMEM)");
  return *l.api;
}

std::shared_ptr<void> ep_nvshmem_allocate(Communicator& comm, size_t bytes, const char* what) {
  const nvshmem_ep::Api& api = ep_nvshmem_api(what);
  Pool& p = pool();
  int32_t mine = -1;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    for (size_t i = 0; i < p.blocks.size(); ++i) {
      if (!p.blocks[i].in_use && p.blocks[i].bytes >= bytes) {
        mine = static_cast<int32_t>(i);
        break;
      }
    }
  }
  std::vector<int32_t> all(comm.world_size());
  comm.control_all_gather(all.data(), &mine, sizeof(mine));  // collective
  bool same = mine >= 0;
  for (int32_t id : all) same = same && id == mine;
  std::lock_guard<std::mutex> lock(p.mu);
  size_t index = 0;
  if (same) {
    index = static_cast<size_t>(mine);
  } else {
    void* ptr = api.malloc(bytes);  // collective over every PE
    COMMLIB_CHECK(ptr != nullptr, InvalidArgument, what, ": nvshmem_malloc of ", bytes,
                  " bytes failed (raise NVSHMEM_SYMMETRIC_SIZE, or use a smaller buffer)");
    p.blocks.push_back({ptr, bytes, false});
    index = p.blocks.size() - 1;
  }
  p.blocks[index].in_use = true;
  return std::shared_ptr<void>(p.blocks[index].ptr, [index](void*) {
    Pool& q = pool();
    std::lock_guard<std::mutex> lock(q.mu);
    q.blocks[index].in_use = false;
  });
}

}  // namespace commlib
