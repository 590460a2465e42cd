"""Confidence logits -> STS-scaled confidences -> prefix survival a[r, j]; max-length masking, the
fresh-request acceptance prior, the live corrections and the lagged survival history. Pure numpy +
stdlib: imports nothing from the package but `algo.monotone`, and never engine, models, torch.cuda
or a clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from dspark_sglang.algo.monotone import isotonic

# Rows up to which the per-step updates below (the corrections' folds, the history lookup) loop
# over Python floats instead of a dozen numpy calls on [n, γ] arrays: the planner runs them on the
# host every drafting step, right after a forward that evicted numpy's code from the caches (at
# c = 1 on the CPU engine the history lookup took 77-98 µs cold, the survival correction's fold
# 86-100). The same float operations in the same order: the same results bit for bit (tests).
SMALL_ROWS = 8

# Index map used by every array here: row r = request, column j-1 = draft position j (1-based as in
# the paper), so a[:, 0] is the first draft token's survival. The anchor (position 0) has no column.


def sts_confidences(
    logits: np.ndarray, temperatures: Sequence[float] | np.ndarray | None = None
) -> np.ndarray:
    """Conditional acceptance c[r, k] = sigmoid(logit[r, k] / T_k) (paper §3.2.1, Sequential
    Temperature Scaling). `temperatures` has one positive T per position; None means T = 1."""
    z = np.asarray(logits, dtype=np.float64)
    if temperatures is not None:
        t = np.asarray(temperatures, dtype=np.float64)
        if t.shape != z.shape[-1:] or not np.all(t > 0):
            raise ValueError(f"need {z.shape[-1]} positive STS temperatures, got {t.tolist()}")
        z = z / t
    # tanh form is the overflow-free sigmoid for large |logit|.
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def survival(confidences: np.ndarray) -> np.ndarray:
    """Prefix survival a[r, j] = prod_{i<=j} c[r, i] (paper §3.2.2, Algorithm 1 line 2).

    Confidences are clipped to [0, 1] so every row is non-increasing; the policies rely on that to
    keep each admitted set a prefix."""
    c = np.clip(np.asarray(confidences, dtype=np.float64), 0.0, 1.0)
    if c.ndim != 2:
        raise ValueError(f"confidences must be [R, gamma], got shape {c.shape}")
    return np.cumprod(c, axis=1)


def max_verify_lengths(tokens_left: np.ndarray, gamma: int) -> np.ndarray:
    """Per-request cap on ℓ: a step emits up to ℓ + 1 tokens, so a request that may emit only
    `tokens_left` more (min of max_tokens and context room, computed by the caller) verifies at most
    tokens_left - 1 drafts."""
    return np.clip(np.asarray(tokens_left, dtype=np.int64) - 1, 0, gamma)


def mask_survival(surv: np.ndarray, max_len: np.ndarray) -> np.ndarray:
    """Zero a[r, j] for j > max_len[r]; Algorithm 1 only considers candidates with a > 0 (line 4).
    The policies' `max_len` argument does the same without a copy."""
    cols = np.arange(1, surv.shape[1] + 1)
    return np.where(cols[None, :] <= np.asarray(max_len)[:, None], surv, 0.0)


@dataclass(frozen=True, slots=True)
class AcceptancePrior:
    """Per-position conditional acceptance rates, an exponential moving average of what verification
    realised. Stands in for the survival of requests with no published confidences yet, so the
    lagged K (paper §5.2) never counts a fresh request as survival 1 (DESIGN §3).

    The starting rates are a guess worth `pseudo` trials: until a position has seen about 1/α
    trials it averages what it saw (weight t / (n + t + pseudo)), after that the EMA takes over.
    A fixed α = 0.01 alone kept the lagged engine's guess of 0.5 for hundreds of steps where
    greedy drafts were accepted at 0.7–0.9, and with K = 0 only sparse probes to learn from, the
    pessimistic prior held K at 0 (CPU engine, c = 4: 4 drafting steps of 375).

    Memory is counted in trials, and a step verifies up to R·γ of them: α = 0.01 forgot
    everything older than a step or two at c = 16, so the rates followed the last few requests'
    text (position 3 at 0.34 where the run's rate was 0.69) and flipped lagged's K = 0 decision
    with them. α = 0.002 keeps about 500 trials (CPU engine, c = 4 → 16 → 64 → 4 → 16: 10 and 1
    drafting steps of ~370 on the way back down at 0.01, 85 of 145 and 65 of 152 at 0.002)."""

    rates: tuple[float, ...]
    alpha: float = 0.002  # EMA weight of one (position, request) trial: memory of ~500 trials
    trials: tuple[float, ...] = ()  # trials folded in so far per position (() = none)
    pseudo: float = 4.0  # trials the starting rates are worth
    # survival, computed once: the lagged planner reads it for every request without a snapshot
    _survival: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.rates or not all(0.0 <= x <= 1.0 for x in self.rates):
            raise ValueError(f"prior rates must be a non-empty tuple in [0, 1], got {self.rates}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"prior alpha must be in (0, 1], got {self.alpha}")
        if self.trials and len(self.trials) != len(self.rates):
            raise ValueError(f"prior trials {len(self.trials)} != rates {len(self.rates)}")
        if self.pseudo < 0.0:
            raise ValueError(f"prior pseudo must be >= 0, got {self.pseudo}")
        surv = np.cumprod(np.asarray(self.rates, dtype=np.float64))
        surv.setflags(write=False)
        object.__setattr__(self, "_survival", surv)

    @classmethod
    def uniform(
        cls, gamma: int, rate: float = 0.5, alpha: float = 0.002, pseudo: float = 4.0
    ) -> AcceptancePrior:
        return cls(rates=(float(rate),) * gamma, alpha=alpha, pseudo=pseudo)

    @property
    def gamma(self) -> int:
        return len(self.rates)

    @property
    def survival(self) -> np.ndarray:
        """Prior survival row [gamma] = cumulative product of the conditional rates (read-only)."""
        return self._survival

    def observe(self, verify_lens: np.ndarray, accepted_lens: np.ndarray) -> AcceptancePrior:
        """New prior after one step. Position k was a conditional trial for request r iff it was
        verified and every earlier draft was accepted (ℓ_r >= k and n_r >= k - 1); it succeeded
        iff n_r >= k. A position with t trials moves toward its observed rate with weight
        1 - (1-α)^t, as if the t trials were folded in one at a time at their mean."""
        lens = np.asarray(verify_lens, dtype=np.int64)
        acc = np.asarray(accepted_lens, dtype=np.int64)
        if lens.shape != acc.shape or (acc.size and (acc.min() < 0 or (acc > lens).any())):
            raise ValueError("accepted_lens must be in [0, verify_lens] elementwise")
        if not lens.any():  # nothing verified (a lagged K = 0 step): the same prior object,
            return self  # so what is keyed on it (the planner's K memo) stays valid
        # Counts by value, then suffix sums: trials[k] = #{min(ℓ, n + 1) >= k}, hits[k] =
        # #{n >= k}, k = 1..γ. The planner folds every verifying step in on the host, and γ
        # scalar updates in Python cost a fraction of a dozen numpy passes over [γ, R] masks.
        g = self.gamma
        if lens.size <= SMALL_ROWS:  # the same integer counts without numpy's per-call cost
            trials, hits = [0] * g, [0] * g
            for n_verified, n_accepted in zip(lens.tolist(), acc.tolist(), strict=True):
                for j in range(min(n_verified, n_accepted + 1, g)):
                    trials[j] += 1
                for j in range(min(n_accepted, g)):
                    hits[j] += 1
        else:
            reach = np.minimum(np.minimum(lens, acc + 1), g)
            trials = np.bincount(reach, minlength=g + 1)[::-1].cumsum()[::-1][1:].tolist()
            hits = np.bincount(np.minimum(acc, g), minlength=g + 1)[::-1].cumsum()[::-1][1:]
            hits = hits.tolist()
        keep = 1.0 - self.alpha
        rates, seen = [], []
        for old, t, h, s in zip(self.rates, trials, hits, self.trials or (0.0,) * g, strict=True):
            if t:
                weight = max(1.0 - keep**t, t / (s + t + self.pseudo))
                old = old + weight * (h / t - old)
            rates.append(old)
            seen.append(s + t)
        return AcceptancePrior(
            rates=tuple(rates), alpha=self.alpha, trials=tuple(seen), pseudo=self.pseudo
        )


def _step_grid(
    verify_lens: np.ndarray, accepted_lens: np.ndarray, gamma: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One step's ℓ and accepted n as [n, 1] columns, and positions k = 1…γ as a [1, γ] row."""
    lens = np.asarray(verify_lens, np.int64)[:, None]
    acc = np.asarray(accepted_lens, np.int64)[:, None]
    return lens, acc, np.arange(1, gamma + 1)[None, :]


def _fold_small(
    pred: tuple[float, ...],
    obs: tuple[float, ...],
    alpha: float,
    values: np.ndarray,
    verify_lens: np.ndarray,
    accepted_lens: np.ndarray,
    conditional: bool,
) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """`_fold` over a few rows in Python floats. Row r is a trial at position k (1-based) iff
    k <= ℓ_r and, `conditional`, every earlier draft was accepted (k <= n_r + 1); a hit iff
    k <= n_r. Sums run over the rows in order, as numpy's axis-0 sum does (its zero terms for
    non-trials add nothing); the decay is numpy's power, which libm's pow does not always match."""
    gamma = len(pred)
    num = [0] * gamma
    sums = [0.0] * gamma
    hits = [0] * gamma
    for row, n_verified, n_accepted in zip(
        values.tolist(),
        np.asarray(verify_lens).tolist(),
        np.asarray(accepted_lens).tolist(),
        strict=True,
    ):
        top = min(n_verified, n_accepted + 1) if conditional else n_verified
        for j in range(min(top, gamma)):
            num[j] += 1
            sums[j] += row[j]
            hits[j] += j < n_accepted
    if not any(num):
        return None
    keep = ((1.0 - alpha) ** np.array(num, np.int64)).tolist()
    return (
        tuple(p * q + x for p, q, x in zip(pred, keep, sums, strict=True)),
        tuple(o * q + h for o, q, h in zip(obs, keep, hits, strict=True)),
    )


def _fold(
    pred: tuple[float, ...],
    obs: tuple[float, ...],
    alpha: float,
    predicted: np.ndarray,
    trial: np.ndarray,
    hit: np.ndarray,
) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """Decayed per-position sums after one step's trials [n, γ] (None when it had none): each
    position keeps (1 − α)^trials of its old sums, then adds the trials' predicted values and hits.
    The trials are folded in one at a time, at their mean."""
    n = trial.sum(axis=0)
    if not n.any():
        return None
    keep = (1.0 - alpha) ** n
    # cumsum adds row after row, as the small fold does; sum() adds eight or more contiguous
    # floats pairwise (n = 8 rows of one position differed in the last bit)
    new_pred = np.asarray(pred) * keep + np.cumsum(predicted * trial, axis=0)[-1]
    new_obs = np.asarray(obs) * keep + (trial & hit).sum(axis=0)
    return tuple(new_pred.tolist()), tuple(new_obs.tolist())


@dataclass(frozen=True, slots=True)
class ConfidenceCorrection:
    """Live recalibration of the confidence head from verified drafts: c'[k] = min(c[k]·ρ_k, 1).

    The head (and its STS temperatures) is calibrated at one sampling temperature; served traffic
    samples at others (greedy accepts far more than T = 1) and drifts. Position k's ratio is
    ρ_k = (observed + w·g) / (predicted + w) over its conditional trials (verified, every earlier
    draft accepted): observed counts the accepted ones and predicted sums their raw confidences,
    both decayed by (1 − α) per trial (a memory of about 1/α trials, the prior's: see
    AcceptancePrior); g is the same ratio over all positions, so a position with few trials
    follows the global one. Starts at ρ = 1."""

    pred: tuple[float, ...]
    obs: tuple[float, ...]
    alpha: float = 0.002
    weight: float = 4.0  # pseudo-trials pulling ρ_k toward the global ratio (and g toward 1)
    # ρ, computed once: the planner applies a correction several times a step (read-only)
    ratios: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pred, obs = np.asarray(self.pred), np.asarray(self.obs)
        g = (obs.sum() + self.weight) / (pred.sum() + self.weight)
        ratios = (obs + self.weight * g) / (pred + self.weight)
        ratios.setflags(write=False)
        object.__setattr__(self, "ratios", ratios)

    @classmethod
    def identity(cls, gamma: int, alpha: float = 0.002) -> ConfidenceCorrection:
        return cls((0.0,) * gamma, (0.0,) * gamma, alpha)

    def apply(self, confidences: np.ndarray) -> np.ndarray:
        return np.minimum(np.asarray(confidences, np.float64) * self.ratios, 1.0)

    def observe(
        self, confidences: np.ndarray, verify_lens: np.ndarray, accepted_lens: np.ndarray
    ) -> ConfidenceCorrection:
        """After a step: raw confidences [n, γ] of the verified rows, their ℓ and accepted n."""
        c = np.asarray(confidences, np.float64)
        if c.shape[0] <= SMALL_ROWS:
            sums = _fold_small(
                self.pred, self.obs, self.alpha, c, verify_lens, accepted_lens, conditional=True
            )
            return self if sums is None else replace(self, pred=sums[0], obs=sums[1])
        lens, acc, k = _step_grid(verify_lens, accepted_lens, c.shape[1])
        trial = (lens >= k) & (acc >= k - 1)  # [n, γ]
        sums = _fold(self.pred, self.obs, self.alpha, c, trial, acc >= k)
        return self if sums is None else replace(self, pred=sums[0], obs=sums[1])


@dataclass(frozen=True, slots=True)
class SurvivalCorrection:
    """Second stage after ConfidenceCorrection, on the survival itself: a'[k] = min(a[k]·σ_k,
    a'[k−1], 1). Conditionals that are right on average still under-price deep survival when the
    head spreads its confidences less than acceptance really varies between requests: a request
    that accepted its first drafts is likelier than average to accept the next, so the product
    of averaged conditionals falls short (CPU engine, greedy code prompts, every draft verified:
    survival at positions 6 and 7 predicted 0.136 and 0.099 after the conditional correction,
    0.174 and 0.137 realised), and the planner dropped tail drafts that paid.

    σ_k = (obs_k + w) / (pred_k + w) over the rows verified to position k or beyond: obs counts
    those that accepted k drafts or more, pred sums their survival a[k] as the first stage left
    it, both decayed by (1 − α) per row (AcceptancePrior's memory); w is the pseudo-count, in
    accepted drafts, that holds σ at 1 until evidence builds. Starts at σ = 1."""

    pred: tuple[float, ...]
    obs: tuple[float, ...]
    alpha: float = 0.002
    weight: float = 2.0
    ratios: np.ndarray = field(init=False, repr=False, compare=False)  # σ, computed once

    def __post_init__(self) -> None:
        ratios = (np.asarray(self.obs) + self.weight) / (np.asarray(self.pred) + self.weight)
        ratios.setflags(write=False)
        object.__setattr__(self, "ratios", ratios)

    @classmethod
    def identity(cls, gamma: int, alpha: float = 0.002) -> SurvivalCorrection:
        return cls((0.0,) * gamma, (0.0,) * gamma, alpha)

    def apply(self, surv: np.ndarray) -> np.ndarray:
        """Survival rows [n, γ] -> corrected rows, still non-increasing and in [0, 1]."""
        a = np.minimum(np.asarray(surv, np.float64) * self.ratios, 1.0)
        return np.minimum.accumulate(a, axis=-1)

    def observe(
        self, surv: np.ndarray, verify_lens: np.ndarray, accepted_lens: np.ndarray
    ) -> SurvivalCorrection:
        """After a step: first-stage survival [n, γ] of the verified rows, their ℓ and n."""
        a = np.asarray(surv, np.float64)
        if a.shape[0] <= SMALL_ROWS:
            sums = _fold_small(
                self.pred, self.obs, self.alpha, a, verify_lens, accepted_lens, conditional=False
            )
            return self if sums is None else replace(self, pred=sums[0], obs=sums[1])
        lens, acc, k = _step_grid(verify_lens, accepted_lens, a.shape[1])
        trial = lens >= k  # [n, γ]: whether position k's survival was observed
        sums = _fold(self.pred, self.obs, self.alpha, a, trial, acc >= k)
        return self if sums is None else replace(self, pred=sums[0], obs=sums[1])


# Bins of the survival the calibration maps (`SurvivalCalibration`): fine where lagged K cuts at
# low load (a tail draft is worth verifying at a few hundredths on the CPU engine), coarse above.
CALIB_EDGES = (
    0.0, 0.02, 0.04, 0.06, 0.08, 0.1, 0.13, 0.16, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0
)  # fmt: skip
_CALIB_MIDS = tuple((lo + hi) / 2.0 for lo, hi in itertools.pairwise(CALIB_EDGES))


@dataclass(frozen=True, slots=True)
class SurvivalCalibration:
    """Third stage, after the two per-position corrections: a monotone map of survival a to the
    survival rows predicted a realise, a' = f(a), learned over every verified draft.

    The corrections fix each position's average; they cannot fix a head that tells drafts apart
    less than it claims. Greedy code prompts on the in-process CPU engine (every draft
    verified, 2026-12-05, c = 2 and 8): drafts predicted 0.01-0.25 after both corrections realised
    0.07-0.19 whatever their prediction, while each position's mean was right within 0.02. The
    lagged K drops the drafts predicted lowest: it priced them at a few hundredths where they
    paid about 0.12 each, and verified two drafts a step fewer than every draft at R = 2 for
    3.4 % fewer tokens and no shorter step.

    Bins of a (CALIB_EDGES) keep decayed sums of the predictions, the hits (a row that accepted
    k drafts or more) and the trials (rows verified to k or beyond), decayed by (1 − α) per
    trial in the bin. Each bin also holds `weight` pseudo-trials at its midpoint that realise
    the midpoint plus the lift (realised rate over midpoint, when above it) of the bin above it:
    a bin without evidence takes its upper neighbour's lift. K drops the drafts predicted
    lowest, so the lowest bins are the ones it never verifies; held at the head's word they
    would stay unverified and unlearned for good. Lifted as the bins above were, they are
    verified and learned where that pays; a head that proves calibrated lifts nothing. Lifts,
    not rates: a bin of drafts predicted 0.02 below one of 0.9 that realised 0.95 reads 0.07,
    not 0.95. f interpolates the bins' mean prediction -> realised rate after a weighted
    isotonic fit, through (0, 0) and (1, 1). Which drafts are verified depends on predictions
    only, never on outcomes, so each bin's own rate is unbiased. Starts as the identity map.
    What it cost at c = 32-64, served: docs/scheduler.md ("Live survival calibration")."""

    pred: tuple[float, ...]
    obs: tuple[float, ...]
    num: tuple[float, ...]
    alpha: float = 0.002
    weight: float = 8.0
    knots: tuple[float, ...] = field(init=False, repr=False, compare=False)
    values: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        w = self.weight
        nb = len(_CALIB_MIDS)
        xs, ys, ws = [0.0] * nb, [0.0] * nb, [0.0] * nb
        lift = 0.0
        for b in reversed(range(nb)):  # top down: a bin's prior carries the lift above it
            m, n = _CALIB_MIDS[b], self.num[b]
            xs[b] = (self.pred[b] + w * m) / (n + w)
            ys[b] = (self.obs[b] + w * min(m + lift, 1.0)) / (n + w)
            lift = max(ys[b] - m, 0.0)
            ws[b] = n + w
        fit = isotonic(np.asarray(ys), np.asarray(ws)).tolist()
        object.__setattr__(self, "knots", (0.0, *xs, 1.0))
        object.__setattr__(self, "values", (0.0, *(min(v, 1.0) for v in fit), 1.0))

    @classmethod
    def identity(cls, alpha: float = 0.002) -> SurvivalCalibration:
        zeros = (0.0,) * (len(CALIB_EDGES) - 1)
        return cls(zeros, zeros, zeros, alpha)

    def apply(self, surv: np.ndarray) -> np.ndarray:
        """Survival rows [n, γ] -> calibrated rows: f is non-decreasing, so a row stays
        non-increasing along its positions and in [0, 1]."""
        return np.interp(np.asarray(surv, np.float64), self.knots, self.values)

    def observe(
        self, surv: np.ndarray, verify_lens: np.ndarray, accepted_lens: np.ndarray
    ) -> SurvivalCalibration:
        """After a step: the survival [n, γ] the first two stages gave the verified rows, their ℓ
        and accepted n. Trials as SurvivalCorrection's: positions k <= ℓ, a hit iff k <= n."""
        a = np.asarray(surv, np.float64)
        lens, acc, k = _step_grid(verify_lens, accepted_lens, a.shape[1])
        trial = lens >= k
        if not trial.any():
            return self
        nb = len(CALIB_EDGES) - 1
        b = np.clip(np.searchsorted(CALIB_EDGES, a[trial], side="right") - 1, 0, nb - 1)
        n = np.bincount(b, minlength=nb)
        keep = (1.0 - self.alpha) ** n
        pred = np.asarray(self.pred) * keep + np.bincount(b, a[trial], nb)
        obs = np.asarray(self.obs) * keep + np.bincount(b, (acc >= k)[trial], nb)
        num = np.asarray(self.num) * keep + n
        return replace(
            self, pred=tuple(pred.tolist()), obs=tuple(obs.tolist()), num=tuple(num.tolist())
        )


@dataclass(frozen=True, slots=True)
class LagShrink:
    """How much of a lagged survival row's departure from the average row still holds when its
    step comes: E[accepted now | row s published `lag` steps ago] = Σ_{j<ℓ} m[j] + ρ·(s[j] − m[j]),
    m the average row. Confidences say how a request's next few tokens go; `lag` steps later some
    of that may have passed. Served on the CPU engine at R = 1, the tokens lagged K was planned
    on against those realised had least-squares slopes of 0.56 and 0.70 (two sweeps): steps
    planned at 2.35 realised 3.36. On the rows themselves this fit read ρ = 0.87 served at
    c = 1 and a slope of 1.3 in-process (the lagged rows departed less than acceptance did), so
    how far lagged confidences hold up depends on the traffic, and is measured, not assumed.

    ρ is the least-squares slope, with an intercept, of y = n − Σ_{j<ℓ} m[j] on
    x = Σ_{j<ℓ} (s[j] − m[j]) over verified rows that had a lagged row (n accepted of ℓ
    verified). With an intercept because the rows observed are selected on x (only drafted rows
    are verified, and K drafts the confident ones) and the average row can be off: a slope
    through the origin reads both as signal (test_survival: 0.68 where the truth is 0.4). The
    sums decay by (1 − α) per row (AcceptancePrior's memory); a pseudo-count `weight` (in x²,
    about that many rows' worth) holds ρ at 1, face value, until evidence builds; clipped to
    [0, 1]. Pure: the planner keeps one and swaps in what `observe` returns."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    alpha: float = 0.002
    weight: float = 8.0

    @property
    def rho(self) -> float:
        if self.n <= 1.0:
            return 1.0
        cxx = self.sxx - self.sx * self.sx / self.n
        cxy = self.sxy - self.sx * self.sy / self.n
        return min(max((cxy + self.weight) / (max(cxx, 0.0) + self.weight), 0.0), 1.0)

    @property
    def slope(self) -> float:
        """The fitted slope itself, unclipped and without the pseudo-count (nan: no spread yet);
        above 1, the lagged rows departed from the average less than acceptance did."""
        if self.n <= 1.0:
            return float("nan")
        cxx = self.sxx - self.sx * self.sx / self.n
        cxy = self.sxy - self.sx * self.sy / self.n
        return cxy / cxx if cxx > 0.0 else float("nan")

    @staticmethod
    def apply(rows: np.ndarray, center: np.ndarray, rho: float) -> np.ndarray:
        """Rows [n, γ] pulled toward `center` [γ]: m + ρ·(s − m). Non-increasing rows and center
        stay non-increasing (a convex combination for ρ in [0, 1])."""
        return center + rho * (np.asarray(rows, np.float64) - center)

    def observe(
        self,
        lagged: np.ndarray,
        center: np.ndarray,
        verify_lens: np.ndarray,
        accepted_lens: np.ndarray,
    ) -> LagShrink:
        """After a step: the lagged rows [n, γ] its verified rows were planned from, the average
        row those departures are measured from, their ℓ and accepted n."""
        lens = np.asarray(verify_lens, np.int64)
        if not lens.size or not lens.any():
            return self
        s = np.asarray(lagged, np.float64)
        m = np.asarray(center, np.float64)
        within = np.arange(s.shape[1])[None, :] < lens[:, None]  # [n, γ]: positions verified
        x = ((s - m[None, :]) * within).sum(axis=1)
        y = np.asarray(accepted_lens, np.float64) - (m[None, :] * within).sum(axis=1)
        # rows folded one at a time in order: row i keeps (1 − α)^(n − 1 − i) of its weight
        w = (1.0 - self.alpha) ** np.arange(lens.size - 1, -1, -1, dtype=np.float64)
        old = (1.0 - self.alpha) ** lens.size
        return replace(
            self,
            n=self.n * old + float(w.sum()),
            sx=self.sx * old + float((w * x).sum()),
            sy=self.sy * old + float((w * y).sum()),
            sxx=self.sxx * old + float((w * x * x).sum()),
            sxy=self.sxy * old + float((w * x * y).sum()),
        )


@dataclass(frozen=True, slots=True, eq=False)  # holds arrays: compare by identity
class SurvivalHistory:
    """Ring buffer of the last `depth` published (request ids, survival) snapshots, one per step.

    The lagged scheduler (§5.2) sizes step t from the snapshot published `lag` steps earlier: push
    after each step's drafts, then `lagged(ids, lag)` reads the snapshot pushed `lag` pushes ago
    (lag=1 is the newest). Immutable: `push` returns a new history."""

    depth: int = 2
    snapshots: tuple[tuple[np.ndarray, np.ndarray], ...] = ()  # (sorted ids [R], survival [R, γ])

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"history depth must be >= 1, got {self.depth}")

    def push(self, request_ids: np.ndarray, surv: np.ndarray) -> SurvivalHistory:
        ids = np.asarray(request_ids, dtype=np.int64)
        s = np.asarray(surv, dtype=np.float64)
        if s.ndim != 2 or s.shape[0] != ids.shape[0]:
            raise ValueError(f"survival {s.shape} does not match {ids.shape[0]} request ids")
        order = np.argsort(ids, kind="stable")
        ids, s = ids[order], s[order]  # fancy indexing copies, so the caller's arrays stay theirs
        ids.setflags(write=False)
        s.setflags(write=False)
        return SurvivalHistory(self.depth, (*self.snapshots, (ids, s))[-self.depth :])

    def repeat(self) -> SurvivalHistory:
        """Push the newest snapshot again (the same read-only arrays, no copy): a step that
        published nothing new. No-op on an empty history."""
        if not self.snapshots:
            return self
        return SurvivalHistory(self.depth, (*self.snapshots, self.snapshots[-1])[-self.depth :])

    def lagged(self, request_ids: np.ndarray, lag: int, prior: AcceptancePrior) -> np.ndarray:
        """Survival [R, γ] for the current requests as published `lag` steps ago; a request absent
        from that snapshot (fresh, or no snapshot yet) gets the prior's survival row."""
        return self.lagged_with_hits(request_ids, lag, prior)[0]

    def lagged_with_hits(
        self, request_ids: np.ndarray, lag: int, prior: AcceptancePrior
    ) -> tuple[np.ndarray, np.ndarray]:
        """`lagged` and which rows the snapshot held ([R] bool; False: the row is the prior's)."""
        if not 1 <= lag <= self.depth:
            raise ValueError(f"lag must be in [1, depth={self.depth}], got {lag}")
        ids = np.asarray(request_ids, dtype=np.int64)
        out = np.empty((ids.shape[0], prior.gamma))
        out[:] = prior.survival
        hit = np.zeros(ids.shape[0], bool)
        if len(self.snapshots) < lag:
            return out, hit
        old_ids, old = self.snapshots[-lag]
        if old.shape[1] != prior.gamma:
            raise ValueError(f"history gamma {old.shape[1]} != prior gamma {prior.gamma}")
        if not old_ids.size:
            return out, hit
        pos = np.searchsorted(old_ids, ids)
        if ids.size <= SMALL_ROWS:  # the K search runs this every step: fewer numpy calls
            known = old_ids.tolist()
            for r, (p, i) in enumerate(zip(pos.tolist(), ids.tolist(), strict=True)):
                if p < len(known) and known[p] == i:
                    hit[r] = True
                    out[r] = old[p]
            return out, hit
        pos = np.minimum(pos, old_ids.size - 1)
        hit = old_ids[pos] == ids
        out[hit] = old[pos[hit]]
        return out, hit


def survival_pool(recent: np.ndarray, rows: np.ndarray, size: int) -> np.ndarray:
    """The last `size` survival rows seen: `recent` (a previous pool, any order) then `rows`."""
    both = np.concatenate([recent, np.asarray(rows, np.float64)])[-size:]
    both.setflags(write=False)
    return both


def stratified_rows(pool: np.ndarray, n: int) -> np.ndarray:
    """n survival rows standing for n requests whose own survival is unknown: the pool's rows at
    the quantiles (i + 1/2) / n of their expected accepted length. Their mean is the pool's, and
    so is their spread, which a single mean row (the prior) lacks: the live top-K picks the best
    drafts among the rows drafted, and over a spread-out batch that is worth more than K spread
    evenly over identical rows (E[top-K] >= top-K of the mean)."""
    order = np.argsort(pool.sum(axis=1), kind="stable")
    at = ((np.arange(n) + 0.5) * pool.shape[0] / n).astype(np.int64)
    return pool[order[at]]
