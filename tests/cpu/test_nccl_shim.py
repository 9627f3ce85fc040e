"""The NCCL shim (python/commlib/lib/libnccl.so.2, docs/nccl.md) on a machine without a GPU: it builds
with the soname libnccl.so.2; it exports every function the installed nccl.h declares (the test's
own parse of the header against `nm -D`); under LD_PRELOAD torch imports and reports the real NCCL's
version; and its CPU-only calls (version, error strings, unique ids, last error, argument errors,
forming a communicator over its own rendezvous) answer as NCCL does. References: the real NCCL
of the nvidia-nccl wheel (versions, error strings) and the header (the API)."""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "python" / "commlib" / "lib" / "libnccl.so.2"
sys.path.insert(0, str(ROOT / "tests" / "cpp"))
from cpp_example_build import build_dir  # noqa: E402
from commlib.nccl import UniqueId  # noqa: E402

NCCL_SUCCESS, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE = 0, 4, 5


def nccl_home() -> Path | None:
    try:
        import nvidia.nccl
    except ImportError:
        return None
    folder = Path(nvidia.nccl.__file__).parent if getattr(nvidia.nccl, "__file__", None) else Path(
        list(nvidia.nccl.__path__)[0])
    return folder if (folder / "include" / "nccl.h").exists() else None


HOME = nccl_home()
HEADER = HOME / "include" / "nccl.h" if HOME else None
REAL = HOME / "lib" / "libnccl.so.2" if HOME else None

needs_shim = pytest.mark.skipif(not SHIM.exists() or HOME is None,
                                reason="NCCL shim not built (needs CUDA and the nvidia-nccl wheel; build commlib)")


def header_functions() -> set[str]:
    """Every nccl* / pnccl* function nccl.h declares: a return type, the name, a parameter list."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", HEADER.read_text(), flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return set(re.findall(r"(?:ncclResult_t|const\s+char\s*\*)\s*(p?nccl\w+)\s*\(", text))


def header_enum_count(name: str) -> int:
    return int(re.search(rf"\b{name}\s*=\s*(\d+)", HEADER.read_text()).group(1))


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for fn in ("ncclGetErrorString", "pncclGetErrorString", "ncclGetLastError", "pncclGetLastError"):
        getattr(lib, fn).restype = ctypes.c_char_p
    return lib


@pytest.fixture(scope="module")
def shim():
    return load(SHIM)


@pytest.fixture(scope="module")
def real():
    return load(REAL)


def last_error(lib) -> str:
    return lib.ncclGetLastError(None).decode()


# ---- the library ----

@needs_shim
def test_builds_with_the_nccl_soname():
    d = build_dir()
    ninja, make = (d / "build.ninja", d / "Makefile") if d else (None, None)
    has_target = d is not None and any(f.exists() and "commlib_nccl_shim" in f.read_text() for f in (ninja, make))
    # The CMake that configured the directory (another version would configure it again).
    cmake = re.search(r"^CMAKE_COMMAND:INTERNAL=(.*)$", (d / "CMakeCache.txt").read_text(), re.M) if d else None
    if has_target and cmake:  # the extension's build directory, when it builds the shim
        result = subprocess.run([cmake.group(1), "--build", str(d), "--target", "commlib_nccl_shim", "-j",
                                 os.environ.get("MAX_JOBS", "1")], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if shutil.which("readelf") is None:
        pytest.skip("readelf not installed")
    dynamic = subprocess.run(["readelf", "-d", str(SHIM)], capture_output=True, text=True, check=True).stdout
    assert "Library soname: [libnccl.so.2]" in dynamic
    assert "libnccl" not in "".join(line for line in dynamic.splitlines() if "NEEDED" in line), dynamic


@needs_shim
def test_exports_every_function_of_the_header():
    if shutil.which("nm") is None:
        pytest.skip("nm not installed")
    declared = header_functions()
    assert len(declared) >= 100 and {"ncclAllReduce", "pncclAllReduce", "ncclCommInitRank"} <= declared
    out = subprocess.run(["nm", "-D", "--defined-only", str(SHIM)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1]: line.split()[-2] for line in out.splitlines() if line.strip()}
    missing = sorted(declared - exported.keys())
    assert not missing, f"the shim lacks {len(missing)} functions of {HEADER}: {missing}"
    assert all(exported[name] in "TW" for name in declared)
    # And every nccl* / pnccl* function the real library exports (the device API's host functions,
    # which torch links against, through trampolines: Note [nccl shim trampolines]).
    out = subprocess.run(["nm", "-D", "--defined-only", str(REAL)], capture_output=True, text=True, check=True).stdout
    real_names = {f[-1] for f in (line.split() for line in out.splitlines()) if f and re.match(r"p?nccl\w+$", f[-1])}
    assert not sorted(real_names - exported.keys()), sorted(real_names - exported.keys())
    # Nothing of commlib, cudart or the C++ runtime leaks out (only NCCL's API and the shim's own).
    extra = sorted(n for n in exported if not re.match(r"(p?nccl|commlibNccl)\w+$", n))
    assert not extra, extra


@needs_shim
def test_torch_imports_under_ld_preload_and_reports_the_real_version(real):
    version = ctypes.c_int()
    assert real.ncclGetVersion(ctypes.byref(version)) == NCCL_SUCCESS
    code = version.value
    expected = (code // 10000, code % 10000 // 100, code % 100)
    script = ("import torch, torch.cuda.nccl\n"
              "v = torch.cuda.nccl.version()\n"
              "maps = open('/proc/self/maps').read()\n"
              "print(tuple(v[:3]), 'SHIM' if %r in maps else 'NOSHIM', 'REAL' if %r in maps else 'NOREAL')\n"
              % (str(SHIM.resolve()), str(REAL.resolve())))
    env = dict(os.environ, LD_PRELOAD=str(SHIM), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("COMMLIB_NCCL_REAL", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["SHIM", "REAL"], result.stdout
    assert eval(result.stdout.rsplit(")", 1)[0] + ")") == expected, result.stdout


AUDIT = SHIM.parent / "libcommlib_nccl_audit.so"


@needs_shim
def test_ld_audit_redirects_only_the_search_for_nccl():
    """Under LD_AUDIT torch gets the shim where it loads NCCL (by path, from the wheel), the shim
    still reaches the real NCCL, and a process that never asks for NCCL maps nothing of commlib's."""
    assert AUDIT.exists(), "the LD_AUDIT library is built with the shim"
    script = ("import ctypes, json, torch, torch.cuda.nccl\n"
              "torch.cuda.nccl.version()\n"
              "def mapped(): return sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libnccl' in l})\n"
              "before = mapped()\n"
              "info = ctypes.CDLL(%r).commlibNcclShimInfo\n"
              "info.restype = ctypes.c_char_p\n"
              "real = dict(l.split('=', 1) for l in info().decode().splitlines())['real_path']\n"
              "print(json.dumps({'before': before, 'after': mapped(), 'real': real}))\n" % str(SHIM))
    env = dict(os.environ, LD_AUDIT=str(AUDIT), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("COMMLIB_NCCL_REAL", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    resolved = {key: [str(Path(p).resolve()) for p in seen[key]] for key in ("before", "after")}
    # torch's NCCL is the shim; the real one is opened only by the shim, by path, and not redirected.
    assert resolved["before"] == [str(SHIM.resolve())], seen
    assert Path(seen["real"]).resolve() == REAL.resolve(), seen
    assert sorted(resolved["after"]) == sorted([str(SHIM.resolve()), str(REAL.resolve())]), seen
    shell = subprocess.run(["sh", "-c", "cat /proc/self/maps"], env=env, capture_output=True, text=True, timeout=60)
    assert shell.returncode == 0 and "libnccl" not in shell.stdout and "commlib_nccl_audit" in shell.stdout


# ---- CPU-only calls, through ctypes ----

@needs_shim
def test_version_is_the_real_nccls(shim, real):
    ours, theirs = ctypes.c_int(), ctypes.c_int()
    assert shim.ncclGetVersion(ctypes.byref(ours)) == NCCL_SUCCESS
    assert real.ncclGetVersion(ctypes.byref(theirs)) == NCCL_SUCCESS
    assert ours.value == theirs.value > 0
    assert shim.pncclGetVersion(ctypes.byref(ours)) == NCCL_SUCCESS and ours.value == theirs.value
    assert shim.ncclGetVersion(None) == NCCL_INVALID_ARGUMENT
    assert "ncclGetVersion" in last_error(shim)


@needs_shim
def test_error_strings_match_the_real_nccl(shim, real):
    num_results = header_enum_count("ncclNumResults")
    assert num_results >= 9
    for code in range(num_results + 2):  # every result, ncclNumResults, one past it
        assert shim.ncclGetErrorString(code) == real.ncclGetErrorString(code), code
        assert shim.pncclGetErrorString(code) == real.ncclGetErrorString(code), code
    assert shim.ncclGetErrorString(NCCL_SUCCESS) == b"no error"


@needs_shim
def test_unique_ids_are_fresh_and_carry_the_real_id(shim):
    ids = [UniqueId(), UniqueId()]
    for uid in ids:
        ctypes.memset(ctypes.byref(uid), 0xAB, 128)  # poison: every byte must be written
        assert shim.ncclGetUniqueId(ctypes.byref(uid)) == NCCL_SUCCESS
    raw = [ctypes.string_at(ctypes.byref(uid), 128) for uid in ids]
    assert all(len(r) == 128 for r in raw)
    assert raw[0] != raw[1]
    assert all(r[:8] == b"clnccl" + b"id" for r in raw)
    assert all(b"\xab" not in r[-8:] for r in raw)  # the reserved tail is written (zero)
    flags = int.from_bytes(raw[0][14:16], "little")
    assert flags & 1, "the real NCCL loads here: its id must be embedded"
    assert any(raw[0][24:120]) and raw[0][24:120] != raw[1][24:120]
    assert shim.ncclGetUniqueId(None) == NCCL_INVALID_ARGUMENT
    assert "ncclGetUniqueId" in last_error(shim) and "NULL" in last_error(shim)


@needs_shim
def test_argument_errors_name_the_function_and_the_value(shim):
    uid = UniqueId()
    assert shim.ncclGetUniqueId(ctypes.byref(uid)) == NCCL_SUCCESS
    comm = ctypes.c_void_p()
    assert shim.ncclCommInitRank(ctypes.byref(comm), 0, uid, 0) == NCCL_INVALID_ARGUMENT
    assert "ncclCommInitRank" in last_error(shim) and "nranks 0" in last_error(shim)
    assert shim.pncclCommInitRank(ctypes.byref(comm), 2, uid, 5) == NCCL_INVALID_ARGUMENT
    assert "pncclCommInitRank" in last_error(shim) and "rank 5" in last_error(shim) and "0..1" in last_error(shim)
    assert shim.ncclCommInitRank(None, 2, uid, 0) == NCCL_INVALID_ARGUMENT
    assert "comm is NULL" in last_error(shim)
    bad_config = (ctypes.c_char * 256)()  # not from NCCL_CONFIG_INITIALIZER: magic 0
    assert shim.ncclCommInitRankConfig(ctypes.byref(comm), 2, uid, 0, bad_config) == NCCL_INVALID_ARGUMENT
    assert "ncclCommInitRankConfig" in last_error(shim) and "NCCL_CONFIG_INITIALIZER" in last_error(shim)
    assert comm.value is None  # nothing was created
    count = ctypes.c_int(-7)
    assert shim.ncclCommCount(None, ctypes.byref(count)) == NCCL_INVALID_ARGUMENT and count.value == -7
    assert "ncclCommCount" in last_error(shim)
    assert shim.ncclAllReduce(None, None, 0, 7, 0, None, None) == NCCL_INVALID_ARGUMENT
    assert "ncclAllReduce: comm is NULL" in last_error(shim)
    assert shim.ncclGroupEnd() == NCCL_INVALID_USAGE
    assert "ncclGroupEnd" in last_error(shim)
    assert shim.ncclGroupStart() == NCCL_SUCCESS and shim.ncclGroupStart() == NCCL_SUCCESS
    assert shim.ncclGroupEnd() == NCCL_SUCCESS and shim.ncclGroupEnd() == NCCL_SUCCESS


@needs_shim
def test_functions_outside_the_header_reach_the_real_nccl(shim, real):
    """Trampolines (Note [nccl shim trampolines]): a plain one returns the real function's result; one
    whose first argument is a communicator checks it first."""
    for max_elts, elt_size in [(1, 4), (77, 8), (1000, 16), (4097, 2)]:
        assert shim.ncclLLA2ACalcSlots(max_elts, elt_size) == real.ncclLLA2ACalcSlots(max_elts, elt_size)
        assert shim.pncclLLA2ACalcSlots(max_elts, elt_size) == real.ncclLLA2ACalcSlots(max_elts, elt_size)
    assert shim.ncclDevCommDestroy(None, None) == NCCL_INVALID_ARGUMENT
    assert last_error(shim) == "ncclDevCommDestroy: comm is NULL"


NO_REAL_SCRIPT = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
lib.ncclGetLastError.restype = ctypes.c_char_p
lib.ncclGetErrorString.restype = ctypes.c_char_p
version = ctypes.c_int()
uid = (ctypes.c_char * 128)()
ptr = ctypes.c_void_p()
out = {"version_rc": lib.ncclGetVersion(ctypes.byref(version)), "version": version.value,
       "id_rc": lib.ncclGetUniqueId(uid), "strings": [lib.ncclGetErrorString(i).decode() for i in range(10)],
       "alloc_rc": lib.ncclMemAlloc(ctypes.byref(ptr), 1024)}
out["alloc_error"] = lib.ncclGetLastError(None).decode()
out["flags"] = int.from_bytes(bytes(uid)[14:16], "little")
print("RESULT " + json.dumps(out))
"""


@needs_shim
def test_without_the_real_nccl_the_shim_still_answers(real):
    """COMMLIB_NCCL_REAL naming no file: version (the header's), error strings, unique ids (without a
    real id) still work; a forwarded call fails with ncclSystemError and says what was tried."""
    env = dict(os.environ, COMMLIB_NCCL_REAL="/nonexistent/libnccl.so.2")
    result = subprocess.run([sys.executable, "-c", NO_REAL_SCRIPT, str(SHIM)], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    header_code = int(re.search(r"#define NCCL_VERSION_CODE (\d+)", HEADER.read_text()).group(1))
    assert (out["version_rc"], out["version"]) == (NCCL_SUCCESS, header_code)
    assert out["id_rc"] == NCCL_SUCCESS and out["flags"] & 1 == 0
    assert out["strings"] == [real.ncclGetErrorString(i).decode() for i in range(10)]
    assert out["alloc_rc"] == 2  # ncclSystemError
    assert "ncclMemAlloc" in out["alloc_error"] and "/nonexistent/libnccl.so.2 (no such file)" in out["alloc_error"]


# ---- a communicator over the shim's own rendezvous, two processes, no GPU ----

RANK_SCRIPT = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
lib.ncclGetLastError.restype = ctypes.c_char_p
lib.commlibNcclCommRoute.restype = ctypes.c_char_p
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
uid = UniqueId()
ctypes.memmove(ctypes.byref(uid), bytes.fromhex(sys.argv[2]), 128)
rank, nranks = int(sys.argv[3]), int(sys.argv[4])
comm = ctypes.c_void_p()
rc = lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank)
assert rc == 0, (rc, lib.ncclGetLastError(None))
count, me, err = ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_int(-1)
assert lib.ncclCommCount(comm, ctypes.byref(count)) == 0
assert lib.ncclCommUserRank(comm, ctypes.byref(me)) == 0 and me.value == rank
assert lib.ncclCommGetAsyncError(comm, ctypes.byref(err)) == 0
route = lib.commlibNcclCommRoute(comm).decode()
# Bad arguments on a live communicator: refused on this rank, the communicator stays usable.
calls = [
    lambda: lib.ncclAllReduce(None, None, 4, 99, 0, comm, None),
    lambda: lib.ncclBroadcast(None, None, 4, 7, nranks + 3, comm, None),
    lambda: lib.ncclSend(None, 4, 7, -1, comm, None),
    lambda: lib.ncclAllGather(None, None, 4, 7, comm, None),
]
errors = []
for call in calls:
    errors.append((call(), lib.ncclGetLastError(None).decode()))
# Splits over the shim's rendezvous: keys reversed (new rank = nranks - 1 - rank), then rank 0 alone.
splits = []
for color, key in [(0, -rank), (0 if rank == 0 else -1, 0)]:  # -1: NCCL_SPLIT_NOCOLOR
    child = ctypes.c_void_p()
    assert lib.ncclCommSplit(comm, color, key, ctypes.byref(child), None) == 0, lib.ncclGetLastError(None)
    if child.value is None:
        splits.append(None)
        continue
    assert lib.ncclCommCount(child, ctypes.byref(count)) == 0 and lib.ncclCommUserRank(child, ctypes.byref(me)) == 0
    splits.append([count.value, me.value, lib.commlibNcclCommRoute(child).decode()])
    assert lib.ncclCommDestroy(child) == 0
errors.append((lib.ncclCommSplit(comm, -5, 0, ctypes.byref(ctypes.c_void_p()), None), lib.ncclGetLastError(None).decode()))
assert lib.ncclCommCount(comm, ctypes.byref(count)) == 0
assert lib.ncclCommDestroy(comm) == 0
print("RESULT " + json.dumps({"count": count.value, "rank": rank, "async": err.value, "route": route,
                               "errors": errors, "splits": splits}))
"""


@needs_shim
def test_two_processes_form_and_split_a_communicator_without_a_gpu(shim):
    uid = UniqueId()
    assert shim.ncclGetUniqueId(ctypes.byref(uid)) == NCCL_SUCCESS  # this process hosts the rendezvous
    hex_id = ctypes.string_at(ctypes.byref(uid), 128).hex()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", COMMLIB_TIMEOUT_MS="60000")
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(SHIM), hex_id, str(rank), "2"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    for rank, (out, _) in enumerate(outs):
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        assert (result["count"], result["rank"], result["async"]) == (2, rank, NCCL_SUCCESS)
        assert result["route"].startswith("nccl: no CUDA device"), result["route"]
        expected = ["ncclAllReduce: datatype 99 invalid", "ncclBroadcast: root 5 invalid", "ncclSend: peer -1 invalid",
                    "ncclAllGather: sendbuff is NULL with count 4", "ncclCommSplit: color -5 invalid"]
        assert len(result["errors"]) == len(expected)
        assert result["splits"][0][:2] == [2, 1 - rank] and result["splits"][0][2].startswith("nccl: no CUDA device")
        assert result["splits"][1] == ([1, 0, result["splits"][1][2]] if rank == 0 else None)
        for (code, text), words in zip(result["errors"], expected):
            assert code == NCCL_INVALID_ARGUMENT and words in text, (code, text)


@needs_shim
def test_python_module_reports_the_shim():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    path = subprocess.run([sys.executable, "-m", "commlib.nccl", "--path"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert path.returncode == 0, path.stderr[-3000:]
    assert Path(path.stdout.strip()).resolve() == SHIM.resolve()
    check = subprocess.run([sys.executable, "-m", "commlib.nccl", "--check"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert f"real NCCL: {REAL}" in check.stdout or str(REAL.resolve()) in check.stdout or "nvidia/nccl/lib" in check.stdout
    assert "ncclAllReduce" in check.stdout and "ncclSend" in check.stdout
    assert f"LD_AUDIT library (redirects only libnccl.so.2 to the shim): {AUDIT}" in check.stdout
    audit = subprocess.run([sys.executable, "-m", "commlib.nccl", "--audit"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert audit.returncode == 0 and Path(audit.stdout.strip()).resolve() == AUDIT.resolve(), audit.stderr[-3000:]
