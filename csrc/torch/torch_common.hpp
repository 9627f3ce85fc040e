// Shared by the torch layer: dtype mapping, tensor argument checks, the c10d Store adapter.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

#include "commlib/communicator.hpp"
#include "commlib/errors.hpp"
#include "commlib/store.hpp"
#include "commlib/types.hpp"
#include "core/plan.hpp"

namespace commlib::torch_layer {

// torch-style name of a dtype ("bfloat16", "int8").
std::string dtype_str(at::ScalarType type);
// Maps a torch dtype; throws TypeMismatch naming `what` for one commlib has no type for.
DataType to_data_type(at::ScalarType type, const char* what);
// Reducible dtypes only (float32, float16, bfloat16).
DataType reducible_type(const at::Tensor& t, const char* what);

void check_cpu_or_cuda(const at::Tensor& t, const char* what, const char* arg);
void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what);
void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* what);
// `whole` (reduce_scatter's input, all_gather's output) must hold world_size x `part`'s elements;
// InvalidArgument naming `what` and both arguments otherwise.
void check_world_multiple(const char* what, const char* whole_name, const at::Tensor& whole, const char* part_name,
                          const at::Tensor& part, int world_size);

// Note [bool bytes]
// A bool sum keeps the sum of the bytes (2 where two trues met), as gloo's and NCCL's do, and
// commlib's reductions give those bytes on every path. torch's bool copies (copy_, contiguous,
// clone, index_copy_) turn each nonzero byte into 1, so the torch layer moves a bool tensor's
// results, and the inputs it stages, as their bytes: a strided or staged path then gives the bytes
// of the contiguous one.

// A bool tensor as its bytes (uint8, same strides), any other as it is (Note [bool bytes]).
inline at::Tensor bytes_of(const at::Tensor& t) { return t.scalar_type() == at::kBool ? t.view(at::kByte) : t; }
// dst.copy_(src) that keeps a bool tensor's bytes (Note [bool bytes]).
inline void copy_bits(const at::Tensor& dst, const at::Tensor& src) { bytes_of(dst).copy_(bytes_of(src)); }
// t.contiguous() that keeps a bool tensor's bytes (Note [bool bytes]).
inline at::Tensor contiguous_bits(const at::Tensor& t) {
  return t.is_contiguous() || t.scalar_type() != at::kBool ? t.contiguous() : bytes_of(t).contiguous().view(at::kBool);
}

// Runs `body` on a contiguous view of `t` and copies back when `t` was not contiguous.
template <typename F>
void with_contiguous(at::Tensor& t, F&& body) {
  if (t.is_contiguous()) {
    body(t);
    return;
  }
  at::Tensor work = contiguous_bits(t);
  body(work);
  copy_bits(t, work);
}

// The commlib.errors class of a communication error: CommTimeoutError, PeerError or CommError.
inline const char* error_class_name(const Error& e) {
  if (dynamic_cast<const Timeout*>(&e) != nullptr) return "CommTimeoutError";
  if (dynamic_cast<const PeerError*>(&e) != nullptr) return "PeerError";
  return "CommError";
}

// error_class_name of the last error that translate_errors turned into DistBackendError on this
// thread (the dispatcher knows only torch's classes): commlib's Python wrappers of torch.ops.commlib
// ops re-raise it as that commlib.errors class (`_C.last_error_class`).
inline thread_local const char* last_error_class = "CommError";

// Runs `body`, turning commlib's typed errors into torch's (one error currency per layer):
// InvalidArgument -> ValueError, TypeMismatch -> TypeError, other commlib errors ->
// DistBackendError. For code reached through the c10d backend or the torch dispatcher.
template <typename F>
void translate_errors(F&& body) {
  try {
    body();
  } catch (const InvalidArgument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const TypeMismatch& e) {
    TORCH_CHECK_TYPE(false, e.what());
  } catch (const Error& e) {
    last_error_class = error_class_name(e);
    C10_THROW_ERROR(DistBackendError, e.what());
  }
}

class TorchStore final : public Store {
 public:
  explicit TorchStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override { store_->set(key, value); }
  std::vector<uint8_t> get(const std::string& key) override { return store_->get(key); }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  bool check(const std::string& key) override { return store_->check({key}); }
  void erase(const std::string& key) override { store_->deleteKey(key); }
  const c10::intrusive_ptr<c10d::Store>& torch_store() const { return store_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// ---- tensor-level collectives shared by the Python API and the c10d backend ----
void all_reduce(Communicator& comm, at::Tensor& t, ReduceOp op, Algorithm algo);
// Out of place: `out` (same shape, dtype and device as `in`, contiguous) receives the reduction and
// `in` is left as it was. `out` may be `in` itself (in place); a partial overlap raises ValueError.
void all_reduce_out(Communicator& comm, at::Tensor& out, const at::Tensor& in, ReduceOp op, Algorithm algo);
void reduce_scatter(Communicator& comm, at::Tensor& out, const at::Tensor& in, ReduceOp op);
void all_gather(Communicator& comm, at::Tensor& out, const at::Tensor& in);
void broadcast(Communicator& comm, at::Tensor& t, int src);
// Records the plan of a CPU exchange op (one variant, host_exchange; Note [plan]) for the counters
// and COMMLIB_LOG_PLAN: the CPU paths above call it, and the backend's own CPU reduce_scatter.
void record_host_exchange(Communicator& comm, CollectiveOp op, size_t message_bytes, const at::Tensor& t);
void all_to_all(Communicator& comm, at::Tensor& out, const at::Tensor& in);
// Splits are counts along dim 0 (host lists); empty lists mean equal splits.
void all_to_all_v(Communicator& comm, at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits);

#if defined(COMMLIB_TORCH_CUDA)
// GPU implementations (csrc/torch/cuda_ops.cpp), on the current stream of the tensor's device.
void all_reduce_cuda(Communicator& comm, at::Tensor& t, ReduceOp op, Algorithm algo);
// The same running the caller's plan (the torch backend's, Note [plan]); `t` contiguous.
void all_reduce_cuda(Communicator& comm, at::Tensor& t, ReduceOp op, const Plan& plan);
// `out` and `in` on one CUDA device, sizes as the CPU versions above require.
void reduce_scatter_cuda(Communicator& comm, at::Tensor& out, const at::Tensor& in, ReduceOp op);
void all_gather_cuda(Communicator& comm, at::Tensor& out, const at::Tensor& in);
void broadcast_cuda(Communicator& comm, at::Tensor& t, int src);
// Equal splits along dim 0 (in and out of the same size).
void all_to_all_cuda(Communicator& comm, at::Tensor& out, const at::Tensor& in);
// csrc/torch/ep_cuda_ops.cpp: splits are int64 [world] tensors on the device (undefined: equal).
void all_to_all_v_cuda(Communicator& comm, at::Tensor& out, const at::Tensor& in, const at::Tensor& in_splits,
                       const at::Tensor& out_splits);
#endif

}  // namespace commlib::torch_layer
