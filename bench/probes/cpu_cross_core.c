// What a byte costs to cross from one core to the other, the part of the CPU all_reduce that the
// DRAM floors of bench/cpu_bandwidth.c leave out: a producer thread on CPU 0 copies chunks into a
// ring, a consumer on CPU 1 reads each chunk once it is published (as a rank reads its peer's ring
// chunk), a flag's round trip between the two CPUs, and the two together the way a 2-rank
// in-place all_reduce of 32 MiB fp32 needs them (see `staged_all_reduce` below).
//   gcc -O3 -march=native -o /tmp/cpu_cross_core bench/probes/cpu_cross_core.c -lpthread
//   /tmp/cpu_cross_core            # chunk KiB x ring depth grid, 256 MiB moved per cell
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t chunk_bytes, depth;
static long num_steps;
static char* ring;
static _Atomic long produced, consumed;
static volatile unsigned long long sink;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void* producer(void* arg) {
  (void)arg;
  pin(0);
  char* src = aligned_alloc(64, chunk_bytes);
  memset(src, 1, chunk_bytes);
  for (long t = 0; t < num_steps; ++t) {
    while (t - atomic_load_explicit(&consumed, memory_order_acquire) >= (long)depth) {
    }
    memcpy(ring + (t % depth) * chunk_bytes, src, chunk_bytes);
    atomic_store_explicit(&produced, t + 1, memory_order_release);
  }
  free(src);
  return NULL;
}

static void* consumer(void* arg) {
  (void)arg;
  pin(1);
  unsigned long long acc = 0;
  for (long t = 0; t < num_steps; ++t) {
    while (atomic_load_explicit(&produced, memory_order_acquire) <= t) {
    }
    // One read of each line; an integer xor vectorises (a float sum would not, without -ffast-math).
    const unsigned long long* p = (const unsigned long long*)(ring + (t % depth) * chunk_bytes);
    for (size_t i = 0; i < chunk_bytes / sizeof *p; ++i) acc ^= p[i];
    atomic_store_explicit(&consumed, t + 1, memory_order_release);
  }
  sink = acc;
  return NULL;
}

static void stream(size_t kib, size_t ring_depth) {
  chunk_bytes = kib << 10;
  depth = ring_depth;
  num_steps = (256L << 20) / (long)chunk_bytes;
  ring = aligned_alloc(4096, chunk_bytes * depth);
  memset(ring, 0, chunk_bytes * depth);
  atomic_store(&produced, 0);
  atomic_store(&consumed, 0);
  pthread_t a, b;
  const double t0 = now();
  pthread_create(&a, NULL, producer, NULL);
  pthread_create(&b, NULL, consumer, NULL);
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  const double dt = now() - t0;
  printf("chunk %5zu KiB x depth %2zu (ring %5zu KiB): %6.2f GB/s\n", kib, depth, kib * depth,
         num_steps * (double)chunk_bytes / dt / 1e9);
  free(ring);
}

static _Atomic long ping __attribute__((aligned(64)));
enum { kRoundTrips = 1000000 };

static void* pong(void* arg) {
  (void)arg;
  pin(1);
  for (long i = 0; i < kRoundTrips; ++i) {
    while (atomic_load_explicit(&ping, memory_order_acquire) != 2 * i + 1) {
    }
    atomic_store_explicit(&ping, 2 * i + 2, memory_order_release);
  }
  return NULL;
}

// The staged 2-rank in-place all_reduce pattern with nothing else: per 128 KiB chunk, each thread
// copies its chunk t into its ring (the read from DRAM, the peer's copy), then adds the peer's ring
// chunk t - 1 into its own chunk t - 1 (the read from the other core, the write back). Per thread:
// 32 MiB read and written in place in DRAM, 32 MiB read from the other core: what every staged
// algorithm moves at least (flat and tree alike), with the protocol reduced to two counters.
enum { kArrayFloats = 8 << 20, kChunkFloats = 32 << 10, kStagedDepth = 4, kStagedRuns = 15 };
static float* staged_ring[2];
static _Atomic long staged_copied[2], staged_released[2], staged_arrived;
static double staged_best[2];

static void* staged_rank(void* arg) {
  const int rank = (int)(long)arg, peer = 1 - rank;
  pin(rank);
  float* a = aligned_alloc(64, kArrayFloats * sizeof(float));
  for (long i = 0; i < kArrayFloats; ++i) a[i] = (float)(i % 7) + rank;
  staged_ring[rank] = aligned_alloc(4096, kStagedDepth * kChunkFloats * sizeof(float));
  memset(staged_ring[rank], 0, kStagedDepth * kChunkFloats * sizeof(float));
  const long num_chunks = kArrayFloats / kChunkFloats;
  staged_best[rank] = 1e9;
  for (long run = 0; run < kStagedRuns; ++run) {
    const long base = run * num_chunks;  // the counters only grow
    atomic_fetch_add(&staged_arrived, 1);  // both ranks start each run together
    while (atomic_load(&staged_arrived) < 2 * (run + 1)) {
    }
    const double t0 = now();
    for (long t = 0; t <= num_chunks; ++t) {
      if (t < num_chunks) {
        while (base + t - atomic_load_explicit(&staged_released[peer], memory_order_acquire) >= kStagedDepth) {
        }
        memcpy(staged_ring[rank] + (t % kStagedDepth) * kChunkFloats, a + t * kChunkFloats,
               kChunkFloats * sizeof(float));
        atomic_store_explicit(&staged_copied[rank], base + t + 1, memory_order_release);
      }
      if (t >= 1) {
        const long c = t - 1;
        while (atomic_load_explicit(&staged_copied[peer], memory_order_acquire) < base + c + 1) {
        }
        const float* theirs = staged_ring[peer] + (c % kStagedDepth) * kChunkFloats;
        float* mine = a + c * kChunkFloats;
        for (long i = 0; i < kChunkFloats; ++i) mine[i] += theirs[i];
        atomic_store_explicit(&staged_released[rank], base + c + 1, memory_order_release);
      }
    }
    const double dt = now() - t0;
    if (dt < staged_best[rank]) staged_best[rank] = dt;
  }
  sink = (unsigned long long)a[kArrayFloats - 1];
  free(a);
  return NULL;
}

static void staged_all_reduce(void) {
  pthread_t ranks[2];
  for (long r = 0; r < 2; ++r) pthread_create(&ranks[r], NULL, staged_rank, (void*)r);
  for (int r = 0; r < 2; ++r) pthread_join(ranks[r], NULL);
  printf("staged in-place all_reduce pattern, 32 MiB fp32, best of %d: %.2f / %.2f ms\n", kStagedRuns,
         staged_best[0] * 1e3, staged_best[1] * 1e3);
  free(staged_ring[0]);
  free(staged_ring[1]);
}

int main(void) {
  pthread_t t;
  pthread_create(&t, NULL, pong, NULL);
  pin(0);
  const double t0 = now();
  for (long i = 0; i < kRoundTrips; ++i) {
    atomic_store_explicit(&ping, 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(&ping, memory_order_acquire) != 2 * i + 2) {
    }
  }
  const double dt = now() - t0;
  pthread_join(t, NULL);
  printf("flag round trip CPU 0 -> 1 -> 0: %.1f ns\n", dt / kRoundTrips * 1e9);
  // The all_reduce's pipeline: 128 KiB chunks, a ring of 4 (csrc/host/collectives.cc).
  static const size_t cells[][2] = {{16, 4}, {64, 4}, {128, 4}, {256, 4}, {64, 16}, {128, 8}, {128, 16}, {32, 32}};
  for (size_t i = 0; i < sizeof cells / sizeof cells[0]; ++i) stream(cells[i][0], cells[i][1]);
  staged_all_reduce();
  return 0;
}
