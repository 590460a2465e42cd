"""bench.hostcpu: /proc readings and the cores they add up to, on a fake /proc with known
ticks and on this machine's own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dspark_sglang.bench import hostcpu


def _proc(root: Path, host: list[int], procs: dict[int, tuple[str, int, int, int]]) -> Path:
    """A fake /proc: the aggregate cpu line and, per pid, (comm, ppid, utime, stime)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("cpu  " + " ".join(map(str, host)) + " 0 0\ncpu0 1 2 3\n")
    for pid, (comm, ppid, ut, st) in procs.items():
        (root / str(pid)).mkdir(exist_ok=True)
        # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
        # utime stime ...; every process its own group and session, as the workers are
        fields = ["S", str(ppid), str(pid), str(pid), "0", "-1", "0", "0", "0", "0", "0"]
        fields += [str(ut), str(st)]
        (root / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + " 0 0\n")
    (root / "self").mkdir(exist_ok=True)  # not a pid: skipped
    return root


def test_cores_from_two_readings_of_a_fake_proc(tmp_path: Path) -> None:
    """Over 2 s at 100 ticks/s on 2 cores (400 ticks): the host columns fold as documented,
    each label sums the process trees it roots (a deployment's workers, in sessions of their
    own, under its API process 10; a grandchild too), and names with spaces and parentheses
    parse."""
    procs = {
        10: ("python", 1, 100, 50),
        11: ("a (b) c", 10, 0, 0),
        12: ("grandchild", 11, 10, 0),
        20: ("x", 1, 5, 5),
    }
    a = hostcpu.read(_proc(tmp_path / "a", [1000, 0, 100, 5000, 0, 0, 0, 10], procs))
    procs = {
        10: ("python", 1, 250, 60),
        11: ("a (b) c", 10, 30, 10),
        12: ("grandchild", 11, 30, 20),
        20: ("x", 1, 5, 5),
    }
    b = hostcpu.read(_proc(tmp_path / "b", [1200, 40, 120, 5120, 10, 5, 5, 30], procs))
    assert a is not None and b is not None
    assert hostcpu.tree_ticks(a, (10,)) == 160 and hostcpu.tree_ticks(b, (10,)) == 400
    assert hostcpu.tree_ticks(b, (11,)) == 90 and hostcpu.tree_ticks(b, (10, 11)) == 400
    b = hostcpu.Snapshot(a.t + 2.0, b.host, b.procs)
    labels = {"dep": (10,), "worker": (11,), "idle": (20,), "both": (10, 20), "none": ()}
    u = hostcpu.usage(a, b, labels, hz=100)
    assert u["window_s"] == 2.0
    assert u["host_user"] == pytest.approx(240 / 200)
    assert u["host_system"] == pytest.approx(30 / 200)
    assert u["host_idle"] == pytest.approx(130 / 200)
    assert u["host_steal"] == pytest.approx(20 / 200)
    assert u["dep"] == pytest.approx(1.2) and u["worker"] == pytest.approx(0.4)
    assert u["idle"] == 0.0 and u["both"] == pytest.approx(1.2) and u["none"] == 0.0


def test_a_tree_whose_processes_exited_is_clipped_at_zero(tmp_path: Path) -> None:
    a = hostcpu.read(_proc(tmp_path / "a", [0] * 8, {5: ("w", 1, 500, 0)}))
    b = hostcpu.read(_proc(tmp_path / "b", [100] * 8, {}))
    assert a is not None and b is not None
    assert hostcpu.usage(a, b, {"gone": (5,)}, hz=100)["gone"] == 0.0


def test_no_linux_proc_reads_none(tmp_path: Path) -> None:
    assert hostcpu.read(tmp_path / "missing") is None
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "stat").write_text("intr 1 2 3\n")
    assert hostcpu.read(tmp_path / "odd") is None


def test_this_process_burning_cpu_shows_in_its_tree() -> None:
    """On this machine's /proc: 0.3 s of busy loop in this process is ~all of a core over the
    window, and the host's columns add up to its core count."""
    a = hostcpu.read()
    if a is None:
        pytest.skip("needs Linux /proc (the feature records nothing elsewhere)")
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    b = hostcpu.read()
    assert b is not None
    u = hostcpu.usage(a, b, {"me": (os.getpid(),)})
    assert 0.5 < u["me"] <= 1.2
    total = sum(u[f"host_{k}"] for k in ("user", "system", "idle", "steal"))
    assert total == pytest.approx(os.cpu_count(), rel=0.2)
