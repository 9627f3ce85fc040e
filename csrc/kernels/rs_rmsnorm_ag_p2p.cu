// Fused reduce-scatter -> residual add + RMSNorm -> all-gather over peer memory (TokenWeave's
// kernel, P2P variant), for token counts too large for the LL kernel (rs_rmsnorm_ag_p2p_ll.cu).
// Per chunk (the rows of every rank's slice that fit one workspace half, Note [token slices]; one
// kernel call runs one chunk or all of them, Note [fused p2p persistent]), block b of every rank
// works on the rows i = b (mod grid) of each owner's chunk:
//   phase A  push: copies those rows of x owned by each peer d into d's workspace, region X, slot
//            of this rank (Note [fused p2p workspace]); barrier kInputsReady.
//   phase B  reduce its own rows i: x from its own tensor and the peers' rows from its own region
//            X (local loads only), in rank order; add the residual; sum of squares in registers;
//            normalise; store out (and residual) locally and push the normalised row (sharded)
//            or the new residual row (replicated) into every peer's region O (R). Each row belongs to one
//            independent group of threads, up to 16 rows in flight per CTA (Note [fused p2p phase
//            B]); barrier kRowsPushed.
//   phase C  sharded: copy the other owners' rows i from its own region O to out; replicated:
//            normalise the other owners' new residual rows from region R itself (Note [fused p2p
//            residual gather]).
// Every NVLink transfer is a store (no remote load waits on a round trip), and every load is local,
// issued several packs per thread at once so that few SMs keep enough bytes in flight.
// Block b only exchanges rows i = b (mod grid) with block b of the peers, which is what the
// per-block barrier (Note [flag barrier]) orders. Arithmetic: Note [fused rmsnorm arithmetic]
// (explicit _rn intrinsics: no contraction).
//
// Note [fused p2p workspace]
// A chunk (collective call) uses the workspace half of its parity (Note [flag barrier]: writes
// before the first barrier must not touch the half a peer may still be reading from the previous
// call). Rank o's half holds two regions, each with world - 1 slots (rank s != o in slot
// peer_slot(s, o, world)) of chunk.capacity rows: X[s][i] is row i of o's chunk of s's x; then, in
// sharded mode O[d][i], row i of d's chunk of out, and in replicated mode R[d][i], row i of d's
// chunk of the new residual (Note [fused p2p residual gather]). Only o reads its own half.
//
// Note [fused p2p persistent]
// A half holds chunk.capacity rows per owner, so a large batch runs as several chunks; chunk k of a
// kernel call is collective call `call + k` (its flag values, Note [flag barrier]) and uses half
// (call + k) & 1. One kernel call runs all chunks, software-pipelined:
//   A0 | B0 | A1 C0 | B1 | A2 C1 | ... | C_last   (| is a barrier)
// so the gather's local copies (or local normalisation) of chunk k run while chunk k + 1's pushes
// are in flight. It beat one kernel call per chunk (each paying start-up, drain and its barriers'
// ramp) and one call running the chunks strictly in order (docs/fused.md, "Chunks").
// There are exactly two barriers per chunk, kInputsReady (after A) and kRowsPushed (after B), and
// none at the end: the halves alternate. Reuse of the halves within a call: block b of a
// rank exchanges only rows i = b (mod grid) with block b of the peers, at the same byte positions
// in every chunk (grid, capacity and slot stride are fixed for the call), and a block's barrier
// says only that the peers' block b arrived there (Note [flag barrier]). That suffices:
//   - A(k) writes half h = (call + k) & 1 of peer d's region X, rows i = b. Peer d's block b last
//     read them in B(k - 2), before its kRowsPushed arrival of chunk k - 2, which this block has
//     passed (it passed both barriers of chunk k - 1 since).
//   - B(k) writes half h of peer d's regions O / R, rows i = b. Peer d's block b last read them in
//     C(k - 2), which it runs before its kInputsReady arrival of chunk k - 1 (after A(k - 1));
//     this block has passed kInputsReady of chunk
//     k, so (flags only grow, the peer's arrivals are in order) that of k - 1 too.
//   - C(k) reads this rank's half h (O / R) after kRowsPushed of chunk k, which acquired the
//     peers' pushes of B(k). The peers write those positions next in B(k + 2), after passing
//     kInputsReady of chunk k + 2, which needs this block's arrival there, after its C(k).
//   - The loop runs A(k + 1) (the peers' half of chunk k + 1) next to C(k) (this rank's half of
//     chunk k): different halves, and different ranks' memory.
// Across kernel calls the first chunk relies on Note [flag barrier]'s argument: when this call
// starts, this rank's previous call has ended in every block, so every peer block of that call
// (same grid on every rank) has arrived at its last barrier, after every read of the other half.
// call_end(num_chunks) then advances the counter as num_chunks single-chunk calls would.
//
// Note [fused p2p residual gather]
// Replicated mode must leave every rank with all rows of out and of the new residual. Pushing both
// rows from the owner would send three slices per direction (x, out, residual) where NCCL's
// all-reduce sends two. Instead the owner pushes only the new residual row (region R), and in phase C every rank normalises the other
// owners' rows itself with phase B's row groups: reduce_row / normalise_row as RowSource::kGathered
// read the row from region R (one source, no reduction, no residual add), store it into `residual`,
// compute its q_k and the tree, and normalise it with the same weight. The q_k depend only on the
// rounded new residual, which is exactly what travelled, and the tree's bits do not depend on the
// group size (Note [fused p2p phase B]), so sumsq, rstd and out are the owner's bits. A half then
// holds two regions per slot, as in sharded mode, so chunks are 1.5x longer than with three.
// In this mode a rank does normalise rows it does not own, against the issue's rule. That rule
// saves arithmetic which NCCL + rms_norm repeats on every rank; in replicated mode the NVLink bytes,
// not the arithmetic, bound the time, and one more local pass over a row (HBM: ~10x the link's
// bandwidth) may cost less than sending the row. Measured on 2x H200 (hidden 8192; docs/fused.md):
// pushing both rows took 302.9 µs at 4096 tokens and 1149.4 µs at 16384, pushing the residual row
// only 204.7 and 775.5 µs.
//
// Note [fused p2p phase B]
// A row belongs to a group of G threads (a power of two, 32..512, warp-aligned; the launcher picks
// the largest G that still puts all of a block's rows of the call in flight at once, so G = 32,
// one warp per row and 16 rows per CTA, whenever a block has 16 rows or more). Groups never wait
// for each other: no __syncthreads, and a group of several warps meets only at its own named
// barrier, once per row. With P = the row's pack count padded to a power of two, thread l of the
// group owns the packs k = l + G * j, j < max(1, P / G), and handles a row in two passes:
//   pass 1  in steps of L packs (L = 4, 2, 1 for 2, 4, 8 ranks: bounded registers), loads every
//           source's pack and the old residual pack of the step before any arithmetic, reduces in
//           rank order, adds the residual, stores the new residual (locally; replicated: also into
//           every peer's region R) and keeps the pack's q_k (Note [fused rmsnorm arithmetic]).
//   pass 2  re-reads its new residual packs (its own stores, still in L2) and the weight,
//           normalises, stores out locally and into every peer's region O.
// Equal bits with the documented tree: its node at level m covers the packs whose index has the
// same low log2(P) - m bits, so thread l's packs (k = l mod G) are exactly the subtree of node l
// at the level where G nodes remain. The thread evaluates that subtree without holding all its
// leaves: it visits j in bit-reversed order, in which every subtree is a contiguous run, so each
// step's L leaves form one subtree (added pairwise) and a binary counter of pending subtrees (one
// register per level) adds two siblings as soon as both exist; additions are commutative, so only
// the tree's shape matters. Then levels G/2 .. 32 (node l + node l + half, across warps: shared
// memory, each warp of the group evaluating them itself) and 16 .. 1 (xor butterfly in the warp).
// Zero leaves beyond P (j padded up to L, lanes beyond P when P < 32) add exact zeros: a larger
// zero-padded tree has the same root. So G and L change only the order of work, never the bits.
#include <algorithm>

#include "commlib/device/barrier.cuh"
#include "commlib/device/dispatch.cuh"
#include "kernels/rs_rmsnorm_ag_common.cuh"

namespace commlib::kernels {
namespace {
using namespace fused_detail;

constexpr int kThreads = 512;                // per CTA: up to 16 rows in flight, <= 128 registers a thread
constexpr int kMaxGroups = kThreads / 32;    // row groups per CTA (one warp each at most)
constexpr int kCopyUnroll = 8;               // packs in flight per thread in phases A and C
constexpr int kOutPacks = 4;                 // packs per thread and step in phase B, pass 2
constexpr int kStackLevels = 6;              // pending subtrees of pass 1: steps per row <= 2^6
static_assert((kFusedMaxHidden / kGroup) / 32 <= (1 << kStackLevels), "pass 1 of a row has at most 64 steps");

// Where a phase-B/C row comes from (Note [fused p2p residual gather]): kReduce, a row this rank
// owns (every rank's x reduced in rank order, plus the old residual); kGathered, another owner's
// new residual row that landed in this rank's region R (one source, no reduction, no residual add).
enum class RowSource : int { kReduce, kGathered };

// Pass-1 packs per thread and step (L of Note [fused p2p phase B]): every source and the residual
// are loaded before the arithmetic, so the registers grow with the rank count.
template <int kCap>
constexpr int leaves_per_step() {
  return kCap <= 2 ? 4 : (kCap <= 4 ? 2 : 1);
}

// Rows per unit of work for the by-size CTA count (fused_rmsnorm_num_blocks): 512 threads of four
// packs per row, e.g. 2 rows of hidden 8192. Kept from the former block-wide row design, whose
// measurements chose the default cap (kFusedP2pDefaultMaxBlocks).
int64_t rows_per_work_unit(int64_t hidden) {
  return kThreads / std::clamp<int64_t>(next_pow2(hidden / kGroup) / 4, 32, kThreads);
}

// G of Note [fused p2p phase B] for a block with up to `rows_per_block` rows of the call: the most
// threads per row that still keep every row in flight at once (16 groups of a warp from 16 rows
// on), and no more than the row's padded pack count (more threads would only hold zeros).
int row_threads(int64_t hidden, int64_t rows_per_block) {
  const int64_t groups = std::clamp<int64_t>(next_pow2(std::max<int64_t>(rows_per_block, 1)), 1, kMaxGroups);
  return static_cast<int>(std::min<int64_t>(kThreads / groups, std::max<int64_t>(32, next_pow2(hidden / kGroup))));
}

// The smallest power of two >= v (v >= 1).
__device__ __forceinline__ int next_pow2_device(int v) { return v <= 1 ? 1 : 1 << (32 - __clz(v - 1)); }

// The low `bits` bits of t in reverse order (t < 2^bits).
__device__ __forceinline__ int bit_reverse(int t, int bits) {
  return bits == 0 ? 0 : static_cast<int>(__brev(static_cast<unsigned>(t)) >> (32 - bits));
}

// bar.sync on a named barrier for `count` threads (a multiple of 32): orders the participants'
// shared-memory accesses like __syncthreads, without waiting for the rest of the block.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// Copies rows m = 0 .. num_rows - 1 (src + m * stride -> dst + m * stride, num_packs packs each)
// with the whole block, kCopyUnroll 16-byte loads in flight per thread before their stores. A
// thread's flat pack index m * num_packs + k advances by blockDim.x per slot; its byte offset
// m * stride + 16 k follows by adds and one compare, not a division per pack.
__device__ __forceinline__ void block_copy_rows(int num_rows, int num_packs, const char* src, char* dst,
                                                size_t stride) {
  const int total = num_rows * num_packs;
  const int step = static_cast<int>(blockDim.x);
  const int t = static_cast<int>(threadIdx.x);
  if (t >= total) return;
  const int dm = step / num_packs;
  const int dk = step - dm * num_packs;
  const size_t advance = dm * stride + static_cast<size_t>(dk) * 16;  // offset change without a wrap
  const size_t wrap = stride - static_cast<size_t>(num_packs) * 16;     // extra when k passes the row end
  int k = t % num_packs;
  size_t off = (t / num_packs) * stride + static_cast<size_t>(k) * 16;
#pragma unroll 1
  for (int base = t; base < total; base += kCopyUnroll * step) {
    // Defined on every path: a slot left unloaded must not carry a value from the previous
    // iteration (the compiler would keep v[] alive across iterations, in local memory).
    uint4 v[kCopyUnroll] = {};
    size_t at[kCopyUnroll];  // the same offset in src and dst
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      at[u] = off;
      if (base + u * step < total) v[u] = device::ld_v4_u32(src + off);
      off += advance;
      k += dk;
      if (k >= num_packs) {
        k -= num_packs;
        off += wrap;
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (base + u * step < total) device::st_v4_u32(dst + at[u], v[u]);
    }
  }
}

// One row of phase B as seen by one thread of its group (Note [fused p2p phase B]).
template <int kCap>
struct RowRefs {
  const char* src[kCap];  // the row of rank s's x, s < world: rank order (Note [reduction order])
  char* peer[kCap];       // [step - 1]: row i of this rank's slot of rank (rank + step) % world's
                          // region X; + RowLayout::o_offset / r_offset for regions O and R
  char* residual;         // this rank's residual row (kReduce: read, then overwritten; kGathered: written)
  char* out;              // this rank's out row
};

struct RowLayout {
  int num_packs;      // packs of the row
  int group;          // G: threads per row
  int lane;           // this thread's index in its group
  int leaf_bits;      // log2 of the thread's leaf count, padded to at least a step
  int num_steps;      // pass-1 steps per row
  size_t o_offset;    // bytes from region X to region O, and to region R, in a workspace half
  size_t r_offset;
  bool push_out;       // kReduce rows: push the normalised row into every peer's region O
  bool push_residual;  // kReduce rows: push the new residual row into every peer's region R
};

// Pass 1 of Note [fused p2p phase B]: the new residual of this thread's packs, stored, and the
// root of this thread's subtree of q (levels P/2 .. G of the tree). kGathered (Note [fused p2p
// residual gather]): the new residual is src[0] as it is; it is stored and its q_k come from the
// same rounded values as on the owner, so the root has the owner's bits.
template <typename T, int kWorldSize, int kCap, RowSource kSource>
__device__ __forceinline__ float reduce_row(const RowRefs<kCap>& row, const RowLayout& lay, int world) {
  constexpr int kLeaves = leaves_per_step<kCap>();
  constexpr int kSources = kSource == RowSource::kReduce ? kCap : 1;
  float pending[kStackLevels] = {};  // pending[l]: a finished subtree of 2^l steps, its sibling not yet
  float node = 0.0f;
#pragma unroll 1
  for (int step = 0; step < lay.num_steps; ++step) {
    int at[kLeaves];  // byte offset of the leaf's pack in the row; -1: a zero leaf (no pack)
    uint4 xs[kLeaves][kSources] = {};  // defined on every path (see block_copy_rows)
    uint4 old[kLeaves] = {};
    // All loads of the step first (local memory only), then the arithmetic.
#pragma unroll
    for (int u = 0; u < kLeaves; ++u) {
      const int k = lay.lane + lay.group * bit_reverse(step * kLeaves + u, lay.leaf_bits);
      at[u] = k < lay.num_packs ? k * 16 : -1;
      if (at[u] < 0) continue;
#pragma unroll
      for (int s = 0; s < kSources; ++s) {
        if (kSource == RowSource::kGathered || kWorldSize > 0 || s < world) {
          xs[u][s] = device::ld_v4_u32(row.src[s] + at[u]);
        }
      }
      if constexpr (kSource == RowSource::kReduce) old[u] = device::ld_v4_u32(row.residual + at[u]);
    }
    float q[kLeaves];
#pragma unroll
    for (int u = 0; u < kLeaves; ++u) {
      q[u] = 0.0f;
      if (at[u] < 0) continue;
      float rf[kGroup];
      uint4 r;
      if constexpr (kSource == RowSource::kReduce) {
        float acc[kGroup];
#pragma unroll
        for (int e = 0; e < kGroup; ++e) acc[e] = raw_elem<T>(xs[u][0], e);
#pragma unroll
        for (int s = 1; s < kSources; ++s) {  // rank order (Note [reduction order])
          if (kWorldSize > 0 || s < world) {
#pragma unroll
            for (int e = 0; e < kGroup; ++e) acc[e] = __fadd_rn(acc[e], raw_elem<T>(xs[u][s], e));
          }
        }
        r = new_residual<T>(old[u], acc, rf);
      } else {
        r = xs[u][0];  // already rounded by its owner: the owner's rf below are these values
#pragma unroll
        for (int e = 0; e < kGroup; ++e) rf[e] = raw_elem<T>(r, e);
      }
      q[u] = sum_squares(rf);
      device::st_v4_u32(row.residual + at[u], r);
      if constexpr (kSource == RowSource::kReduce) {
        if (lay.push_residual) {
#pragma unroll
          for (int d = 0; d < kCap - 1; ++d) {
            if (kWorldSize > 0 || d < world - 1) device::st_v4_u32(row.peer[d] + lay.r_offset + at[u], r);
          }
        }
      }
    }
    // The step's leaves are one subtree (consecutive in bit-reversed order): add them pairwise.
#pragma unroll
    for (int h = 1; h < kLeaves; h *= 2) {
#pragma unroll
      for (int u = 0; u < kLeaves; u += 2 * h) q[u] = __fadd_rn(q[u], q[u + h]);
    }
    // Binary counter over steps: bit l of `step` set means a left sibling of 2^l steps is pending.
    // (No early exit: the loop unrolls completely, so pending[] stays in registers.)
    node = q[0];
    bool carry = true;
#pragma unroll
    for (int l = 0; l < kStackLevels; ++l) {
      if (carry) {
        if ((step >> l) & 1) {
          node = __fadd_rn(pending[l], node);
        } else {
          pending[l] = node;
          carry = false;
        }
      }
    }
  }
  return node;  // after the last step: the root of the thread's subtree
}

// Levels G/2 .. 32 of the tree for the warp lane l32, over the nodes l32 + 32 w (w < kWarps) in
// shared memory: the node covering the w = kA (mod kStride) is the sum of the nodes covering
// w = kA and w = kA + kStride (mod 2 kStride), as the stride-halving loop adds them. Recursion
// with constant indices, no array: everything stays in registers.
template <int kWarps, int kStride = 1, int kA = 0>
__device__ __forceinline__ float cross_warp_levels(const float* nodes, int l32) {
  if constexpr (kStride == kWarps) {
    return nodes[l32 + 32 * kA];
  } else {
    return __fadd_rn(cross_warp_levels<kWarps, 2 * kStride, kA>(nodes, l32),
                     cross_warp_levels<kWarps, 2 * kStride, kA + kStride>(nodes, l32));
  }
}

// Levels G/2 .. 1 of the tree over the group's per-thread roots (thread l holds node l); every
// thread of the group returns the row's sum of squares with the same bits. `scratch`: the
// group's G floats, not read by any group thread still in the previous use of the same buffer
// (callers alternate two buffers: a thread that writes buffer b for row n + 2 has passed the
// barrier of row n + 1, which every thread of the group reached after reading b for row n).
__device__ __forceinline__ float row_sum_squares(float node, float* scratch, int group, int lane,
                                                 int barrier_id) {
  if (group > 32) {
    scratch[lane] = node;
    named_barrier_sync(barrier_id, group);  // the group's roots are visible to all its warps
    // Every warp of the group does the same additions in the same order.
    const int l32 = lane & 31;
    switch (group / 32) {
      case 2: node = cross_warp_levels<2>(scratch, l32); break;
      case 4: node = cross_warp_levels<4>(scratch, l32); break;
      case 8: node = cross_warp_levels<8>(scratch, l32); break;
      default: node = cross_warp_levels<kMaxGroups>(scratch, l32); break;
    }
  }
  // Levels 16 .. 1: lanes l and l ^ half add the same two values, so all end with the root's bits.
#pragma unroll
  for (int half = 16; half >= 1; half /= 2) node = __fadd_rn(node, __shfl_xor_sync(0xffffffffu, node, half));
  return node;
}

// Pass 2 of Note [fused p2p phase B]: out = round((r * rstd) * w) for this thread's packs, stored
// locally and (kReduce, unless Note [fused p2p residual gather]) pushed into every peer's region O.
template <typename T, int kWorldSize, int kCap, RowSource kSource>
__device__ __forceinline__ void normalise_row(const RowRefs<kCap>& row, const RowLayout& lay, int world, float rstd,
                                              const char* weight) {
#pragma unroll 1
  for (int j0 = 0; lay.group * j0 < lay.num_packs; j0 += kOutPacks) {
    int at[kOutPacks];
    uint4 r[kOutPacks] = {}, w[kOutPacks] = {};
#pragma unroll
    for (int u = 0; u < kOutPacks; ++u) {
      const int k = lay.lane + lay.group * (j0 + u);
      at[u] = k < lay.num_packs ? k * 16 : -1;
      if (at[u] < 0) continue;
      // This thread's own stores of pass 1 (program order makes them visible to it).
      r[u] = device::ld_v4_u32(row.residual + at[u]);
      w[u] = device::ld_v4_u32(weight + at[u]);  // cache-resident: every row reads it
    }
#pragma unroll
    for (int u = 0; u < kOutPacks; ++u) {
      if (at[u] < 0) continue;
      const uint4 y = normalised<T>(r[u], rstd, w[u]);
      device::st_v4_u32(row.out + at[u], y);
      if constexpr (kSource == RowSource::kReduce) {
        if (lay.push_out) {
#pragma unroll
          for (int d = 0; d < kCap - 1; ++d) {
            if (kWorldSize > 0 || d < world - 1) device::st_v4_u32(row.peer[d] + lay.o_offset + at[u], y);
          }
        }
      }
    }
  }
}

// What one kernel call runs: chunks k < num_chunks, chunk k being rows first.offset + k *
// first.capacity onwards of every owner's slice, as collective call `call + k`.
struct FusedSchedule {
  int num_chunks = 1;
};

template <typename T, int kWorldSize>
__global__ void __launch_bounds__(kThreads, 1)
    rs_rmsnorm_ag_p2p_kernel(RsRmsNormAgP2pParams p, FusedChunk first, FusedSchedule sched, int group) {
  constexpr int kCap = kWorldSize > 0 ? kWorldSize : kMaxDeviceRanks;
  __shared__ float scratch[2][kThreads];  // row groups' roots, two buffers by row parity
  const device::CallInfo call = device::call_begin(p.barrier);
  if (!call.ok) return;
  const FusedRmsNormArgs& a = p.args;
  const int world = kWorldSize > 0 ? kWorldSize : p.barrier.world_size;
  const int rank = p.barrier.rank;
  const int num_packs = static_cast<int>(a.hidden / kGroup);
  const size_t row_bytes = static_cast<size_t>(a.hidden) * sizeof(T);
  const size_t slot_bytes = static_cast<size_t>(first.capacity) * row_bytes;
  const size_t region_bytes = static_cast<size_t>(world - 1) * slot_bytes;
  const bool replicated = a.mode == ResidualMode::kReplicated;
  // Regions of a half (Note [fused p2p workspace]): X, then O (sharded) or R (replicated).
  const size_t o_offset = region_bytes;
  const size_t r_offset = region_bytes;
  const int grid = static_cast<int>(gridDim.x);
  const int b = static_cast<int>(blockIdx.x);
  const size_t block_stride = static_cast<size_t>(grid) * row_bytes;  // between a block's rows
  // Row i of rank s's slot of the region at byte `region` of rank `owner`'s workspace half `half`.
  auto ws_row = [&](int owner, size_t half, size_t region, int s, int64_t i) {
    return p.workspace.peer<char>(owner) + half + region + peer_slot(s, owner, world) * slot_bytes + i * row_bytes;
  };
  // The half of collective call c (Note [flag barrier]).
  auto half_of = [&](uint64_t c) { return static_cast<size_t>(c & 1) * first.half_bytes; };
  auto chunk_at = [&](int k) {
    FusedChunk c = first;
    c.offset = first.offset + static_cast<int64_t>(k) * first.capacity;
    return c;
  };
  // Rows of `rows` this block handles: b, b + grid, ...
  auto block_rows = [&](const TokenSlice& rows) {
    const int64_t n = rows.size();
    return n > b ? static_cast<int>((n - b + grid - 1) / grid) : 0;
  };
  auto row_of = [&](int m) { return b + static_cast<int64_t>(m) * grid; };
  const char* x = static_cast<const char*>(a.x);
  char* out = static_cast<char*>(a.out);
  char* residual = static_cast<char*>(a.residual);  // full layout whenever replicated
  const char* weight = static_cast<const char*>(a.weight);

  // Row groups of phases B and C (Note [fused p2p phase B]).
  const int num_groups = kThreads / group;
  const int g = static_cast<int>(threadIdx.x) / group;
  constexpr int kLeaves = leaves_per_step<kCap>();
  RowLayout lay;
  lay.num_packs = num_packs;
  lay.group = group;
  lay.lane = static_cast<int>(threadIdx.x) & (group - 1);
  // The thread's leaves: P / G packs, at least one, padded with zero leaves to a whole step.
  const int per_thread = next_pow2_device(num_packs) / group;
  const int leaves = per_thread > kLeaves ? per_thread : kLeaves;
  lay.leaf_bits = __ffs(leaves) - 1;
  lay.num_steps = leaves / kLeaves;
  lay.o_offset = o_offset;
  lay.r_offset = r_offset;
  lay.push_out = !replicated;
  lay.push_residual = replicated;
  int parity = 0;  // scratch buffer of the group's next row; the same in all threads of a group

  // Phase A: push the rows of x the peers own into their region X.
  auto phase_a = [&](const FusedChunk& c, size_t half) {
    for (int step = 1; step < world; ++step) {
      const int d = (rank + step) % world;
      const TokenSlice rows = chunk_rows(a, c, world, d);
      block_copy_rows(block_rows(rows), num_packs, x + (rows.begin + b) * row_bytes, ws_row(d, half, 0, rank, b),
                      block_stride);
    }
  };

  // Phase B: group g of this block reduces, adds, normalises and pushes the block's rows g,
  // g + groups, ... (Note [fused p2p phase B]); packs stay raw (Note [raw packs]).
  auto phase_b = [&](const FusedChunk& c, size_t half) {
    const TokenSlice mine = chunk_rows(a, c, world, rank);
    const int64_t own_begin = token_slice(a.num_tokens, world, rank).begin;
    const int my_rows = block_rows(mine);
    const char* x_peers = ws_row(rank, half, 0, (rank + 1) % world, 0);  // slot 0; slot s at + s * slot_bytes
#pragma unroll 1
    for (int m = g; m < my_rows; m += num_groups, parity ^= 1) {  // trip count uniform in the group
      const int64_t i = row_of(m);
      const int64_t token = mine.begin + i;
      RowRefs<kCap> row;
#pragma unroll
      for (int s = 0; s < kCap; ++s) {
        if (kWorldSize == 0 && s >= world) continue;
        row.src[s] =
            s == rank ? x + token * row_bytes : x_peers + peer_slot(s, rank, world) * slot_bytes + i * row_bytes;
      }
#pragma unroll
      for (int d = 0; d < kCap - 1; ++d) {
        if (kWorldSize == 0 && d >= world - 1) continue;
        row.peer[d] = ws_row((rank + d + 1) % world, half, 0, rank, i);
      }
      row.residual = reinterpret_cast<char*>(residual_row<T>(a, own_begin, token));
      row.out = out + token * row_bytes;
      const float node = reduce_row<T, kWorldSize, kCap, RowSource::kReduce>(row, lay, world);
      const float sumsq = row_sum_squares(node, &scratch[parity][g * group], group, lay.lane, 1 + g);
      normalise_row<T, kWorldSize, kCap, RowSource::kReduce>(row, lay, world, row_rstd(sumsq, a.hidden, a.eps),
                                                             weight);
    }
  };

  // Phase C: the other owners' rows, from this rank's own region O (sharded), or normalised here
  // from region R (replicated; Note [fused p2p residual gather]).
  auto phase_c = [&](const FusedChunk& c, size_t half) {
    for (int step = 1; step < world; ++step) {
      const int d = (rank + step) % world;
      const TokenSlice rows = chunk_rows(a, c, world, d);
      const int n = block_rows(rows);
      if (replicated) {
#pragma unroll 1
        for (int m = g; m < n; m += num_groups, parity ^= 1) {  // trip count uniform in the group
          const int64_t i = row_of(m);
          const int64_t token = rows.begin + i;
          RowRefs<kCap> row;  // kGathered reads src[0], residual and out only
          row.src[0] = ws_row(rank, half, r_offset, d, i);
          row.residual = residual + token * row_bytes;
          row.out = out + token * row_bytes;
          const float node = reduce_row<T, kWorldSize, kCap, RowSource::kGathered>(row, lay, world);
          const float sumsq = row_sum_squares(node, &scratch[parity][g * group], group, lay.lane, 1 + g);
          normalise_row<T, kWorldSize, kCap, RowSource::kGathered>(row, lay, world,
                                                                   row_rstd(sumsq, a.hidden, a.eps), weight);
        }
      } else {
        block_copy_rows(n, num_packs, ws_row(rank, half, o_offset, d, b), out + (rows.begin + b) * row_bytes,
                        block_stride);
      }
    }
  };

  // Chunk k is call call + k in half (call + k) & 1; the reuse of the halves across chunks and
  // the two barriers per chunk: Note [fused p2p persistent].
#pragma unroll 1
  for (int k = 0; k < sched.num_chunks; ++k) {
    const uint64_t call_k = call.call + static_cast<uint64_t>(k);
    const FusedChunk cur = chunk_at(k);
    phase_a(cur, half_of(call_k));
    // The previous chunk's gather runs while this chunk's pushes are in flight (other half).
    if (k > 0) phase_c(chunk_at(k - 1), half_of(call_k - 1));
    // Publishes this block's pushes to the peers' block b; acquires the rows they pushed here.
    if (!device::barrier_block<Phase::kInputsReady>(p.barrier, call_k)) return;
    phase_b(cur, half_of(call_k));
    // Publishes this block's pushed rows to the peers' block b; acquires the rows they pushed here.
    if (!device::barrier_block<Phase::kRowsPushed>(p.barrier, call_k)) return;
  }
  const int last = sched.num_chunks - 1;
  phase_c(chunk_at(last), half_of(call.call + static_cast<uint64_t>(last)));
  device::call_end(p.barrier, static_cast<uint64_t>(sched.num_chunks));
}

template <typename T, int kWorldSize>
Status launch_typed(const RsRmsNormAgP2pParams& params, const FusedChunk& chunk, const FusedSchedule& sched,
                    int blocks, int group, Stream stream) {
  return launch_kernel("fused_allreduce_rmsnorm(p2p)", rs_rmsnorm_ag_p2p_kernel<T, kWorldSize>,
                       {dim3(blocks), dim3(kThreads)}, reinterpret_cast<cudaStream_t>(stream), LaunchOrder::kStream,
                       params, chunk, sched, group);
}

}  // namespace

namespace fused_detail {

Status check_p2p_args(const char* what, const FusedRmsNormArgs& a, const BarrierDevice& barrier) {
  const int world = barrier.world_size;
  if (a.dtype != DataType::kBFloat16 && a.dtype != DataType::kFloat16) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": dtype ", dtype_name(a.dtype),
                                                               " not supported on GPU; supported: bfloat16, float16"));
  }
  if (a.hidden < kGroup || a.hidden % kGroup != 0 || a.hidden > kFusedMaxHidden) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": hidden size ", a.hidden, " not supported; supported: multiples of ", kGroup,
                                 " up to ", kFusedMaxHidden));
  }
  if (world < 1 || world > kMaxDeviceRanks || barrier.rank < 0 || barrier.rank >= world) {
    return Status(StatusCode::kInvalidArgument, detail::concat(what, ": world_size ", world, " / rank ", barrier.rank,
                                                               " invalid; supported: 1..", kMaxDeviceRanks));
  }
  if (a.num_tokens > 0 && (!aligned16(a.x) || !aligned16(a.out) || !aligned16(a.residual) || !aligned16(a.weight))) {
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(what, ": x, residual, weight and out must be 16-byte aligned"));
  }
  return Status::ok();
}

}  // namespace fused_detail


Status launch_rs_rmsnorm_ag_p2p(const RsRmsNormAgP2pParams& params, Stream stream) {
  const char* what = "fused_allreduce_rmsnorm(p2p)";
  const FusedRmsNormArgs& a = params.args;
  const int world = params.barrier.world_size;
  Status status = check_p2p_args(what, a, params.barrier);
  if (!status.is_ok() || a.num_tokens == 0) return status;
  FusedSchedule sched;
  const size_t row_bytes = static_cast<size_t>(a.hidden) * dtype_size(a.dtype);
  // Regions X, and O (sharded) or R (replicated): Note [fused p2p workspace].
  const size_t regions = 2;
  FusedChunk chunk{};
  chunk.half_bytes = params.workspace.bytes / 2 / 256 * 256;
  const int64_t per_rank = (a.num_tokens + world - 1) / world;
  chunk.capacity = per_rank;
  if (world > 1) {
    const size_t per_row = regions * static_cast<size_t>(world - 1) * row_bytes;
    const int64_t fit = static_cast<int64_t>(chunk.half_bytes / per_row);
    if (fit < 1) {
      return Status(StatusCode::kInvalidArgument,
                    detail::concat(what, ": one row needs ", 2 * per_row, " bytes of GPU workspace but it has ",
                                   params.workspace.bytes, "; raise COMMLIB_GPU_WORKSPACE_BYTES"));
    }
    chunk.capacity = std::min(fit, per_rank);
  }
  // A chunk is what a half holds. Shorter chunks, whose gather the pipelined loop overlaps with the
  // next chunk's push (Note [fused p2p persistent]), were slower on 2x H200 (hidden 8192): 128- or
  // 256-row chunks at 1024-4096 tokens (docs/fused.md, "Chunks"); the two barriers per chunk cost
  // more than the overlap. One exception:
  if (world > 1 && a.mode == ResidualMode::kReplicated) {
    // Replicated mode's residual gather (a local normalisation per gathered row) is what the loop
    // overlaps best: a slice of more than kFusedRepSplitBytes that would otherwise run as one chunk,
    // or as one full chunk and a short one, runs in chunks of that size. On 2x H200 (hidden 8192:
    // 512-row chunks) 2048 tokens took 110.0-113.9 instead of 114.1-116.0 µs, 2560 tokens
    // 136.4-137.2 instead of 140.3-141.8; 4096-16384 tokens, already two chunks or more, were
    // 1-2 % slower in such chunks, and sharded mode was slower at every size (docs/fused.md,
    // "Chunks"). With the default workspace only 2 ranks have halves larger
    // than the split.
    const int64_t split = std::max<int64_t>(1, static_cast<int64_t>(kFusedRepSplitBytes / row_bytes));
    if (per_rank > split && 2 * per_rank < 3 * chunk.capacity) chunk.capacity = std::min(chunk.capacity, split);
  }
  const int64_t num_chunks = (per_rank + chunk.capacity - 1) / chunk.capacity;
  const int64_t rows_per_unit = rows_per_work_unit(a.hidden);
  const int cap = params.config.tuned_max_blocks > 0 ? params.config.tuned_max_blocks : kFusedP2pDefaultMaxBlocks;
  const int blocks = fused_rmsnorm_num_blocks(params.num_blocks, cap,
                                              (chunk.capacity + rows_per_unit - 1) / rows_per_unit);
  // Only the order of work depends on the group size, never the bits (Note [fused p2p phase B]).
  const int group = row_threads(a.hidden, (chunk.capacity + blocks - 1) / blocks);
  const auto launch = [&]<typename T>() {
    return COMMLIB_DISPATCH_WORLD_SIZE(world, kWorldSize, [&] {
      return launch_typed<T, kWorldSize>(params, chunk, sched, blocks, group, stream);
    });
  };
  const auto launch_chunks = [&] {
    return a.dtype == DataType::kBFloat16 ? launch.template operator()<__nv_bfloat16>()
                                          : launch.template operator()<__half>();
  };
  // One call for every chunk (Note [fused p2p persistent]).
  sched.num_chunks = static_cast<int>(num_chunks);
  chunk.offset = 0;
  return launch_chunks();
}

}  // namespace commlib::kernels
