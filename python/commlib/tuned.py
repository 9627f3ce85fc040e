"""The values ``commlib-tune`` measured on this machine, as the library reads them.

``commlib-tune`` (``commlib.perf.tune``) measures and writes the tune file (``COMMLIB_TUNE_FILE``,
default ``~/.cache/commlib/tune.txt``; docs/perf.md gives its format, one ``<section> key=value ...``
line per record, Note [tune file format]). This module is the product's side of it: it finds and
reads the file (``parse_lines``, ``read_file``) and answers what the library asks of it
(``load``: an all-reduce entry by machine key; ``load_cp``: context parallelism's machine
constants; ``tokenweave_tuned``: TokenWeave's wave steps, crossover and SM budget). It writes
nothing and imports nothing of ``commlib.perf`` or ``commlib.models``: the product never imports
its benchmark. The C++ selector reads the same file itself (csrc/core/algorithm_selector.cc).
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from urllib.parse import quote, unquote

FORMAT_VERSION = 1
# The CUDA collectives besides all_reduce whose crossovers an entry may carry
# (Note [collective crossovers]).
COLLECTIVE_OPS = ("reduce_scatter", "all_gather", "broadcast", "all_to_all")


def cache_path(path: Optional[str] = None) -> Path:
    """``path``, else ``$COMMLIB_TUNE_FILE``, else ``~/.cache/commlib/tune.txt``."""
    if path:
        return Path(path)
    env = os.environ.get("COMMLIB_TUNE_FILE")
    return Path(env) if env else Path.home() / ".cache" / "commlib" / "tune.txt"


def _library_version() -> str:
    from . import __version__
    return __version__


def cpu_model() -> str:
    """The CPU's ``model name`` (/proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_link(num_devices: int) -> str:
    """nvlink when NVML reports an active NVLink on device 0; p2p with peer access; else pcie."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            for link in range(18):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        return "nvlink"
                except pynvml.NVMLError:
                    break
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML is optional
        pass
    try:
        import torch
        if num_devices >= 2 and torch.cuda.can_device_access_peer(0, 1):
            return "p2p"
    except Exception:  # noqa: BLE001
        pass
    return "pcie"


def make_key(device_type: str, world_size: int, link: Optional[str] = None) -> dict:
    """The cache key of this machine for ``device_type`` ("cpu" or "cuda") and ``world_size``."""
    if device_type == "cuda":
        import torch
        device = torch.cuda.get_device_name(0)
        link = link or gpu_link(torch.cuda.device_count())
    elif device_type == "cpu":
        device, link = cpu_model(), link or "shm"
    else:
        raise ValueError(f"commlib.tuned: device type '{device_type}' not supported; supported: cpu, cuda")
    return {"device": device, "world_size": int(world_size), "link": link, "version": _library_version()}


def validate(data, path) -> dict:
    """``data`` if it is a well-formed tune file, else ValueError naming ``path`` and the field."""
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION or not isinstance(data.get("entries"), list):
        raise ValueError(f"commlib.tuned: {path} is not a version-{FORMAT_VERSION} tune file "
                         f"(expected {{\"version\": 1, \"entries\": [...]}})")
    for i, entry in enumerate(data["entries"]):
        ar = entry.get("all_reduce") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict) or not isinstance(ar, dict):
            raise ValueError(f"commlib.tuned: {path}: entry {i} needs 'key' and 'all_reduce' objects")
        for field in ("flat_max_bytes", "tree_max_bytes"):
            if not isinstance(ar.get(field), int) or ar[field] < 0:
                raise ValueError(f"commlib.tuned: {path}: entry {i}: all_reduce.{field} must be an integer >= 0, "
                                 f"got {ar.get(field)!r}")
        sms = entry.get("fused_num_sms")
        if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
            raise ValueError(f"commlib.tuned: {path}: entry {i}: fused_num_sms must be None or an integer >= 1, "
                             f"got {sms!r}")
        coll = entry.get("collectives")
        if coll is not None and (not isinstance(coll, dict) or any(
                op not in COLLECTIVE_OPS or isinstance(v, bool) or not isinstance(v, int) or v < 0
                for op, v in coll.items())):
            raise ValueError(f"commlib.tuned: {path}: entry {i}: collectives must map {', '.join(COLLECTIVE_OPS)} "
                             f"to integers >= 0, got {coll!r}")
    return data


# A record's section in the file -> its list in read_file's dict (the others keep their name).
_LISTS = {"entry": "entries"}


def parse_lines(text: str, path) -> List[Tuple[str, Dict[str, str]]]:
    """The records of a tune file's ``text`` (Note [tune file format]): ``(section, {key: value})``
    per line that is neither blank nor a ``#`` comment, values as written. ValueError naming
    ``path``, the line number and the line for a word without ``=``, or for an older JSON file."""
    if text.lstrip().startswith("{"):
        raise ValueError(f"commlib.tuned: '{path}' is a JSON tune file of an older commlib; the format is now one "
                         "`<section> key=value ...` line per entry: re-run commlib-tune (it replaces the file)")
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        for word in words[1:]:
            if word.find("=") <= 0:
                raise ValueError(f"commlib.tuned: '{path}' line {number}: '{word}' is not key=value: '{line}'")
        records.append((words[0], dict(w.split("=", 1) for w in words[1:])))
    return records


def _number(word: str):
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            pass
    return None


def _value(word: str):
    """A written value: None when empty, an int, a float, else a (percent-encoded) string."""
    if not word:
        return None
    number = _number(word)
    return unquote(word) if number is None else number


def _word(value) -> str:
    """``value`` as one word of the file: None empty, strings percent-encoded (no space, ``=`` or
    ``#``) and, when they would read back as a number, with their first character encoded too."""
    if value is None:
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    word = quote(str(value), safe="()+,:/@")
    return word if _number(word) is None else f"%{ord(word[0]):02X}{word[1:]}"


def format_record(section: str, record: dict) -> str:
    """One line of the file: ``record``'s fields, nested dicts as dotted keys (``a.b=1``)."""
    def flat(d: dict, prefix: str):
        for k, v in d.items():
            key = prefix + quote(str(k), safe="").replace(".", "%2E")
            if isinstance(v, dict):
                yield from flat(v, key + ".")
            else:
                yield f"{key}={_word(v)}"
    return " ".join([section, *flat(record, "")])


def _record(fields: Dict[str, str]) -> dict:
    out: dict = {}
    for key, word in fields.items():
        *parents, leaf = [unquote(k) for k in key.split(".")]
        d = out
        for k in parents:
            d = d.setdefault(k, {})
        d[leaf] = _value(word)
    return out


def format_file(data: dict) -> str:
    """The text of the tune file holding ``data`` (read_file's dict): a header comment, then one
    line per record of every list."""
    section = {name: sec for sec, name in _LISTS.items()}
    lines = ["# commlib-tune's measurements of this machine (docs/perf.md, Note [tune file format])"]
    for name, records in data.items():
        if isinstance(records, list):
            lines += [format_record(section.get(name, name), r) for r in records if isinstance(r, dict)]
    return "\n".join(lines) + "\n"


def read_file(path: Optional[str] = None) -> dict:
    """The whole tune file as ``{"version", "entries": [...], <section>: [...]}`` (an empty one
    when it does not exist); ValueError naming the file if malformed."""
    p = cache_path(path)
    data = {"version": FORMAT_VERSION, "entries": []}
    if not p.exists():
        return data
    for section, fields in parse_lines(p.read_text(), p):
        data.setdefault(_LISTS.get(section, section), []).append(_record(fields))
    return validate(data, p)


def load(key: dict, path: Optional[str] = None) -> Optional[dict]:
    """The entry whose key equals ``key`` (see ``make_key``), or None."""
    for entry in read_file(path)["entries"]:
        if entry["key"] == key:
            return entry
    return None


def cp_entries(data: dict) -> list:
    """The ``cp`` records of a tune file (context parallelism's machine constants)."""
    entries = data.get("cp", [])
    return entries if isinstance(entries, list) else []


def load_cp(device_type: str, world_size: int, path: Optional[str] = None) -> Optional[dict]:
    """The cached cp constants for this machine (``{"key", "bw_bytes_per_s", "attn_flops_per_s"}``),
    or None. A missing BW (one GPU: no ring to time) is commlib.cp's built-in default."""
    key = make_key(device_type, world_size)
    for e in cp_entries(read_file(path)):
        if isinstance(e, dict) and e.get("key") == key:
            values = dict(e)
            if values.get("bw_bytes_per_s") is None:
                from .cp import DEFAULT_BW
                values["bw_bytes_per_s"] = DEFAULT_BW[device_type]
            return values
    return None


def tokenweave_tuned(world_size: Optional[int] = None, path: Optional[str] = None) -> Optional[dict]:
    """The ``tokenweave`` record of this GPU for ``world_size`` (else any record of this GPU, whose
    wave steps still apply: they depend on the GEMM shapes, not on the world size; its crossover
    and SM budget are then dropped), or None. A malformed file is ignored with a warning."""
    try:
        import torch
        device = torch.cuda.get_device_name(0)
        records = [r for r in read_file(path).get("tokenweave") or [] if isinstance(r, dict)
                   and r.get("device") == device]
    except (ValueError, OSError, RuntimeError) as e:
        print(f"commlib: ignoring tune file's tokenweave values: {e}", file=sys.stderr)
        return None
    for r in records:
        if world_size is not None and r.get("world_size") == int(world_size):
            return r
    if records:
        return {"wave_steps": records[-1].get("wave_steps") or {}}
    return None


__all__ = ["FORMAT_VERSION", "COLLECTIVE_OPS", "cache_path", "cpu_model", "gpu_link", "make_key", "validate",
           "parse_lines", "format_record", "format_file", "read_file", "load", "cp_entries", "load_cp",
           "tokenweave_tuned"]
