"""device::FastDiv, the multiply-and-shift division the KV copy and the attention-state merge use
for row indices below 2^31: tests/cpp/fast_div_check.cc, built with the host compiler against
include/commlib/device/fast_div.cuh (the same arithmetic as on the GPU, __umulhi spelled out),
compares it with n / d over every divisor up to 4096, powers of two and their neighbours, large
primes and 2^31, at the numerators around multiples of d, the top of the range and random ones."""
from host_check import run_host_check


def test_fast_div_matches_division(tmp_path):
    run_host_check("fast_div_check", tmp_path)
