#!/usr/bin/env python3
"""Generates the NCCL shim's forwarders from an nccl.h (Note [nccl shim forwarding] in
csrc/nccl_shim/shim.hpp).

    gen_forwarders.py NCCL_H OUT_DIR [--real-lib LIBNCCL --nm NM]

writes OUT_DIR/nccl_api.hpp (one `COMMLIB_NCCL_HAS_<name>` per function the header declares) and
OUT_DIR/forwarders.cc: for every `nccl*` / `pnccl*` function of the header, a typed call into the
real NCCL (`commlib::nccl_shim::real::<name>`), and an exported forwarder for every function the
shim does not implement itself (HANDWRITTEN). A forwarder swaps each shim communicator argument
for the real NCCL communicator inside it and wraps each new real communicator it is handed back.
With --real-lib, every other nccl* / pnccl* symbol that library exports (the device API's host
functions of nccl_device/*.h, which torch links against, and internal ones) gets a trampoline
(Note [nccl shim trampolines] in csrc/nccl_shim/trampolines.cc), told whether its first argument
is a communicator by the declarations in the headers beside NCCL_H.
`--list` prints the parsed declarations instead.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# Implemented in csrc/nccl_shim/*.cc (each with its p-prefixed twin).
HANDWRITTEN = {
    "ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommInitAll",
    "ncclCommInitRankScalable", "ncclCommDestroy", "ncclCommAbort", "ncclCommGetAsyncError", "ncclCommCount",
    "ncclCommUserRank", "ncclCommCuDevice", "ncclGetErrorString", "ncclGetLastError", "ncclGroupStart",
    "ncclGroupEnd", "ncclGroupSimulateEnd", "ncclAllReduce", "ncclReduceScatter", "ncclAllGather",
    "ncclBroadcast", "ncclBcast", "ncclAlltoAll", "ncclSend", "ncclRecv", "ncclCommSplit",
}
# Forwarded only when the real communicator already exists (nothing to do otherwise): these must
# not create one, which would be collective.
EXISTING_REAL_ONLY = {"ncclCommFinalize", "ncclCommRevoke", "ncclCommSuspend", "ncclCommResume"}

DECL = re.compile(r"(?:^|[;}\s])(ncclResult_t|const\s+char\s*\*)\s*(p?nccl\w+)\s*\(([^;{}()]*)\)\s*;", re.S)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def parse(header_text: str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(return type, name, [(parameter type, parameter name)]) of every nccl*/pnccl* function."""
    decls, seen = [], set()
    for ret, name, params in DECL.findall(strip_comments(header_text)):
        if name in seen:
            continue
        seen.add(name)
        args = []
        for i, p in enumerate(x.strip() for x in params.split(",")):
            if not p or p == "void":
                continue
            m = re.match(r"(.*?[\s*&])(\w+)$", p)
            args.append((m.group(1).strip(), m.group(2)) if m else (p, f"arg{i}"))
        decls.append((re.sub(r"\s+", " ", ret).replace(" *", "*"), name, args))
    return decls


def base(name: str) -> str:
    return name[1:] if name.startswith("p") else name


def is_comm(ptype: str) -> bool:
    return re.sub(r"\bconst\b", "", ptype).strip() == "ncclComm_t"


def is_comm_out(ptype: str) -> bool:
    return ptype.replace(" ", "") == "ncclComm_t*"


def forwarder(ret: str, name: str, args: list[tuple[str, str]]) -> str:
    params = ", ".join(f"{t} {n}" for t, n in args)
    body, call_args = [], []
    comm_outs = [n for t, n in args if is_comm_out(t)]
    if ret != "ncclResult_t" or any(t == "ncclUniqueId" for t, _ in args) or len(comm_outs) > 1:
        raise SystemExit(f"gen_forwarders: {name} needs a handwritten implementation (add it to HANDWRITTEN)")
    for t, n in args:
        if is_comm(t):
            mode = "RealComm::kExisting" if base(name) in EXISTING_REAL_ONLY else "RealComm::kCreate"
            body.append(f"  ncclComm_t real_{n} = nullptr;\n"
                        f"  if (ncclResult_t r = shim::real_comm({n}, \"{name}\", {mode}, &real_{n}); r != ncclSuccess) return r;")
            if base(name) in EXISTING_REAL_ONLY:
                body.append(f"  if (real_{n} == nullptr) return ncclSuccess;  // no real communicator: nothing to do")
            call_args.append(f"real_{n}")
        elif is_comm_out(t):
            body.append(f"  ncclComm_t real_{n} = nullptr;")
            call_args.append(f"{n} == nullptr ? nullptr : &real_{n}")
        else:
            call_args.append(n)
    call = f"shim::real::{name}({', '.join(call_args)})"
    if comm_outs:
        n = comm_outs[0]
        parent = next((an for t, an in args if is_comm(t)), None)
        body.append(f"  ncclResult_t result = {call};\n"
                    f"  if ({n} != nullptr) *{n} = shim::wrap_real(real_{n}, {parent or 'nullptr'});\n"
                    f"  return result;")
    else:
        body.append(f"  return {call};")
    return f"NCCL_SHIM_API {ret} {name}({params}) {{\n" + "\n".join(body) + "\n}\n"


def real_call(ret: str, name: str, args: list[tuple[str, str]]) -> str:
    params = ", ".join(f"{t} {n}" for t, n in args)
    types = ", ".join(t for t, _ in args)
    names = ", ".join(n for _, n in args)
    missing = "return nullptr;" if ret != "ncclResult_t" else f"return missing(\"{name}\");"
    call = f"fn({names})" if ret != "ncclResult_t" else f"forwarded(fn({names}))"
    return (f"{ret} {name}({params}) {{\n"
            f"  using Fn = {ret} (*)({types});\n"
            f"  static Fn fn = reinterpret_cast<Fn>(symbol(\"{name}\"));\n"
            f"  if (fn == nullptr) {missing}\n"
            f"  return {call};\n}}\n")


def real_exports(lib: Path, nm: str) -> list[str]:
    """The nccl* / pnccl* functions `lib` exports."""
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return sorted({f[-1] for f in (line.split() for line in out.splitlines())
                   if len(f) >= 3 and f[-2] in "TW" and re.match(r"p?nccl\w+$", f[-1])})


def comm_first(name: str, headers_text: str) -> bool:
    """Whether a header declares `name` (or its unprefixed twin) with a communicator first."""
    return re.search(rf"\b{base(name)}\s*\(\s*(?:const\s+)?ncclComm_t\b", headers_text) is not None


TRAMPOLINE_STUB = """\
  .globl {name}
  .type {name},@function
{name}:
  mov ${index}, %r11d
  jmp commlib_nccl_shim_trampoline
  .size {name}, .-{name}
"""


def trampolines(names: list[str], headers_text: str) -> str:
    """x86-64 entry points (Note [nccl shim trampolines]): each loads its index into r11 and joins
    the common trampoline of trampolines.cc; elsewhere none are made."""
    table = ",\n".join(f'    {{"{n}", FirstArg::{"kComm" if comm_first(n, headers_text) else "kPlain"}}}' for n in names)
    stubs = "".join(TRAMPOLINE_STUB.format(name=n, index=i) for i, n in enumerate(names))
    return (f"\nnamespace commlib::nccl_shim {{\n\nconst TrampolineEntry kTrampolines[] = {{\n{table or '    {nullptr, FirstArg::kPlain}'}\n}};\n"
            f"const size_t kNumTrampolines = {len(names)};\n\n}}  // namespace commlib::nccl_shim\n\n"
            f"#if defined(__x86_64__)\nasm(R\"(\n  .text\n{stubs})\");\n#endif\n")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--list":
        for ret, name, args in parse(Path(argv[1]).read_text()):
            print(f"{ret} {name}({', '.join(f'{t} {n}' for t, n in args)})")
        return 0
    options = dict(zip(argv[2::2], argv[3::2]))
    if len(argv) < 2 or len(argv) % 2 or set(options) - {"--real-lib", "--nm"}:
        print(__doc__, file=sys.stderr)
        return 2
    header, out = Path(argv[0]), Path(argv[1])
    decls = parse(header.read_text())
    if not any(name == "ncclAllReduce" for _, name, _ in decls):
        raise SystemExit(f"gen_forwarders: no ncclAllReduce in {header}; is it nccl.h?")
    out.mkdir(parents=True, exist_ok=True)
    note = f"// Generated by csrc/nccl_shim/gen_forwarders.py from {header}; do not edit.\n"
    api = [note, "#pragma once\n\n#include <nccl.h>\n\n"]
    api += [f"#define COMMLIB_NCCL_HAS_{name} 1\n" for _, name, _ in decls]
    api.append("\nnamespace commlib::nccl_shim::real {\n\n// The real NCCL's functions (nullptr / ncclSystemError"
               " when it is not loaded).\n")
    api += [f"{ret} {name}({', '.join(f'{t} {n}' for t, n in args)});\n" for ret, name, args in decls]
    api.append("\n}  // namespace commlib::nccl_shim::real\n")
    src = [note, '#include "nccl_shim/shim.hpp"\n\nnamespace commlib::nccl_shim::real {\n\n']
    src += [real_call(*d) for d in decls]
    src.append("\n}  // namespace commlib::nccl_shim::real\n\nnamespace shim = commlib::nccl_shim;\n"
               "using commlib::nccl_shim::RealComm;\n\nextern \"C\" {\n\n")
    src += [forwarder(*d) for d in decls if base(d[1]) not in HANDWRITTEN]
    src.append("\n}  // extern \"C\"\n")
    declared = {name for _, name, _ in decls}
    extra = []
    if "--real-lib" in options:
        extra = [n for n in real_exports(Path(options["--real-lib"]), options.get("--nm", "nm")) if n not in declared]
    headers_text = "\n".join(strip_comments(p.read_text(errors="replace")) for p in sorted(header.parent.rglob("*.h")))
    src.append(trampolines(extra, headers_text))
    for path, text in ((out / "nccl_api.hpp", "".join(api)), (out / "forwarders.cc", "".join(src))):
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
