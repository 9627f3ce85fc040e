"""torch's entry points register "ddacomm" without importing commlib (Note [lazy registration] in
python/_commlib_autoload.py): a plain ``import torch`` never imports commlib, never fails because of
it, and the first "ddacomm" group imports it. Each case runs a fresh interpreter; the reference is
the sum a one-rank all_reduce must return (the input itself)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PLAIN_IMPORT = r"""
import sys
import torch
import torch.distributed as dist
assert "commlib" not in sys.modules, "import torch imported commlib"
assert "DDACOMM" in dist.Backend._plugins, "ddacomm not registered after a plain import torch"
dist.init_process_group("ddacomm", store=dist.HashStore(), rank=0, world_size=1)
assert "commlib" in sys.modules, "the first ddacomm group did not import commlib"
t = torch.randn(37, dtype=torch.float32)
ref = t.clone()
dist.all_reduce(t)
assert torch.equal(t, ref)
assert dist.get_backend() == "ddacomm"
dist.destroy_process_group()
print("ok", sys.modules["commlib"].__file__)
"""

HIDDEN_EXTENSION = r"""
import sys
import warnings
import torch
import torch.distributed as dist
assert "commlib" not in sys.modules, "import torch imported commlib"
try:
    dist.init_process_group("ddacomm", store=dist.HashStore(), rank=0, world_size=1)
except Exception as e:
    chain, err = [], e
    while err is not None:
        chain.append(str(err))
        err = err.__cause__ or err.__context__
    print("raised:", " | ".join(chain))
else:
    print("no error")
"""


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_plain_import_torch_does_not_import_commlib():
    import commlib
    here = os.path.dirname(os.path.dirname(commlib.__file__))
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    res = _run(PLAIN_IMPORT, env)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.startswith("ok " + here), res.stdout


def test_import_torch_survives_a_missing_extension(tmp_path):
    """commlib installed without its extension file (a stale editable install): ``import torch``
    works and warns; asking for "ddacomm" raises an error that says to rebuild."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "python" / "commlib", site / "commlib",
                    ignore=shutil.ignore_patterns("_C*.so", "*.so", "__pycache__"))
    shutil.copy(ROOT / "python" / "_commlib_autoload.py", site)
    info = site / "commlib-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: commlib\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nddacomm = _commlib_autoload:register\n\n"
                                           "[torch.distributed.backends]\nddacomm = _commlib_autoload:register\n")
    assert not list((site / "commlib").glob("_C*"))
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    res = _run(HIDDEN_EXTENSION, env)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "ddacomm\" will not work: its extension commlib._C is missing" in res.stderr, res.stderr[-4000:]
    assert res.stdout.startswith("raised:"), res.stdout
    assert "commlib cannot be imported" in res.stdout and "rebuild it against this torch" in res.stdout, res.stdout
