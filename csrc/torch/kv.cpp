// commlib._C's KV-cache transfer (python/commlib/kv.py): the agent over a c10d Store, the engine
// chosen by device (csrc/cuda/cuda_kv.hpp, csrc/host/kv_host.hpp), and memfd-backed host tensors.
#include <torch/csrc/utils/pybind.h>

#include "core/kv_agent.hpp"
#include "cuda/cuda_kv.hpp"
#include "host/kv_host.hpp"
#include "torch/bindings.hpp"
#include "torch/torch_common.hpp"

namespace py = pybind11;

namespace commlib::torch_layer {
namespace {

KvRole parse_role(const std::string& role) {
  if (role == "prefill") return KvRole::kPrefill;
  if (role == "decode") return KvRole::kDecode;
  if (role == "both") return KvRole::kBoth;
  throw InvalidArgument("KVAgent: role '" + role + "' not supported; supported: prefill, decode, both");
}

const char* state_name(KvEvent::State state) {
  switch (state) {
    case KvEvent::State::kPending: return "pending";
    case KvEvent::State::kDone: return "done";
    case KvEvent::State::kFailed: return "failed";
  }
  return "?";
}

py::tuple event_tuple(const KvEvent& e) {
  return py::make_tuple(e.request_id, e.kind == KvEvent::Kind::kSent ? "send" : "recv", state_name(e.state),
                        e.error_class, e.reason, e.peer, e.num_layers, e.layers_done, e.num_blocks);
}

// Block ids: a contiguous CPU int32 tensor (commlib.kv converts lists and other dtypes).
const int32_t* block_ids(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_TYPE(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(),
                   "KVAgent.send: ", arg, " must be a contiguous 1-D CPU int32 tensor");
  return t.data_ptr<int32_t>();
}

py::list route_dicts(const std::vector<KvRoute>& routes) {
  py::list out;
  for (const KvRoute& r : routes) {
    out.append(py::dict(py::arg("rank") = r.rank, py::arg("src_head") = r.src_head, py::arg("dst_head") = r.dst_head,
                        py::arg("heads") = r.heads, py::arg("first_sender") = r.first_sender,
                        py::arg("num_contributors") = r.num_contributors, py::arg("contributor") = r.contributor));
  }
  return out;
}

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

void bind_kv(py::module_& m) {
  py::class_<KvAgent, std::shared_ptr<KvAgent>>(m, "KVAgent")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, const std::string& instance,
                       const std::string& role, int tp_rank, int tp_size, const std::string& device, int device_index,
                       double timeout_s, int num_ctas) {
             KvAgentOptions options;
             options.instance = instance;
             options.role = parse_role(role);
             options.tp_rank = tp_rank;
             options.tp_size = tp_size;
             options.timeout = millis(timeout_s);
             options.num_ctas = num_ctas;
             auto engine = device == "cuda" ? make_cuda_kv_engine(device_index) : make_host_kv_engine();
             return std::make_shared<KvAgent>(std::make_shared<TorchStore>(store), options, std::move(engine));
           }),
           py::arg("store"), py::arg("instance"), py::arg("role"), py::arg("tp_rank"), py::arg("tp_size"),
           py::arg("device"), py::arg("device_index"), py::arg("timeout_s"), py::arg("num_ctas") = 0)
      .def(
          "register_cache",
          [](KvAgent& a, const std::string& layout, const std::string& dtype, int elem_bytes, int num_layers,
             int num_planes, bool mla, int64_t num_blocks, int block_size, int num_heads, int head_dim,
             int64_t block_stride, int64_t token_stride, int64_t head_stride, std::vector<uint64_t> planes,
             uint64_t plane_span) {
            KvCacheLayout l;
            l.layout = layout;
            l.dtype = dtype;
            l.elem_bytes = elem_bytes;
            l.num_layers = num_layers;
            l.num_planes = num_planes;
            l.mla = mla;
            l.num_blocks = num_blocks;
            l.block_size = block_size;
            l.num_heads = num_heads;
            l.head_dim = head_dim;
            l.block_stride = block_stride;
            l.token_stride = token_stride;
            l.head_stride = head_stride;
            l.planes = std::move(planes);
            l.plane_span = plane_span;
            a.register_cache(l);
          })
      .def("connect", &KvAgent::connect, py::arg("peer"), py::call_guard<py::gil_scoped_release>())
      .def("destinations", &KvAgent::destinations, py::arg("peer"))
      .def(
          "check_peer",
          [](KvAgent& a, const std::string& peer) {
            std::vector<commlib::KvRoute> routes;
            {
              py::gil_scoped_release release;  // waits for the peer's ranks to register
              routes = a.check_peer(peer);
            }
            return route_dicts(routes);
          },
          py::arg("peer"), "connect()'s checks of a peer (Note [kv peer checks]); returns the routes (dicts).")
      .def(
          "begin",
          [](KvAgent& a, const std::string& peer, const std::string& request_id, const at::Tensor& src,
             const at::Tensor& dst, int64_t num_tokens, const std::vector<int>& layers, uint64_t stream) {
            const int32_t* s = block_ids(src, "src_blocks");
            const int32_t* d = block_ids(dst, "dst_blocks");
            return a.begin(peer, request_id, s, static_cast<size_t>(src.numel()), d, static_cast<size_t>(dst.numel()),
                           num_tokens, layers, reinterpret_cast<void*>(stream));
          },
          py::arg("peer"), py::arg("request_id"), py::arg("src_blocks"), py::arg("dst_blocks"), py::arg("num_tokens"),
          py::arg("layers"), py::arg("stream"))
      .def(
          "send_layers",
          [](KvAgent& a, uint64_t send, int layer_begin, int num_layers, uint64_t stream) {
            a.send_layers(send, layer_begin, num_layers, reinterpret_cast<void*>(stream));
          },
          py::arg("send"), py::arg("layer_begin"), py::arg("num_layers"), py::arg("stream"))
      .def("send_done", &KvAgent::send_done, py::arg("send"))
      .def(
          "wait_send", [](KvAgent& a, uint64_t send, double timeout_s) { a.wait_send(send, millis(timeout_s)); },
          py::arg("send"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("poll",
           [](KvAgent& a) {
             std::vector<KvEvent> events;
             {
               py::gil_scoped_release release;
               events = a.poll();
             }
             py::list out;
             for (const auto& e : events) out.append(event_tuple(e));
             return out;
           })
      .def(
          "wait",
          [](KvAgent& a, const std::string& request_id, double timeout_s) {
            KvEvent e;
            {
              py::gil_scoped_release release;
              e = a.wait(request_id, millis(timeout_s));
            }
            return event_tuple(e);
          },
          py::arg("request_id"), py::arg("timeout_s"))
      .def(
          "wait_layer",
          [](KvAgent& a, const std::string& request_id, int layer, double timeout_s) {
            return a.wait_layer(request_id, layer, millis(timeout_s));
          },
          py::arg("request_id"), py::arg("layer"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &KvAgent::closed)
      .def("close", &KvAgent::close, py::call_guard<py::gil_scoped_release>());

  m.def(
      "kv_routes",
      [](int heads, bool mla, int tp_rank, int tp_size, int tp_dest) {
        return route_dicts(commlib::kv_routes(heads, mla, tp_rank, tp_size, tp_dest));
      },
      py::arg("heads"), py::arg("mla"), py::arg("tp_rank"), py::arg("tp_size"), py::arg("tp_dest"),
      "A sending rank's destinations (Note [kv tensor parallelism]): a list of dicts.");
  m.def(
      "kv_check_request",
      [](const std::string& request_id, const at::Tensor& src, const at::Tensor& dst, int64_t num_tokens,
         int64_t src_num_blocks, int64_t block_size, int64_t dst_num_blocks, int64_t dst_block_size,
         const std::vector<int>& layers, int num_layers) {
        // The NIXL path's checks (Note [kv request checks]); its duplicate state lives per thread.
        thread_local std::vector<uint32_t> stamp;
        thread_local uint32_t stamp_now = 0;
        return commlib::kv_check_request("KVAgent.send", request_id, block_ids(src, "src_blocks"),
                                         static_cast<size_t>(src.numel()), src_num_blocks, block_size,
                                         block_ids(dst, "dst_blocks"), static_cast<size_t>(dst.numel()),
                                         dst_num_blocks, dst_block_size, num_tokens, layers, num_layers, stamp,
                                         stamp_now);
      },
      py::arg("request_id"), py::arg("src_blocks"), py::arg("dst_blocks"), py::arg("num_tokens"),
      py::arg("src_num_blocks"), py::arg("block_size"), py::arg("dst_num_blocks"), py::arg("dst_block_size"),
      py::arg("layers"), py::arg("num_layers"),
      "A KV request's argument checks (Note [kv request checks]); returns num_tokens resolved.");

  m.def(
      "kv_host_empty",
      [](int64_t nbytes) {
        void* p = kv_host_allocate(static_cast<size_t>(nbytes));
        return at::from_blob(p, {nbytes}, [](void* q) { kv_host_free(q); }, at::TensorOptions().dtype(at::kByte));
      },
      py::arg("nbytes"), "nbytes of host memory a KV peer process can map (commlib.kv.host_empty)");
}

BindingRegistrar reg("kv", bind_kv);

}  // namespace
}  // namespace commlib::torch_layer
