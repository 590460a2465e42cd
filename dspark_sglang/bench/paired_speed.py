"""Time at identical shapes, paired cell by cell (`bench.steps --cells`, `bench.sweep`).

bench.steps compares two deployments' forward (and drafter) times at identical shapes by each
shape's median over the whole run. On a shared host a few cells in a slow spell move those
medians: in session 41's sweeps lagged's R = 2 drafter read 1.08-1.19x verify-all's that way in
three runs, where one pass's lagged cell alone ran 1.44x verify-all's cell seconds before it
(docs/results/s41_notes.txt, items 8 and 11). A sweep measures every policy's cell at one
(pass, concurrency) seconds apart; comparing shapes within those two cells, then over the pairs,
takes out the drift from pass to pass and gives an interval from the pairs' spread.

Per pair of cells (the policy's and the reference's at one pass and c, each a window of the
step logs' `started_at`): the median over the shapes (R, B) both cells ran at least
MIN_CELL_STEPS times, of the policy's median forward over the reference's, in log; the drafter
likewise per R of steady whole-batch drafting steps; per R bin and over every R. Over the pairs:
the geometric mean and a 90 % interval (± 1.645 standard errors of the mean log ratio).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sglang.bench.steps import _fmt, _Step, bin_label, by_shape, r_bin_bounds

MIN_CELL_STEPS = 5  # steps of one shape each cell needs before its median counts
Z90 = 1.645


@dataclass(frozen=True)
class PairedRow:
    policy: str
    reference: str
    r_lo: int  # 0, 0: every R
    r_hi: int
    forward_pairs: int  # cell pairs with a shape in common at these R
    forward_ratio: float  # geometric mean over pairs; nan: none
    forward_lo: float  # 90 % interval; nan below two pairs
    forward_hi: float
    drafter_pairs: int
    drafter_ratio: float
    drafter_lo: float
    drafter_hi: float


def read_cells(path: Path) -> list[dict[str, Any]]:
    """A sweep's per-cell records (its NAME.jsonl) that carry a window: policy, concurrency,
    pass, cell_start, cell_end."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
        if r.get("cell_start") is not None and r.get("cell_end") is not None and "policy" in r:
            out.append(r)
    return out


def _stamped(s: _Step) -> bool:
    return s.started_at is not None and math.isfinite(s.started_at)


def _window(steps: list[_Step], times: list[float], cell: dict[str, Any]) -> list[_Step]:
    lo = bisect.bisect_left(times, float(cell["cell_start"]))
    hi = bisect.bisect_right(times, float(cell["cell_end"]))
    return steps[lo:hi]


def _summary(logs: list[float]) -> tuple[int, float, float, float]:
    if not logs:
        return 0, math.nan, math.nan, math.nan
    m = float(np.mean(logs))
    if len(logs) < 2:
        return 1, math.exp(m), math.nan, math.nan
    half = Z90 * float(np.std(logs, ddof=1)) / math.sqrt(len(logs))
    return len(logs), math.exp(m), math.exp(m - half), math.exp(m + half)


def paired_rows(
    logs: dict[str, list[_Step]], cells: list[dict[str, Any]], reference: str
) -> list[PairedRow]:
    """Each other policy's time at identical shapes over `reference`'s, cell pair by cell pair,
    per R bin and over every R (0, 0)."""
    stamped = {
        p: sorted((s for s in steps if _stamped(s)), key=lambda s: s.started_at)
        for p, steps in logs.items()
    }
    times = {p: [s.started_at for s in steps] for p, steps in stamped.items()}
    at = {(c["policy"], c.get("pass", 0), c.get("concurrency")): c for c in cells}
    rows: list[PairedRow] = []
    for policy in logs:
        if policy == reference or reference not in logs:
            continue
        fwd: dict[tuple[int, int], list[float]] = {}
        draft: dict[tuple[int, int], list[float]] = {}
        for (p, k, c), cell in at.items():
            other = at.get((reference, k, c))
            if p != policy or other is None:
                continue
            f, d = by_shape(_window(stamped[p], times[p], cell), MIN_CELL_STEPS)
            rf, rd = by_shape(_window(stamped[reference], times[reference], other), MIN_CELL_STEPS)
            f_log = {key: math.log(f[key] / rf[key]) for key in f.keys() & rf.keys()}
            d_log = {r: math.log(d[r] / rd[r]) for r in d.keys() & rd.keys()}
            for out, got, r_of in ((fwd, f_log, lambda key: key[0]), (draft, d_log, int)):
                by_bin: dict[tuple[int, int], list[float]] = {}
                for key, v in got.items():
                    by_bin.setdefault(r_bin_bounds(r_of(key)), []).append(v)
                    by_bin.setdefault((0, 0), []).append(v)
                for b, vs in by_bin.items():
                    out.setdefault(b, []).append(float(np.median(vs)))
        bins = sorted(fwd.keys() | draft.keys(), key=lambda b: (b == (0, 0), b))
        for lo, hi in bins:
            f_sum, d_sum = _summary(fwd.get((lo, hi), [])), _summary(draft.get((lo, hi), []))
            rows.append(PairedRow(policy, reference, lo, hi, *f_sum, *d_sum))
    return rows


def print_paired(rows: list[PairedRow]) -> None:
    if not rows:
        return
    print(
        f"time at identical shapes over {rows[0].reference}'s, paired cell by cell (geometric "
        f"mean over cell pairs of the same pass and c, 90 % interval; shapes with >= "
        f"{MIN_CELL_STEPS} steps in both cells):"
    )
    print(f"{'R':>7s} {'policy':14s} {'pairs':>5s} {'forward':>24s} {'pairs':>5s} {'drafter':>24s}")
    for r in rows:
        rng = bin_label(r.r_lo, r.r_hi)
        f = _interval(r.forward_ratio, r.forward_lo, r.forward_hi)
        d = _interval(r.drafter_ratio, r.drafter_lo, r.drafter_hi)
        print(
            f"{rng:>7s} {r.policy:14s} {r.forward_pairs:5d} {f:>24s} {r.drafter_pairs:5d} {d:>24s}"
        )


def _interval(x: float, lo: float, hi: float) -> str:
    return f"{_fmt(x, '.3f')} [{_fmt(lo, '.3f')}, {_fmt(hi, '.3f')}]"
