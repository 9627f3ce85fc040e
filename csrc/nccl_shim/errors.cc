// The shim's errors: ncclGetErrorString, ncclGetLastError and the last-error record behind them.
#include <string>

#include "nccl_shim/shim.hpp"

namespace commlib::nccl_shim {
namespace {

// NCCL keeps one last error per process, shared by every thread; so does the shim (a copy per
// thread is handed out, so a reader never sees the text change under it).
std::mutex last_error_mutex;
std::string last_error_text;
bool last_error_is_real = false;  // the real NCCL's own ncclGetLastError has it
thread_local std::string last_error_copy;

// ncclTimeout (8) is in nccl.h from NCCL 2.29 on; older headers end the enum with ncclNumResults = 8.
constexpr ncclResult_t kTimeout = static_cast<ncclResult_t>(8);

const char* result_name(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case kTimeout: return "timeout";
    default: return "unknown result code";
  }
}

const char* error_string(const char* name, ncclResult_t result) {
  // The real NCCL's words when it is there (programs match on them), the same words otherwise.
  using Fn = const char* (*)(ncclResult_t);
  if (auto fn = reinterpret_cast<Fn>(symbol(name))) return fn(result);
  return result_name(result);
}

}  // namespace

ncclResult_t fail(ncclResult_t code, const std::string& message) {
  std::lock_guard<std::mutex> lock(last_error_mutex);
  last_error_text = message;
  last_error_is_real = false;
  return code;
}

ncclResult_t forwarded(ncclResult_t result) {
  if (result != ncclSuccess && result != ncclInProgress) {
    std::lock_guard<std::mutex> lock(last_error_mutex);
    last_error_is_real = true;
  }
  return result;
}

const char* last_error(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(last_error_mutex);
  if (last_error_is_real) {
    ncclComm_t real = comm != nullptr && comm->magic == kCommMagic ? comm->real.load() : nullptr;
    const char* text = real::ncclGetLastError(real);
    last_error_copy = text != nullptr ? text : "";
  } else {
    last_error_copy = last_error_text;
  }
  return last_error_copy.c_str();
}

}  // namespace commlib::nccl_shim

NCCL_SHIM_API const char* ncclGetErrorString(ncclResult_t result) {
  return commlib::nccl_shim::error_string("ncclGetErrorString", result);
}
NCCL_SHIM_API const char* pncclGetErrorString(ncclResult_t result) {
  return commlib::nccl_shim::error_string("pncclGetErrorString", result);
}
NCCL_SHIM_API const char* ncclGetLastError(ncclComm_t comm) { return commlib::nccl_shim::last_error(comm); }
NCCL_SHIM_API const char* pncclGetLastError(ncclComm_t comm) { return commlib::nccl_shim::last_error(comm); }
