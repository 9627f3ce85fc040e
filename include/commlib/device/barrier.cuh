// Per-block flag barrier across the ranks of a communicator, with bounded waits.
//
// Note [flag barrier]
// Each rank owns a signal pad (symmetric memory): flags[block][peer], written only by `peer`.
// A collective call has a number `call` (BarrierCallState::calls, one count per block index: block
// b reads calls[b] at kernel start with call_begin and advances it with call_end, block 0 also
// advancing the counts of the indices the grid does not use, so every count is the same again when
// the kernel ends: no atomic, no fence, nothing shared between the blocks) and up to
// kBarrierPhasesPerCall barrier phases (0 .. kBarrierPhasesPerCall - 1). At phase p, block b of rank r stores
// call * kBarrierPhasesPerCall + p + 1 into flags[b][r] of every peer (release, system scope:
// publishes every write this block made before the barrier), then waits until its own
// flags[b][q] reaches that value for every peer q (acquire, system scope: makes the peers'
// published writes visible to this block). Values only grow, so nothing is ever reset, and a peer
// that is already further ahead satisfies the wait.
// Consequences kernels rely on: blocks only synchronise with the block of the same index on the
// peers, so block b of every rank must touch the same data; and since kernels of one communicator
// run in stream order, once any block of call k has passed a barrier, every peer has finished call
// k - 1 entirely (so two alternating workspace halves need no trailing barrier). A kernel may run
// several consecutive calls in one launch (call_end's num_calls): between two calls of the same
// launch, passing a barrier of call k tells block b only that block b of every peer has finished
// its own part of call k - 1, so such a kernel must give block b the same data in every call.
// Every wait is bounded by BarrierDevice::timeout_ns: on expiry the first waiter records rank,
// peer, phase, block and elapsed time in the host-mapped DeviceErrorWord, the state is poisoned
// (later calls return at once, and waits still spinning in this call give up) and the kernel
// returns; the host raises Timeout naming them.
#pragma once

#include <cstdint>

#include "commlib/device/ptx.cuh"
#include "commlib/phase.hpp"
#include "commlib/symmetric_buffer.hpp"

namespace commlib::device {

struct CallInfo {
  uint64_t call;
  bool ok;  // false: the communicator is poisoned, return at once
};

// Every thread of every block calls this first.
__device__ __forceinline__ CallInfo call_begin(const BarrierDevice& bar) {
  CallInfo info;
  info.call = ld_volatile_u64(&bar.state->calls[blockIdx.x]);
  info.ok = ld_volatile_u32(&bar.state->poisoned) == 0;
  return info;
}

// Every block calls this last (all threads), unless a wait failed. A kernel that runs several
// calls in one launch (calls call .. call + num_calls - 1, each with its own barrier phases)
// advances the count by num_calls, so the next kernel sees the number that many launches would.
// (One-dimensional grids of at most kMaxBarrierBlocks blocks, as every barrier user launches.)
__device__ __forceinline__ void call_end(const BarrierDevice& bar, uint64_t num_calls = 1) {
  __syncthreads();  // every thread of the block read calls[b] at its start
  uint64_t* calls = bar.state->calls;
  if (threadIdx.x == 0) calls[blockIdx.x] += num_calls;
  if (blockIdx.x == 0) {  // the indices no block of this grid holds (the next kernel may use them)
    for (unsigned i = gridDim.x + threadIdx.x; i < static_cast<unsigned>(kMaxBarrierBlocks); i += blockDim.x) {
      calls[i] += num_calls;
    }
  }
}

// Out of line and by value (never a reference to a kernel parameter, which would copy the
// parameter block to local memory in every thread).
__device__ __noinline__ inline void record_timeout(BarrierCallState* state, DeviceErrorWord* error, int rank, int peer,
                                                   int phase, uint64_t elapsed, uint64_t call) {
  // The first waiter to fail on this rank claims the record (device memory: no atomics on the
  // host-mapped word, which PCIe need not support).
  if (atomicCAS(&state->poisoned, 0u, 1u) == 0u) {
    error->rank = rank;
    error->peer = peer;
    error->phase = phase;
    error->block = static_cast<int32_t>(blockIdx.x);
    error->elapsed_ns = elapsed;
    error->call = call;
    // Publishes the fields above to the host before `failed`.
    st_release_sys_u32(&error->failed, 1u);
  }
}

__device__ __forceinline__ void record_timeout(const BarrierDevice& bar, int peer, int phase, uint64_t elapsed,
                                               uint64_t call) {
  record_timeout(bar.state, bar.error, bar.rank, peer, phase, elapsed, call);
}

// Waits (this thread) until *flag >= value, acquire at system scope: what the writer published
// before its release store of that value is then visible to this thread. Bounded: false when
// BarrierDevice::timeout_ns passed (the first such waiter records peer and phase and poisons the
// state) or when another wait of this rank already failed (poisoned: the other waits stop instead
// of each running out its own timeout).
__device__ __forceinline__ bool wait_flag(const BarrierDevice& bar, const uint64_t* flag, uint64_t value, int peer,
                                          int phase, uint64_t call) {
  if (ld_acquire_sys_u64(flag) >= value) return true;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (ld_acquire_sys_u64(flag) < value) {
    if ((++spins & 255u) == 0u) {
      if (ld_volatile_u32(&bar.state->poisoned) != 0) return false;
      const uint64_t elapsed = globaltimer_ns() - start;
      if (elapsed > bar.timeout_ns) {
        record_timeout(bar, peer, phase, elapsed, call);
        return false;
      }
    }
  }
  return true;
}

// How a block announces that it reached a barrier phase.
enum class BarrierArrival {
  kRelease,  // after a block-wide sync, with release semantics: publishes the block's earlier writes
  kRelaxed,  // at once, relaxed: for a phase that publishes nothing this kernel wrote (the waiting
             // side still acquires, so what the peer published before its arrival stays ordered)
};

// Block-wide barrier with the same block index on every peer (Note [flag barrier]), at phase
// kPhase of the call. Returns false on every thread of the block if a wait timed out (the caller
// must return).
template <Phase kPhase>
__device__ __forceinline__ bool barrier_block(const BarrierDevice& bar, uint64_t call,
                                              BarrierArrival arrival = BarrierArrival::kRelease) {
  // The flag carries call * kBarrierPhasesPerCall + phase + 1: a phase at or above
  // kBarrierPhasesPerCall would store a value of a later call, whose wait it would then satisfy
  // before that call's peers arrive (the next kernel would read a peer's data before it was pushed).
  static_assert(static_cast<int>(kPhase) >= 0 && static_cast<int>(kPhase) < kBarrierPhasesPerCall,
                "a barrier phase must be below kBarrierPhasesPerCall (Note [flag barrier])");
  constexpr int phase = static_cast<int>(kPhase);
  // This block's writes happen-before the release below (CTA scope, then cumulative). A relaxed
  // arrival publishes nothing, so its thread need not wait for the rest of the block.
  if (arrival == BarrierArrival::kRelease) __syncthreads();
  const int t = static_cast<int>(threadIdx.x);
  int failed = 0;
  if (t < bar.world_size && t != bar.rank) {
    const uint64_t value = call * kBarrierPhasesPerCall + static_cast<uint64_t>(phase) + 1;
    uint64_t* theirs = bar.flags[t] + blockIdx.x * kMaxDeviceRanks + bar.rank;
    if (arrival == BarrierArrival::kRelease) {
      // Publishes this block's writes to peer t: its wait acquires this flag.
      st_release_sys_u64(theirs, value);
    } else {
      // Publishes nothing: only says that this block reached the phase.
      st_relaxed_sys_u64(theirs, value);
    }
    const uint64_t* mine = bar.flags[bar.rank] + blockIdx.x * kMaxDeviceRanks + t;
    // Makes peer t's writes before its release visible to this block (with the __syncthreads below).
    failed = wait_flag(bar, mine, value, t, phase, call) ? 0 : 1;
  }
  return __syncthreads_or(failed) == 0;
}

}  // namespace commlib::device
