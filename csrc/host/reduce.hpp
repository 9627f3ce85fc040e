// Vectorised CPU reduction used by every host collective.
//
// Note [reduction order]
// Every algorithm (flat, tree, fused; CPU and GPU) reduces in fp32, adding the ranks' values in
// rank order 0, 1, ..., n-1 starting from rank 0's value, and rounds once to the element type at
// the end; avg divides the fp32 sum by n (IEEE division). So every algorithm gives the same bits
// for the same inputs, on every rank.
#pragma once

#include <cstddef>
#include <cstdint>

#include "commlib/types.hpp"

namespace commlib::host {

// out[i] = reduce(op, srcs[0][i], ..., srcs[num_srcs - 1][i]) for i < count. `out` may alias a
// source (each block is read fully before it is written). `divisor` is the avg's n.
void reduce(void* out, const void* const* srcs, int num_srcs, size_t count, DataType dtype, ReduceOp op,
            int divisor);

float to_float(uint16_t bits, DataType dtype);
uint16_t from_float(float value, DataType dtype);

}  // namespace commlib::host
