"""How fast one process reads another's memory with process_vm_readv (Linux cross-memory attach),
against memcpy: the question was whether the CPU in-place all_reduce could read the peer's tensor
directly instead of copying it through shared memory (bench/results/cpu-cma-2026-12-01.md).

    python bench/cpu_cma_probe.py [MiB]

A forked child holds a buffer; the parent reads it whole, then in chunks of 64 KiB..4 MiB into a
small reused buffer, best of 5 each; then memcpy of the same size.
"""
import ctypes
import os
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def main():
    size = int(sys.argv[1] if len(sys.argv) > 1 else 32) << 20
    buf = ctypes.create_string_buffer(b"x" * 16, size)
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the peer: publishes its buffer's address and waits
        os.write(w, str(ctypes.addressof(buf)).encode().ljust(32))
        os.read(r2, 1)
        os._exit(0)
    addr = int(os.read(r, 32))
    for chunk in (size, 64 << 10, 256 << 10, 1 << 20, 4 << 20):
        dst = ctypes.create_string_buffer(chunk)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for off in range(0, size, chunk):
                local, remote = IoVec(ctypes.addressof(dst), chunk), IoVec(addr + off, chunk)
                if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != chunk:
                    raise OSError(ctypes.get_errno(), "process_vm_readv")
            best = min(best, time.perf_counter() - t0)
        print(f"process_vm_readv, {chunk >> 10} KiB chunks: {best * 1e3:.2f} ms ({size / best / 1e9:.1f} GB/s)")
    big = ctypes.create_string_buffer(size)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        ctypes.memmove(big, buf, size)
        best = min(best, time.perf_counter() - t0)
    print(f"memcpy: {best * 1e3:.2f} ms ({size / best / 1e9:.1f} GB/s)")
    os.write(w2, b"x")
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
