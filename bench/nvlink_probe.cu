// NVLink copy-rate probe: how many bytes per second a given number of SMs moves between two GPUs
// with each way of issuing the transfer, both GPUs sending at once (as in a 2-rank collective).
// It answers the design question behind the fused and EP kernels' CTA counts: what one SM can push.
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -o /tmp/nvlink_probe bench/nvlink_probe.cu && /tmp/nvlink_probe [MiB]
//
// Methods (every one moves the same bytes, 16-byte aligned, from GPU g's buffer to GPU 1-g's):
//   push-st      512 threads, each loads 8 local 16-byte packs then stores them to the peer
//   push-st16    the same with 16 packs in flight per thread
//   pull-ld      512 threads, each loads 8 packs from the peer then stores them locally
//   push-tma     one thread per CTA: cp.async.bulk global->shared (local, mbarrier) then
//                shared->global (peer, bulk group), 4 stages of 32 KiB in flight
// Prints GB/s per direction (bytes / time of the slower GPU) for 1 .. 132 CTAs.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

constexpr int kThreads = 512;
constexpr int kStages = 4;
constexpr int kStageBytes = 32 << 10;

template <int kUnroll>
__global__ void __launch_bounds__(kThreads) copy_st(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t base = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; base < n; base += kUnroll * step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + u * step;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + u * step;
      if (i < n) dst[i] = v[u];
    }
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread per CTA drives a kStages-deep ring: bulk-load a stage (local), wait on its mbarrier,
// bulk-store it to the peer; before reusing a stage, wait until its store has read shared memory.
__global__ void copy_tma(const char* __restrict__ src, char* __restrict__ dst, size_t bytes) {
  extern __shared__ __align__(128) char stage[];
  __shared__ __align__(8) uint64_t bars[kStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kStages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const size_t chunks = (bytes + kStageBytes - 1) / kStageBytes;
  uint32_t phase[kStages] = {};
  int k = 0;
  for (size_t c = blockIdx.x; c < chunks; c += gridDim.x, ++k) {
    const int s = k % kStages;
    const size_t off = c * kStageBytes;
    const uint32_t len = static_cast<uint32_t>(bytes - off < kStageBytes ? bytes - off : kStageBytes);
    if (k >= kStages) {
      // The store issued kStages chunks ago used this stage: wait until at most kStages - 1 are pending.
      asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kStages - 1) : "memory");
    }
    const uint32_t bar = smem_addr(&bars[s]);
    const uint32_t buf = smem_addr(stage + s * kStageBytes);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(len) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(buf),
                 "l"(src + off), "r"(len), "r"(bar)
                 : "memory");
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(bar), "r"(phase[s])
          : "memory");
    }
    phase[s] ^= 1u;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + off), "r"(buf), "r"(len)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

enum Method { kPushSt, kPushSt16, kPullLd, kPushTma };
const char* kNames[] = {"push-st", "push-st16", "pull-ld", "push-tma"};

void launch(Method m, int g, int blocks, char* const* buf, size_t bytes, cudaStream_t st) {
  char* mine = buf[g];
  char* peer = buf[1 - g];
  const size_t n = bytes / 16;
  switch (m) {
    case kPushSt: copy_st<8><<<blocks, kThreads, 0, st>>>(reinterpret_cast<uint4*>(mine), reinterpret_cast<uint4*>(peer) + n, n); break;
    case kPushSt16: copy_st<16><<<blocks, kThreads, 0, st>>>(reinterpret_cast<uint4*>(mine), reinterpret_cast<uint4*>(peer) + n, n); break;
    case kPullLd: copy_st<8><<<blocks, kThreads, 0, st>>>(reinterpret_cast<uint4*>(peer), reinterpret_cast<uint4*>(mine) + n, n); break;
    case kPushTma: copy_tma<<<blocks, 32, kStages * kStageBytes, st>>>(mine, peer + bytes, bytes); break;
  }
}

int main(int argc, char** argv) {
  const size_t bytes = static_cast<size_t>(argc > 1 ? std::atoi(argv[1]) : 64) << 20;
  char* buf[2];
  cudaStream_t st[2];
  cudaEvent_t ev[2][2];
  for (int g = 0; g < 2; ++g) {
    CHECK(cudaSetDevice(g));
    CHECK(cudaDeviceEnablePeerAccess(1 - g, 0));
    CHECK(cudaMalloc(&buf[g], 2 * bytes));  // [0, bytes): source; [bytes, 2 bytes): the peer's landing zone
    CHECK(cudaMemset(buf[g], g + 1, 2 * bytes));
    CHECK(cudaStreamCreateWithFlags(&st[g], cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&ev[g][0]));
    CHECK(cudaEventCreate(&ev[g][1]));
    CHECK(cudaFuncSetAttribute(copy_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, kStages * kStageBytes));
  }
  std::printf("# NVLink copy probe: %zu MiB per direction, both GPUs sending; GB/s per direction\n", bytes >> 20);
  const std::vector<int> grid = {1, 2, 4, 8, 16, 32, 64, 132};
  std::printf("%-10s", "CTAs");
  for (int b : grid) std::printf("%8d", b);
  std::printf("\n");
  for (Method m : {kPushSt, kPushSt16, kPullLd, kPushTma}) {
    std::printf("%-10s", kNames[m]);
    for (int blocks : grid) {
      float best = 1e30f;
      for (int rep = 0; rep < 3; ++rep) {
        for (int g = 0; g < 2; ++g) {
          CHECK(cudaSetDevice(g));
          CHECK(cudaDeviceSynchronize());
        }
        for (int g = 0; g < 2; ++g) {
          CHECK(cudaSetDevice(g));
          CHECK(cudaEventRecord(ev[g][0], st[g]));
          launch(m, g, blocks, buf, bytes, st[g]);
          CHECK(cudaEventRecord(ev[g][1], st[g]));
        }
        float worst = 0;
        for (int g = 0; g < 2; ++g) {
          CHECK(cudaSetDevice(g));
          CHECK(cudaEventSynchronize(ev[g][1]));
          CHECK(cudaGetLastError());
          float ms = 0;
          CHECK(cudaEventElapsedTime(&ms, ev[g][0], ev[g][1]));
          worst = ms > worst ? ms : worst;
        }
        best = worst < best ? worst : best;
      }
      std::printf("%8.1f", bytes / (best * 1e-3) / 1e9);
    }
    std::printf("\n");
  }
  // Spot check: the last method's landing zone on GPU 1 holds GPU 0's bytes.
  unsigned char probe = 0;
  CHECK(cudaSetDevice(1));
  CHECK(cudaMemcpy(&probe, buf[1] + bytes + bytes / 2, 1, cudaMemcpyDeviceToHost));
  std::printf("# check: landing byte %s\n", probe == 1 ? "ok" : "WRONG");
  return probe == 1 ? 0 : 1;
}
