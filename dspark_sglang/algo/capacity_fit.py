"""Capacity fits from measurements (DESIGN §4): batch fits of the table and additive forms, and the
live estimator that turns StepRecords into new CapacityModel versions. Pure numpy + stdlib; imports
`config`, `types` and `algo.capacity` only; no clock, no I/O."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dspark_sglang.algo.capacity import (
    AdditiveModel,
    CapacityModel,
    Curve,
    ExpertParallelTerm,
    TableModel,
    executed_tokens,
)
from dspark_sglang.algo.monotone import isotonic
from dspark_sglang.types import StepRecord

Array = np.ndarray


def records_to_arrays(
    records: Iterable[StepRecord], *, include_prefill: bool = False
) -> tuple[Array, Array, Array, Array]:
    """(R, B, ctx, seconds) of the usable records (DESIGN §3 step 4). Steps carrying prefill tokens
    are dropped by default: the planner prices verify forwards; a prompt chunk costs differently."""
    rows = [
        (r.num_reqs, r.num_tokens, r.kv_tokens, r.step_seconds)
        for r in records
        if (include_prefill or r.num_prefill_tokens == 0)
        and r.num_tokens > 0
        and r.step_seconds > 0
        and math.isfinite(r.step_seconds)
    ]
    if not rows:
        return tuple(np.empty(0) for _ in range(4))  # type: ignore[return-value]
    num_reqs, num_tokens, ctx, secs = (np.asarray(c, np.float64) for c in zip(*rows, strict=True))
    return num_reqs, num_tokens, ctx, secs


def _knots(x: Array, max_knots: int) -> tuple[float, ...]:
    """Distinct values of x, thinned to at most max_knots by quantile; always keeps min and max."""
    u = np.unique(x)
    if u.size > max_knots:
        u = np.unique(np.quantile(u, np.linspace(0.0, 1.0, max_knots), method="nearest"))
    return tuple(float(v) for v in u)


def _hat_basis(x: Array, knots: Sequence[float]) -> Array:
    """[len(x), len(knots)] basis of `Curve` over these knots (flat left, linear right)."""
    k = np.asarray(knots, np.float64)
    eye = np.eye(k.size)
    basis = np.stack([np.interp(x, k, eye[i]) for i in range(k.size)], axis=1)
    if k.size > 1:
        over = x > k[-1]
        t = (x[over] - k[-1]) / (k[-1] - k[-2])
        basis[over, -1], basis[over, -2] = 1.0 + t, -t
    return basis


def _robust_lstsq(design: Array, y: Array, iters: int = 8) -> Array:
    """Least squares in relative error (what MAPE scores) with Huber reweighting by the MAD."""
    base = 1.0 / y
    w = base
    for _ in range(iters + 1):
        beta = np.linalg.lstsq(design * w[:, None], y * w, rcond=None)[0]
        r = (y - design @ beta) / y
        s = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), 1e-9)
        a = np.abs(r)
        w = base * np.sqrt(np.where(a <= 1.345 * s, 1.0, 1.345 * s / np.maximum(a, 1e-300)))
    return beta


def fit_table(num_tokens: Array, seconds: Array, buckets: Sequence[int]) -> TableModel:
    """Median step time per executed bucket (DESIGN §4), gaps interpolated, then made
    non-decreasing in B by weighted isotonic regression (a bigger forward never runs faster)."""
    b = np.asarray(buckets, np.int64)
    ex = executed_tokens(tuple(buckets), np.asarray(num_tokens, np.int64))
    secs = np.asarray(seconds, np.float64)
    med = np.full(b.size, np.nan)
    count = np.zeros(b.size)
    for i, bucket in enumerate(b):
        hit = secs[ex == bucket]
        if hit.size:
            med[i], count[i] = np.median(hit), hit.size
    have = count > 0
    if not have.any():
        raise ValueError("fit_table: no measurement falls in any bucket")
    med[~have] = Curve(tuple(b[have].tolist()), tuple(med[have].tolist()))(b[~have])
    smooth = isotonic(med, np.maximum(count, 1e-3))
    return TableModel(tuple(int(v) for v in b), tuple(float(v) for v in smooth))


def _independent(base: Array, x: Array) -> bool:
    """Whether column x varies independently of the columns of `base` (its least-squares
    residual is more than round-off)."""
    resid = x - base @ np.linalg.lstsq(base, x, rcond=None)[0]
    return bool(np.linalg.norm(resid) > 1e-3 * max(np.linalg.norm(x), 1.0))


def fit_additive(
    num_reqs: Array,
    num_tokens: Array,
    ctx: Array,
    seconds: Array,
    *,
    buckets: Sequence[int] = (),
    max_knots: int = 16,
) -> AdditiveModel:
    """Robust least squares for T = bias + α(R) + θ(B_exec) + κ·ctx + κ_q·ctx·(B_exec − R)/R
    (DESIGN §4; upstream's OLS backfit with hat functions instead of dummies), α(R_min) =
    θ(B_min) = 0 so bias is T at the smallest cell; α, θ then projected onto non-decreasing
    curves. Each context term is fitted only when it varies independently of R, B and the other
    (a profile at one context length leaves both 0 and α, θ absorb them; one at one token per
    request leaves κ_q 0); a negative one is noise and is refitted without."""
    reqs = np.asarray(num_reqs, np.float64)
    ex = executed_tokens(tuple(buckets), np.asarray(num_tokens, np.int64)).astype(np.float64)
    c, y = np.asarray(ctx, np.float64), np.asarray(seconds, np.float64)
    cq = c * np.maximum(ex - np.maximum(reqs, 1.0), 0.0) / np.maximum(reqs, 1.0)
    r_knots, b_knots = _knots(reqs, max_knots), _knots(ex, max_knots)
    cols = [np.ones((y.size, 1)), _hat_basis(reqs, r_knots)[:, 1:], _hat_basis(ex, b_knots)[:, 1:]]
    base = np.concatenate(cols, axis=1)
    terms: dict[str, Array] = {}
    for name, x in (("kappa", c), ("kappa_q", cq)):
        if _independent(np.column_stack([base, *terms.values()]), x):
            terms[name] = x
    while True:
        beta = _robust_lstsq(np.column_stack([base, *terms.values()]), y)
        coef = dict(zip(terms, beta[base.shape[1] :].tolist(), strict=True))
        negative = [k for k, v in coef.items() if v < 0.0]
        if not negative:
            break
        del terms[min(negative, key=coef.__getitem__)]  # noise: refit without it
    m = len(r_knots) - 1
    alpha = isotonic(np.concatenate(([0.0], beta[1 : 1 + m])))
    theta = isotonic(np.concatenate(([0.0], beta[1 + m : 1 + m + len(b_knots) - 1])))
    bias = float(beta[0] + alpha[0] + theta[0])  # keep α(R_min) = θ(B_min) = 0
    if bias <= 0.0:
        raise ValueError(f"fit_additive: non-positive step time {bias} at the smallest cell")
    return AdditiveModel(
        bias_s=bias,
        alpha=Curve(r_knots, tuple((alpha - alpha[0]).tolist())),
        theta=Curve(b_knots, tuple((theta - theta[0]).tolist())),
        kappa_s=coef.get("kappa", 0.0),
        kappa_q_s=coef.get("kappa_q", 0.0),
        buckets=tuple(int(v) for v in buckets),
    )


# ---- live estimation -----------------------------------------------------------------------


SIGMA_EVERY = 8  # records between refreshes of the residuals' MAD


def _median(xs: Iterable[float]) -> float:
    """np.median of a few dozen floats (the same value: the middle one, or the mean of the two),
    by sorting a list: a tenth of numpy's cost at this size."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2.0


HOST_SPIKE = 4.0  # a plain step's host seconds count at most this multiple of the running mean
# A drafting step timed while its R has fewer than 8 records counts at most this multiple of the
# larger of its R's mean so far and the prior's price there (the running mean is too young to
# clip by). Served, 2026-12-05 (s46, c = 1): the second drafting record at R = 1 took 106.6 ms (a
# host stall the forward missed: 6.7 ms, no outlier), the prior priced 2.8 ms, drafting added
# 4-5; published at once, the price read 33 ms, the planner chose K = 0, and the retimes that
# followed (3.4-3.7 ms) brought it to 24 ms over 300 steps: the pass ran at 0.89 of the
# same policy priced at 8 pseudo-records. Twice the prior still lets every drafting record seen
# in-process through (1.3-1.8x the drafter-only prior).
EARLY_SPIKE = 2.0


# The live scale's buckets of executed B where the engine runs exactly B tokens (`live_grid`):
# every B up to LIVE_DENSE_B, then at most LIVE_RATIO apart.
LIVE_DENSE_B, LIVE_RATIO = 32, 1.125


def live_grid(knots: Sequence[float]) -> Array:
    """Buckets of executed B for the live scale when there are no graph tiers: the prior's knots,
    every B up to LIVE_DENSE_B and steps of at most LIVE_RATIO beyond, up to the last knot. A
    record corrects the bucket its B falls in and the scale is interpolated between buckets, so
    on the prior's knots alone (the start-up grid's R x {1, 4, 8} tokens: 8, 16, 32 …) the records
    at B = 9 … 15 all moved the knot at 16. Served, R = 2 (2026-12-02): the forward took 6.35 ms
    at B = 12 and 6.80 at B = 16 (every expert busy by then), a line from 8 to 16 under-priced 12,
    the records there pushed 16 up, and B = 16 was priced 13.5 ms for 12.0 taken, so lagged
    verified 10.8 drafts a step where verify-all's 13.7 cost 0.17 ms more and accepted 0.35 more."""
    top = max(float(k) for k in knots)
    pts = sorted(
        {float(k) for k in knots} | {float(b) for b in range(1, int(min(top, LIVE_DENSE_B)) + 1)}
    )
    grid = [pts[0]]
    for b in pts[1:]:
        while (step := max(grid[-1] + 1.0, float(math.ceil(grid[-1] * LIVE_RATIO)))) < b:
            grid.append(step)  # a wide gap between two knots
        grid.append(b)
    return np.asarray(grid, np.float64)


# Drafting records at an R before its price caps the R above it (a few steps give a stable mean).
CAP_MIN_RECORDS = 4

# How far (log) one drafting step's own level may move its drafter seconds from the running
# level's reading (`LiveEstimator._draft_at_level`): 2x, past any spell seen on the CPU host.
LEVEL_CLIP = math.log(2.0)


def _cap_above_seen(table: dict[int, tuple[float, float]], curve: Curve | None) -> Curve | None:
    """The drafter's price at an R above every R drafted so far, capped at the largest drafted
    R's price scaled by R: drafting costs at most in proportion to its rows (a fixed part plus a
    per-row part; the profile CLI: 43.6 ms at R = 32, 71.4 at 64). Above the drafted range the
    price is the start-up curve's shape times the level, and a start-up point timed high (three
    repeats on a noisy host; 15-repeat timings of R = 64 ranged 67-113 ms) is never corrected,
    because the planner then drafts no batch that large (probes price nothing): in-process,
    2026-12-01, a lagged engine that had drafted R = 31 at 41.5 ms priced R = 64 at 151 ms and
    served c = 64 without drafting."""
    if curve is None:
        return None
    seen = [r for r, (_, n) in table.items() if n >= CAP_MIN_RECORDS]
    if not seen:
        return curve
    top = max(seen)
    at_top = float(curve(float(top)))
    vals = tuple(
        min(v, at_top * k / top) if k > top else v
        for k, v in zip(curve.knots, curve.values, strict=True)
    )
    return Curve(curve.knots, vals)


# R at least this far apart in prior price (largest / smallest) fit an intercept as well as a
# slope to the prior's curve; closer, the slope alone (a ratio) is all they can tell.
AFFINE_SPREAD = 2.0


def r_bin(r: int) -> int:
    """R rounded up to an eighth of its power of two (exact below 16): the R whose drafting
    records count together. A full batch wanders by a few requests (c = 64: R = 58-64), and per-R
    counts left each R below CAP_MIN_RECORDS after a dozen drafting steps there."""
    step = 1 << max(0, int(r).bit_length() - 4)
    return -(-int(r) // step) * step


def _from_prior(
    table: dict[int, tuple[float, float]], prior: Curve | None, w0: float
) -> Callable[[float], float] | None:
    """What the R seen say of the live term at any R, read off the prior's curve p(R).

    The ratio of measured to prior, shrunk toward 1 by w0 pseudo-records, carries a multiplicative
    error (a slower host). Drafting adds a fixed part the start-up profile never timed (the
    drafter's bookkeeping, the plan; about 3 ms on the CPU engine) and a ratio learned where
    that part dominates, at R = 1, multiplied it into every R: served, 2026-12-02, a lagged engine
    that had drafted R = 1-32 priced R = 64 at 130 ms where a drafting step there added 90, and
    served c = 64 without drafting. Where the R seen span AFFINE_SPREAD of prior price, lines
    m = a + b·p (a ≥ 0, b > 0) are fitted as well, and the lowest of them is used: a price too low
    is corrected by the drafting steps it brings; one too high is never tested. Two lines: one
    weighted by records, one weighing each R bin alike. The record-weighted line alone is the
    slope of the small R, where a low-load run piles up thousands of records; served (sweep
    rot_db68f3d, replayed from its step logs), the drafter's cost per row fell at R = 40-64 and
    that line priced R = 64 at 1.29x its measured bin (a drafting step priced 21 % above what it
    added, median, at R >= 40; 11 % with the bin-weighted line as well), so lagged served c = 64
    without drafting where fixed:3 made 6 % more tokens a ms than no-spec's plain steps."""
    if prior is None:
        return None
    pairs = [(m, n, float(prior(r))) for r, (m, n) in table.items() if m > 0.0 and n > 0.0]
    pairs = [(m, n, p) for m, n, p in pairs if p > 0.0]
    num = sum(n * math.log(m / p) for m, n, p in pairs)
    den = sum(n for _, n, _ in pairs)
    level = math.exp(num / (den + w0))  # shrunk toward 1 like each R toward the prior
    groups: dict[int, list[tuple[float, float, float]]] = {}
    for r, (m, n) in table.items():
        if m > 0.0 and n > 0.0 and float(prior(r)) > 0.0:
            groups.setdefault(r_bin(r), []).append((m, n, float(prior(r))))
    firm = []  # (mean seconds, records, mean prior seconds) of each R bin with enough records
    for g in groups.values():
        n_sum = sum(n for _, n, _ in g)
        if n_sum >= CAP_MIN_RECORDS:
            firm.append(
                (sum(m * n for m, n, _ in g) / n_sum, n_sum, sum(p * n for _, n, p in g) / n_sum)
            )
    lines = []
    if len(firm) >= 2 and max(p for *_, p in firm) >= AFFINE_SPREAD * min(p for *_, p in firm):
        m, n, p = (np.asarray(x, np.float64) for x in zip(*firm, strict=True))
        for w in (n, np.ones_like(n)):
            pw = float(w @ p) / float(w.sum())
            b = float(w @ ((p - pw) * m)) / float(w @ ((p - pw) ** 2))
            a = float(w @ m) / float(w.sum()) - b * pw
            if b > 0.0 and a >= 0.0:
                lines.append((a, b))
    if not lines:
        return lambda r: float(prior(r)) * level
    return lambda r: min(float(prior(r)) * level, *(a + b * float(prior(r)) for a, b in lines))


# Pseudo-records holding the drafter's price at each R at the prior's (shrunk toward what the R
# seen say of it, `_from_prior`). The start-up profile times the drafter alone, and a drafting
# step adds its bookkeeping, so the prior sits low wherever it is read: in-process, c = 64, it
# priced R = 64 at 25.9 ms where drafting steps added 34-38, and four steps at this weight moved
# the price to 30 ms (at 1, the run stopped drafting at R = 64 after five steps). Served A/B
# against 2 (s46_price, six passes, 8 over 2, geometric mean of per-pass tok/s ratios, 90 % t):
# c = 1 0.986 [0.973, 0.999], c = 16 1.016 [0.990, 1.043], c = 32 1.025 [1.021, 1.029], c = 64
# 1.003 [0.963, 1.045]: no better overall, so the forward's weight stays (docs/capacity.md "The
# drafter's price").
DRAFT_PRIOR_WEIGHT = 8.0


@dataclass(frozen=True, slots=True)
class EstimatorConfig:
    publish_every: int = 32  # accepted records between published versions
    window: int = 32  # recent residuals: MAD noise scale and the post-drift restart
    mape_window: int = 100  # records in the rolling MAPE
    reject_z: float = 5.0  # |residual| / σ beyond which a record is an outlier
    cusum_k: float = 0.5  # CUSUM slack, in σ
    cusum_h: float = 16.0  # CUSUM alarm level, in σ: ≥ 4 clipped outliers in a row
    rate: float = 0.05  # slowest EWMA rate of the level g (≈ 20-record memory once warm)
    # slowest EWMA rate of a bucket's deviation u (≈ 200 records): the shape is the prior's
    # and the profile's, and moves slowly; what moves fast is the host, the level
    shape_rate: float = 0.005
    prior_weight: float = 8.0  # pseudo-records holding the level and each bucket at the prior
    draft_prior_weight: float = DRAFT_PRIOR_WEIGHT  # the same for the draft term at each R
    min_sigma: float = 0.02  # noise floor on log step time (a deterministic clock has MAD 0)
    popularity_rate: float = 0.02  # EWMA rate of the expert histogram
    popularity_tol: float = 0.05  # L1 change that republishes the popularity
    warm_tokens: int = 512  # precompute E[max load] this far at publish, off the planner path
    include_prefill: bool = False


class LiveEstimator:
    """Online capacity estimator (DESIGN §4 "updated live"). Fed one StepRecord at a time, it keeps
    a multiplicative correction of the prior model per executed bucket and publishes new models.

    Residual e = log(measured) - log(prior prediction) = g + u[bucket] + noise: g is the global
    level, u the bucket's deviation, shrunk toward 0 (the prior's shape) by `prior_weight`.
    Records with |e - g - u| > reject_z·σ (σ from the MAD of recent residuals) are outliers. A
    two-sided CUSUM on the clipped residuals detects drift; on alarm g restarts at the median of
    the records since the drift began and a new model is published at once. Published scales make
    T(1, B, 0) non-decreasing in B (weighted isotonic regression in log space). No clock, no I/O,
    no randomness: two estimators fed the same records publish identical models."""

    def __init__(self, prior: CapacityModel, cfg: EstimatorConfig | None = None) -> None:
        self.cfg = cfg = cfg or EstimatorConfig()
        self.model = prior
        self.num_observed = 0
        self.num_rejected = 0
        self.drift_events = 0
        self._base = replace(prior, scale=None)
        form = prior.form
        if form.buckets:  # graph tiers: the executed B takes only these values
            self._grid = np.asarray(form.buckets, np.float64)
        elif isinstance(form, AdditiveModel):
            self._grid = live_grid(form.theta.knots)
        else:
            self._grid = np.ones(1)
        self._grid_at = tuple(self._grid.tolist())  # the grid for bisect, one record at a time
        # A prior that already carries a live scale (a profile saved from a running engine) keeps
        # it: residuals are measured against it and the published scale multiplies it.
        self._prior_scale = prior.scale
        self._g, self._n_g = 0.0, 0.0
        self._u, self._n = np.zeros(self._grid.size), np.zeros(self._grid.size)
        # which buckets have records, and how many in all (observe's centering of u, per record)
        self._seen, self._n_sum = np.zeros(self._grid.size, bool), 0.0
        self._resid: deque[float] = deque(maxlen=cfg.window)
        self._level: deque[float] = deque(maxlen=cfg.window)
        self._ape: deque[float] = deque(maxlen=cfg.mape_window)
        self._cusum, self._run = [0.0, 0.0], [0, 0]  # (upward, downward)
        self._since = 0
        self._sigma_val, self._sigma_at = 0.0, None  # cached MAD scale, num_observed when taken
        # Drafter seconds per R: measured directly each drafting step, so a plain EWMA per R
        # (no regression); the prior's curve fills the R never seen.
        self._draft: dict[int, tuple[float, float]] = {}  # R -> (EWMA seconds, records)
        self.drafts_observed = 0  # drafting records that taught the draft term (ticks `_draft`)
        # Host seconds of plain steps per R (records that timed their forward): the same EWMA.
        self._host: dict[int, tuple[float, float]] = {}
        moe = prior.moe
        self._pop = None
        if moe is not None:
            pop = np.asarray(moe.popularity or (1.0,) * moe.num_experts, np.float64)
            self._pop = pop / pop.sum()
            moe.max_loads(cfg.warm_tokens)  # the prior's E[max load] table, off the planner path

    @property
    def mape(self) -> float:
        """Rolling mean |predicted - measured| / measured of the published model (DESIGN §8)."""
        return float(np.mean(self._ape)) if self._ape else float("nan")

    def observe(self, rec: StepRecord) -> CapacityModel | None:
        """Feed one step; returns the new model when this record publishes one, else None."""
        cfg = self.cfg
        if rec.num_prefill_tokens and not cfg.include_prefill:
            return None
        y = rec.step_seconds
        if rec.num_tokens < 1 or not (y > 0.0 and math.isfinite(y)):
            self.num_rejected += 1
            return None
        self.num_observed += 1
        args = (rec.num_reqs, rec.num_tokens, rec.kv_tokens)
        drafted = rec.draft_seconds > 0.0 and math.isfinite(rec.draft_seconds)
        # the drafter's time is keyed by the rows it drafted, which can be fewer than the step's R
        # (rows capped at one token; a probe's few, which price no step and teach nothing below)
        draft_r = rec.num_draft_reqs if rec.num_draft_reqs > 0 else rec.num_reqs
        untimed = rec.draft_resumed or (rec.probe and draft_r < rec.num_reqs)
        pred_y = self.model.predict(*args) + (
            float(self.model.draft_seconds(draft_r)) if drafted else 0.0
        )
        self._ape.append(abs(pred_y - y) / y)
        self._count_experts(rec.routed_tokens_per_expert)
        fwd = rec.forward_seconds
        split = 0.0 < fwd <= y and math.isfinite(fwd)
        dsec = rest = 0.0
        if split:
            # The forward was timed alone: the rest of the step is the host's work, and on a
            # drafting step also everything drafting adds (the drafter, its bookkeeping, the
            # plan), which is what the planner must weigh against skipping it.
            rest = y - fwd
            if not drafted:
                self._observe_host(rec.num_reqs, rest, fwd)
            y = fwd
        elif drafted:
            dsec = rec.draft_seconds
            y = max(y - dsec, 0.05 * y)  # the forward's share: what the form prices
        bk = self._base.form.buckets
        j = bisect.bisect_left(bk, rec.num_tokens)
        ex = bk[j] if j < len(bk) else rec.num_tokens  # executed_tokens, without arrays
        i = min(bisect.bisect_left(self._grid_at, ex), len(self._grid_at) - 1)
        u = float(self._u[i]) * float(self._n[i]) / (float(self._n[i]) + cfg.prior_weight)
        pred = float(self._base.step_seconds(*args)) * self._prior_factor_at(ex)
        if not split:  # y still holds the host's share
            pred += float(self._base.host_seconds(rec.num_reqs))
        e = math.log(y) - math.log(pred)
        d = e - self._g - u
        self._resid.append(d)
        self._level.append(e - u)
        sigma = self._sigma()
        z = max(-cfg.reject_z, min(cfg.reject_z, d / sigma))
        for side, zz in enumerate((z, -z)):
            self._cusum[side] = max(0.0, self._cusum[side] + zz - cfg.cusum_k)
            self._run[side] = self._run[side] + 1 if self._cusum[side] > 0.0 else 0
        alarm = [side for side in (0, 1) if self._cusum[side] > cfg.cusum_h]
        if alarm:
            # Restart the level from the records since the CUSUM last sat at zero: the drift began
            # there. A median of them ignores the odd spike that rode along.
            run = min(self._run[alarm[0]], len(self._level))
            self._g = float(np.median(list(self._level)[-run:]))
            # The draft and host terms are kept at the level (see _observe_draft), so they move
            # with it. The drafting steps since the drift began do not restart the draft term:
            # a stall of four steps fires the alarm too, and its drafting steps' median (a
            # stall hits the drafter's share of a step as it likes) priced R = 1 at 5.1 ms where
            # drafting added 2.3, for good, as K = 0 then timed no drafting step (served CPU
            # engine, sweep 06d3171, c = 1).
            self._n_g = float(run)
            self._cusum, self._run = [0.0, 0.0], [0, 0]
            self.drift_events += 1
            return self._publish()
        news = False
        if abs(d) <= cfg.reject_z * sigma:
            if drafted:  # an outlier's drafting time is the stall's, not the drafter's
                news = not untimed and self.drafts_timed(draft_r) < CAP_MIN_RECORDS
                at_level = (
                    self._draft_at_level(rec.num_reqs, rest, e - u)
                    if split
                    else dsec * math.exp(-self._g)
                )
                self._observe_draft(draft_r, at_level, untimed)
            self._g += max(cfg.rate, 1.0 / (self._n_g + 1.0 + cfg.prior_weight)) * (e - u - self._g)
            self._n_g += 1.0
            # Python floats, numpy's operations: the same value, without numpy scalars
            ui, ni = float(self._u[i]), float(self._n[i])
            self._u[i] = ui + max(cfg.shape_rate, 1.0 / (ni + 1.0)) * (e - self._g - ui)
            self._n[i] = ni + 1.0
            if ni == 0.0:
                self._seen[i] = True
            self._n_sum += 1.0  # counts: exact in any order, so numpy's sum of _n
            # A bucket's records fix only the sum g + u: with one bucket fed (lagged K = 0 steps
            # at c = 1) the split random-walked (CPU engine: g 0.67, u[B = 1] -0.48 after 2,700
            # records), and priced every other bucket, and through the drift shift the drafter,
            # at twice their measured times. Holding the record-weighted mean of u at 0 makes g
            # the level of what was measured and u each bucket's deviation from it.
            m = float(self._n @ self._u) / self._n_sum
            self._g += m
            self._u[self._seen] -= m
        else:
            self.num_rejected += 1
        self._since += 1
        # The first drafting steps timed at an R bin are the evidence its price waits on (the
        # planner drafts there to learn it, EXPLORE_RATIO): published at once, not up to
        # publish_every records later, while the drafting they price is still being chosen.
        return self._publish() if news or self._since >= cfg.publish_every else None

    def _observe_draft(self, num_reqs: int, seconds: float, skip: bool = False) -> None:
        """`seconds`: what drafting added to a step, at the forward's level g = 0.

        Whatever slows the forward (a CPU hog, a throttled GPU) slows the drafter and the host
        alike, so their EWMAs hold seconds at the level and are published times exp(g). Moving
        them by g's jumps at drift alarms alone ratcheted: a jump up and a gradual return (the
        level's EWMA) left the drafter 2x dear, and at c = 1, where nearly every drafting step
        is a probe or a resumed drafter, no observation ever brought it back (in-process,
        2026-12-01: 32-48 ms for a drafter that took 7-15 ms)."""
        if skip:  # a probe's few rows, or a resumed drafter: no step's price (StepRecord)
            return
        mean, n = self._draft.get(num_reqs, (0.0, 0.0))
        if n >= 8:  # a spike rides on one step (HOST_SPIKE), not on the price
            seconds = min(seconds, HOST_SPIKE * mean)
        else:
            prior = float(self._base.draft_seconds(num_reqs)) if self._base.draft else 0.0
            if max(mean, prior) > 0.0:
                seconds = min(seconds, EARLY_SPIKE * max(mean, prior))
            if n == 0.0:
                mean = seconds
        mean += max(self.cfg.rate, 1.0 / (n + 1.0)) * (seconds - mean)
        self._draft[num_reqs] = (mean, n + 1.0)
        self.drafts_observed += 1

    def _draft_at_level(self, num_reqs: int, rest: float, level: float) -> float:
        """A drafting step's seconds outside its timed forward (`rest`) -> what drafting added,
        at the level g = 0, read at the step's own level (`level`: its forward's log residual
        less its bucket's deviation) rather than at the running g: the drafter and the forward
        share the core at that moment, so a slow spell that slows one slows the other. Served
        CPU steps (s66_full, verify-all and fixed:3 at R = 4, 16, 32, 36 deployment cells):
        per-step log drafting time against log forward time (less its bucket's median) has
        slope 0.59-1.36 (median ~0.9), and the drafting time's spread falls from sd 0.051-0.213
        to 0.041-0.117 read at the step's level, in 35 of the 36 cells. A lagged deployment
        whose first whole-batch drafting steps at R = 16 ran in a spell (forward 1.2-1.5x its
        price) stopped drafting there and never timed it again (s66_full, c = 16, one of six);
        replayed into an estimator on the Zen 4 profile, its R = 16 price after those three
        steps is 14.7 ms read at each step's level, 16.1 ms read at g. The step's level moves
        the price at most LEVEL_CLIP (log) away from g's reading."""
        lv = min(max(level, self._g - LEVEL_CLIP), self._g + LEVEL_CLIP)
        host = self._host_at(num_reqs) * math.exp(-self._g)
        return max(rest * math.exp(-lv) - host, 0.0)

    def drafts_timed(self, num_reqs: int) -> float:
        """Drafting steps that taught the draft term at R's bin (`r_bin`) or a larger one: at
        most a few below that, R's price is interpolated between timed points rather than
        extrapolated past them (probes and resumed drafters teach nothing). Counting R's bin
        alone, a 24-request run at c = 8 explored on 47 of its 171 steps, most of them while its
        batch drained through R = 7 … 1 below an R = 8 timed 33 times."""
        b = r_bin(num_reqs)
        return sum(n for r, (_, n) in self._draft.items() if r_bin(r) >= b)

    def _observe_host(self, num_reqs: int, seconds: float, forward: float) -> None:
        """A plain step's host seconds (`forward`: its timed forward). Clipped as the drafter's
        are: at HOST_SPIKE x its R's mean from 8 records on, and before that at EARLY_SPIKE x
        the larger of that mean and what the R seen so far (or the prior) say of this R, or of
        the step's own forward when nothing does. Unclipped, one stall at a new R priced every
        larger R (the host term is isotonic in R): served, c = 64 (sweep s65_c64), the first
        plain step at R = 24 spent 0.60 s outside its 22 ms forward, plain steps at R = 64 were
        priced 0.69 s for 0.03 taken, and lagged drafted every row at every step of the cell
        (0.70 of no-spec) since no plain step there could show the price wrong."""
        level = math.exp(-self._g)
        seconds *= level  # at the level, as _observe_draft
        mean, n = self._host.get(num_reqs, (0.0, 0.0))
        if n >= 8:  # a collector pause or a preempted thread: one spike must not move the mean
            seconds = min(seconds, HOST_SPIKE * mean)
        else:
            ref = max(mean, self._host_ref(num_reqs, level))
            if not ref > 0.0:
                ref = forward * level
            seconds = min(seconds, EARLY_SPIKE * ref)
            if n == 0.0:
                mean = seconds
        mean += max(self.cfg.rate, 1.0 / (n + 1.0)) * (seconds - mean)
        self._host[num_reqs] = (mean, n + 1.0)

    def _host_ref(self, num_reqs: int, level: float) -> float:
        """The host seconds at the level the other R seen say of this R (held flat past them),
        or the prior's; 0 when neither knows."""
        others = [r for r in self._host if r != num_reqs]
        if others:
            others.sort()
            return float(np.interp(num_reqs, others, [self._host[r][0] for r in others]))
        return float(self._base.host_seconds(num_reqs)) * level

    def _host_at(self, num_reqs: int) -> float:
        """The host seconds of a plain step of R requests as learned so far (the prior's when no
        plain step was seen yet)."""
        if num_reqs in self._host:
            return self._host[num_reqs][0] * math.exp(self._g)
        if self._host:
            ks = sorted(self._host)
            at_level = np.interp(num_reqs, ks, [self._host[k][0] for k in ks])
            return float(at_level) * math.exp(self._g)
        return float(self._base.host_seconds(num_reqs))

    def _draft_curve(self) -> Curve | None:
        return self._at_level(
            self._draft,
            _cap_above_seen(
                self._draft,
                self._ewma_curve(self._draft, self._base.draft, self.cfg.draft_prior_weight),
            ),
        )

    def _host_curve(self) -> Curve | None:
        """The host term as `_host_at` reads it. Without a prior host curve its knots are only the
        R of the plain steps seen, and a Curve continues its last segment's slope: a lagged engine
        that had decoded plainly at R = 1-3 only (2.2-2.8 ms) priced the host of a drafting step
        at R = 63 at 36-91 ms (served, c = 64, 2026-12-02; a plain step there has 11 ms of host
        work), every step at that load 25-55 % dear. Held flat past the largest R seen instead:
        under-priced by the host's growth until plain steps at that R teach it."""
        curve = self._at_level(
            self._host, self._ewma_curve(self._host, self._base.host, self.cfg.prior_weight)
        )
        if self._base.host is None and curve is not None and len(curve.knots) > 1:
            last = curve.knots[-1]
            curve = Curve((*curve.knots, last + 1.0), (*curve.values, curve.values[-1]))
        return curve

    def _at_level(self, table: dict[int, tuple[float, float]], curve: Curve | None) -> Curve | None:
        """A learned term in seconds at today's level (the prior's as it is, where none was)."""
        if not table or curve is None:
            return curve
        f = math.exp(self._g)
        return Curve(curve.knots, tuple(v * f for v in curve.values))

    def _ewma_curve(
        self, table: dict[int, tuple[float, float]], prior: Curve | None, w0: float
    ) -> Curve | None:
        """Seconds vs R from per-R EWMAs, a sparse R shrunk toward what the R seen say of the
        prior's curve there (`_from_prior`). The prior's shape carries to an R not seen yet, its
        level does not: the start-up profile times the drafter alone, while the live term is all
        that drafting adds to a step (the drafter's own timer saw 5.1 of 7 ms at R = 1), so
        shrinking toward the raw prior priced drafting low at every R not drafted yet, and each
        drafting step at such an R (high load, after low load) lost throughput until the EWMA
        caught up."""
        if not table:
            return prior
        reqs = sorted(set(table) | set(int(k) for k in (prior.knots if prior else ())))
        at = _from_prior(table, prior, w0)
        vals, wts = [], []
        for r in reqs:
            mean, n = table.get(r, (0.0, 0.0))
            if at is not None:  # shrink a sparse R toward the prior's value there
                mean = (mean * n + at(r) * w0) / (n + w0)
            vals.append(mean)
            wts.append(n + (w0 if at is not None else 0.0))
        # more requests never cost less: isotonic in R, as the forward's scale is in B
        smooth = isotonic(np.asarray(vals), np.maximum(np.asarray(wts), 1e-3))
        return Curve(tuple(float(r) for r in reqs), tuple(smooth.tolist()))

    def _prior_factor(self, executed: Array | int) -> Array:
        s = self._prior_scale
        return np.ones(np.shape(executed)) if s is None else np.interp(executed, s.knots, s.values)

    def _prior_factor_at(self, executed: int) -> float:
        """`_prior_factor` of one executed B, in Python floats (np.interp: flat outside)."""
        s = self._prior_scale
        if s is None:
            return 1.0
        ks, vs = s.knots, s.values
        return float(
            vs[0] if executed <= ks[0] else vs[-1] if executed >= ks[-1] else s._at(executed)
        )

    def _sigma(self) -> float:
        if len(self._resid) < 8:  # too few to estimate a spread: stay lenient, let CUSUM act
            return max(self.cfg.min_sigma, 0.25)
        # The MAD of a 32-record window moves slowly; two medians per step were 40 % of observe()
        # on the CPU engine's planner path, so it is refreshed every SIGMA_EVERY records.
        if self._sigma_at is None or self.num_observed - self._sigma_at >= SIGMA_EVERY:
            mid = _median(self._resid)
            mad = 1.4826 * _median([abs(x - mid) for x in self._resid])
            self._sigma_val, self._sigma_at = max(self.cfg.min_sigma, mad), self.num_observed
        return self._sigma_val

    def _count_experts(self, counts: Sequence[int]) -> None:
        if self._pop is None or len(counts) != self._pop.size or sum(counts) <= 0:
            return
        c = np.asarray(counts, np.float64)
        rho = self.cfg.popularity_rate
        self._pop = (1.0 - rho) * self._pop + rho * c / c.sum()

    def _refresh_popularity(self) -> None:
        moe = self._base.moe
        if moe is None or self._pop is None:
            return
        old = np.asarray(moe.popularity or (1.0,) * moe.num_experts, np.float64)
        if np.abs(self._pop - old / old.sum()).sum() <= self.cfg.popularity_tol:
            return
        pop = tuple(np.round(self._pop, 6).tolist())
        new: ExpertParallelTerm = replace(moe, popularity=pop)
        new.max_loads(self.cfg.warm_tokens)  # fill the cache here, not on the planner path
        self._base = replace(self._base, moe=new)

    def _publish(self) -> CapacityModel:
        cfg = self.cfg
        self._since = 0
        self._refresh_popularity()
        grid = self._grid.astype(np.int64)
        log_s = np.log(self._prior_factor(grid))
        log_s += self._g + self._u * self._n / (self._n + cfg.prior_weight)
        # Monotone smoothing: T(1, B, 0) must not fall as B grows, or noise in a sparse bucket
        # would hand the planner a fake bargain it then keeps choosing.
        ref = np.log(self._base.step_seconds(1, grid, 0))
        log_s = isotonic(ref + log_s, self._n + cfg.prior_weight) - ref
        scale = Curve(tuple(self._grid.tolist()), tuple(np.exp(log_s).tolist()))
        self.model = replace(
            self._base,
            scale=scale,
            draft=self._draft_curve(),
            host=self._host_curve(),
            version=self.model.version + 1,
        )
        return self.model
