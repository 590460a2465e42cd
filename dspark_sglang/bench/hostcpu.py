"""Where the host's CPU went during one measurement window (Linux `/proc`).

A sweep on a shared VM cannot tell a slow policy from a slow host by throughput alone. Two
readings of `/proc` around a window say how busy the host was and with what: the whole host's
user, system, idle and steal time (steal: the hypervisor ran someone else on our cores), and
the CPU time of chosen process trees (a pid and every live descendant: a `launch_server`
deployment's API process and the workers it spawns, each worker in a session of its own, so
neither a process group nor a session holds a deployment). Everything is in cores, averaged
over the window: 0.5 = half of one core for the whole window. Elsewhere than Linux `read`
returns None and the sweep records nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
# /proc/stat "cpu" columns: user nice system idle iowait irq softirq steal
_USER, _NICE, _SYSTEM, _IDLE, _IOWAIT, _IRQ, _SOFTIRQ, _STEAL = range(8)


@dataclass(frozen=True, slots=True)
class Snapshot:
    t: float  # time.monotonic() of the reading
    host: tuple[int, ...]  # the aggregate "cpu" line of /proc/stat, in clock ticks
    procs: dict[int, tuple[int, int]]  # pid -> (parent pid, utime + stime in ticks)


def _ticks_per_second() -> int:
    return int(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100


def _parent_and_ticks(stat_line: str) -> tuple[int, int]:
    """(ppid, utime + stime) from one /proc/PID/stat line. The command name in parentheses
    may hold spaces and parentheses itself, so the fields are counted after the last ')'."""
    rest = stat_line[stat_line.rindex(")") + 2 :].split()
    # rest[0] = state, [1] ppid, [2] pgrp, ... [11] utime, [12] stime
    return int(rest[1]), int(rest[11]) + int(rest[12])


def read(proc: Path = PROC) -> Snapshot | None:
    """One reading, or None where there is no Linux /proc. Processes that exit while being read
    are skipped."""
    try:
        first = (proc / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not first or first[0] != "cpu":
        return None
    host = tuple(int(x) for x in first[1:9])
    procs: dict[int, tuple[int, int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            procs[int(entry.name)] = _parent_and_ticks((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
    return Snapshot(time.monotonic(), host, procs)


def tree_ticks(s: Snapshot, roots: tuple[int, ...]) -> int:
    """Ticks of the live processes in the trees rooted at `roots` (each counted once)."""
    want, total = set(roots), 0
    for pid, (_, ticks) in s.procs.items():
        seen, p = 0, pid
        while p > 1 and p not in want and seen < 64:  # up the parents; 64: a cycle guard
            p, seen = s.procs.get(p, (0, 0))[0], seen + 1
        if p in want:
            total += ticks
    return total


def usage(
    a: Snapshot, b: Snapshot, labels: Mapping[str, tuple[int, ...]], hz: int | None = None
) -> dict[str, float]:
    """Cores used between two readings: `host_user`, `host_system` (with irq and softirq),
    `host_idle` (with iowait), `host_steal`, and per label the process trees rooted at the pids
    it names. A tree whose processes exited in between loses their ticks: its figure is clipped
    at 0."""
    hz = hz or _ticks_per_second()
    span = max(b.t - a.t, 1e-9) * hz
    d = [y - x for x, y in zip(a.host, b.host, strict=True)]
    out = {
        "window_s": b.t - a.t,
        "host_user": (d[_USER] + d[_NICE]) / span,
        "host_system": (d[_SYSTEM] + d[_IRQ] + d[_SOFTIRQ]) / span,
        "host_idle": (d[_IDLE] + d[_IOWAIT]) / span,
        "host_steal": d[_STEAL] / span,
    }
    for name, roots in labels.items():
        out[name] = max(tree_ticks(b, roots) - tree_ticks(a, roots), 0) / span
    return out
