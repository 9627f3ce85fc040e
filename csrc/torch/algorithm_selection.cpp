// commlib._C.select_all_reduce_algorithm / all_reduce_limits / collective_max_bytes / tuned_fused_num_sms /
// select_host_all_reduce_algorithm: the pure choices of csrc/core/algorithm_selector.hpp, for
// commlib-tune, the Python API and tests. No GPU needed.
#include <torch/csrc/utils/pybind.h>

#include "core/algorithm_selector.hpp"
#include "torch/bindings.hpp"
#include "torch/torch_common.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

DataType reducible(at::ScalarType type, const char* what) {
  COMMLIB_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16, TypeMismatch, what, ": dtype ",
                dtype_str(type), " not supported; supported: float32, float16, bfloat16");
  return to_data_type(type, what);
}

BindingRegistrar reg("algorithm_selection", [](py::module_& m) {
  m.def(
      "select_all_reduce_algorithm",
      [](int64_t bytes, int world_size, at::ScalarType dtype) {
        const char* what = "select_all_reduce_algorithm";
        COMMLIB_CHECK(bytes >= 0, InvalidArgument, what, ": bytes ", bytes, " must be >= 0");
        return std::string(
            algorithm_name(select_all_reduce_algorithm(static_cast<size_t>(bytes), world_size, reducible(dtype, what))));
      },
      py::arg("bytes"), py::arg("world_size"), py::arg("dtype"),
      "The GPU all-reduce algorithm ('flat', 'tree' or 'nccl') for a message of `bytes` bytes; honours "
      "COMMLIB_ALLREDUCE_ALGO, COMMLIB_FLAT_MAX_BYTES, COMMLIB_TREE_MAX_BYTES and COMMLIB_TUNE_FILE.");
  m.def(
      "all_reduce_limits",
      [](int world_size, at::ScalarType dtype) {
        const AllReduceLimits limits = all_reduce_limits(world_size, reducible(dtype, "all_reduce_limits"));
        return std::make_pair(limits.flat_max_bytes, limits.tree_max_bytes);
      },
      py::arg("world_size"), py::arg("dtype"),
      "(flat_max_bytes, tree_max_bytes) that apply to (world_size, dtype) after overrides.");
  m.def(
      "collective_max_bytes",
      [](const std::string& op, int world_size) {
        const char* what = "collective_max_bytes";
        COMMLIB_CHECK(world_size >= 1, InvalidArgument, what, ": world_size ", world_size, " must be >= 1");
        const CollectiveConfig config(world_size);
        for (int i = 0; i < kNumCollectiveOps; ++i) {
          if (op == collective_op_name(static_cast<CollectiveOp>(i))) return config.max_bytes[i];
        }
        throw InvalidArgument(detail::concat(what, ": op '", op,
                                             "' not known; known: reduce_scatter, all_gather, broadcast, all_to_all"));
      },
      py::arg("op"), py::arg("world_size"),
      "The largest message (bytes) of a CUDA reduce_scatter / all_gather / broadcast / all_to_all that the "
      "torch backend gives to commlib's kernel at world_size (larger: NCCL); honours COMMLIB_<OP>_MAX_BYTES "
      "and COMMLIB_TUNE_FILE (Note [collective crossovers]).");
  m.def(
      "tuned_fused_num_sms",
      [](int world_size) {
        COMMLIB_CHECK(world_size >= 1, InvalidArgument, "tuned_fused_num_sms: world_size ", world_size,
                      " must be >= 1");
        return tuned_fused_num_sms(world_size);
      },
      py::arg("world_size"),
      "commlib-tune's CTA count for the fused all-reduce + RMSNorm GPU kernel at world_size (the tune "
      "file's fused_num_sms entries, COMMLIB_TUNE_FILE), 0 when none: the by-size cap used when num_sms is "
      "None and COMMLIB_FUSED_NUM_SMS is 0.");
  m.def(
      "select_host_all_reduce_algorithm",
      [](int64_t bytes, int world_size) {
        const char* what = "select_host_all_reduce_algorithm";
        COMMLIB_CHECK(bytes >= 0 && world_size >= 1, InvalidArgument, what, ": need bytes >= 0 and world_size >= 1; got ",
                      bytes, ", ", world_size);
        return std::string(algorithm_name(resolve_host_all_reduce(world_size).select(static_cast<size_t>(bytes))));
      },
      py::arg("bytes"), py::arg("world_size"),
      "The CPU all-reduce algorithm ('flat' or 'tree') that algo='auto' runs for a message of `bytes` bytes: "
      "COMMLIB_HOST_TREE_THRESHOLD when set, else the tune file's host_all_reduce entry, else the built-in "
      "threshold. A communicator resolves it once, when it first needs it.");
});

}  // namespace
}  // namespace commlib::torch_layer
