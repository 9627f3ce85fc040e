// Finding and loading the real NCCL (Note [nccl shim forwarding] in nccl_shim/shim.hpp), and
// ncclGetVersion, which reports it.
#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "commlib/env.hpp"
#include "nccl_shim/shim.hpp"

#ifndef COMMLIB_NCCL_REAL_DEFAULT
#define COMMLIB_NCCL_REAL_DEFAULT ""
#endif

namespace commlib::nccl_shim {
namespace {

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// This library's own file.
std::string self_path() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&self_path), &info) == 0 || info.dli_fname == nullptr) return {};
  return info.dli_fname;
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// The directory of the loaded libtorch_cuda.so (torch/lib), if torch is loaded.
std::string torch_lib_directory() {
  std::string found;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        static const std::string kTorchCuda = "/libtorch_cuda.so";
        const std::string name = info->dlpi_name ? info->dlpi_name : "";
        if (name.size() > kTorchCuda.size() &&
            name.compare(name.size() - kTorchCuda.size(), kTorchCuda.size(), kTorchCuda) == 0) {
          *static_cast<std::string*>(out) = directory_of(name);
          return 1;
        }
        return 0;
      },
      &found);
  return found;
}

// Where the real NCCL may be, in order (Note [nccl shim forwarding]).
std::vector<std::string> candidates(const std::string& self) {
  const std::string chosen = env::get("COMMLIB_NCCL_REAL");
  if (!chosen.empty()) return {chosen};
  std::vector<std::string> paths;
  const std::string torch_lib = torch_lib_directory();
  if (!torch_lib.empty()) paths.push_back(torch_lib + "/../../nvidia/nccl/lib/libnccl.so.2");
  // Installed: <site-packages>/commlib/lib/libnccl.so.2 beside <site-packages>/nvidia/nccl.
  if (!self.empty()) paths.push_back(directory_of(self) + "/../../nvidia/nccl/lib/libnccl.so.2");
  if (std::strlen(COMMLIB_NCCL_REAL_DEFAULT) > 0) paths.push_back(COMMLIB_NCCL_REAL_DEFAULT);
  return paths;
}

RealNccl load() {
  RealNccl real;
  const std::string self = self_path();
  std::string tried;
  for (const std::string& path : candidates(self)) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      tried += "; " + path + " (no such file)";
      continue;
    }
    if (!self.empty() && same_file(path, self)) {
      tried += "; " + path + " (the shim itself)";
      continue;
    }
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (handle == nullptr) {
      const char* why = ::dlerror();
      tried += "; " + path + " (" + (why ? why : "dlopen failed") + ")";
      continue;
    }
    using GetVersion = ncclResult_t (*)(int*);
    auto get_version = reinterpret_cast<GetVersion>(::dlsym(handle, "ncclGetVersion"));
    if (get_version == nullptr || get_version(&real.version) != ncclSuccess) {
      tried += "; " + path + " (no working ncclGetVersion: not an NCCL)";
      ::dlclose(handle);
      continue;
    }
    real.handle = handle;
    char resolved[PATH_MAX] = {};
    real.path = ::realpath(path.c_str(), resolved) != nullptr ? resolved : path;
    return real;
  }
  real.error = tried.empty() ? "no candidate path (set COMMLIB_NCCL_REAL)" : "tried " + tried.substr(2);
  return real;
}

}  // namespace

const RealNccl& real_nccl() {
  static const RealNccl real = load();
  return real;
}

void* symbol(const char* name) {
  const RealNccl& real = real_nccl();
  return real.handle == nullptr ? nullptr : ::dlsym(real.handle, name);
}

ncclResult_t missing(const char* name) {
  const RealNccl& real = real_nccl();
  if (real.handle == nullptr) {
    return fail(ncclSystemError, std::string(name) + ": this call needs the real NCCL, which did not load: " + real.error);
  }
  return fail(ncclSystemError, std::string(name) + ": the real NCCL (" + real.path + ") has no such function");
}

namespace {

ncclResult_t get_version(const char* what, int* version) {
  if (version == nullptr) return fail(ncclInvalidArgument, std::string(what) + ": version is NULL");
  const RealNccl& real = real_nccl();
  // Without a real NCCL the shim still answers, with the version of the header it implements.
  *version = real.handle != nullptr ? real.version : NCCL_VERSION_CODE;
  return ncclSuccess;
}

}  // namespace
}  // namespace commlib::nccl_shim

NCCL_SHIM_API ncclResult_t ncclGetVersion(int* version) {
  return commlib::nccl_shim::get_version("ncclGetVersion", version);
}
NCCL_SHIM_API ncclResult_t pncclGetVersion(int* version) {
  return commlib::nccl_shim::get_version("pncclGetVersion", version);
}
