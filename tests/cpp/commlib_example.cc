// A C++ program that drives commlib through its public headers only (include/commlib): all-reduce,
// fused all-reduce + RMSNorm and expert-parallel dispatch / combine, on CPU over shared memory and,
// with --gpu, on the GPUs. The ranks are threads of this process that share an in-memory Store.
// Every result is checked against a double-precision reference computed from the same inputs.
//
//   commlib_example [--world N] [--gpu]     exits 0 and prints "OK ..." when every check passed
//
// tests/cpu/test_cpp_example.py builds it (CMake target commlib_example) and runs the CPU path; the
// GPU path runs in tests/gpu (rank r on GPU r; one GPU per rank).
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "commlib/communicator.hpp"
#include "commlib/ep.hpp"
#include "commlib/errors.hpp"
#include "commlib/fused_rmsnorm.hpp"
#include "commlib/gpu.hpp"
#include "commlib/store.hpp"

#if defined(COMMLIB_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

// The ranks' rendezvous: one map behind a mutex; get() waits for the key.
class InMemoryStore : public commlib::Store {
 public:
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    std::lock_guard<std::mutex> lock(mutex_);
    data_[key] = value;
    changed_.notify_all();
  }
  std::vector<uint8_t> get(const std::string& key) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!changed_.wait_for(lock, std::chrono::seconds(120), [&] { return data_.count(key) != 0; })) {
      throw commlib::Timeout("InMemoryStore: key '" + key + "' not set within 120 s");
    }
    return data_[key];
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<uint8_t>& v = data_[key];
    int64_t value = 0;
    if (v.size() == sizeof(value)) std::memcpy(&value, v.data(), sizeof(value));
    value += delta;
    v.resize(sizeof(value));
    std::memcpy(v.data(), &value, sizeof(value));
    changed_.notify_all();
    return value;
  }
  bool check(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return data_.count(key) != 0;
  }
  void erase(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    data_.erase(key);
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::vector<uint8_t>> data_;
};

// Fresh, rank-dependent data (never zeros).
float value_of(int rank, int64_t i, int salt) {
  const uint32_t h = static_cast<uint32_t>((rank + 1) * 2654435761u) ^ static_cast<uint32_t>(i * 40503 + salt * 97);
  return static_cast<float>(h % 2001) / 1000.0f - 1.0f + 0.001f;
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (finite inputs)
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// all_reduce of `count` floats against the fp64 sum of every rank's input.
void all_reduce_cpu(commlib::Communicator& comm, int64_t count) {
  const int n = comm.world_size();
  std::vector<float> x(count);
  for (int64_t i = 0; i < count; ++i) x[i] = value_of(comm.rank(), i, 1);
  std::vector<float> out(count, -12345.0f);  // poisoned
  comm.all_reduce_host(x.data(), out.data(), count, commlib::DataType::kFloat32, commlib::ReduceOp::kSum,
                       commlib::Algorithm::kAuto);
  for (int64_t i = 0; i < count; ++i) {
    double ref = 0;
    for (int r = 0; r < n; ++r) ref += value_of(r, i, 1);
    check(std::fabs(out[i] - ref) <= 1e-5 * (1 + std::fabs(ref)), "all_reduce element " + std::to_string(i));
  }
}

// Fused all-reduce + residual add + RMSNorm (replicated) against an fp64 reference.
template <typename Run>
void fused_check(commlib::Communicator& comm, int64_t tokens, int64_t hidden, bool bf16, Run run) {
  const int n = comm.world_size();
  const double eps = 1e-6;
  std::vector<double> sum(tokens * hidden), res(tokens * hidden), w(hidden);
  for (int64_t i = 0; i < tokens * hidden; ++i) {
    for (int r = 0; r < n; ++r) sum[i] += value_of(r, i, 2);
    res[i] = value_of(7, i, 3);
  }
  for (int64_t k = 0; k < hidden; ++k) w[k] = 0.5 + value_of(9, k, 4);
  std::vector<float> out, new_res;
  run(eps, &out, &new_res);
  const double tol = bf16 ? 3e-2 : 1e-4;
  for (int64_t t = 0; t < tokens; ++t) {
    double ss = 0;
    for (int64_t k = 0; k < hidden; ++k) {
      const double r = sum[t * hidden + k] + res[t * hidden + k];
      ss += r * r;
    }
    const double rstd = 1.0 / std::sqrt(ss / hidden + eps);
    for (int64_t k = 0; k < hidden; ++k) {
      const double r = sum[t * hidden + k] + res[t * hidden + k];
      check(std::fabs(new_res[t * hidden + k] - r) <= tol * (1 + std::fabs(r)), "fused residual");
      check(std::fabs(out[t * hidden + k] - r * rstd * w[k]) <= tol * (1 + std::fabs(r * rstd * w[k])), "fused out");
    }
  }
}

void fused_cpu(commlib::Communicator& comm, int64_t tokens, int64_t hidden) {
  fused_check(comm, tokens, hidden, false, [&](double eps, std::vector<float>* out, std::vector<float>* res) {
    std::vector<float> x(tokens * hidden), w(hidden);
    res->resize(tokens * hidden);
    out->assign(tokens * hidden, -12345.0f);
    for (int64_t i = 0; i < tokens * hidden; ++i) {
      x[i] = value_of(comm.rank(), i, 2);
      (*res)[i] = value_of(7, i, 3);
    }
    for (int64_t k = 0; k < hidden; ++k) w[k] = 0.5f + value_of(9, k, 4);
    commlib::FusedRmsNormArgs a;
    a.x = x.data();
    a.residual = res->data();
    a.weight = w.data();
    a.out = out->data();
    a.num_tokens = tokens;
    a.hidden = hidden;
    a.dtype = commlib::DataType::kFloat32;
    a.eps = static_cast<float>(eps);
    commlib::check_fused_rmsnorm_args(a, comm.world_size(), comm.rank());
    commlib::fused_allreduce_rmsnorm_host(comm, a);
  });
}

// EP routing of this test: token t of rank s goes to experts (s + t) % E and (3 t + 1) % E with
// weights 0.75 and 0.25; the experts are the identity, so combine returns x (up to rounding).
struct Routing {
  std::vector<int64_t> idx;
  std::vector<float> w;
};
Routing routing(int rank, int64_t tokens, int64_t experts) {
  Routing r;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t a = (rank + t) % experts, b = (3 * t + 1) % experts;
    r.idx.push_back(a);
    r.idx.push_back(b);
    r.w.push_back(0.75f);
    r.w.push_back(0.25f);
  }
  return r;
}

void ep_cpu(commlib::Communicator& comm, int64_t tokens, int64_t hidden) {
  const int n = comm.world_size();
  commlib::EPConfig c;
  c.max_tokens_per_rank = tokens;
  c.hidden = hidden;
  c.num_experts = 4 * n;
  c.topk = 2;
  c.dtype = commlib::DataType::kFloat32;
  c = commlib::validate_ep_config(c, n);
  const int64_t L = c.num_local_experts(n);
  std::vector<float> expert_x(L * c.capacity * hidden);
  std::vector<int32_t> counts(L), recv_pos(n * tokens * 2), meta_idx(n * tokens * 2), meta_n(n);
  std::vector<float> meta_w(n * tokens * 2);
  std::vector<int64_t> overflow(commlib::kEPOverflowWords);
  commlib::EPState st{expert_x.data(), counts.data(), recv_pos.data(), meta_idx.data(), meta_w.data(),
                      meta_n.data(), overflow.data()};
  std::vector<float> x(tokens * hidden);
  for (int64_t i = 0; i < tokens * hidden; ++i) x[i] = value_of(comm.rank(), i, 5);
  const Routing r = routing(comm.rank(), tokens, c.num_experts);
  commlib::ep_dispatch_host(comm, c, st, x.data(), tokens, r.idx.data(), r.w.data());
  std::vector<float> out(tokens * hidden, -12345.0f);
  commlib::ep_combine_host(comm, c, st, expert_x.data(), out.data());  // identity experts
  for (int64_t i = 0; i < tokens * hidden; ++i) check(std::fabs(out[i] - x[i]) <= 1e-6 * (1 + std::fabs(x[i])), "ep combine");
}

#if defined(COMMLIB_WITH_CUDA)
#define CUDA_OK(call) check((call) == cudaSuccess, #call)

void gpu_paths(commlib::Communicator& comm, int device) {
  CUDA_OK(cudaSetDevice(device));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  const auto gs = reinterpret_cast<commlib::GpuStream>(stream);
  const int n = comm.world_size();
  // all_reduce, bf16-exact inputs in fp32.
  {
    const int64_t count = 100003;
    std::vector<float> x(count), out(count);
    for (int64_t i = 0; i < count; ++i) x[i] = value_of(comm.rank(), i, 1);
    float* d = nullptr;
    CUDA_OK(cudaMalloc(&d, count * 4));
    CUDA_OK(cudaMemcpy(d, x.data(), count * 4, cudaMemcpyHostToDevice));
    commlib::all_reduce_gpu(comm, device, d, d, count, commlib::DataType::kFloat32, commlib::ReduceOp::kSum,
                            commlib::Algorithm::kAuto, gs);
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(out.data(), d, count * 4, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < count; ++i) {
      double ref = 0;
      for (int r = 0; r < n; ++r) ref += value_of(r, i, 1);
      check(std::fabs(out[i] - ref) <= 1e-5 * (1 + std::fabs(ref)), "gpu all_reduce");
    }
    CUDA_OK(cudaFree(d));
  }
  // Fused, bf16 (LL at 3 tokens, the barrier kernel at 300).
  for (int64_t tokens : {3, 300}) {
    const int64_t hidden = 1024;
    fused_check(comm, tokens, hidden, true, [&](double eps, std::vector<float>* out, std::vector<float>* res) {
      const int64_t m = tokens * hidden;
      std::vector<uint16_t> x(m), r(m), w(hidden), o(m);
      for (int64_t i = 0; i < m; ++i) {
        x[i] = to_bf16(value_of(comm.rank(), i, 2));
        r[i] = to_bf16(value_of(7, i, 3));
      }
      for (int64_t k = 0; k < hidden; ++k) w[k] = to_bf16(0.5f + value_of(9, k, 4));
      uint16_t *dx, *dr, *dw, *dout;
      CUDA_OK(cudaMalloc(&dx, m * 2));
      CUDA_OK(cudaMalloc(&dr, m * 2));
      CUDA_OK(cudaMalloc(&dw, hidden * 2));
      CUDA_OK(cudaMalloc(&dout, m * 2));
      CUDA_OK(cudaMemcpy(dx, x.data(), m * 2, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(dr, r.data(), m * 2, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(dw, w.data(), hidden * 2, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemset(dout, 0xff, m * 2));  // poisoned (NaN)
      commlib::FusedRmsNormArgs a;
      a.x = dx;
      a.residual = dr;
      a.weight = dw;
      a.out = dout;
      a.num_tokens = tokens;
      a.hidden = hidden;
      a.dtype = commlib::DataType::kBFloat16;
      a.eps = static_cast<float>(eps);
      commlib::fused_allreduce_rmsnorm_gpu(comm, device, a, 0, commlib::FusedAlgo::kAuto, gs);
      CUDA_OK(cudaStreamSynchronize(stream));
      CUDA_OK(cudaMemcpy(o.data(), dout, m * 2, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(r.data(), dr, m * 2, cudaMemcpyDeviceToHost));
      out->resize(m);
      res->resize(m);
      for (int64_t i = 0; i < m; ++i) {
        (*out)[i] = from_bf16(o[i]);
        (*res)[i] = from_bf16(r[i]);
      }
      for (uint16_t* p : {dx, dr, dw, dout}) CUDA_OK(cudaFree(p));
    });
  }
  // EP dispatch / combine, fp32, identity experts.
  {
    const int64_t tokens = 9, hidden = 256;
    commlib::EPConfig c;
    c.max_tokens_per_rank = tokens;
    c.hidden = hidden;
    c.num_experts = 4 * n;
    c.topk = 2;
    c.dtype = commlib::DataType::kFloat32;
    commlib::EPBufferGpu buf(comm, c, device);
    const commlib::EPConfig& cfg = buf.config();
    const int64_t L = cfg.num_local_experts(n);
    void* expert_x;
    int32_t *counts, *recv_pos;
    CUDA_OK(cudaMalloc(&expert_x, L * cfg.capacity * hidden * 4));
    CUDA_OK(cudaMalloc(&counts, L * 4));
    CUDA_OK(cudaMalloc(&recv_pos, n * tokens * 2 * 4));
    buf.set_local(expert_x, counts, recv_pos);
    std::vector<float> x(tokens * hidden), out(tokens * hidden);
    for (int64_t i = 0; i < tokens * hidden; ++i) x[i] = value_of(comm.rank(), i, 5);
    const Routing r = routing(comm.rank(), tokens, c.num_experts);
    float *dx, *dw, *dout;
    int64_t* didx;
    CUDA_OK(cudaMalloc(&dx, x.size() * 4));
    CUDA_OK(cudaMalloc(&dw, r.w.size() * 4));
    CUDA_OK(cudaMalloc(&didx, r.idx.size() * 8));
    CUDA_OK(cudaMalloc(&dout, x.size() * 4));
    CUDA_OK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dw, r.w.data(), r.w.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(didx, r.idx.data(), r.idx.size() * 8, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dout, 0xff, x.size() * 4));
    buf.dispatch(dx, tokens, didx, dw, commlib::EPPhase::kBoth, gs);
    buf.combine(expert_x, dout, commlib::EPPhase::kBoth, gs);  // identity experts
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(out.data(), dout, x.size() * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < x.size(); ++i) check(std::fabs(out[i] - x[i]) <= 1e-6 * (1 + std::fabs(x[i])), "gpu ep");
    for (void* p : {static_cast<void*>(dx), static_cast<void*>(dw), static_cast<void*>(didx), static_cast<void*>(dout),
                    expert_x, static_cast<void*>(counts), static_cast<void*>(recv_pos)}) {
      CUDA_OK(cudaFree(p));
    }
  }
  commlib::check_gpu_error(comm);
  CUDA_OK(cudaStreamDestroy(stream));
}
#else
void gpu_paths(commlib::Communicator&, int) { throw std::runtime_error("built without CUDA"); }
#endif

}  // namespace

int main(int argc, char** argv) {
  int world = 2;
  bool gpu = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--world" && i + 1 < argc) {
      world = std::atoi(argv[++i]);
    } else if (a == "--gpu") {
      gpu = true;
    } else {
      std::fprintf(stderr, "usage: %s [--world N] [--gpu]\n", argv[0]);
      return 2;
    }
  }
  if (gpu && !commlib::gpu_built()) {
    std::fprintf(stderr, "commlib_example: this build has no GPU paths\n");
    return 2;
  }
#if defined(COMMLIB_WITH_CUDA)
  int num_devices = 0;
  // One GPU per rank: the ranks are threads of one process, whose kernels (which wait for each
  // other) would all have to be resident at once on a shared GPU.
  if (gpu && (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices < world)) {
    std::fprintf(stderr, "commlib_example: --gpu needs one GPU per rank (%d ranks, %d GPUs)\n", world, num_devices);
    return 2;
  }
#endif
  auto store = std::make_shared<InMemoryStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        commlib::Communicator comm(store, rank, world, "example");
        all_reduce_cpu(comm, 1000003);
        fused_cpu(comm, 5, 72);
        ep_cpu(comm, 7, 64);
        if (gpu) gpu_paths(comm, rank);
        comm.close();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  bool ok = true;
  for (int rank = 0; rank < world; ++rank) {
    if (!errors[rank].empty()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, errors[rank].c_str());
      ok = false;
    }
  }
  if (!ok) return 1;
  std::printf("OK world %d: all_reduce, fused_allreduce_rmsnorm, ep dispatch/combine on CPU%s\n", world,
              gpu ? " and GPU" : "");
  return 0;
}
