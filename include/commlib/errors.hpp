// Error currency of commlib.
//
// Kernel launchers and transports return a Status; the core throws the typed errors below, and
// the Python bindings map them: InvalidArgument -> ValueError, TypeMismatch -> TypeError,
// Timeout -> commlib.TimeoutError, PeerError / CudaError / Error -> commlib.CommError
// (all of the last three derive from torch.distributed.DistBackendError on the Python side).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace commlib {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,
  kUnsupported = 2,
  kCudaError = 3,
  kTimeout = 4,
  kInternal = 5,
  kTypeMismatch = 6,  // a dtype or device the operation does not support
};

// Returned by launchers (csrc/kernels) and transports: cheap, no exceptions on the hot path.
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }
  bool is_ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A bad argument value (size, shape, op, algorithm).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};
// A bad argument type (dtype, device).
class TypeMismatch : public Error {
 public:
  using Error::Error;
};
// A CUDA runtime or driver call failed.
class CudaError : public Error {
 public:
  using Error::Error;
};
// A bounded wait expired: the message names the rank, the peer and the phase.
class Timeout : public Error {
 public:
  using Error::Error;
};
// A peer disagreed (world size, allocation order) or went away.
class PeerError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Throws the Status as the matching typed error (kOk does nothing).
void throw_if_error(const Status& status);

// The point-to-point peer check of every engine: InvalidArgument "<what>: <arg> <peer> out of range;
// valid: 0..world_size - 1 except this rank (<rank>)" unless `peer` is another rank of the group.
void check_peer_rank(const char* what, const char* arg, int peer, int world_size, int rank);

}  // namespace commlib

// COMMLIB_CHECK(cond, ErrorType, message parts...): throws ErrorType(concat(parts)) unless cond.
#define COMMLIB_CHECK(cond, ErrorType, ...)                                  \
  do {                                                                       \
    if (!(cond)) throw ::commlib::ErrorType(::commlib::detail::concat(__VA_ARGS__)); \
  } while (0)
