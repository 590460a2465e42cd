"""The machine a measurement ran on, for the provenance of profiles, sweeps and reports.

`platform.processor()` is empty or just `x86_64` on Linux, so every CPU profile read
"x86_64 x1 threads" whether it came from an AMD EPYC or an Intel Xeon. The project's VM has been
both on different days, with different GEMM libraries chosen (`--cpu-gemm auto`) and forward
times that do not carry over, so a number needs the CPU model next to it. Standard library only:
the bench client reads this without importing torch.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

CPUINFO = "/proc/cpuinfo"


def cpu_fields(cpuinfo: str = CPUINFO) -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo ({} where there is none)."""
    out: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    if out:  # every processor repeats the block; the first is enough
                        break
                    continue
                key, sep, value = line.partition(":")
                if sep:
                    out.setdefault(key.strip(), value.strip())
    except OSError:  # not Linux
        return {}
    return out


def cpu_model(cpuinfo: str = CPUINFO) -> str:
    """e.g. 'AMD EPYC 9B45 (family 26 model 2)' or 'Intel(R) Xeon(R) Processor (family 6 model
    207)'; the architecture where unknown. The family and model numbers are there because a VM
    may name only the line ('AMD EPYC' was a Zen 5 one day and a Zen 3 on 2026-12-06, with
    different GEMM speeds)."""
    fields = cpu_fields(cpuinfo)
    name = fields.get("model name", "")
    if not name:
        return platform.processor() or platform.machine() or "unknown cpu"
    family, model = fields.get("cpu family"), fields.get("model")
    return f"{name} (family {family} model {model})" if family and model else name


def cpu_vendor(cpuinfo: str = CPUINFO) -> str:
    """'AuthenticAMD', 'GenuineIntel', ... ('' where unknown)."""
    return cpu_fields(cpuinfo).get("vendor_id", "")


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS
        return os.cpu_count() or 1


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def host_facts(cpuinfo: str = CPUINFO) -> dict[str, Any]:
    """CPU model and vendor, usable CPUs, Python and torch versions: a report's `host` field."""
    return {
        "cpu": cpu_model(cpuinfo),
        "vendor": cpu_vendor(cpuinfo),
        "usable_cpus": usable_cpus(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": _version("torch"),
    }
