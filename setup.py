"""Thin driver: runs CMake against the installed torch and packages python/commlib.

    pip install --no-build-isolation -e .     # torch must already be installed

Environment: CUDA_HOME (default /usr/local/cuda) locates nvcc; COMMLIB_NO_CUDA=1 skips the CUDA
sources; COMMLIB_NO_NVSHMEM=1 skips the NVSHMEM EP kernels (built when the nvidia-nvshmem wheel is
installed); MAX_JOBS caps the build's parallelism.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def find_nvshmem():
    """The nvidia-nvshmem wheel's nvidia/nvshmem folder (headers, device library, host library), or
    None (COMMLIB_NO_NVSHMEM=1 skips it)."""
    if os.environ.get("COMMLIB_NO_NVSHMEM") == "1":
        return None
    for entry in sys.path:
        home = Path(entry or ".") / "nvidia" / "nvshmem"
        if (home / "include" / "nvshmem.h").exists() and (home / "lib" / "libnvshmem_device.a").exists():
            return home.resolve()
    return None


def find_nccl():
    """The nvidia-nccl wheel's nvidia/nccl folder (nccl.h and the real libnccl.so.2 the NCCL shim is
    built against and forwards to), or None."""
    for entry in sys.path:
        home = Path(entry or ".") / "nvidia" / "nccl"
        if (home / "include" / "nccl.h").exists() and (home / "lib" / "libnccl.so.2").exists():
            return home.resolve()
    return None


def find_nvcc():
    if os.environ.get("COMMLIB_NO_CUDA") == "1":
        return None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return Path(home) / "bin" / "nvcc"
    return None


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("COMMLIB_BUILD_DIR", ROOT / "build" / "cmake"))
        build_dir.mkdir(parents=True, exist_ok=True)
        nvcc = find_nvcc()
        torch_root = Path(torch.__file__).parent
        args = [
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCOMMLIB_OUTPUT_DIR={out_dir}",
            f"-DCOMMLIB_TORCH_INCLUDE_DIRS={torch_root / 'include'};{torch_root / 'include/torch/csrc/api/include'}",
            f"-DCOMMLIB_TORCH_LIBRARY_DIR={torch_root / 'lib'}",
            f"-DCOMMLIB_TORCH_HAS_CUDA={'ON' if torch.version.cuda else 'OFF'}",
            f"-DCOMMLIB_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            f"-DCOMMLIB_WITH_CUDA={'ON' if nvcc else 'OFF'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if nvcc:
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        nvshmem = find_nvshmem() if nvcc else None
        args.append(f"-DCOMMLIB_NVSHMEM_HOME={nvshmem or ''}")
        nccl = find_nccl() if nvcc else None
        args.append(f"-DCOMMLIB_NCCL_HOME={nccl or ''}")
        if shutil.which("ninja"):
            args.append("-GNinja")
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args])
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs])
        if getattr(self, "editable_mode", False):
            self._copy_nvshmem_library(out_dir)

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        self._copy_nvshmem_library(Path(self.build_lib).resolve() / "commlib")

    @staticmethod
    def _copy_nvshmem_library(out_dir: Path) -> None:
        """The NVSHMEM kernels' library and the NCCL shim (built beside _C when found) are no
        extensions setuptools knows: an in-place or editable build copies them into the package."""
        # the NCCL shim and its LD_AUDIT library after the NVSHMEM kernels
        for name in ("libcommlib_nvshmem.so", "lib/libnccl.so.2", "lib/libcommlib_nccl_audit.so"):
            lib = out_dir / name
            dest = ROOT / "python" / "commlib" / name
            if lib.exists() and lib.resolve() != dest.resolve():
                dest.parent.mkdir(exist_ok=True)
                shutil.copy2(lib, dest)


setup(
    name="commlib",
    version="0.1.0",
    description="Direct-data-access collectives for LLM inference over NVLink peer memory",
    package_dir={"": "python"},
    packages=find_packages("python"),
    py_modules=["_commlib_autoload"],  # torch's entry points (Note [lazy registration])
    ext_modules=[Extension("commlib._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    # EPBuffer(transport="nvshmem"): nvshmem4py bootstraps NVSHMEM (its runtime comes with torch's
    # nvidia-nvshmem-cu13).
    extras_require={"nvshmem": ["nvshmem4py-cu13"], "nixl": ["nixl-cu13"]},
    entry_points={
        "console_scripts": [
            "commlib-perf=commlib.perf.__main__:main",
            "commlib-tune=commlib.perf.tune:main",
        ],
        "torch.backends": ["ddacomm=_commlib_autoload:register"],
        "torch.distributed.backends": ["ddacomm=_commlib_autoload:register"],
    },
)
