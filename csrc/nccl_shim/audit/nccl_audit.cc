// Note [nccl shim audit]
// An LD_AUDIT library that sends the loader's searches for NCCL to the shim beside it:
// `LD_AUDIT=$(python -m commlib.nccl --audit) python serve.py`. Unlike LD_PRELOAD, which maps the
// shim (and through it CUDA's libraries) into every process the program starts, shells and tools
// included, the audit library changes nothing for a process that never asks for NCCL, and a
// process that does gets the shim exactly where it would have got NCCL. A search is NCCL's when
// the name's last component is "libnccl.so.2": the bare soname (a DT_NEEDED entry) or a full path
// (torch preloads the nvidia-nccl wheel's library by path). The one search left alone is the
// shim's own, for the real NCCL it forwards to (Note [nccl shim forwarding]): the loader tells
// which object asks by the cookie it gave that object in la_objopen. The loader runs audit
// libraries in a namespace of their own before the program's libraries exist, so this file uses
// the C library alone.
#include <dlfcn.h>
#include <link.h>
#include <string.h>

namespace {

char shim_path[4096];
uintptr_t* shim_cookie = nullptr;  // the loader's cookie of the shim, once it is open

// The shim's path: lib/libnccl.so.2 in this library's own folder; empty when that does not fit.
void locate_shim() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&locate_shim), &info) == 0 || info.dli_fname == nullptr) return;
  const char* slash = strrchr(info.dli_fname, '/');
  const size_t dir = slash != nullptr ? static_cast<size_t>(slash - info.dli_fname) + 1 : 0;
  static const char kName[] = "libnccl.so.2";
  if (dir + sizeof(kName) > sizeof(shim_path)) return;
  memcpy(shim_path, info.dli_fname, dir);
  memcpy(shim_path + dir, kName, sizeof(kName));
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) unsigned int la_version(unsigned int version) {
  locate_shim();
  return version < LAV_CURRENT ? version : LAV_CURRENT;
}

__attribute__((visibility("default"))) unsigned int la_objopen(struct link_map* map, Lmid_t /*lmid*/,
                                                                 uintptr_t* cookie) {
  if (map->l_name != nullptr && shim_path[0] != '\0' && strcmp(map->l_name, shim_path) == 0) shim_cookie = cookie;
  return 0;  // no symbol bindings to audit
}

__attribute__((visibility("default"))) char* la_objsearch(const char* name, uintptr_t* cookie, unsigned int flag) {
  if (flag != LA_SER_ORIG || shim_path[0] == '\0' || (shim_cookie != nullptr && cookie == shim_cookie)) {
    return const_cast<char*>(name);
  }
  const char* slash = strrchr(name, '/');
  const char* base = slash != nullptr ? slash + 1 : name;
  if (strcmp(base, "libnccl.so.2") == 0 && strcmp(name, shim_path) != 0) return shim_path;
  return const_cast<char*>(name);
}

}  // extern "C"
