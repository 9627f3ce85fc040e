// Note [nccl shim trampolines]
// The real NCCL exports functions nccl.h does not declare: the host side of its device API
// (nccl_device/*.h: ncclDevCommCreate, ncclTeamWorld, ...; torch links against some of them, so
// a shim without them cannot stand in for libnccl.so.2 at all) and a few internal ones. Their
// types live in headers that need nvcc, and some take or return structures by value, so the shim
// forwards them without knowing their types: each exported entry point (generated, x86-64 only)
// puts its index in r11 and jumps to commlib_nccl_shim_trampoline below, which saves every
// argument register, asks commlib_nccl_shim_resolve for the real function (and, for a function
// whose first argument is a communicator, the real communicator inside the shim's), restores the
// registers with that first argument swapped in, and tail-jumps: the real function returns
// straight to the caller, whatever it returns. A function returning a structure in memory (the
// hidden pointer is then the first argument) cannot take a swapped communicator; none does today.
#include <cstdint>

#include "nccl_shim/shim.hpp"

namespace commlib::nccl_shim {
namespace {

// Why the last trampoline call on this thread could not reach the real NCCL.
thread_local ncclResult_t pending_error = ncclSuccess;

ncclResult_t return_pending_error() { return pending_error; }

}  // namespace
}  // namespace commlib::nccl_shim

// The real function and first argument for trampoline `index` (returned in rax:rdx).
struct ResolvedCall {
  void* target;
  void* first;
};

extern "C" __attribute__((visibility("hidden"), used)) ResolvedCall commlib_nccl_shim_resolve(uint32_t index,
                                                                                               void* first) {
  namespace shim = commlib::nccl_shim;
  ResolvedCall call{reinterpret_cast<void*>(&shim::return_pending_error), first};
  if (index >= shim::kNumTrampolines) {
    shim::pending_error = shim::fail(ncclInternalError, "nccl shim: trampoline index out of range");
    return call;
  }
  const shim::TrampolineEntry& entry = shim::kTrampolines[index];
  if (entry.first_arg == shim::FirstArg::kComm) {
    ncclComm_t inner = nullptr;
    const ncclResult_t r =
        shim::real_comm(static_cast<ncclComm_t>(first), entry.name, shim::RealComm::kCreate, &inner);
    if (r != ncclSuccess) {
      shim::pending_error = r;
      return call;
    }
    call.first = inner;
  }
  if (void* fn = shim::symbol(entry.name)) {
    call.target = fn;
  } else {
    shim::pending_error = shim::missing(entry.name);
  }
  return call;
}

#if defined(__x86_64__)
// rdi, rsi, rdx, rcx, r8, r9 and xmm0-7 carry arguments (System V); r11 is free at a call.
asm(R"(
  .text
  .p2align 4
  .globl commlib_nccl_shim_trampoline
  .hidden commlib_nccl_shim_trampoline
  .type commlib_nccl_shim_trampoline,@function
commlib_nccl_shim_trampoline:
  push %rbp
  mov %rsp, %rbp
  sub $176, %rsp
  mov %rdi, 0(%rsp)
  mov %rsi, 8(%rsp)
  mov %rdx, 16(%rsp)
  mov %rcx, 24(%rsp)
  mov %r8, 32(%rsp)
  mov %r9, 40(%rsp)
  movdqu %xmm0, 48(%rsp)
  movdqu %xmm1, 64(%rsp)
  movdqu %xmm2, 80(%rsp)
  movdqu %xmm3, 96(%rsp)
  movdqu %xmm4, 112(%rsp)
  movdqu %xmm5, 128(%rsp)
  movdqu %xmm6, 144(%rsp)
  movdqu %xmm7, 160(%rsp)
  mov %r11d, %edi
  mov 0(%rsp), %rsi
  call commlib_nccl_shim_resolve
  mov %rax, %r11
  mov %rdx, %rdi
  mov 8(%rsp), %rsi
  mov 16(%rsp), %rdx
  mov 24(%rsp), %rcx
  mov 32(%rsp), %r8
  mov 40(%rsp), %r9
  movdqu 48(%rsp), %xmm0
  movdqu 64(%rsp), %xmm1
  movdqu 80(%rsp), %xmm2
  movdqu 96(%rsp), %xmm3
  movdqu 112(%rsp), %xmm4
  movdqu 128(%rsp), %xmm5
  movdqu 144(%rsp), %xmm6
  movdqu 160(%rsp), %xmm7
  leave
  jmp *%r11
  .size commlib_nccl_shim_trampoline, .-commlib_nccl_shim_trampoline
)");
#endif
