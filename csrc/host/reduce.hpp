// Vectorised CPU reduction used by every host collective.
//
// Note [reduction order]
// Every algorithm (flat, tree, fused; CPU and GPU) reduces in fp32, adding the ranks' values in
// rank order 0, 1, ..., n-1 starting from rank 0's value, and rounds once to the element type at
// the end; avg divides the fp32 sum by n (IEEE division). So every algorithm gives the same bits
// for the same inputs, on every rank. float64, integer and bool types reduce in their own type in
// the same rank order (Note [host exact reduction], csrc/host/reduce.cc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "commlib/types.hpp"

namespace commlib::host {

// Note [host streaming stores]
// A large message's result is not read again before it leaves the caches, so writing it with
// ordinary stores makes DRAM carry every output line twice: read for ownership, then written
// back. Non-temporal (streaming) stores write whole lines without reading them. They are weakly
// ordered: a caller that streamed must call store_fence() before another thread may rely on the
// data (the collectives do so once, at their end). Shared-memory buffers that a peer reads next
// keep ordinary stores, so the data is still in cache when the peer reads it.
enum class StoreMode {
  kCached,     // ordinary stores
  kStreaming,  // non-temporal stores where `out` is 16-byte aligned (ordinary stores otherwise)
};

// Whether the CPU reduction supports `op` on `dtype` (gloo's set): avg needs a floating dtype,
// band / bor / bxor an integer or bool one; every other pair is supported.
bool supports(DataType dtype, ReduceOp op);

// out[i] = reduce(op, srcs[0][i], ..., srcs[num_srcs - 1][i]) for i < count. `out` may alias a
// source (each block is read fully before it is written). `divisor` is the avg's n. When `copy`
// is given, the result is also written there (with ordinary stores, in the same pass); `copy`
// must not overlap a source or `out`.
void reduce(void* out, const void* const* srcs, int num_srcs, size_t count, DataType dtype, ReduceOp op,
            int divisor, StoreMode out_mode = StoreMode::kCached, void* copy = nullptr);

// memcpy (non-overlapping) with the given store mode.
void copy(void* dst, const void* src, size_t bytes, StoreMode mode);

// Orders this thread's earlier streaming stores before its later stores (Note [host streaming stores]).
void store_fence();

float to_float(uint16_t bits, DataType dtype);
uint16_t from_float(float value, DataType dtype);

}  // namespace commlib::host
