// Parameters and launcher of the bounded flag wait of CUDA point-to-point (csrc/kernels/p2p_wait.cu;
// Note [cuda p2p] in csrc/cuda/cuda_p2p.hpp). Host-compilable; no torch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "commlib/errors.hpp"

struct CUstream_st;

namespace commlib::kernels {

using Stream = CUstream_st*;

// One slot's signal word and the header of the message whose first chunk the slot holds, in the
// receiver's symmetric memory; written by the sender (stream memory operations), read by the
// receiver's wait.
struct P2pSlotHeader {
  uint32_t ready;  // 1: the slot holds a chunk (the receiver resets it to 0)
  int32_t tag;
  uint32_t bytes_lo;
  uint32_t bytes_hi;
  uint32_t dtype;
  uint32_t pad[3];
};
static_assert(sizeof(P2pSlotHeader) == 32);

enum class P2pFailure : uint32_t { kNone = 0, kTimeout = 1, kMismatch = 2 };
enum class P2pRole : uint32_t { kSend = 0, kRecv = 1 };

// Host-mapped record of the first failed wait of a rank's P2P channels. `failed` is stored last
// (release), so a host that reads failed == 1 sees the other fields.
struct P2pErrorWord {
  uint32_t failed;
  uint32_t failure;  // P2pFailure
  uint32_t role;     // P2pRole of the wait that failed
  int32_t rank;
  int32_t peer;
  int32_t lane;
  int32_t expected_tag;
  int32_t got_tag;
  uint32_t expected_dtype;
  uint32_t got_dtype;
  uint64_t expected_bytes;
  uint64_t got_bytes;
  uint64_t elapsed_ns;
};

struct P2pWaitParams {
  uint32_t* flag = nullptr;  // this rank's word (a slot's ready, or a busy word)
  uint32_t expected = 0;     // wait until *flag == expected
  uint32_t next = 0;         // then store this (the word's next state)
  // Receiver, first chunk of a message: the header to compare with the receive; else null.
  const P2pSlotHeader* header = nullptr;
  // Sender, first chunk of a message: the receiver's header to fill with tag, dtype and bytes after
  // the wait (before the chunk's ready word, which a later stream write sets); else null.
  P2pSlotHeader* fill = nullptr;
  int32_t tag = 0;
  uint32_t dtype = 0;
  uint64_t bytes = 0;
  uint32_t* poisoned = nullptr;  // device memory: set by the first failure; later waits return at once
  P2pErrorWord* error = nullptr;  // host-mapped
  uint64_t timeout_ns = 0;
  int32_t rank = 0;
  int32_t peer = 0;
  int32_t lane = 0;
  P2pRole role = P2pRole::kRecv;
};

Status launch_p2p_wait(const P2pWaitParams& params, Stream stream);

}  // namespace commlib::kernels
