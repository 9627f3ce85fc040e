// Memory-bandwidth floors of this machine for the CPU all_reduce at 32 MiB (fp32): how long one
// process takes to stream 32 MiB through the access patterns an all_reduce is made of. Run one copy
// alone and two at once (two ranks share the memory system):
//   gcc -O3 -march=native -o /tmp/cpu_bandwidth bench/cpu_bandwidth.c
//   /tmp/cpu_bandwidth; (/tmp/cpu_bandwidth > /tmp/a & /tmp/cpu_bandwidth > /tmp/b; wait; cat /tmp/a /tmp/b)
// Plain loops that -O3 -march=native vectorises for the machine's widest vectors (AVX-512 on the
// Intel VM, AVX2 on the AMD one); the streaming copy uses SSE2, which every x86-64 has. Best of 15
// runs per pattern.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N (8u << 20)  // floats: 32 MiB

static float *a, *b, *c;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void copy(void) { memcpy(c, a, N * 4); }
static void stream_copy(void) {
  for (size_t i = 0; i < N; i += 4) _mm_stream_ps(c + i, _mm_load_ps(a + i));
  _mm_sfence();
}
static void read_only(void) {
  float s[16] = {0};  // 16 independent sums, so the loop vectorises without -ffast-math
  for (size_t i = 0; i < N; i += 16)
    for (int k = 0; k < 16; k++) s[k] += a[i + k];
  volatile float x = s[0];
  for (int k = 1; k < 16; k++) x += s[k];
  (void)x;
}
static void add_in_place(void) {
  for (size_t i = 0; i < N; i++) a[i] += b[i];
}
static void update_in_place(void) {
  for (size_t i = 0; i < N; i++) a[i] += 1.f;
}

int main(void) {
  a = aligned_alloc(64, N * 4);
  b = aligned_alloc(64, N * 4);
  c = aligned_alloc(64, N * 4);
  for (size_t i = 0; i < N; i++) a[i] = (float)i, b[i] = 1.f, c[i] = 2.f;
  const struct {
    const char* name;
    void (*fn)(void);
    double mib;  // bytes moved, counted as the program reads and writes them
  } patterns[] = {{"memcpy (R32 + W32)", copy, 64},
                  {"streaming copy (R32 + W32 nt)", stream_copy, 64},
                  {"read (R32)", read_only, 32},
                  {"a += b (R64 + W32)", add_in_place, 96},
                  {"a += 1 (R32 + W32, in place)", update_in_place, 64}};
  for (size_t k = 0; k < sizeof patterns / sizeof patterns[0]; k++) {
    double best = 1e9;
    for (int it = 0; it < 15; it++) {
      const double t = now();
      patterns[k].fn();
      const double dt = now() - t;
      if (dt < best) best = dt;
    }
    printf("%-32s %7.2f ms %6.1f GB/s\n", patterns[k].name, best * 1e3, patterns[k].mib * 1048576.0 / best / 1e9);
  }
  return 0;
}
