"""Experiment: what does a kernel pay for reading its parameters? Kernels of 8 blocks x 512 threads
whose parameter struct spans N 64-byte lines and which read one word of each (in-order issue: each
first touch of a line can stall), and with the lines first read by N lanes at once through a
register index (which, as measured, makes the compiler copy the parameters to local memory)."""
import torch
from graph_timing import graph_step_us
from torch.utils.cpp_extension import load_inline

src = r"""
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>
template <int N> struct P { int4 v[4 * N]; float* out; };
template <int N>
__global__ void plain(const __grid_constant__ P<N> p) {
  int acc = threadIdx.x;
#pragma unroll
  for (int i = 0; i < N; ++i) acc = acc * 3 + p.v[4 * i].x;
  if (acc == 123456789) p.out[0] = 1.f;
}
template <int N>
__global__ void primed(const __grid_constant__ P<N> p) {
  if (threadIdx.x < N) {
    int w = p.v[4 * threadIdx.x].y;  // LDC with a register index: the lines load at once
    if (w == 123456789) p.out[1] = 1.f;
  }
  __syncthreads();
  int acc = threadIdx.x;
#pragma unroll
  for (int i = 0; i < N; ++i) acc = acc * 3 + p.v[4 * i].x;
  if (acc == 123456789) p.out[0] = 1.f;
}
template <int N>
void go(bool prime, float* o, cudaStream_t s) {
  P<N> p{};
  for (int i = 0; i < 4 * N; ++i) p.v[i] = make_int4(i, i + 1, i + 2, i + 3);
  p.out = o;
  if (prime) primed<N><<<8, 512, 0, s>>>(p); else plain<N><<<8, 512, 0, s>>>(p);
}
void launch(int n, bool prime, torch::Tensor out) {
  float* o = out.data_ptr<float>();
  auto s = at::cuda::getCurrentCUDAStream().stream();
  switch (n) {
    case 1: go<1>(prime, o, s); break;
    case 4: go<4>(prime, o, s); break;
    case 8: go<8>(prime, o, s); break;
    case 16: go<16>(prime, o, s); break;
    case 32: go<32>(prime, o, s); break;
  }
}
"""
m = load_inline("param_probe", cpp_sources="void launch(int n, bool prime, torch::Tensor out);", cuda_sources=src,
                functions=["launch"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
out = torch.zeros(4, device="cuda")


def per_kernel(n, prime):
    return graph_step_us(lambda: m.launch(n, prime, out))


print("µs per kernel (graph, median of 7 replays of 200)")
for n in (1, 4, 8, 16, 32):
    plain, primed = per_kernel(n, False), per_kernel(n, True)
    print(f"{n:2d} parameter lines read: plain {plain:.2f}, lines touched first {primed:.2f}")
