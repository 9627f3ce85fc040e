"""Experiment: what a kernel of 8 blocks x 512 threads pays for memory round trips, in a CUDA graph:
a chain of K dependent loads (thread 0 of each block) within one 2 MiB page or one per page (1 GiB
buffer), and one warp loading 8 rows at once from one page or from 8 pages."""
import torch
from graph_timing import graph_step_us
from torch.utils.cpp_extension import load_inline

src = r"""
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>
__global__ void chain(const long long* buf, long long stride_words, int k, float* out) {
  if (threadIdx.x != 0) return;
  long long at = blockIdx.x * 16, acc = 0;
  for (int i = 0; i < k; ++i) {
    const long long v = buf[at];
    acc += v;
    at = (at + stride_words + (v & 1)) % (256ll << 20 >> 3) ;  // dependent on the loaded value
  }
  if (acc == 123456789) out[0] = 1.f;
}
__global__ void fan(const int4* buf, long long stride_packs, int rounds, float* out) {
  if (threadIdx.x >= 32) return;
  int acc = 0;
  long long base = blockIdx.x * 64;
  for (int r = 0; r < rounds; ++r) {
    int4 v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = buf[base + i * stride_packs + threadIdx.x];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += v[i].x;
    base += (acc & 1) + 4096;
  }
  if (acc == 123456789) out[0] = 1.f;
}
void launch(int which, torch::Tensor buf, long long stride, int k, torch::Tensor out) {
  auto s = at::cuda::getCurrentCUDAStream().stream();
  const int64_t* words = buf.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  if (which == 0) chain<<<8, 512, 0, s>>>(reinterpret_cast<const long long*>(words), stride, k, o);
  else fan<<<8, 512, 0, s>>>(reinterpret_cast<const int4*>(words), stride, k, o);
}
"""
decl = "void launch(int which, torch::Tensor buf, long long stride, int k, torch::Tensor out);"
m = load_inline("tlb_probe", cpp_sources=decl, cuda_sources=src, functions=["launch"],
                extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
buf = torch.zeros(1 << 27, dtype=torch.int64, device="cuda")  # 1 GiB of zeros
out = torch.zeros(4, device="cuda")


def per_kernel(which, stride, k):
    return graph_step_us(lambda: m.launch(which, buf, stride, k, out))


print("µs per kernel (graph, median of 7 replays of 200); buffer 1 GiB, loads only touch its first 256 MiB")
for k in (1, 8, 32):
    same = per_kernel(0, 16, k)           # 128 B apart: one page
    pages = per_kernel(0, (2 << 20) >> 3, k)  # 2 MiB apart: a page each
    print(f"chain of {k:2d} dependent loads: same page {same:.2f}, a new 2 MiB page each {pages:.2f}")
for rounds in (1, 8):
    same = per_kernel(1, 256, rounds)          # 8 rows 4 KiB apart
    pages = per_kernel(1, (2 << 20) >> 4, rounds)  # 8 rows 2 MiB apart
    print(f"warp loads 8 rows at once, {rounds} rounds: rows in one page {same:.2f}, in 8 pages {pages:.2f}")
