"""CPU time of every process on this machine over a benchmark run, from Linux's ``/proc`` (``kvgrid bench serve
--cpu-per-process``): where a server on the same machine spends its CPU per streamed token, process by process
(Ray's workers by their actor class, vLLM's by its process title), beside the load generator's own."""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

_PROC = Path("/proc")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
# ray::RankActor.subscribe -> ray::RankActor; ray::ServeReplica:acme:Gateway -> ray::ServeReplica:acme:Gateway
_RAY_TITLE = re.compile(r"^(ray::[^.\s]+)")

Snapshot = dict[int, tuple[float, str]]  # pid -> (CPU seconds, user and system, since it started; its label)


def label(cmdline: list[str], comm: str) -> str:
    """A process's name for the table: a Ray worker's actor class (or ``ray::IDLE``), a Python program's module or
    script, else the executable's name."""
    first = cmdline[0] if cmdline else comm
    m = _RAY_TITLE.match(first)
    if m:
        return m.group(1)
    base = os.path.basename(first.split()[0]) if first else comm
    if base.startswith("python") and len(cmdline) > 1:
        rest = cmdline[1:]
        if rest[0] == "-m" and len(rest) > 1:
            return f"python -m {rest[1]}"
        if not rest[0].startswith("-"):
            return f"python {os.path.basename(rest[0])}"
    return base or comm


def snapshot() -> Snapshot:
    """Every process's CPU seconds so far, and its label (processes that vanish meanwhile are left out)."""
    out: Snapshot = {}
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = [a for a in (entry / "cmdline").read_bytes().decode(errors="replace").split("\0") if a]
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry.name)] = ((int(fields[11]) + int(fields[12])) * _TICK_S, label(cmdline, comm))
    return out


def own_cpu_s() -> float:
    """This process's CPU seconds so far (user and system)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def per_process(before: Snapshot, after: Snapshot, skip_pid: int | None = None) -> dict[str, float]:
    """CPU seconds each label used between two snapshots (a process started meanwhile counts from zero)."""
    used: dict[str, float] = {}
    for pid, (cpu_s, name) in after.items():
        if pid == skip_pid:
            continue
        delta = cpu_s - before.get(pid, (0.0, name))[0]
        if delta > 0:
            used[name] = used.get(name, 0.0) + delta
    return used


def table(used: dict[str, float], own_s: float, tokens: int, min_ms: float = 3.0) -> dict[str, float]:
    """CPU ms per 1000 output tokens per label, the largest first, the load generator (this process) as
    ``load generator``; labels under ``min_ms`` are summed into ``other``."""
    if tokens <= 0:
        return {}
    scale = 1e6 / tokens  # seconds per token -> ms per 1000 tokens
    rows: dict[str, float] = {"load generator": own_s * scale}
    other = 0.0
    for name, cpu_s in sorted(used.items(), key=lambda kv: -kv[1]):
        ms = cpu_s * scale
        if ms >= min_ms:
            rows[name] = rows.get(name, 0.0) + ms
        else:
            other += ms
    if other:
        rows["other"] = other
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))
