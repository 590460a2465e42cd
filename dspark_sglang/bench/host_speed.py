"""The host's speed in each sweep cell, read from the deployment's own forwards at equal shapes.

A served sweep on a shared host measures each policy's cell seconds apart from its rivals', and
still the host's speed moves under them: one pass's target forward at a given shape (R requests,
B tokens) can run 20-40 % slower than the next pass's (docs/results/host_drift_s36.txt). Lagged
/ best rival per pass then scatters with a log standard deviation near 0.1, and eight passes
cannot resolve the 3 % the goal of issue 9 is stated in.

A deployment's forward of one shape is the same work every time it runs at one load, so its
time is a clock of the host: a cell whose forwards ran at 1.15x the time this deployment took
for the same shapes in its other cells at the same concurrency ran on a host 15 % slower than
those did on average. This module turns the step logs (`launch_server --step-log`, each record
stamped `started_at`) into that factor per cell, and scales the cell's throughput by it.

The reference is the deployment's own cells at the cell's concurrency, over every pass:
- never a rival's: forwards of one shape differ between deployments for the policy's own
  reasons (a drafting engine's forward also returns the drafter's taps: lagged's plain B = R
  steps ran 4.72 ms where no-spec's ran 4.16, sweep rot_49d32bf), and a rival's clock would
  book them on the host;
- never its cells at another concurrency: (R, B) leaves out the context attended, and a shape
  met in the drain of a c = 64 cell (requests near their end) carries longer contexts than the
  same shape in a c = 32 cell. Pooled over levels, no-spec's c = 32 cells read 10 % slow in
  sweep hs_17c3f04 for that reason alone.
So the factors of one deployment at one concurrency centre on 1 over the passes: the scaling
takes out the spread of host speed from pass to pass and cell to cell, and keeps every
difference between the deployments at a concurrency, a deployment that ran its forwards slower
than its siblings in most passes included. The scaled figures sit beside the measured ones and
never replace them.

A sweep with --fresh-deployments runs each policy on a new deployment every pass, all writing
to the policy's step-log folder: the reference then pools the policy's deployments, and a
deployment that ran its forwards slower than the policy's others reads as a slow host. That
difference is the deployment's luck, not the policy's (two deployments of one configuration ran
4-5 % apart, docs/results/s40_notes.txt), so the scaling takes it out with the host's drift.

Reference shapes: the pure decode (R, B) the deployment's cells at that concurrency ran at
least MIN_SHAPE_STEPS times together, each at its median forward seconds. A cell's factor is
the median, over its decode steps at reference shapes (at least MIN_CELL_STEPS), of forward /
reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

LOG_SUFFIX = ".steps.jsonl"
MIN_SHAPE_STEPS = 10
MIN_CELL_STEPS = 10
ADJUSTED = "host_adjusted_output_throughput"


class _Step(msgspec.Struct):
    num_reqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_reqs: int
    forward_seconds: float | None = None
    started_at: float | None = None


def read_forwards(folder: Path) -> np.ndarray:
    """[n, 4] (started_at, R, B, forward seconds) of the pure decode steps in a deployment's
    step logs that carry a timestamp and a timed forward, in time order."""
    dec = msgspec.json.Decoder(_Step)
    rows = []
    for path in sorted(folder.glob(f"*{LOG_SUFFIX}")):
        with path.open("rb") as f:
            for line in f:
                if not line.strip():
                    continue
                s = dec.decode(line)
                if (
                    s.num_prefill_tokens == 0
                    and s.num_decode_reqs == s.num_reqs > 0
                    and s.forward_seconds is not None
                    and math.isfinite(s.forward_seconds)
                    and s.started_at is not None
                    and math.isfinite(s.started_at)
                ):
                    rows.append((s.started_at, s.num_reqs, s.num_tokens, s.forward_seconds))
    out = np.array(rows, np.float64).reshape(-1, 4)
    return out[np.argsort(out[:, 0], kind="stable")]


def reference(steps: np.ndarray) -> dict[tuple[int, int], float]:
    """Per shape (R, B) one deployment ran MIN_SHAPE_STEPS times or more: its median forward
    seconds over the run."""
    if not len(steps):
        return {}
    shapes = steps[:, 1:3].astype(np.int64)
    keys, inverse, counts = np.unique(shapes, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    return {
        (int(keys[i, 0]), int(keys[i, 1])): float(np.median(steps[inverse == i, 3]))
        for i in np.flatnonzero(counts >= MIN_SHAPE_STEPS)
    }


def cell_factor(
    steps: np.ndarray, ref: Mapping[tuple[int, int], float]
) -> tuple[float, int] | None:
    """(median forward / reference over a cell's steps at reference shapes, how many such
    steps); None below MIN_CELL_STEPS."""
    ratios = [
        t / ref[(int(r), int(b))]
        for _, r, b, t in steps
        if (int(r), int(b)) in ref and ref[(int(r), int(b))] > 0
    ]
    if len(ratios) < MIN_CELL_STEPS:
        return None
    return float(np.median(ratios)), len(ratios)


def _window(steps: np.ndarray, r: dict[str, Any]) -> np.ndarray | None:
    if r.get("cell_start") is None or not r.get("cell_end"):
        return None
    lo, hi = np.searchsorted(steps[:, 0], [float(r["cell_start"]), float(r["cell_end"])])
    return steps[lo:hi]


def adjust(
    raw: Iterable[dict[str, Any]], step_logs: Path, policies: Sequence[str]
) -> list[dict[str, Any]]:
    """Copies of the sweep's per-cell records, each with `host_speed_factor` (its forwards'
    time over the reference of its deployment at its concurrency; > 1: a slow host),
    `host_speed_steps`, and `host_adjusted_output_throughput` = output_throughput x factor,
    where the cell has a window (`cell_start`, `cell_end`) and enough steps at reference
    shapes; else None."""
    forwards = {p: read_forwards(step_logs / p) for p in policies if (step_logs / p).is_dir()}
    out = [dict(r) for r in raw]
    cells: dict[tuple[str, Any], list[tuple[dict[str, Any], np.ndarray]]] = {}
    for r in out:
        r |= {"host_speed_factor": None, "host_speed_steps": 0, ADJUSTED: None}
        steps = forwards.get(r.get("policy", ""))
        got = _window(steps, r) if steps is not None and len(steps) else None
        if got is not None:
            cells.setdefault((r["policy"], r.get("concurrency")), []).append((r, got))
    for group in cells.values():
        ref = reference(np.concatenate([steps for _, steps in group]))
        for r, steps in group:
            got = cell_factor(steps, ref)
            if got is None:
                continue
            r["host_speed_factor"], r["host_speed_steps"] = got
            if r.get("output_throughput") is not None:
                r[ADJUSTED] = r["output_throughput"] * got[0]
    return out


def log_spread(raw: Sequence[dict[str, Any]], key: str, a: str, b: str) -> float | None:
    """Standard deviation over passes of log(a / b) at each c, about that c's mean, pooled over
    the c's: how far two policies' per-pass ratio scatters (None below 2 degrees of freedom)."""
    by: dict[tuple[int, int], dict[str, float]] = {}
    for r in raw:
        if r.get(key):
            by.setdefault((r["concurrency"], r.get("pass", 0)), {})[r["policy"]] = r[key]
    per_c: dict[int, list[float]] = {}
    for (c, _), v in by.items():
        if a in v and b in v:
            per_c.setdefault(c, []).append(math.log(v[a] / v[b]))
    dev = [x - float(np.mean(xs)) for xs in per_c.values() if len(xs) >= 2 for x in xs]
    dof = sum(len(xs) - 1 for xs in per_c.values() if len(xs) >= 2)
    if dof < 2:
        return None
    return math.sqrt(sum(d * d for d in dev) / dof)
