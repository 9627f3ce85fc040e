"""The C++ API on GPU without Python: tests/cpp/commlib_example.cc --gpu runs all_reduce_gpu,
fused_allreduce_rmsnorm_gpu (LL and barrier kernels) and EPBufferGpu dispatch / combine through
include/commlib only, ranks as threads of one process, one GPU each (threads of one process cannot
share a GPU: their spinning kernels would need to be resident at once), each result checked against
an fp64 reference by the program itself (poisoned outputs)."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpp"))
from cpp_example_build import build_dir, build_example  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world_size", [1, 2])
def test_cpp_example_gpu(world_size):
    import torch
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs: the example's ranks are threads, one GPU each")
    if build_dir() is None:
        pytest.skip("no CMake build directory of the extension; run `make build`")
    example = build_example()
    result = subprocess.run([str(example), "--world", str(world_size), "--gpu"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"OK world {world_size}:") and "and GPU" in result.stdout
