"""Verify-length planning in the engine: policy state, capacity model, overlap of the lagged K.

Turns one step's draft confidences into verify lengths with the pure policies of
algo/verify_budget.py, keeps what they need across steps (survival history, acceptance prior,
the live capacity model), and in lagged mode plans the next step's K on a worker thread while the
current forward runs (ZOS): that K may only read survival published `lag` steps earlier.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dspark_sglang.algo.capacity import CapacityModel
from dspark_sglang.algo.capacity_fit import (
    CAP_MIN_RECORDS,
    DRAFT_PRIOR_WEIGHT,
    EstimatorConfig,
    LiveEstimator,
    r_bin,
)
from dspark_sglang.algo.step_bias import StepKindBias
from dspark_sglang.algo.survival import (
    AcceptancePrior,
    ConfidenceCorrection,
    LagShrink,
    SurvivalCalibration,
    SurvivalCorrection,
    SurvivalHistory,
    stratified_rows,
    sts_confidences,
    survival,
    survival_pool,
)
from dspark_sglang.algo.verify_budget import (
    ScheduleMode,
    assign_top_k,
    expected_throughput,
    lagged_global_plan,
    plan_verify_lengths,
    selective_k,
)
from dspark_sglang.types import StepRecord

_NO_SPS = np.ones(1)  # modes that never read a capacity curve
PROBE_MIN, PROBE_MAX = 8, 256  # lagged K = 0: steps between drafting probes (doubling)
# Requests a probe drafts and verifies (in rotation): enough acceptance evidence per probe, at a
# cost that does not grow with the batch (a probe of all 32 requests on the CPU engine cost a
# 43 ms drafter pass and a 256-token verify).
PROBE_ROWS = 4
# Verified drafts at position 1 before probes may back off: until then they come every PROBE_MIN
# steps. Backing off after a few unlucky probes (3 of 7 first drafts accepted where the drafter
# averages 0.76) left the prior and the confidence correction on that small sample for hundreds
# of steps, and lagged at K = 0 where drafting paid 8–13 % (CPU engine, c = 1 and 4). 64 cost
# 64 probes at c = 1 where drafting never pays (T = 1: 0.93 -> 0.87 of no-spec with the aging).
PROBE_EVIDENCE = 32
# Skipped steps age the last drafts' survival toward the prior by STALE_DECAY per step, and past
# STALE_FLOOR weight drop it: a request's confidences say how its next few tokens go, not the next
# hundred. Re-pushing them unchanged let one low-confidence step hold K at 0 until a probe came
# (runs of 100+ plain steps at c = 1 where drafting averaged 3.5 tokens per step). The aged
# snapshot is pushed after 1, 2, 4, 8 … skipped steps and repeated in between: each new one
# costs a K recomputation (on the worker thread, 0.25 ms at c = 1), fourteen in a row after
# every probe were 43 % of a T = 1 run's steps.
STALE_DECAY, STALE_FLOOR = 0.8, 0.05
# A backed-off probe gap belongs to the load it was learned at: once the batch is more than
# LOAD_SHIFT times larger or smaller than when probes last came every PROBE_MIN steps, they do
# again. A drop from c = 64, where drafting does not pay and the gap grew to PROBE_MAX, to c = 4
# otherwise waited up to 256 steps (eight 128-token requests at c = 4) to learn that it pays now.
LOAD_SHIFT = 2
# Lagged K for requests with no survival of their own (fresh, or stale after skipped steps) reads
# stratified rows of the last POOL_ROWS survival rows drafted without selection (every row of a
# step, or a probe's rotation), once POOL_MIN are in, instead of the prior's one mean row for all
# of them: K = 0 at full load made every row the prior, and top-K over identical rows undervalued
# drafting the batch (CPU engine, c = 64: priced 567 against 620 tok/s plain, while the steps that
# did draft every row realised 726 against 642 with the live top-K).
POOL_ROWS, POOL_MIN = 256, 16
# Selective lagged: the whole batch is drafted, though priced below the best plan, while it is
# priced within EXPLORE_RATIO of it and fewer than CAP_MIN_RECORDS drafting steps timed the
# drafter at this R's bin or a larger one (capacity_fit.r_bin; below a timed R the price is
# interpolated; `--explore-ratio`, 0 = never). A price never tested is never corrected: the planner
# declines what it prices dear and so never times it. Served, 2026-12-02 (sweep 31a9224): at
# c = 64 lagged priced a whole-batch drafting step 21-43 % above what it took (sync drafted every
# step there and realised 850 tok/s over full-load steps against lagged's plain 752), because
# every drafting step it took there came after plain steps (a resumed drafter, which teaches
# nothing). The cost is bounded: at most (1 - EXPLORE_RATIO) of a step's predicted throughput, a
# few steps per R bin (the first is resumed, the next CAP_MIN_RECORDS teach).
EXPLORE_RATIO = 0.75
# ... and what exploration loses is budgeted: a burst of exploration (EXPLORE_BURST steps in a
# row: the resumed first, then those that teach) starts only while the seconds explored steps
# lost so far, each against its plain step at the model's rate (StepRecord.plain_theta), are at
# most this share of the seconds of every step observed (`--explore-budget`; 1 = no cap). A burst
# in progress finishes. Served, 2026-12-07 (s62_v step logs, c = 64): one pass explored in bursts
# every ~130 steps while R wandered 36-56 (a new R bin each time, none tested from above) and
# lost 3.0 % of its decode time to them, the other two 0.6 %.
EXPLORE_BUDGET = 0.01
EXPLORE_BURST = 1 + CAP_MIN_RECORDS
# A lagged probe that drafted every row of a batch after skipped steps (a resumed drafter, which
# prices nothing) is followed by one more drafting step, once probes have backed off: the
# drafter's price at that R is then retimed each probe gap. Nothing else times it while K stays 0,
# so a price once set too high held K at 0 for good: served, 2026-12-03 (sweep 06d3171, c = 1),
# a host stall of four steps restarted the R = 1 drafter price at 5.1 ms where drafting added
# 2.3, and lagged decoded plainly for the rest of the run (0.81 of verify-all in that pass).
# The live estimator is fed step records FOLD_RECORDS at a time. Fed one per step, its update ran
# cold after each forward: 99 us median inside the CPU engine's step against 18 us in a loop over
# the same records, and the forward after it ran slower too (in-process, c = 1, lagged at K = 0:
# step 2.99 ms against 2.82 with no estimator, 2.89 folding 16). A drafting step's record, with
# those queued before it, goes in at once where its timing is news: the first of a drafting run
# (a probe, its retime, a resumed drafter: the price a plain run waits on) and any at an R whose
# drafter price exploration still tests (EXPLORE_RATIO counts timed drafting steps, and is exact
# so). Steady drafting steps fold too (session 39: a flush on every drafting step cost 150 us a
# call at c = 2, 53 us a record, in-process). What folding delays: a publish or a drift alarm by
# up to FOLD_RECORDS - 1 steps.
FOLD_RECORDS = 16
# Resuming the drafter after plain steps costs more than a drafting step that follows one: its
# first pass projects the skipped steps' rows into its cache and runs with its weights evicted by
# the target's forwards. Served, 2026-12-03, c = 1 (R = 1): a resumed K = 5 step's drafter took
# 3.05 ms against 2.75 after a drafting step, a resumed K = 7 one 3.17 against 2.70, and the step
# 8.5-10.0 ms against 7.9-8.1. The live draft term learns from steady steps only, so a switch was
# priced free either way and lagged flipped between plain and drafting steps on break-even
# margins, paying the resume each time (8 % of that run's time on resumed steps, at 0.31 tokens a
# ms against 0.38-0.42 for steady drafting). The planner learns the resumed drafter's excess over
# a steady one of as many rows (r_bin), as a ratio (EMA, RESUME_RATE; capped at RESUME_MAX), and
# in a drafting run charges a K = 0 step that ratio times the drafter's price (its resume comes
# later), spread over the average plain run (one resume per run: charged whole to every step, a
# plain stretch at high load whose steps each beat drafting by less than a resume would never be
# entered). Leaving a plain run is not charged: a plain engine learns only from probes, and a
# charge there can only lengthen K = 0 traps (sweep e14fdaa, c = 1: a 508-step plain run at
# R = 1 whose probes accepted 2.6 of 7 drafts on average, where drafting made 0.31 tokens a ms
# and plain steps 0.23, its lagged survival pessimistic at 2.8 planned tokens against 3.6).
# Decisions only: predicted step times stay the engine's own. The steady time is the planner's
# own average of steady drafter runs (RESUME_MIN_STEADY of them first), not the draft term: at a
# load where the drafter rarely runs steadily that term is still the start-up profile's, and
# against it every resume looked 2-3x dear (in-process, c = 1, a host 2x slower than the
# profile), which held lagged drafting where plain steps were faster.
RESUME_RATE, RESUME_MAX, RESUME_MIN_STEADY = 0.1, 2.0, 4
# Leaving a plain run projects the context rows its steps queued for the requests drafted
# (engine/draft_context.py): about one row per request per plain step, priced at the seconds per
# row the engine's flushes measured (an EMA of RESUME_RATE over flushes of FLUSH_MIN_ROWS rows or
# more; 0, no charge, until one was timed). A drafting plan is charged that projection spread over
# the steps it can pay back in: the drafted requests' steps left (tokens left over the tokens a
# drafting step makes, the prior's 1 + Σ survival), at most RESUME_HORIZON: a cap of 16 steps
# (s45_resume, six passes) cost 2 % at c = 8, where plain runs then ran longer between steps
# that drafting paid for, and the cap only matters away from the batch's end. Served, 2026-12-05
# (s44_full, c = 64): as the batch drained lagged left a plain run of about 120 steps at R = 45-54
# and projected ~6,000 rows, a 126-192 ms drafter run, for the 8 steps its requests had left (R
# 44 -> 10); the 17 resumed steps at R 33-64 ran at 1,164 tok/s against plain steps' 2,118. At
# c = 1 a 20-step plain run queues 20 rows (~0.2 ms), spread over up to RESUME_HORIZON steps: the
# charge does not hold K at 0 where drafting pays. Pending rows and steps left are rounded to
# powers of two, so the K memo (_k_key) sees a new charge O(log) times in a plain run.
FLUSH_MIN_ROWS, RESUME_HORIZON = 64, 64
# A pinned K (`replan_every`, K planned inline): once PIN_PLANS K searches in a row chose the same
# K for the same batch (the same requests and caps, under the same capacity model), drafting
# every row, the next replan_every - 1 steps take that K without a search and learn no
# acceptance, except the step whose survival the next search reads (`lag` steps before it),
# which plans as usual. Where K verifies every draft a pinned step computes no survival either.
# Served, 2026-12-05 (2-core VM, four passes, sweep s40_pin3): lagged's host time in and between
# its R = 1 steps, 1.69-1.76 ms with a search every step, was 1.58-1.59 pinned every 4 and 1.32
# every 8 (verify-all's: 1.42); at R = 2, 1.89-1.94 / 1.73-1.85 / 1.68 (docs/scheduler.md "A
# pinned K").
PIN_PLANS = 2
# A pinned K = 0 (`replan_every`, K planned inline): once ZERO_PIN_PLANS K searches in a row chose
# K = 0 for batches of one size bin (`_r_bin`: R rounded up, in steps of an eighth of R),
# under the same capacity model and lagged snapshot, the next replan_every - 1 steps of that bin,
# model and snapshot decode plainly without a search (probes still run on their own schedule,
# and the survival a probe verifies is a new snapshot, which ends the pin). At high load the
# search costs ~0.37 ms a step (CPU engine, c = 64, where a plain step runs 24 ms) and its
# inputs change nearly every step (a request joins or leaves, one nears its end and its cap
# shrinks), so the exact-input memo missed 92 % of them. One search suffices: the key already
# holds what a K = 0 search reads besides the batch (model, snapshot, size), and at two every
# key change cost two searches (in-process c = 32: 66 of 120 searches were a key's first).
ZERO_PIN_PLANS = 1


def _r_bin(r: int) -> int:
    """R rounded up to a step of an eighth of the power of two at or below it: exact up to 15,
    then steps of 2 (16-31), 4 (32-63: 61-64 is one bin), 8 (64-127), ..."""
    step = 1 << max(0, int(r).bit_length() - 4)
    return -(-int(r) // step) * step


def ctx_bucket(ctx: int) -> int:
    """The context a step's SPS curve is priced at: ctx rounded up to a sixteenth of its power of
    two (at most 6.25 % more context). Context grows every step; without the rounding each step
    would price a new curve and re-plan K from scratch even when nothing else changed."""
    step = 1 << max(0, int(ctx).bit_length() - 5)
    return -(-int(ctx) // step) * step


def _resume_charged(
    sps: np.ndarray, draft: np.ndarray | None, r: int, row_s: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """Every drafting plan charged `row_s` seconds per drafted request (the projection leaving a
    plain run costs, spread over its horizon): the row-priced drafter's draft[n] + n * row_s, or
    the whole-batch table's B > R with R * row_s more seconds; the plain step as it was."""
    if not row_s > 0.0 or sps.size <= r + 1:
        return sps, draft
    if draft is not None:
        draft = np.array(draft, np.float64, copy=True)
        draft[1:] += np.arange(1, draft.size) * row_s
        return sps, draft
    out = np.array(sps, np.float64, copy=True)
    out[r + 1 :] = 1.0 / (1.0 / out[r + 1 :] + r * row_s)
    return out, draft


def _pow2(x: float) -> float:
    """x rounded to a power of two (0 for x < 0.5): a coarse grid for the K memo."""
    return 0.0 if x < 0.5 else float(2.0 ** round(math.log2(x)))


def _conditionals(surv: np.ndarray) -> np.ndarray:
    """Survival rows -> the conditional acceptances whose running product they are (0 past a
    survival of 0): how the corrected survival reaches policies that take confidences."""
    prev = np.concatenate([np.ones((surv.shape[0], 1)), surv[:, :-1]], axis=1)
    return np.divide(surv, prev, out=np.zeros_like(surv), where=prev > 0)


Rows = np.ndarray | None  # selective lagged: the requests a K drafts (None: not selective)
# a lagged K, the rows it drafts, the tokens it was planned on (verify_budget.planned_tokens) and
# whether exploration chose it (the drafter's price at this R untested, EXPLORE_RATIO)
KPlan = tuple[int, Rows, float, bool]


def _planned(theta: float, sps: np.ndarray, r: int, k: int, draft_s: float) -> float:
    """The tokens K was planned on (verify_budget.planned_tokens), read off the Θ the K search
    found: Θ = τ / (forward(R + K) + drafter). nan at K = 0 (no draft for the lagged survival to
    be tested on) and where no K fitted the table."""
    if k <= 0 or not math.isfinite(theta):
        return math.nan
    return theta * (1.0 / float(sps[r + k]) + draft_s)


def _fold(mean: float, n: int, x: float) -> tuple[float, int]:
    """(mean, count) after folding x in: the running mean for the first 1 / RESUME_RATE, then an
    EMA of weight RESUME_RATE."""
    return mean + max(RESUME_RATE, 1.0 / (n + 1)) * (x - mean), n + 1


def _charged_sps(sps: np.ndarray, r: int, skip_s: float) -> np.ndarray:
    """The whole-batch SPS table with `skip_s` seconds charged on the plain step B = R (the
    resume it causes, RESUME_RATE)."""
    if not skip_s or sps.size <= r:
        return sps
    out = np.array(sps, np.float64, copy=True)
    out[r] = 1.0 / (1.0 / out[r] + skip_s)
    return out


def _biased(
    sps: np.ndarray, draft: np.ndarray | None, r: int, bias: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """The SPS table and the row-priced drafter with every drafting plan's seconds times
    exp(bias) (StepKindBias): the whole-batch table's B > R, or with a row-priced drafter the
    forward's B > R and the drafter of n >= 1 rows; the plain step B = R (and draft[0], the
    resume charge) as they were."""
    if not bias or sps.size <= r + 1:
        return sps, draft
    f = math.exp(bias)
    out = np.array(sps, np.float64, copy=True)
    out[r + 1 :] /= f
    if draft is not None:
        draft = np.array(draft, np.float64, copy=True)
        draft[1:] *= f
    return out, draft


def _center(prior: AcceptancePrior, pool: np.ndarray | None) -> np.ndarray:
    """The average survival row LagShrink measures departures from: the pool's (rows drafted
    without selection, on the lagged rows' own scale) once it holds POOL_MIN, else the prior's."""
    if pool is not None and pool.shape[0] >= POOL_MIN:
        return pool.mean(axis=0)
    return prior.survival


def _shrunk_lagged(
    history: SurvivalHistory,
    ids: np.ndarray,
    lag: int,
    prior: AcceptancePrior,
    pool: np.ndarray | None,
    rho: float,
) -> tuple[np.ndarray, np.ndarray]:
    """history.lagged_with_hits, the rows it held pulled toward the average row by `rho`."""
    lagged, hit = history.lagged_with_hits(ids, lag, prior)
    if rho < 1.0 and hit.any():
        lagged[hit] = LagShrink.apply(lagged[hit], _center(prior, pool), rho)
    return lagged, hit


def _batch_key(ids: object, max_len: object) -> tuple[bytes, bytes]:
    """A batch by value: its request ids and their verify caps."""
    return np.asarray(ids, np.int64).tobytes(), np.asarray(max_len, np.int64).tobytes()


def _same_zero_key(a: tuple[int, object, object], b: tuple[int, object, object]) -> bool:
    """The same R, and the same capacity model and lagged snapshot objects."""
    return a[0] == b[0] and a[1] is b[1] and a[2] is b[2]


@dataclass(frozen=True)
class Plan:
    lengths: np.ndarray  # [R] verify lengths
    k: int
    predicted_seconds: float
    predicted_theta: float
    fallback: str
    probe: bool = False  # a lagged K = 0 probe: drafted a few rows (all, in a small batch)
    draft_rows: int = -1  # rows the drafter ran on (-1: every row, or none on a skipped step)
    resumed: bool = False  # lagged: the drafter's first run after steps without it
    planned_tokens: float = math.nan  # lagged K > 0: the tokens K was planned on (StepRecord)
    pinned: bool = False  # lagged: K taken from the pin, without a search (PIN_PLANS)
    plain_theta: float = math.nan  # lagged K > 0: the model's Θ of a plain step (StepRecord)
    explored: bool = False  # lagged: K drafts the batch to time an untested drafter price


class VerifyPlanner:
    def __init__(
        self,
        mode: ScheduleMode,
        gamma: int,
        capacity: CapacityModel | None,
        sts: np.ndarray | None,
        live: bool,
        min_user_tps: float,
        overlap: bool,
        selective: bool = False,
        explore_ratio: float = EXPLORE_RATIO,
        lag_shrink: bool = False,
        replan_every: int = 1,
        step_bias: bool = True,
        step_bias_prior: float = 0.0,
        resume_charge: bool = False,
        draft_price_prior_weight: float = DRAFT_PRIOR_WEIGHT,
        user_rate_floor: float = 0.0,
        tie_margin: float = 0.0,
        explore_budget: float = EXPLORE_BUDGET,
    ) -> None:
        self.mode, self.gamma, self.sts = mode, gamma, sts
        # lagged: a drafting K widens to the largest K within this share of the best Θ
        self.tie_margin = tie_margin if mode.name == "lagged" else 0.0
        # lagged: the fraction of its plain-step rate every request's expected rate keeps
        self.user_rate_floor = user_rate_floor if mode.name == "lagged" else 0.0
        # lagged: draft only the requests K admits, priced by the rows drafted (row_priced_sps)
        self.selective = selective and mode.name == "lagged" and capacity is not None
        self.explore_ratio = explore_ratio
        self._explore_memo: tuple[tuple[int, int], bool] = ((-1, -1), False)
        self.explore_budget = explore_budget
        self.explore_lost_s = 0.0  # what explored steps lost against the plain rate (seconds)
        self._observed_s = 0.0  # seconds of every step observed
        self._burst = 0  # explored steps in a row, up to the last observed
        self.capacity = capacity
        self.estimator = (
            LiveEstimator(capacity, EstimatorConfig(draft_prior_weight=draft_price_prior_weight))
            if capacity is not None and live
            else None
        )
        self.fold = FOLD_RECORDS
        self._queued: list[StepRecord] = []  # step records not fed to the estimator yet
        self.min_user_tps = min_user_tps
        self.prior = AcceptancePrior.uniform(gamma)
        # lagged: two snapshots more than K reads, so observe() still finds the rows this step's
        # K was planned from once plan() pushed its own (LagShrink learns from them), and the
        # one before those, which tells whether they were a repeat (_learn_lag)
        lagged = mode.name == "lagged"
        self.history = SurvivalHistory(depth=max(mode.lag, 1) + 2 * lagged)
        # how much of a lagged row's departure from the average row K believes (LagShrink),
        # learned and applied with `lag_shrink` only
        self.lag_fit = LagShrink()
        self._shrinks = lag_shrink and lagged
        self._worker = ThreadPoolExecutor(1) if overlap and mode.name == "lagged" else None
        # PIN_PLANS: inline lagged K only (the overlap thread hides the search already)
        self.replan_every = replan_every if lagged and self._worker is None else 1
        self._pin_plans = 0  # consecutive K searches that chose _pin's K for _pin's batch
        # (batch, capacity model, K) of the last K search
        self._pin: tuple[tuple[bytes, bytes], CapacityModel | None, int] | None = None
        self._pinned_left = 0  # pinned steps before the next K search
        self._pinned = False  # budget() took this step's K from the pin
        self._learns = True  # observe() learns acceptance from this step (not a pinned plan)
        self.pinned_steps = 0
        # K = 0 pin: ((R, capacity model, lagged snapshot), searches in a row that chose 0 for
        # it, steps left to take 0 without a search)
        self._zero: tuple[tuple[int, object, object], int, int] | None = None
        self.zero_pinned_steps = 0
        # next step's K: computing on the worker, or known (memo hit: no Future to build)
        self._next_k: Future[KPlan] | KPlan | None = None
        # the rows the last budget()'s K drafts, for draft_rows: ((ids, caps) bytes, K, rows)
        self._k_rows: tuple[tuple[bytes, bytes], int, np.ndarray] | None = None
        self.fallbacks: dict[str, int] = {}
        self._fallback = ""  # why this step's K fell back ("" = it did not)
        self._sps_cache: tuple[tuple[int, int], np.ndarray, CapacityModel] | None = None
        self._draft_cache: tuple[int, np.ndarray, CapacityModel] | None = None
        self._since_draft = 0  # lagged: steps since the drafter last ran
        self._probe_every = PROBE_MIN
        self._retime = False  # the step after a whole-batch probe drafts too (retimes the price)
        self._drafting_run = 0  # consecutive steps with K > 0
        self._last_rows = 0  # rows the last K > 0 step drafted
        self.resume_ratio = 0.0  # a resumed drafter's excess over its steady price (RESUME_RATE)
        self._resumes = 0  # resumed steps that taught resume_ratio
        self._resume_rows = 0  # rows of this step's drafter run when it resumed (observe reads it)
        self._steady_run = False  # this step's drafter run followed a drafting step
        self._plain_run = 0  # consecutive steps with K = 0 (skipped or probes)
        self._plain_len = (1.0, 0)  # average length of finished plain runs, how many (RESUME_RATE)
        self._resume_charge = resume_charge and lagged  # FLUSH_MIN_ROWS
        # seconds to project one queued context row (engine flushes, FLUSH_MIN_ROWS), how many
        self.flush_row_seconds, self._flushes = 0.0, 0
        # (mean queued rows, mean tokens left) of the batch budget() last saw (engine-reported)
        self._queued_ctx: tuple[float, float] = (0.0, math.inf)
        # r_bin(rows) -> (average seconds of a steady drafter run of that many rows, runs)
        self._steady: dict[int, tuple[float, int]] = {}
        self._probe_next = 0  # rotation offset of the rows the next probe drafts
        self._probe_load = 0  # batch size when the probe gap was last PROBE_MIN
        # live recalibration of the confidences (capacity-driven modes only)
        self.correction = ConfidenceCorrection.identity(gamma)
        self.surv_correction = SurvivalCorrection.identity(gamma)
        self.calibration = SurvivalCalibration.identity()
        self._corrects = mode.name in ("sync", "lagged")
        # lagged: the capacity model's error on drafting steps over plain ones (algo/step_bias.py)
        self.step_bias = StepKindBias(step_bias_prior)
        self._biased = step_bias and lagged and capacity is not None
        # this step's drafts for observe_acceptance: (request ids, raw confidences, their
        # first-stage survival, the ConfidenceCorrection that survival was taken under)
        self._drafted: tuple[list[int], np.ndarray, np.ndarray, ConfidenceCorrection] | None = None
        # (request ids, raw confidences) of the last step that drafted; skipped steps re-push it
        self._last_raw: tuple[np.ndarray, np.ndarray] | None = None
        # "prior" once skip() pushed the empty (all-prior) snapshot: later skips repeat it
        self._skip_src: str | None = None
        # the last K and what it was planned from (identities + bytes): the same inputs, same K
        self._k_memo: tuple[tuple[object, ...], KPlan] | None = None
        self._k_planned = math.nan  # what budget()'s K was planned on, for plan()
        self._k_explored = False  # budget()'s K drafts the batch to time an untested price
        self._next_key: tuple[object, ...] | None = None  # the inputs _next_k is computed from
        self._next_for = (b"", b"")  # (ids, max_len) bytes _next_k's rows index into
        # lagged: recent survival rows drafted without selection (POOL_ROWS; read-only array)
        self._pool = survival_pool(np.empty((0, gamma)), np.empty((0, gamma)), POOL_ROWS)

    @property
    def never_verifies(self) -> bool:
        """`fixed:0`: no draft is ever verified, so the drafter never runs (the deployment still
        keeps the drafter's context, as every speculative one does: what being speculative costs
        before any drafting decision, the ceiling of any policy that would not draft)."""
        return self.mode.name == "fixed" and self.mode.length == 0

    @property
    def plans_before_drafting(self) -> bool:
        """Lagged K is known before this step's drafts exist, so K = 0 can skip the drafter."""
        return self.mode.name == "lagged"

    def _sps(self, r: int, ctx: int) -> np.ndarray:
        if self.capacity is None:
            return _NO_SPS
        ctx = ctx_bucket(ctx) if self.capacity.uses_context else 0
        cache = self._sps_cache  # steps of one R and context bucket share it
        if cache is not None and cache[0] == (r, ctx) and cache[2] is self.capacity:
            return cache[1]
        # lagged: B = R skips the drafter; every other mode drafted before planning (sunk cost).
        # Selective lagged prices the drafter by its rows along the K path (_draft_for).
        if self.selective:
            draft = "never"
        else:
            draft = "when_verifying" if self.plans_before_drafting else "always"
        sps = self.capacity.sps_array(r, r * (self.gamma + 1), ctx, draft=draft)
        self._sps_cache = ((r, ctx), sps, self.capacity)
        return sps

    def _draft_for(self, r: int) -> np.ndarray | None:
        """Selective lagged: drafter seconds by rows drafted, 0..R (0 rows: no drafter)."""
        if not self.selective or self.capacity is None:
            return None
        cache, capacity = self._draft_cache, self.capacity
        if cache is not None and cache[0] == r and cache[2] is capacity:
            return cache[1]
        d = np.asarray(capacity.draft_seconds(np.arange(r + 1)), np.float64).copy()
        d[0] = 0.0
        self._draft_cache = (r, d, capacity)
        return d

    def draft_rows(self, ids: list[int], k: int, max_len: np.ndarray) -> np.ndarray | None:
        """Selective lagged, K > 0: indices of the rows to draft, those the K top lagged
        survivals admit (the ones K was priced for); None = draft every row, also when that
        costs no more (a drafter priced the same for any rows, or none): the live top-K then
        picks among them all."""
        draft = self._draft_for(len(ids))
        if draft is None or k <= 0 or self._pinned:
            return None
        memo, key = self._k_rows, _batch_key(ids, max_len)
        if memo is not None and memo[0] == key and memo[1] == k:  # budget() found them with K
            keep = memo[2]
        else:
            lagged, _ = _shrunk_lagged(
                self.history, np.asarray(ids), self.mode.lag, self.prior, self._pool, self._rho()
            )
            keep = np.flatnonzero(assign_top_k(lagged, k, max_len=max_len))
        return None if keep.size == 0 or draft[keep.size] >= draft[-1] else keep

    def note_queue(self, queued: list[int], left: list[int]) -> None:
        """Before budget(): per request of its batch, the context rows waiting to be projected
        and the tokens it has left (the resume charge, FLUSH_MIN_ROWS)."""
        if queued and left:
            self._queued_ctx = (sum(queued) / len(queued), sum(left) / len(left))

    def budget(self, ids: list[int], max_len: np.ndarray, ctx: int) -> int:
        """Lagged mode: this step's K, from survival published `lag` steps ago (no drafts yet)."""
        assert self.plans_before_drafting
        key = _batch_key(ids, max_len) if self.replan_every > 1 else None
        pinned = self._pin_holds(key)
        self._pinned = pinned > 0
        self._k_explored = False
        if self._pinned:
            self._k_planned, self._fallback, self._k_rows = math.nan, "", None
            return pinned
        zero_key = self._zero_key(_r_bin(len(ids))) if key is not None else None
        if zero_key is not None and self._zero_holds(zero_key):
            self._k_planned, self._fallback, self._k_rows = math.nan, "", None
            return 0
        k, rows, self._k_planned, self._k_explored, self._fallback = self._lagged_k(
            np.asarray(ids), self._sps(len(ids), ctx), max_len
        )
        self._k_rows = None if rows is None else (_batch_key(ids, max_len), k, rows)
        if key is not None:
            self._update_pin(key, k if rows is None or rows.size == len(ids) else 0)
        if zero_key is not None:
            self._update_zero(zero_key, k)
        return k

    def _zero_key(self, r: int) -> tuple[int, object, object]:
        snaps = self.history.snapshots
        lag = self.mode.lag
        return (r, self.capacity, snaps[-lag] if len(snaps) >= lag else None)

    def _zero_holds(self, key: tuple[int, object, object]) -> bool:
        """This step takes K = 0 from the pin (K = 0 pin, ZERO_PIN_PLANS): steps are left and R, the
        capacity model and the lagged snapshot are the ones it was set for."""
        z = self._zero
        if z is None or z[2] <= 0:
            return False
        if not _same_zero_key(z[0], key):
            self._zero = None
            return False
        self._zero = (z[0], z[1], z[2] - 1)
        self.zero_pinned_steps += 1
        return True

    def _update_zero(self, key: tuple[int, object, object], k: int) -> None:
        """After a K search: count a K = 0 toward the pin when the last search chose 0 for the
        same R, model and snapshot, and pin the next replan_every - 1 steps after
        ZERO_PIN_PLANS."""
        if k > 0:
            self._zero = None
            return
        z = self._zero
        n = z[1] + 1 if z is not None and _same_zero_key(z[0], key) else 1
        self._zero = (key, n, self.replan_every - 1 if n >= ZERO_PIN_PLANS else 0)

    def _pin_holds(self, key: tuple[bytes, bytes] | None) -> int:
        """The pinned K for this step (PIN_PLANS), or 0: steps are left and the batch and the
        capacity model are the ones the pin was set for (any change ends it)."""
        pin = self._pin
        if self._pinned_left <= 0 or key is None or pin is None:
            return 0
        if pin[0] != key or pin[1] is not self.capacity:
            self._pinned_left = 0
            return 0
        self._pinned_left -= 1
        self.pinned_steps += 1
        return pin[2]

    def _update_pin(self, key: tuple[bytes, bytes], k: int) -> None:
        """After a K search (k: 0 unless it drafts every row): count it toward the pin when it
        chose the last search's K for the same batch, and pin the next replan_every - 1 steps
        after PIN_PLANS such."""
        pin = self._pin
        same = pin is not None and pin[0] == key and pin[1] is self.capacity and pin[2] == k
        self._pin_plans = (self._pin_plans + 1 if same else 1) if k > 0 else 0
        self._pin = (key, self.capacity, k)
        if self._pin_plans >= PIN_PLANS:
            self._pinned_left = self.replan_every - 1

    def should_probe(self) -> bool:
        """Lagged K = 0, but draft anyway this step and verify the drafts, to refresh the survival
        history and the confidence correction: without drafts the history only holds old
        confidences and the prior, and a pessimistic prior would keep K at 0 forever even where
        drafting pays. Once PROBE_EVIDENCE drafts were verified, probes back off exponentially
        (PROBE_MIN to PROBE_MAX steps apart) while they keep finding K = 0. A backed-off
        whole-batch probe is followed by a second drafting step (the retime, see above)."""
        return self._retime or self._since_draft >= self._probe_every

    def _track_load(self, r: int) -> None:
        """Resets the probe gap after a load shift (LOAD_SHIFT); remembers the load while the gap
        is at its minimum."""
        ref = self._probe_load
        if self._probe_every == PROBE_MIN or not ref / LOAD_SHIFT <= r <= ref * LOAD_SHIFT:
            self._probe_every, self._probe_load = PROBE_MIN, r

    def probe_rows(self, num_rows: int) -> np.ndarray:
        """Indices of the rows a probe drafts: PROBE_ROWS of them, rotating through the batch so
        successive probes see different requests (all rows when there are no more)."""
        if num_rows <= PROBE_ROWS:
            return np.arange(num_rows)
        start = self._probe_next % num_rows
        self._probe_next = start + PROBE_ROWS
        return np.sort((start + np.arange(PROBE_ROWS)) % num_rows)

    def skip(self, ids: list[int], max_len: np.ndarray, ctx: int) -> Plan:
        """Lagged K = 0: no drafter this step. The last drafted step's confidences are pushed
        again, under the confidence correction as it stands now (so `lag` pushes stay `lag`
        steps, and what probes verified reaches K), their survival aged toward the prior's by
        STALE_DECAY per skipped step (re-pushed after 1, 2, 4, 8 … skipped steps, repeated in
        between), then dropped (every request reads the prior); the next K is planned from the
        history as usual, while this forward runs."""
        r = len(ids)
        sps = self._sps(r, ctx)
        self._track_load(r)
        self._since_draft += 1
        self._drafting_run = 0
        self._plain_run += 1
        age = self._since_draft
        weight = STALE_DECAY**age
        if self._last_raw is None or (age & (age - 1) and weight >= STALE_FLOOR):
            self.history = self.history.repeat()  # no snapshot yet, or between two agings
        elif weight < STALE_FLOOR:  # stale: the prior for everyone, pushed once
            if self._skip_src != "prior":
                self.history = self.history.push(np.empty(0, np.int64), np.empty((0, self.gamma)))
                self._skip_src = "prior"
            else:
                self.history = self.history.repeat()
        else:  # the last drafts' confidences, under today's correction, aged
            last_ids, raw = self._last_raw
            base = self.prior.survival
            self.history = self.history.push(last_ids, base + (self._survival(raw) - base) * weight)
            self._skip_src = None
        self._submit_next(np.asarray(ids), sps, max_len)
        self._count_fallback()
        if self.capacity is not None:  # B = R, no drafter, at the exact context
            predicted = float(self.capacity.predict(r, r, ctx, drafted=False))
            theta = r / predicted
        else:
            predicted = theta = math.nan
        return Plan(np.zeros(r, np.int64), 0, predicted, theta, self._fallback)

    def plan(
        self,
        ids: list[int],
        conf_logits: np.ndarray | None,
        max_len: np.ndarray,
        ctx: int,
        k: int | None = None,
        batch: tuple[list[int], np.ndarray, int] | None = None,
        backlog: bool = False,
    ) -> Plan:
        """Verify lengths for this step's drafts; lagged mode takes the K `budget` returned.
        `batch` = (ids, max_len, ctx) of every decode row when the drafts cover only some of
        them (a probe, or a selective K > 0 step): the next step's K is planned for the whole
        batch."""
        r = len(ids)
        if self.plans_before_drafting and k is None:
            k = self.budget(ids, max_len, ctx)
        self._learns = True
        # the next K search reads the survival pushed `lag` steps before it: that step plans
        if self._pinned and k and batch is None and self._pinned_left != self.mode.lag - 1:
            return self._pinned_plan(conf_logits, k, max_len, ctx, backlog)
        if conf_logits is not None:
            raw = sts_confidences(conf_logits, self.sts)
            self._last_raw = (np.asarray(ids), raw)
            if self._corrects:
                first = survival(self.correction.apply(raw))
                self._drafted = (list(ids), raw, first, self.correction)
                surv = self._past_first(first)
            else:
                surv = survival(raw)
        else:
            raw = surv = np.ones((r, self.gamma))
        sps = self._sps(r, ctx)
        resumed = self.plans_before_drafting and self._since_draft > 0
        # a drafter run that resumed after plain steps teaches the switch's price; one that also
        # projected a prompt's rows (`backlog`) prices nothing the planner chooses between
        self._resume_rows = r if resumed and not backlog and conf_logits is not None else 0
        self._steady_run = not (resumed or backlog)
        if self.plans_before_drafting:
            assert k is not None
            # A probe verifies every draft it made: acceptance evidence at each position for the
            # confidence correction, which a head calibrated at another sampling temperature
            # needs before its survival can justify K > 0.
            lens = assign_top_k(surv, k if k > 0 else int(max_len.sum()), max_len=max_len)
            # Probes back off (twice as long after each) until drafting has paid for PROBE_MIN
            # steps in a row. The K > 0 steps right after a probe only echo the probe's own
            # confidences; letting each such blip reset the gap kept a 2-core CPU engine at
            # c = 1 probing every ~10 steps, a drafter pass and an 8-token verify each time.
            self._track_load(len(batch[0]) if batch is not None else r)
            retime, self._retime = self._retime, False
            if k == 0:
                if self._evidence() >= PROBE_EVIDENCE and not retime:
                    self._probe_every = min(2 * self._probe_every, PROBE_MAX)
                whole = batch is None or len(batch[0]) == r
                self._retime = resumed and whole and self._probe_every > PROBE_MIN
                self._drafting_run = 0
                self._plain_run += 1
            else:
                self._count_drafting(r)
            self._since_draft = 0
        else:
            conf = _conditionals(surv) if self._corrects else raw  # sync: the corrected survival
            lens = plan_verify_lengths(
                self.mode, conf, sps, max_len=max_len, min_user_tps=self.min_user_tps
            )
        if self.plans_before_drafting and conf_logits is not None and (batch is None or not k):
            self._pool = survival_pool(self._pool, surv, POOL_ROWS)  # no selection behind them
        pushed_ids, pushed = np.asarray(ids), surv
        if batch is not None and k is not None and k > 0:  # selective: carry the rest forward
            rest = np.setdiff1d(np.asarray(batch[0], np.int64), pushed_ids)
            # rows the newest snapshot lacks stay absent: K reads them as unknown (the pool)
            old, hit = self.history.lagged_with_hits(rest, 1, self.prior)
            if hit.any():
                base = self.prior.survival
                pushed_ids = np.concatenate([pushed_ids, rest[hit]])
                pushed = np.concatenate([surv, base + (old[hit] - base) * STALE_DECAY])
        self.history = self.history.push(pushed_ids, pushed)
        self._skip_src = None
        if batch is None:
            self._submit_next(np.asarray(ids), sps, max_len)
        else:
            all_ids, all_max, all_ctx = batch
            self._submit_next(np.asarray(all_ids), self._sps(len(all_ids), all_ctx), all_max)
        self._count_fallback()
        # what this step's lagged K was planned on (budget() set it this step)
        planned = self._k_planned if self.plans_before_drafting and k else math.nan
        plain = self._plain_theta(
            *((len(batch[0]), batch[2]) if batch is not None else (r, ctx)), k
        )
        if batch is not None and self.capacity is not None:  # a row subset: price the whole step
            rr, cc = len(batch[0]), batch[2]
            tokens = rr + float(surv[np.arange(self.gamma)[None, :] < lens[:, None]].sum())
            predicted = self.capacity.predict(rr, rr + int(lens.sum()), cc, draft_rows=r)
            return Plan(
                lens,
                int(lens.sum()),
                predicted,
                tokens / predicted,
                self._fallback,
                probe=not k,
                draft_rows=r,
                resumed=resumed,
                planned_tokens=planned,
                plain_theta=plain,
            )
        b = r + int(lens.sum())
        predicted = self.capacity.predict(r, b, ctx, drafted=True) if self.capacity else math.nan
        if self.selective and self.capacity is not None:
            # Selective lagged prices SPS without the drafter (row_priced_sps adds it per row),
            # so expected_throughput would read a forward-only Θ; the step ran the drafter.
            theta = (
                r + float(surv[np.arange(self.gamma)[None, :] < lens[:, None]].sum())
            ) / predicted
        else:
            theta = expected_throughput(surv, lens, sps) if self.capacity else math.nan
        return Plan(
            lens,
            int(lens.sum()),
            predicted,
            theta,
            self._fallback,
            resumed=resumed,
            planned_tokens=planned,
            pinned=self._pinned,  # the step the next search reads: K pinned, planned as usual
            plain_theta=plain,
            explored=bool(self.plans_before_drafting and k and self._k_explored),
        )

    def _plain_theta(self, r: int, ctx: int, k: int | None) -> float:
        """Lagged K > 0: the capacity model's tokens/s for a plain step of these R requests (the
        alternative the K search weighed); nan for other steps and modes."""
        if not (self.plans_before_drafting and k and self.capacity is not None and r > 0):
            return math.nan
        return r / float(self.capacity.predict(r, r, ctx, drafted=False))

    def _pinned_plan(
        self, conf_logits: np.ndarray | None, k: int, max_len: np.ndarray, ctx: int, backlog: bool
    ) -> Plan:
        """A step with a pinned K (PIN_PLANS): the K top drafts by this step's survival verified
        (every draft: no survival needed), the drafting-run bookkeeping plan() keeps, and
        nothing else: the history repeats its last snapshot, observe() learns no acceptance."""
        r = len(max_len)
        lens = np.array(max_len, np.int64)
        if k < int(lens.sum()) and conf_logits is not None:
            surv = self._survival(sts_confidences(conf_logits, self.sts))
            lens = assign_top_k(surv, k, max_len=max_len)
        self._resume_rows, self._steady_run = 0, not backlog  # pinned only after drafting
        self._track_load(r)
        self._count_drafting(r)
        self._since_draft = 0
        self._learns = False
        self.history = self.history.repeat()
        self._skip_src = None
        b = r + int(lens.sum())
        predicted = self.capacity.predict(r, b, ctx, drafted=True) if self.capacity else math.nan
        return Plan(lens, int(lens.sum()), predicted, math.nan, "", pinned=True)

    def state(self) -> dict[str, object]:
        """What the planner has learned so far (GET /capacity): the acceptance prior, the two
        live confidence corrections, the switch price and the probe gap. Two deployments of one
        schedule that decide differently differ here (a served sweep's twin lagged deployments:
        one drafted on 99.4 % of its R = 1 steps, the other on 83.7 %)."""
        return {
            "mode": self.mode.name,
            "prior_rates": list(self.prior.rates),
            "prior_trials": list(self.prior.trials),
            "confidence_ratios": self.correction.ratios.tolist(),
            "survival_ratios": self.surv_correction.ratios.tolist(),
            "calibration": {
                "knots": list(self.calibration.knots),
                "values": list(self.calibration.values),
            },
            "resume_ratio": self.resume_ratio,
            "resumes": self._resumes,
            "flush_row_seconds": self.flush_row_seconds,
            "flushes": self._flushes,
            "resume_charge_per_row": self._resume_row_s(),
            "probe_every": self._probe_every,
            "steps_since_draft": self._since_draft,
            "fallbacks": dict(self.fallbacks),
            "lag_shrink": self.lag_fit.rho,
            # None before any spread: GET /capacity answers strict JSON, which has no NaN
            "lag_slope": slope if math.isfinite(slope := self.lag_fit.slope) else None,
            "lag_shrink_applied": self._shrinks,
            "replan_every": self.replan_every,
            "pinned_steps": self.pinned_steps,
            "zero_pinned_steps": self.zero_pinned_steps,
            "step_bias": self.step_bias.state(),
            "explore_budget": self.explore_budget,
            "explore_lost_s": self.explore_lost_s,
            "explore_lost_share": self.explore_lost_s / self._observed_s
            if self._observed_s
            else 0.0,
        }

    def _survival(self, raw: np.ndarray) -> np.ndarray:
        """Survival rows from raw confidences, under the live corrections and calibration
        (capacity-driven modes; the others read the head as it is)."""
        if not self._corrects:
            return survival(raw)
        return self._past_first(survival(self.correction.apply(raw)))

    def _past_first(self, first: np.ndarray) -> np.ndarray:
        """The first stage's survival through the second (per-position) and the calibration."""
        return self.calibration.apply(self.surv_correction.apply(first))

    def _evidence(self) -> float:
        """Drafts verified at position 1 so far (probes and drafting steps alike)."""
        return self.prior.trials[0] if self.prior.trials else 0.0

    def _explore(self, r: int) -> bool:
        """Whether the drafter's price at R is untested (EXPLORE_RATIO) and exploring it is
        within EXPLORE_BUDGET (or finishes a burst)."""
        est = self.estimator
        if not self.selective or est is None or self.explore_ratio <= 0.0:
            return False
        # drafts_timed sums over every R timed so far: at c = 64 that loop ran every step,
        # though its answer changes only when a drafting step teaches the draft term
        key = (r, est.drafts_observed)
        if self._explore_memo[0] != key:
            self._explore_memo = (key, est.drafts_timed(r) < CAP_MIN_RECORDS)
        if not self._explore_memo[1]:
            return False
        if 0 < self._burst < EXPLORE_BURST:
            return True
        return self.explore_lost_s <= self.explore_budget * self._observed_s

    def _count_exploration(self, rec: StepRecord) -> None:
        """EXPLORE_BUDGET's books: every step's seconds, and what an explored step lost against
        its plain alternative (nothing for a step that paid; a step with prefill rows is left
        out, its seconds being more than the plain step it is priced against)."""
        if math.isfinite(rec.step_seconds):
            self._observed_s += rec.step_seconds
        if not rec.explored:
            self._burst = 0
            return
        self._burst += 1
        theta = rec.plain_theta
        if rec.num_prefill_tokens or not (math.isfinite(theta) and theta > 0.0):
            return
        plain_s = (rec.num_decode_reqs + rec.num_accepted) / theta
        self.explore_lost_s += max(rec.step_seconds - plain_s, 0.0)

    def _k_key(self, ids: np.ndarray, sps: np.ndarray, max_len: np.ndarray) -> tuple[object, ...]:
        lag = self.mode.lag
        snaps = self.history.snapshots
        snap = snaps[-lag] if len(snaps) >= lag else None
        ml = np.asarray(max_len, np.int64)
        ids_b = np.asarray(ids, np.int64).tobytes()
        return (
            snap,
            self.prior,
            sps,
            self._pool,
            ids_b,
            ml.tobytes(),
            self._explore(ids.size),
            self._skip_charge(ids.size),
            self._rho(),
            self._bias(ids.size),
            self._resume_row_s(),
        )

    def _memo_k(self, key: tuple[object, ...]) -> KPlan | None:
        memo = self._k_memo
        if memo is None:
            return None
        old = memo[0]
        same = all(a is b for a, b in zip(old[:4], key[:4], strict=True)) and old[4:] == key[4:]
        return memo[1] if same else None

    def _submit_next(self, ids: np.ndarray, sps: np.ndarray, max_len: np.ndarray) -> None:
        if self._worker is None:
            return
        key = self._k_key(ids, sps, max_len)
        self._next_for = (key[4], key[5])
        k = self._memo_k(key)
        if k is not None:  # nothing K depends on changed: no worker round trip
            self._next_k, self._next_key = k, None
            return
        # next step's K, while this step's forward runs
        hist, prior, draft = self.history, self.prior, self._draft_for(ids.size)
        self._next_k = self._worker.submit(
            self._k_from_history, hist, ids, prior, sps, max_len, draft, self._pool, *key[6:]
        )
        self._next_key = key

    def _count_fallback(self) -> None:
        if self._fallback:
            self.fallbacks[self._fallback] = self.fallbacks.get(self._fallback, 0) + 1

    def _k_from_history(
        self,
        history: SurvivalHistory,
        ids: np.ndarray,
        prior: AcceptancePrior,
        sps: np.ndarray,
        max_len: np.ndarray,
        draft: np.ndarray | None = None,
        pool: np.ndarray | None = None,
        explore: bool = False,
        skip_charge: float = 0.0,
        rho: float = 1.0,
        bias: float = 0.0,
        resume: float = 0.0,
    ) -> KPlan:
        """K from the lagged survival, and with a row-priced drafter the rows that K drafts (all
        of them: `np.arange(R)`). Requests the snapshot lacks read the prior when chosen one by
        one, and stratified pool rows (POOL_ROWS) when the whole batch is drafted: its live top-K
        then picks among them all, which the pool's spread prices and the prior's mean does not.
        `explore`: the drafter's price at this R is untested, and the whole batch is drafted
        while priced within EXPLORE_RATIO of the best plan. `skip_charge`: seconds a K = 0 step is
        charged for the resume it causes (`_skip_charge`). `rho`: how much of a lagged row's
        departure from the average row to believe (LagShrink). `bias`: the log factor on a
        drafting plan's seconds (StepKindBias). `resume`: seconds charged per drafted request for
        projecting the context rows a plain run queued (_resume_row_s)."""
        sps, draft = _biased(sps, draft, ids.size, bias)
        sps, draft = _resume_charged(sps, draft, ids.size, resume)
        lagged, hit = _shrunk_lagged(history, ids, self.mode.lag, prior, pool, rho)
        tps = self._floor_tps(sps, ids.size)
        absent = ~hit
        fill = None
        if pool is not None and pool.shape[0] >= POOL_MIN and np.count_nonzero(absent) >= 2:
            fill = lagged.copy()
            fill[absent] = stratified_rows(pool, int(np.count_nonzero(absent)))
        if draft is None:  # every K > 0 drafts every row
            surv = lagged if fill is None else fill
            sps = _charged_sps(sps, ids.size, skip_charge)
            k, tau = lagged_global_plan(
                surv, sps, max_len=max_len, min_user_tps=tps, tie_margin=self.tie_margin
            )
            return k, None, tau if k > 0 else math.nan, False
        if skip_charge:  # draft[n]: the drafter of n rows; draft[0]: none (a plain step)
            draft = draft.copy()
            draft[0] = skip_charge
        r = ids.size
        k, rows, theta = selective_k(
            lagged, sps, draft, max_len=max_len, min_user_tps=tps, tie_margin=self.tie_margin
        )
        planned = _planned(theta, sps, r, k, float(draft[rows.size]))
        if fill is None and not explore:
            return k, rows, planned, False
        every = np.full_like(draft, draft[-1])
        every[0] = draft[0]
        surv = lagged if fill is None else fill
        k_all, _, theta_all = selective_k(
            surv, sps, every, max_len=max_len, min_user_tps=tps, tie_margin=self.tie_margin
        )
        if k_all > 0 and theta_all > theta:
            return k_all, np.arange(r), _planned(theta_all, sps, r, k_all, float(draft[-1])), False
        if explore and not (k_all == 0 and self.user_rate_floor > 0.0):
            if k_all == 0:  # the best plan that drafts: every row verifies at least one draft
                once = np.minimum(np.asarray(max_len), 1)
                k_all, _, theta_all = selective_k(
                    surv, sps, every, min_len=once, max_len=max_len, min_user_tps=tps
                )
            if k_all > 0 and theta_all >= self.explore_ratio * theta:
                planned_all = _planned(theta_all, sps, r, k_all, float(draft[-1]))
                return k_all, np.arange(r), planned_all, True
        return k, rows, planned, False

    def _floor_tps(self, sps: np.ndarray, r: int) -> float:
        """The per-request tokens/s floor a K search keeps: `min_user_tps`, or `user_rate_floor`
        times a plain step's rate (one token per SPS(R) step, uncharged), whichever is higher.
        K = 0 always meets the relative floor, so it only ever turns drafting down: no K whose
        longer step leaves some request (undrafted, or with little survival) below the fraction
        of its plain rate. Exploration then only tests plans that meet it."""
        tps = self.min_user_tps
        if self.user_rate_floor > 0.0 and sps.size > r:
            tps = max(tps, self.user_rate_floor * float(sps[r]))
        return tps

    def _lagged_k(
        self, ids: np.ndarray, sps: np.ndarray, max_len: np.ndarray
    ) -> tuple[int, Rows, float, bool, str]:
        future, self._next_k = self._next_k, None
        if future is not None:
            got = future if isinstance(future, tuple) else future.result()
            if self._next_key is not None:
                self._k_memo, self._next_key = (self._next_key, got), None
            # planned for last step's batch: its rows and tokens are this one's only if the batch
            # is the same
            k, rows, planned, explored = got
            if self._next_for == _batch_key(ids, max_len):
                return k, rows, planned, explored, ""
            return k, None, math.nan, explored, ""
        # No plan from the previous step (first step, or overlap off): the same rule inline.
        key = self._k_key(ids, sps, max_len)
        got = self._memo_k(key)
        if got is None:
            draft = self._draft_for(ids.size)
            got = self._k_from_history(
                self.history, ids, self.prior, sps, max_len, draft, self._pool, *key[6:]
            )
            self._k_memo = (key, got)
        return *got, ("no_overlap_plan" if self._worker is not None else "")

    def observe(
        self,
        verify_lens: np.ndarray,
        accepted: np.ndarray,
        rec: StepRecord,
        ids: list[int] | None = None,
    ) -> None:
        """After a step: update the acceptance prior, the confidence correction (given the
        verified rows' request ids, in the order of the arrays) and the live capacity model."""
        learns, self._learns, self._pinned = self._learns, True, False
        # a skipped step verified nothing (the record is all it brings); a pinned one learns not
        if verify_lens.size and learns:
            self.observe_acceptance(verify_lens, accepted, ids)
        if rec.draft_seconds > 0.0 and math.isfinite(rec.draft_seconds):
            if self._resume_rows:
                self._learn_resume(self._resume_rows, rec.draft_seconds)
            elif self._steady_run and not (rec.draft_resumed or rec.probe) and rec.num_draft_reqs:
                self._learn_steady(rec.num_draft_reqs, rec.draft_seconds)
        steady, self._resume_rows, self._steady_run = self._steady_run, 0, False
        if self.selective:
            self._count_exploration(rec)
        if self._biased and not rec.num_prefill_tokens:
            drafted = rec.draft_seconds > 0.0
            if not drafted or (steady and not (rec.probe or rec.draft_resumed)):
                self.step_bias.observe(
                    rec.num_reqs, drafted, rec.step_seconds, rec.predicted_seconds
                )
        if self.estimator is None:
            return
        self._queued.append(rec)
        if len(self._queued) < self.fold and not self._news(rec, steady):
            return
        self.flush_records()

    def _news(self, rec: StepRecord, steady: bool) -> bool:
        """Whether a record goes to the estimator now rather than in the next fold: a drafting
        step that did not follow one (the price a plain run waits on), or one at an R whose
        drafter price exploration still tests. Feeding the latter at once keeps `_explore`
        exact: a record whose bin already has CAP_MIN_RECORDS timed steps changes no R's
        answer, as `drafts_timed` counts that bin and the larger ones only."""
        if not rec.draft_seconds > 0.0:
            return False
        if not steady or rec.probe or rec.draft_resumed:
            return True
        assert self.estimator is not None
        r = rec.num_draft_reqs if rec.num_draft_reqs > 0 else rec.num_reqs
        return self.estimator.drafts_timed(r) < CAP_MIN_RECORDS

    def _learn_steady(self, rows: int, seconds: float) -> None:
        self._steady[r_bin(rows)] = _fold(*self._steady.get(r_bin(rows), (seconds, 0)), seconds)

    def _learn_resume(self, rows: int, seconds: float) -> None:
        """Fold a resumed drafter run's excess over steady runs of as many rows into
        resume_ratio (nothing until RESUME_MIN_STEADY steady runs were timed there)."""
        steady, n = self._steady.get(r_bin(rows), (0.0, 0))
        if n < RESUME_MIN_STEADY or not steady > 0.0:
            return
        excess = min(max(seconds / steady - 1.0, 0.0), RESUME_MAX)
        self.resume_ratio, self._resumes = _fold(self.resume_ratio, self._resumes, excess)

    def observe_flush(self, rows: int, seconds: float) -> None:
        """The engine projected `rows` queued context rows in `seconds` (a drafter run's flush):
        folds the seconds per row in, from FLUSH_MIN_ROWS rows up (below, fixed costs rule)."""
        if rows >= FLUSH_MIN_ROWS and seconds > 0.0 and math.isfinite(seconds):
            self.flush_row_seconds, self._flushes = _fold(
                self.flush_row_seconds, self._flushes, seconds / rows
            )

    def _resume_row_s(self) -> float:
        """Seconds a drafting plan is charged per drafted request for the context rows queued
        beyond one drafting step's (a plain run's backlog: the projection leaving it costs),
        spread over the steps the batch has left to pay it back (at most RESUME_HORIZON); on a
        grid of powers of two, so the K memo survives the backlog growing a row a step."""
        rows, left = self._queued_ctx
        if not (self._resume_charge and self.flush_row_seconds > 0.0) or rows <= 0.0:
            return 0.0
        per_step = 1.0 + float(self.prior.survival.sum())  # tokens a drafting step makes
        backlog = _pow2(rows - per_step)
        if backlog <= 0.0:
            return 0.0
        horizon = min(max(_pow2(left / per_step), 1.0), float(RESUME_HORIZON))
        return _pow2(backlog * self.flush_row_seconds / horizon * 1e6) * 1e-6

    def _bias(self, r: int) -> float:
        """StepKindBias's log factor at R, in steps of 1/128 (a K memo survives small moves)."""
        return round(self.step_bias.log_factor(r) * 128.0) / 128.0 if self._biased else 0.0

    def _skip_charge(self, r: int) -> float:
        """Seconds a K search for R requests charges K = 0 in a drafting run: the resume it
        causes later, on about the rows the last drafting step drafted, over the average plain
        run (RESUME_RATE); 0 elsewhere."""
        rho = self.resume_ratio
        if rho <= 0.0 or self.capacity is None or r <= 0 or self._drafting_run <= 0:
            return 0.0
        rows = min(max(self._last_rows, 1), r)
        return rho * float(self.capacity.draft_seconds(rows)) / self._plain_len[0]

    def _count_drafting(self, rows: int) -> None:
        """A K > 0 step drafting `rows` rows: ends the plain run, lengthens the drafting run, and
        after PROBE_MIN drafting steps in a row brings the probe gap back to its minimum."""
        self._end_plain_run()
        self._drafting_run += 1
        self._last_rows = rows
        if self._drafting_run >= PROBE_MIN:
            self._probe_every = PROBE_MIN

    def _end_plain_run(self) -> None:
        """A K > 0 step: fold the plain run it ends into the average plain run."""
        steps, self._plain_run = self._plain_run, 0
        if steps <= 0:
            return
        mean, n = _fold(*self._plain_len, float(steps))
        self._plain_len = (max(mean, 1.0), n)

    def flush_records(self) -> None:
        """Feed the queued step records (FOLD_RECORDS) to the live estimator, in step order."""
        queued, self._queued = self._queued, []
        for rec in queued:
            new = self.estimator.observe(rec) if self.estimator is not None else None
            if new is not None:  # swap at the step boundary
                self.capacity = new

    def observe_acceptance(
        self, verify_lens: np.ndarray, accepted: np.ndarray, ids: list[int] | None = None
    ) -> None:
        if not verify_lens.any():  # a K = 0 step verified nothing: nothing to learn
            return
        if self._shrinks and ids:  # 30-40 us a step: not paid while off
            self._learn_lag(np.asarray(ids, np.int64), verify_lens, accepted)
        self.prior = self.prior.observe(verify_lens, accepted)
        drafted = self._drafted
        if not self._corrects or drafted is None or not ids:
            return
        planned, conf, first, corr = drafted
        lens, acc = verify_lens, accepted
        if list(ids) != planned:  # only some drafted rows verified, or in another order
            at = {sid: i for i, sid in enumerate(planned)}
            rows = [i for i, sid in enumerate(ids) if sid in at]
            if not rows:
                return
            sel = [at[ids[i]] for i in rows]
            conf, first, lens, acc = conf[sel], first[sel], verify_lens[rows], accepted[rows]
        if corr is not self.correction:  # what the second stage is fed under today's first
            first = survival(self.correction.apply(conf))
        self.calibration = self.calibration.observe(self.surv_correction.apply(first), lens, acc)
        self.surv_correction = self.surv_correction.observe(first, lens, acc)
        self.correction = self.correction.observe(conf, lens, acc)

    def _rho(self) -> float:
        """The LagShrink factor K applies, in steps of 1/32 (a K memo survives small moves);
        1 (face value) unless lag shrinking is on."""
        return round(self.lag_fit.rho * 32.0) / 32.0 if self._shrinks else 1.0

    def _learn_lag(self, ids: np.ndarray, verify_lens: np.ndarray, accepted: np.ndarray) -> None:
        """Fold the verified rows that had a lagged row into LagShrink: the snapshot this step's
        K read is `lag + 1` pushes back now that plan() pushed this step's own. Not when that
        snapshot repeats the one before it (a pinned step's, or a plain step's between two
        agings): its rows are older than `lag` steps, and ρ is how much of a row `lag` steps
        old still holds."""
        lag = self.mode.lag + 1
        snaps = self.history.snapshots
        if len(snaps) < lag or (len(snaps) > lag and snaps[-lag] is snaps[-lag - 1]):
            return
        old, hit = self.history.lagged_with_hits(ids, lag, self.prior)
        if not hit.any():
            return
        center = _center(self.prior, self._pool)
        self.lag_fit = self.lag_fit.observe(old[hit], center, verify_lens[hit], accepted[hit])

    def close(self) -> None:
        self.flush_records()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
