"""The capacity model's error on each kind of step a lagged K chooses between, learned live.

A lagged K = 0 step decodes plainly; a K > 0 step runs the drafter and a verify forward. The K
search compares the two through one capacity model, so where they run within a few per cent of
each other (high load on the CPU engine) a bias of that size between the model's two predictions
decides. Served, 2026-12-05 (sweep s42_cal, lagged step logs, median log(measured / predicted)):
drafting steps at R = 17-32 ran +0.03 / +0.10 over their prediction (two runs) while plain steps
ran -0.00 / -0.02; at R = 33-64 +0.02 / +0.01 against -0.03 / -0.04. The live estimator learns
one forward scale per executed bucket, a draft term and a host term; the misses it leaves
(verify forwards at ragged shapes, the drafter's bookkeeping on steps that follow plain ones) add
up to a step-level bias that no single term shows. This module measures it where it acts: per R
bin, the mean log residual of steady drafting steps and of plain steps, and their difference as
the factor the K search multiplies a drafting plan's seconds by, shrunk toward a prior while a
bin's evidence is thin. A common error (a slower host the level has not caught yet) cancels;
only the kinds' difference moves K, and it moves only the choice between drafting and not
(every K > 0 plan takes the same factor).

Pure Python: no numpy needed for a dozen bins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# EWMA rate once warm: the bias moves as the live model learns, over hundreds of steps
BIAS_RATE = 0.02
# records of a kind that hold its half of a bin's evidence weight (a bin that has seen only
# drafting steps, as at low load, keeps factor 1)
BIAS_PRIOR = 16.0
# a step's log residual counts at most this much: a stall is not the model's bias
BIAS_CLIP = 0.5
# the factor stays within exp(±BIAS_MAX)
BIAS_MAX = 0.25
# What a bin's factor starts from and is shrunk toward while its evidence is thin (as a fraction:
# drafting steps assumed this much over their prediction, relative to plain steps). At high load
# on the CPU engine a deployment sees a few dozen drafting steps per R bin, so a prior of 0 kept
# the factor near 1 for most of its life while every run measured drafting over plain:
# summed-seconds ratios (measured / predicted, drafting over plain) of 1.06-1.075 (R 33-64) and
# 1.00-1.07 (R 17-32) in s43's lagged logs, 1.10-1.15 at R = 2; per deployment 0.91-1.20.
# Served A/B (s44_malloc): without it lagged ran 0.969 of itself at c = 2 and within 0.991-1.012
# (intervals spanning 1) at c = 8-64 (docs/scheduler.md).
DEFAULT_PRIOR = 0.04


def bias_bin(r: int) -> int:
    """R's bin: 1, 2, 3-4, 5-8, … (the bit length of R - 1)."""
    return max(int(r) - 1, 0).bit_length()


@dataclass
class StepKindBias:
    """Per R bin: [mean log residual, records] of drafting steps and of plain steps. `prior`: the
    fraction a bin's factor starts from (0 = the model's prices until measured)."""

    prior: float = 0.0
    bins: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prior) and -0.5 < self.prior < 1.0):
            raise ValueError(f"step bias prior must be in (-0.5, 1), got {self.prior}")
        self._prior_log = max(-BIAS_MAX, min(BIAS_MAX, math.log1p(self.prior)))

    def observe(self, r: int, drafted: bool, measured: float, predicted: float) -> None:
        """Fold one step: `drafted` = a steady drafting step (not a probe, not a resumed
        drafter), else a plain one; the seconds it took and the seconds it was planned at."""
        if not (measured > 0.0 and predicted > 0.0) or not math.isfinite(measured / predicted):
            return
        e = max(-BIAS_CLIP, min(BIAS_CLIP, math.log(measured / predicted)))
        row = self.bins.setdefault(bias_bin(r), [0.0, 0.0, 0.0, 0.0])
        i = 0 if drafted else 2
        mean, n = row[i], row[i + 1]
        row[i] = mean + max(BIAS_RATE, 1.0 / (n + 1.0)) * (e - mean)
        row[i + 1] = n + 1.0

    def log_factor(self, r: int) -> float:
        """log of the factor on a drafting plan's seconds at R: the drafting steps' mean
        residual less the plain steps', shrunk toward the prior by each kind's evidence
        (BIAS_PRIOR records each): a bin that has seen one kind only has no difference to tell
        and keeps the prior."""
        row = self.bins.get(bias_bin(r))
        if row is None:
            return self._prior_log
        weight = row[1] / (row[1] + BIAS_PRIOR) * row[3] / (row[3] + BIAS_PRIOR)
        measured = weight * (row[0] - row[2]) + (1.0 - weight) * self._prior_log
        return max(-BIAS_MAX, min(BIAS_MAX, measured))

    def state(self) -> dict[str, dict[str, float]]:
        """Per bin (the smallest R in it): the two kinds' means and counts, and the factor."""
        out = {}
        for b in sorted(self.bins):
            d, nd, p, np_ = self.bins[b]
            r = 1 if b == 0 else (1 << (b - 1)) + 1
            out[str(r)] = {
                "draft_log_residual": d,
                "draft_steps": nd,
                "plain_log_residual": p,
                "plain_steps": np_,
                "factor": math.exp(self.log_factor(r)),
            }
        return out
