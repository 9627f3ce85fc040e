"""Rendering: the nccl-tests table (plus backend and ratio columns), JSON, CSV and the plot."""
from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import math
import os
import subprocess
from typing import Dict, List, Optional

from ..tuned import cpu_model

MODES = ("oop", "ip")
PLOT_BESIDE_OUT = "<beside --out>"  # a bare --plot: the results file's name with .png


def write_section(path: str, title: str, body: str, preamble: str) -> None:
    """Replaces the section ``## title`` of the results file at ``path`` with ``body`` (which starts
    with that heading), or appends it, keeping the other sections; a new file starts with
    ``preamble``. Sections are set off by one blank line."""
    text = open(path).read() if os.path.exists(path) else preamble
    marker = f"## {title}\n"
    if marker in text:
        before, rest = text.split(marker, 1)
        after = rest[rest.find("\n## "):] if "\n## " in rest else ""
        text = before + body.rstrip("\n") + ("\n\n" + after.lstrip("\n") if after else "\n")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def machine_description(device_type: str) -> str:
    if device_type == "cuda":
        import torch
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"{cpu_model()} ({os.cpu_count()} cores)"


def software_description(device_type: str) -> str:
    import sys

    import torch
    parts = [f"torch {torch.__version__}"]
    if device_type == "cuda" and hasattr(torch.cuda, "nccl"):
        try:
            parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
        except Exception:  # noqa: BLE001
            pass
    parts.append(f"Python {sys.version.split()[0]}")
    return ", ".join(parts)


def today() -> str:
    return _dt.date.today().isoformat()


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def source_commit() -> str:
    """The git commit of the commlib being measured (``+ local changes`` when tracked files differ
    from it), or ``unknown`` outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> Optional[str]:
        try:
            r = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return commit + (" + local changes" if dirty else "")


def _cell(m: Optional[dict], check: bool) -> str:
    if m is None or m.get("time_us") is None:
        return f"{'n/a':>9} {'':>7} {'':>7} {'':>6}"
    wrong = f"{m['wrong']:>6d}" if check else f"{'N/A':>6}"
    return f"{m['time_us']:9.2f} {m['algbw']:7.2f} {m['busbw']:7.2f} {wrong}"


def _ratio(base: Optional[dict], this: Optional[dict]) -> str:
    if not base or not this or base.get("time_us") is None or this.get("time_us") is None:
        return f"{'-':>7}"
    return f"{base['time_us'] / this['time_us']:7.2f}"


class Table:
    """Streams the table to ``out`` (rank 0) and keeps the rows for JSON/CSV/plot."""

    def __init__(self, out, meta: dict, backends: List[str], check: bool):
        self.out = out
        self.meta = meta
        self.backends = backends
        self.check = check
        self.rows: List[dict] = []
        self.notes: List[str] = []
        self.lines: List[str] = []  # everything printed, for the results file

    def p(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, file=self.out, flush=True)

    def header(self) -> None:
        m = self.meta
        self.p(f"# commlib-perf {m['version']}: {m['command']}")
        self.p(f"# machine: {m['machine']}; date: {m['date']}; world size {m['world_size']}; device {m['device']}; "
               f"timing: {m['timing']}")
        self.p(f"# backends: {', '.join(self.backends)}; iters {m['iters']}, warmup {m['warmup']}, "
               f"check {int(self.check)}")
        if len(self.backends) > 1:
            self.p(f"# ratio = time({self.backends[1]}) / time(backend): > 1 means faster than "
                   f"{self.backends[1]} (the first baseline)")

    def section(self, op: str) -> None:
        ratio_hdr = f" {'ratio':>7} {'ratio':>7}" if len(self.backends) > 1 else ""
        ratio_sub = f" {'oop':>7} {'ip':>7}" if len(self.backends) > 1 else ""
        self.p("#")
        self.p(f"# {op}")
        self.p(f"#{'':>13} {'':>12} {'':>12} {'':>8} {'':>6} {'':>5}  {'out-of-place':>31}  {'in-place':>31}")
        self.p(f"#{'backend':>13} {'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}  "
               f"{'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}  {'time':>9} {'algbw':>7} {'busbw':>7} "
               f"{'#wrong':>6}{ratio_hdr}")
        self.p(f"#{'':>11} {'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>5}  "
               f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}  {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} "
               f"{'':>6}{ratio_sub}")

    def add_size(self, rows: List[dict]) -> None:
        """Rows of one (op, type, redop, size), one per backend, in backend order."""
        base = rows[1] if len(rows) > 1 else None
        for row in rows:
            if base is not None:
                for mode in MODES:
                    b, t = base.get(mode), row.get(mode)
                    row[f"ratio_{mode}"] = (b["time_us"] / t["time_us"]
                                            if b and t and b.get("time_us") and t.get("time_us") else None)
            ratio = f" {_ratio(base and base.get('oop'), row.get('oop'))} {_ratio(base and base.get('ip'), row.get('ip'))}" \
                if base is not None else ""
            self.p(f" {row['backend']:>13} {row['bytes']:>12d} {row['count']:>12d} {row['type']:>8} "
                   f"{row['redop']:>6} {row['root']:>5d}  {_cell(row.get('oop'), self.check)}  "
                   f"{_cell(row.get('ip'), self.check)}{ratio}")
            for mode in MODES:
                reason = (row.get(mode) or {}).get("reason")
                if reason and reason not in self.notes:
                    self.notes.append(reason)
            self.rows.append(row)

    def total_wrong(self) -> int:
        return sum((row.get(m) or {}).get("wrong") or 0 for row in self.rows for m in MODES)

    def footer(self) -> None:
        wrong = self.total_wrong()
        self.p("#")
        for note in self.notes:
            self.p(f"# n/a: {note}")
        self.p(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        for backend in self.backends:
            vals = [row[m]["busbw"] for row in self.rows if row["backend"] == backend for m in MODES
                    if row.get(m) and row[m].get("busbw") is not None and not math.isnan(row[m]["busbw"])]
            avg = sum(vals) / len(vals) if vals else float("nan")
            self.p(f"# Avg bus bandwidth    : {avg:.4g} GB/s  ({backend})")
        if len(self.backends) > 1:
            for backend in self.backends[:1] + self.backends[2:]:
                rs = [row[f"ratio_{m}"] for row in self.rows if row["backend"] == backend for m in MODES
                      if row.get(f"ratio_{m}")]
                if rs:
                    geo = math.exp(sum(math.log(r) for r in rs) / len(rs))
                    self.p(f"# {backend} vs {self.backends[1]}: geometric-mean ratio {geo:.2f}x "
                           f"(min {min(rs):.2f}x, max {max(rs):.2f}x)")
        self.p("#")

    # ---- outputs ----
    def to_markdown(self, plot: Optional[str] = None) -> str:
        """The results file (``--out``): what was measured, where, on which commit, when, the exact
        command, and the table as printed. ``plot``: a plot file beside it, linked."""
        m = self.meta
        ops = []
        for row in self.rows:
            if row["op"] not in ops:
                ops.append(row["op"])
        title = ", ".join(ops) or "commlib-perf"
        lines = [
            f"# {title}: {' vs '.join(self.backends)}, {m['device'].upper()}, world size {m['world_size']}",
            "",
            f"- machine: {m['machine']}; {m.get('software', '')}".rstrip("; "),
            f"- commit: {m.get('commit', 'unknown')}",
            f"- date: {m.get('time', m['date'])}",
            f"- command: `{m['command']}`",
            f"- timing: {m['timing']}; iters {m['iters']}, warmup {m['warmup']}",
        ]
        if len(self.backends) > 1:
            lines.append(f"- ratio = time({self.backends[1]}) / time(backend): > 1 means faster than "
                         f"{self.backends[1]}")
        lines += ["", "Regenerate: run the command above (it rewrites this file).", ""]
        if plot:
            lines += [f"![{title}]({os.path.basename(plot)})", ""]
        lines += ["```"] + [line for line in self.lines] + ["```", ""]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"meta": self.meta, "backends": self.backends, "results": self.rows,
                           "wrong": self.total_wrong()}, indent=1, default=str)

    def to_csv(self) -> str:
        buf = io.StringIO()
        fields = ["op", "backend", "bytes", "count", "type", "redop", "root"]
        for mode in MODES:
            fields += [f"{mode}_time_us", f"{mode}_algbw", f"{mode}_busbw", f"{mode}_wrong", f"ratio_{mode}"]
        w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        for row in self.rows:
            rec = {k: row[k] for k in fields[:7]}
            for mode in MODES:
                m = row.get(mode) or {}
                rec[f"{mode}_time_us"] = m.get("time_us")
                rec[f"{mode}_algbw"] = m.get("algbw")
                rec[f"{mode}_busbw"] = m.get("busbw")
                rec[f"{mode}_wrong"] = m.get("wrong")
                rec[f"ratio_{mode}"] = row.get(f"ratio_{mode}")
            w.writerow(rec)
        return buf.getvalue()

    def plot(self, path: str) -> Optional[str]:
        """Writes latency and busbw against size; returns an error message instead of raising."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return (f"commlib-perf: --plot {path} skipped: matplotlib is not installed "
                    f"(pip install matplotlib)")
        fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
        series: Dict[tuple, list] = {}
        for row in self.rows:
            series.setdefault((row["op"], row["type"], row["redop"], row["backend"]), []).append(row)
        for (op, typ, redop, backend), rows in series.items():
            mode = "ip" if any(r.get("ip") and r["ip"].get("time_us") for r in rows) else "oop"
            pts = [(r["bytes"], r[mode]["time_us"], r[mode]["busbw"]) for r in rows
                   if r.get(mode) and r[mode].get("time_us")]
            if not pts:
                continue
            label = f"{backend} {op} {typ}" + (f" {redop}" if redop != "none" else "") + f" ({mode})"
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax_b.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
        for ax, ylabel in ((ax_t, "time per op (us)"), (ax_b, "bus bandwidth (GB/s)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"commlib-perf: {self.meta['machine']}, world size {self.meta['world_size']}, "
                     f"{self.meta['date']}")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return None
