// torch.ops.commlib: every commlib operation as a dispatcher op (docs/ops.md), so torch.compile
// traces it into a graph and CUDA graph capture records it like any other op.
//
// Note [commlib op conventions]
// - ATen naming: `all_reduce` returns a new tensor, `all_reduce_` mutates its input, and
//   `all_reduce_out` writes a keyword-only `out`; the schemas mark the written argument
//   (`Tensor(a!)`), so torch.compile functionalises them (auto_functionalize) and inductor
//   re-inplaces them. The mutating forms return nothing, unlike ATen's: inductor does not know
//   that a custom op's returned tensor aliases its mutated argument, and would reuse that buffer
//   while the alias is still read (seen in torch 2.14). The Python methods return the tensor.
// - The group is a string naming a live communicator of this process (ops.hpp), as in torch's
//   symmetric-memory ops; EP ops name an EPBuffer the same way.
// - Each op has a Meta kernel (shapes and dtypes only; the EP ones read the named buffer's
//   fixed shapes) and is tagged pt2_compliant. The CPU and CUDA kernels are the same function:
//   the torch-layer collective picks the device path.
// - ep_dispatch returns views of the buffer's registered tensors (no copy), valid until the next
//   ep_dispatch on that buffer, exactly as EPBuffer.dispatch.
#include "torch/ops.hpp"

#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "commlib/fused_rmsnorm.hpp"
#include "torch/bindings.hpp"
#include "torch/fused_ops.hpp"
#include "torch/torch_common.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

struct NameRegistry {
  std::mutex mutex;
  std::unordered_map<std::string, std::weak_ptr<Communicator>> groups;
  std::unordered_map<std::string, std::weak_ptr<EPBufferTorch>> ep_buffers;
};

NameRegistry& registry() {
  static NameRegistry* r = new NameRegistry;  // never destroyed: ops may run at exit
  return *r;
}

std::shared_ptr<Communicator> live(const std::weak_ptr<Communicator>& weak) {
  std::shared_ptr<Communicator> comm = weak.lock();
  return comm != nullptr && !comm->closed() ? comm : nullptr;
}

template <typename Map, typename Alive>
std::string names_of(const Map& map, Alive alive) {
  std::vector<std::string> names;
  for (const auto& [name, weak] : map) {
    if (alive(weak)) names.push_back("'" + name + "'");
  }
  std::sort(names.begin(), names.end());
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

}  // namespace

void register_group(const std::string& name, const std::shared_ptr<Communicator>& comm, NameClash clash) {
  NameRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.groups.find(name);
  if (it != reg.groups.end() && clash == NameClash::kRaise) {
    std::shared_ptr<Communicator> other = live(it->second);
    if (other == comm) return;
    COMMLIB_CHECK(other == nullptr, InvalidArgument, "Communicator: name '", name,
                  "' already names an open communicator in this process (names key torch.ops.commlib ops); "
                  "close it first or pass another name");
  }
  reg.groups[name] = comm;
}

void unregister_group(const std::string& name, const Communicator* comm) {
  NameRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.groups.find(name);
  if (it == reg.groups.end()) return;
  std::shared_ptr<Communicator> current = it->second.lock();
  if (current == nullptr || current.get() == comm) reg.groups.erase(it);
}

std::shared_ptr<Communicator> communicator_from_group(const std::string& name, const char* what) {
  NameRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.groups.find(name);
  std::shared_ptr<Communicator> comm = it == reg.groups.end() ? nullptr : live(it->second);
  COMMLIB_CHECK(comm != nullptr, InvalidArgument, what, ": group_name '", name,
                "' names no open communicator in this process; open: ",
                names_of(reg.groups, [](const auto& w) { return live(w) != nullptr; }),
                " (a commlib.Communicator is named by its name; a \"ddacomm\" process group's by "
                "'ddacomm-<group name>')");
  return comm;
}

void register_ep_buffer(const std::string& name, const std::shared_ptr<EPBufferTorch>& buffer) {
  NameRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.ep_buffers.find(name);
  if (it != reg.ep_buffers.end()) {
    std::shared_ptr<EPBufferTorch> other = it->second.lock();
    if (other == buffer) return;
    COMMLIB_CHECK(other == nullptr, InvalidArgument, "EPBuffer: name '", name,
                  "' already names a live EP buffer in this process; pass another name");
  }
  reg.ep_buffers[name] = buffer;
}

void unregister_ep_buffer(const std::string& name, const EPBufferTorch* buffer) {
  NameRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.ep_buffers.find(name);
  if (it == reg.ep_buffers.end()) return;
  std::shared_ptr<EPBufferTorch> current = it->second.lock();
  if (current == nullptr || current.get() == buffer) reg.ep_buffers.erase(it);
}

std::shared_ptr<EPBufferTorch> ep_buffer_from_name(const std::string& name, const char* what) {
  NameRegistry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.ep_buffers.find(name);
  std::shared_ptr<EPBufferTorch> buffer = it == reg.ep_buffers.end() ? nullptr : it->second.lock();
  COMMLIB_CHECK(buffer != nullptr, InvalidArgument, what, ": buffer_name '", name,
                "' names no live EP buffer in this process; live: ",
                names_of(reg.ep_buffers, [](const auto& w) { return !w.expired(); }), " (see EPBuffer.name)");
  return buffer;
}

namespace {

std::string str(c10::string_view s) { return std::string(s.data(), s.size()); }

template <typename F>
auto translated(F&& body) -> decltype(body()) {
  decltype(body()) result;
  translate_errors([&] { result = body(); });
  return result;
}

// ---- all_reduce ----

at::Tensor all_reduce_op(const at::Tensor& input, c10::string_view reduce_op, c10::string_view group_name,
                         c10::string_view algo) {
  return translated([&] {
    const ReduceOp op = parse_reduce_op("all_reduce", str(reduce_op));
    const Algorithm alg = parse_algorithm("all_reduce", str(algo));
    std::shared_ptr<Communicator> comm = communicator_from_group(str(group_name), "all_reduce");
    at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
    all_reduce_out(*comm, out, input, op, alg);
    return out;
  });
}

void all_reduce_inplace_op(at::Tensor& input, c10::string_view reduce_op, c10::string_view group_name,
                           c10::string_view algo) {
  translate_errors([&] {
    const ReduceOp op = parse_reduce_op("all_reduce_", str(reduce_op));
    const Algorithm alg = parse_algorithm("all_reduce_", str(algo));
    std::shared_ptr<Communicator> comm = communicator_from_group(str(group_name), "all_reduce_");
    all_reduce(*comm, input, op, alg);
  });
}

void all_reduce_out_op(const at::Tensor& input, c10::string_view reduce_op, c10::string_view group_name,
                       c10::string_view algo, at::Tensor& out) {
  translate_errors([&] {
    const ReduceOp op = parse_reduce_op("all_reduce_out", str(reduce_op));
    const Algorithm alg = parse_algorithm("all_reduce_out", str(algo));
    std::shared_ptr<Communicator> comm = communicator_from_group(str(group_name), "all_reduce_out");
    all_reduce_out(*comm, out, input, op, alg);
  });
}

at::Tensor all_reduce_meta(const at::Tensor& input, c10::string_view, c10::string_view, c10::string_view) {
  return at::empty_like(input, at::MemoryFormat::Contiguous);
}

void all_reduce_inplace_meta(at::Tensor&, c10::string_view, c10::string_view, c10::string_view) {}

void all_reduce_out_meta(const at::Tensor& input, c10::string_view, c10::string_view, c10::string_view,
                         at::Tensor& out) {
  TORCH_CHECK_VALUE(out.sym_sizes() == input.sym_sizes() && out.scalar_type() == input.scalar_type(),
                    "all_reduce_out: out must have input's shape and dtype; got ", out.sym_sizes(), " ",
                    out.scalar_type(), " for input ", input.sym_sizes(), " ", input.scalar_type());
}

// ---- reduce_scatter / all_gather / broadcast (out and in-place forms only, like the Python API) ----

void reduce_scatter_out_op(const at::Tensor& input, c10::string_view reduce_op, c10::string_view group_name,
                           at::Tensor& out) {
  translate_errors([&] {
    const ReduceOp op = parse_reduce_op("reduce_scatter_out", str(reduce_op));
    std::shared_ptr<Communicator> comm = communicator_from_group(str(group_name), "reduce_scatter_out");
    reduce_scatter(*comm, out, input, op);
  });
}

void all_gather_out_op(const at::Tensor& input, c10::string_view group_name, at::Tensor& out) {
  translate_errors([&] {
    std::shared_ptr<Communicator> comm = communicator_from_group(str(group_name), "all_gather_out");
    all_gather(*comm, out, input);
  });
}

void broadcast_inplace_op(at::Tensor& tensor, int64_t src, c10::string_view group_name) {
  translate_errors([&] {
    std::shared_ptr<Communicator> comm = communicator_from_group(str(group_name), "broadcast_");
    broadcast(*comm, tensor, static_cast<int>(src));
  });
}

void reduce_scatter_out_meta(const at::Tensor& input, c10::string_view, c10::string_view, at::Tensor& out) {
  TORCH_CHECK_VALUE(out.scalar_type() == input.scalar_type(), "reduce_scatter_out: out must have input's dtype");
}

void all_gather_out_meta(const at::Tensor& input, c10::string_view, at::Tensor& out) {
  TORCH_CHECK_VALUE(out.scalar_type() == input.scalar_type(), "all_gather_out: out must have input's dtype");
}

void broadcast_inplace_meta(at::Tensor&, int64_t, c10::string_view) {}

// ---- all_to_all_v ----

std::vector<int64_t> to_vector(at::IntArrayRef a) { return std::vector<int64_t>(a.begin(), a.end()); }

at::Tensor all_to_all_v_op(const at::Tensor& input, at::IntArrayRef output_split_sizes,
                           at::IntArrayRef input_split_sizes, c10::string_view group_name) {
  return translated([&] {
    std::shared_ptr<Communicator> comm = communicator_from_group(str(group_name), "all_to_all_v");
    std::vector<int64_t> shape = input.sizes().vec();
    COMMLIB_CHECK(!shape.empty(), InvalidArgument, "all_to_all_v: input must have at least one dimension; got 0-D");
    if (!output_split_sizes.empty()) {
      int64_t rows = 0;
      for (int64_t s : output_split_sizes) rows += s;
      shape[0] = rows;
    }
    at::Tensor out = at::empty(shape, input.options());
    all_to_all_v(*comm, out, input, to_vector(output_split_sizes), to_vector(input_split_sizes));
    return out;
  });
}

void all_to_all_v_out_op(const at::Tensor& input, at::IntArrayRef output_split_sizes, at::IntArrayRef input_split_sizes,
                         c10::string_view group_name, at::Tensor& out) {
  translate_errors([&] {
    std::shared_ptr<Communicator> comm = communicator_from_group(str(group_name), "all_to_all_v_out");
    all_to_all_v(*comm, out, input, to_vector(output_split_sizes), to_vector(input_split_sizes));
  });
}

at::Tensor all_to_all_v_meta(const at::Tensor& input, c10::SymIntArrayRef output_split_sizes, c10::SymIntArrayRef,
                             c10::string_view) {
  TORCH_CHECK_VALUE(input.dim() >= 1, "all_to_all_v: input must have at least one dimension; got 0-D");
  std::vector<c10::SymInt> shape = input.sym_sizes().vec();
  if (!output_split_sizes.empty()) {
    c10::SymInt rows = 0;
    for (const c10::SymInt& s : output_split_sizes) rows = rows + s;
    shape[0] = rows;
  }
  return at::empty_symint(shape, input.options());
}

void all_to_all_v_out_meta(const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef, c10::string_view,
                           at::Tensor&) {}

// ---- expert-parallel dispatch / combine ----

std::tuple<at::Tensor, at::Tensor> ep_dispatch_op(const at::Tensor& x, const at::Tensor& topk_idx,
                                                  const at::Tensor& topk_weights, c10::string_view buffer_name) {
  std::pair<at::Tensor, at::Tensor> result;
  translate_errors([&] {
    std::shared_ptr<EPBufferTorch> buffer = ep_buffer_from_name(str(buffer_name), "ep_dispatch");
    COMMLIB_CHECK(topk_weights.is_floating_point(), TypeMismatch, "ep_dispatch: topk_weights has dtype ",
                  dtype_str(topk_weights.scalar_type()), "; supported: floating");
    const at::Tensor idx = topk_idx.scalar_type() == at::kInt ? topk_idx.to(at::kLong) : topk_idx;
    result = buffer->dispatch(x, idx, topk_weights.to(at::kFloat), EPPhase::kBoth);
  });
  return {result.first, result.second};
}

at::Tensor ep_combine_op(const at::Tensor& expert_out, const at::Tensor& topk_idx, c10::string_view buffer_name) {
  return translated([&] {
    std::shared_ptr<EPBufferTorch> buffer = ep_buffer_from_name(str(buffer_name), "ep_combine");
    COMMLIB_CHECK(topk_idx.dim() == 2, InvalidArgument, "ep_combine: topk_idx must be dispatch's [num_tokens, topk]; got ",
                  topk_idx.sizes());
    return buffer->combine(expert_out, topk_idx.size(0), at::Tensor(), EPPhase::kBoth);
  });
}

std::tuple<at::Tensor, at::Tensor> ep_dispatch_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                                    c10::string_view buffer_name) {
  std::shared_ptr<EPBufferTorch> buffer;
  translate_errors([&] { buffer = ep_buffer_from_name(str(buffer_name), "ep_dispatch"); });
  const EPTensors& t = buffer->tensors();
  return {at::empty(t.expert_x.sizes(), x.options().dtype(t.expert_x.scalar_type())),
          at::empty(t.expert_counts.sizes(), x.options().dtype(at::kInt))};
}

at::Tensor ep_combine_meta(const at::Tensor& expert_out, const at::Tensor& topk_idx, c10::string_view) {
  TORCH_CHECK_VALUE(topk_idx.dim() == 2 && expert_out.dim() == 3,
                    "ep_combine: expects expert_out [L, capacity, hidden] and topk_idx [num_tokens, topk]");
  return at::empty_symint({topk_idx.sym_size(0), expert_out.sym_size(2)}, expert_out.options());
}

// ---- fused all-reduce + residual add + RMSNorm ----

void fused_into(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                c10::string_view group_name, c10::string_view residual_mode, int64_t num_sms, c10::string_view algo,
                at::Tensor& out) {
  translate_errors([&] {
    const FusedAlgo parsed_algo = parse_fused_algo(str(algo));
    const ResidualMode mode = parse_residual_mode(str(residual_mode));
    std::shared_ptr<Communicator> comm = communicator_from_group(str(group_name), "fused_allreduce_rmsnorm");
    fused_allreduce_rmsnorm(*comm, x, residual, weight, eps, out, mode, num_sms, parsed_algo);
  });
}

at::Tensor fused_op(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                    c10::string_view group_name, c10::string_view residual_mode, int64_t num_sms,
                    c10::string_view algo) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  fused_into(x, residual, weight, eps, group_name, residual_mode, num_sms, algo, out);
  return out;
}

void fused_out_op(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                  c10::string_view group_name, c10::string_view residual_mode, int64_t num_sms, c10::string_view algo,
                  at::Tensor& out) {
  fused_into(x, residual, weight, eps, group_name, residual_mode, num_sms, algo, out);
}

at::Tensor fused_meta(const at::Tensor& x, at::Tensor&, const at::Tensor&, double, c10::string_view,
                      c10::string_view, int64_t, c10::string_view) {
  TORCH_CHECK_VALUE(x.dim() == 2, "fused_allreduce_rmsnorm: x must be 2-D [tokens, hidden]; got ", x.dim(), "-D");
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

void fused_out_meta(const at::Tensor& x, at::Tensor&, const at::Tensor&, double, c10::string_view, c10::string_view,
                    int64_t, c10::string_view, at::Tensor& out) {
  TORCH_CHECK_VALUE(x.dim() == 2 && out.sym_sizes() == x.sym_sizes(),
                    "fused_allreduce_rmsnorm_out: out must have x's shape");
}

}  // namespace
}  // namespace commlib::torch_layer

TORCH_LIBRARY(commlib, m) {
  const at::Tag pt2 = at::Tag::pt2_compliant_tag;
  m.def("all_reduce(Tensor input, str reduce_op, str group_name, str algo=\"auto\") -> Tensor", {pt2});
  m.def("all_reduce_(Tensor(a!) input, str reduce_op, str group_name, str algo=\"auto\") -> ()", {pt2});
  m.def("all_reduce_out(Tensor input, str reduce_op, str group_name, str algo=\"auto\", *, Tensor(a!) out) -> ()",
        {pt2});
  m.def("reduce_scatter_out(Tensor input, str reduce_op, str group_name, *, Tensor(a!) out) -> ()", {pt2});
  m.def("all_gather_out(Tensor input, str group_name, *, Tensor(a!) out) -> ()", {pt2});
  m.def("broadcast_(Tensor(a!) tensor, int src, str group_name) -> ()", {pt2});
  m.def("all_to_all_v(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name) -> "
        "Tensor",
        {pt2});
  m.def("all_to_all_v_out(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name, "
        "*, Tensor(a!) out) -> ()",
        {pt2});
  m.def("ep_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, str buffer_name) -> (Tensor expert_x, "
        "Tensor expert_counts)",
        {pt2});
  m.def("ep_combine(Tensor expert_out, Tensor topk_idx, str buffer_name) -> Tensor", {pt2});
  m.def("fused_allreduce_rmsnorm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, str group_name, "
        "str residual_mode=\"replicated\", int num_sms=0, str algo=\"auto\") -> Tensor",
        {pt2});
  m.def("fused_allreduce_rmsnorm_out(Tensor x, Tensor(a!) residual, Tensor weight, float eps, str group_name, "
        "str residual_mode=\"replicated\", int num_sms=0, str algo=\"auto\", *, Tensor(b!) out) -> ()",
        {pt2});
}

#define COMMLIB_OPS_IMPL(KEY)                                                           \
  TORCH_LIBRARY_IMPL(commlib, KEY, m) {                                                 \
    using namespace commlib::torch_layer;                                               \
    m.impl("all_reduce", &all_reduce_op);                                               \
    m.impl("all_reduce_", &all_reduce_inplace_op);                                      \
    m.impl("all_reduce_out", &all_reduce_out_op);                                       \
    m.impl("reduce_scatter_out", &reduce_scatter_out_op);                               \
    m.impl("all_gather_out", &all_gather_out_op);                                       \
    m.impl("broadcast_", &broadcast_inplace_op);                                        \
    m.impl("all_to_all_v", &all_to_all_v_op);                                           \
    m.impl("all_to_all_v_out", &all_to_all_v_out_op);                                   \
    m.impl("ep_dispatch", &ep_dispatch_op);                                             \
    m.impl("ep_combine", &ep_combine_op);                                               \
    m.impl("fused_allreduce_rmsnorm", &fused_op);                                       \
    m.impl("fused_allreduce_rmsnorm_out", &fused_out_op);                               \
  }
COMMLIB_OPS_IMPL(CPU)
COMMLIB_OPS_IMPL(CUDA)
#undef COMMLIB_OPS_IMPL

TORCH_LIBRARY_IMPL(commlib, Meta, m) {
  using namespace commlib::torch_layer;
  m.impl("all_reduce", &all_reduce_meta);
  m.impl("all_reduce_", &all_reduce_inplace_meta);
  m.impl("all_reduce_out", &all_reduce_out_meta);
  m.impl("reduce_scatter_out", &reduce_scatter_out_meta);
  m.impl("all_gather_out", &all_gather_out_meta);
  m.impl("broadcast_", &broadcast_inplace_meta);
  m.impl("all_to_all_v", &all_to_all_v_meta);
  m.impl("all_to_all_v_out", &all_to_all_v_out_meta);
  m.impl("ep_dispatch", &ep_dispatch_meta);
  m.impl("ep_combine", &ep_combine_meta);
  m.impl("fused_allreduce_rmsnorm", &fused_meta);
  m.impl("fused_allreduce_rmsnorm_out", &fused_out_meta);
}

namespace commlib::torch_layer {
namespace {

const BindingRegistrar kRegistrar("ops", [](py::module_& m) {
  m.def(
      "register_group",
      [](const std::string& name, const py::handle& comm, bool replace) {
        register_group(name, communicator_from_python(comm), replace ? NameClash::kReplace : NameClash::kRaise);
      },
      py::arg("name"), py::arg("comm"), py::arg("replace") = false,
      "Names `comm` in torch.ops.commlib ops (held weakly); `replace`: take the name from an open one.");
  m.def(
      "unregister_group",
      [](const std::string& name, const py::handle& comm) {
        unregister_group(name, communicator_from_python(comm).get());
      },
      py::arg("name"), py::arg("comm"));
  m.def(
      "register_ep_buffer",
      [](const std::string& name, const std::shared_ptr<EPBufferTorch>& buffer) { register_ep_buffer(name, buffer); },
      py::arg("name"), py::arg("buffer"), "Names an EP buffer in torch.ops.commlib.ep_* ops (held weakly).");
  m.def(
      "unregister_ep_buffer",
      [](const std::string& name, const std::shared_ptr<EPBufferTorch>& buffer) {
        unregister_ep_buffer(name, buffer.get());
      },
      py::arg("name"), py::arg("buffer"));
});

}  // namespace
}  // namespace commlib::torch_layer
