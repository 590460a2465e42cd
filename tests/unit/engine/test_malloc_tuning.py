"""engine/malloc_tuning.py: a CPU engine's process keeps freed heap memory for the next step."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from dspark_sglang.engine.malloc_tuning import keep_freed_memory

GLIBC = platform.libc_ver()[0] == "glibc"

# A step's worth of temporaries, all alive at once and then freed, again and again (the drafter's
# logits, gathered K/V, activations); minor page faults per round after a warm-up. With glibc's
# defaults the freed top of the heap usually exceeds the trim threshold (twice the largest chunk
# freed) and goes back to the kernel each round, but not always (a small live chunk above it
# keeps it): the control pins glibc's fixed 128 KiB mmap threshold instead, so every chunk is
# mapped and unmapped and faults every round.
_ROUNDS = """
import json, resource, sys
import torch
from dspark_sglang.engine import malloc_tuning as mt
if sys.argv[1] == "control":
    import ctypes, ctypes.util
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(mt.M_MMAP_THRESHOLD, 128 << 10)
    took = False
else:
    took = mt.keep_freed_memory(int(sys.argv[1]))
sizes = [7 << 20, 3 << 20, 4 << 20, 1 << 20, 6 << 20, 2 << 20, 5 << 20, 7 << 20]
def one_round():
    held = []
    for n in sizes:
        t = torch.empty(n // 4)
        t.fill_(1.0)
        held.append(t)
for _ in range(5):
    one_round()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    one_round()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 20
print(json.dumps({"took": took, "faults": faults}))
"""


def _faults(keep: int | str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, str(keep)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's; elsewhere the tuning is a no-op")
def test_freed_memory_is_reused_instead_of_faulted_back_in() -> None:
    control = _faults("control")
    assert control["faults"] > 1000  # chunks handed back to the kernel: thousands of fresh pages
    assert not _faults(0)["took"]  # 0: glibc's defaults, nothing set
    tuned = _faults(256 << 20)
    assert tuned["took"]
    assert tuned["faults"] < 0.05 * control["faults"]


def test_nothing_is_set_for_zero_or_less() -> None:
    assert keep_freed_memory(0) is False
    assert keep_freed_memory(-1) is False
