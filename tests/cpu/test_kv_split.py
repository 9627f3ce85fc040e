"""The KV copy kernel's split of a launch over its CTAs, layers side by side (Note [kv copy
geometry]): tests/cpp/kv_split_check.cc, built with the host compiler against
csrc/kernels/kv_copy_params.hpp (the functions the kernel calls), walks every CTA's parts as the
kernel does and checks that each unit of each layer has one owner and each layer's flags are
published once, by the part whose count completes it."""
from host_check import run_host_check


def test_kv_split_covers_every_unit_once(tmp_path):
    run_host_check("kv_split_check", tmp_path, includes=("include", "csrc"))
