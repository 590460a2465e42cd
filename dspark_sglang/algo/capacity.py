"""Capacity model (DESIGN §4; the paper's SPS(B), §3.2.2): step seconds T(R, B, ctx), the SPS array
the verify planner reads, and the EP balls-into-bins load. Immutable, versioned, plain-dict I/O.
Pure numpy + stdlib; imports only `config`, never engine, models, yaml, torch.cuda or a clock."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np

from dspark_sglang.config import ConfigError

Array = np.ndarray
_SPAN = 8.0  # binomial tails beyond mean ± 8 sd hold < 1e-15 of the mass
_EXACT_PAIRS = 128  # up to this many routed pairs E[max] is exact (the approximation is
# weakest at small n); above it ranks are taken as independent binomials (< 1.5% low)
_TABLE_MIN = 1024  # smallest E[max load] table; larger ones double (few cache variants)


# ---- validation of plain dicts: every error names the field by its dotted path -------------


def get_field(d: Any, key: str, where: str, default: Any = ...) -> Any:
    """d[key]; `where` is d's dotted path ("" at the top) and names the field in errors, as DESIGN
    §4 asks of profile validation."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where or 'top level'}: expected a mapping, got {type(d).__name__}")
    if key not in d:
        if default is ...:
            raise ConfigError(f"{where + '.' if where else ''}{key}: missing")
        return default
    return d[key]


def as_float(x: Any, where: str, minimum: float | None = 0.0) -> float:
    """A finite number >= minimum (DESIGN §4: profiles are validated on load)."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ConfigError(f"{where}: expected a finite number, got {x!r}")
    if minimum is not None and x < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {x!r}")
    return float(x)


def as_int(x: Any, where: str, minimum: int = 0) -> int:
    """An integer (not a bool) >= minimum (DESIGN §4)."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise ConfigError(f"{where}: expected an integer, got {x!r}")
    if x < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {x}")
    return x


def as_increasing(x: Any, where: str, *, integer: bool, allow_empty: bool = False) -> tuple:
    """A strictly increasing list of knots or buckets (DESIGN §4)."""
    if not isinstance(x, list | tuple) or (not x and not allow_empty):
        raise ConfigError(f"{where}: expected a non-empty list, got {x!r}")
    conv = as_int if integer else as_float
    out = tuple(conv(v, f"{where}[{i}]", 1 if integer else 0.0) for i, v in enumerate(x))
    if any(b <= a for a, b in itertools.pairwise(out)):
        raise ConfigError(f"{where}: must be strictly increasing, got {list(out)}")
    return out


def _is_scalar(x: object) -> bool:
    return isinstance(x, int | float | np.integer | np.floating)


def _plain(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)  # knots 1, 2, 4 stay ints in YAML


# ---- forms ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Curve:
    """Piecewise-linear y(x) on strictly increasing knots. Flat left of the first knot; right of
    the last it continues the last segment's slope (floored at 0): a forward past the profiled grid
    costs at least the last point, so a flat clamp there would under-price it."""

    knots: tuple[float, ...]
    values: tuple[float, ...]

    def __call__(self, x: Array | float) -> Array:
        if _is_scalar(x):
            return np.float64(self._at(float(x)))  # the planner's per-step path: no arrays
        xs, ys = np.asarray(self.knots, np.float64), np.asarray(self.values, np.float64)
        x = np.asarray(x, np.float64)
        out = np.interp(x, xs, ys)
        if xs.size > 1:
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            out = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), out)
        return out

    def _at(self, x: float) -> float:
        ks, vs = self.knots, self.values
        if x != x:  # NaN, as np.interp
            return x
        if x <= ks[0]:
            return float(vs[0])
        if x >= ks[-1]:
            if len(ks) == 1:
                return float(vs[0])
            slope = max(0.0, (vs[-1] - vs[-2]) / (ks[-1] - ks[-2]))
            return vs[-1] + slope * (x - ks[-1])
        j = bisect.bisect_right(ks, x) - 1
        return vs[j] + (vs[j + 1] - vs[j]) / (ks[j + 1] - ks[j]) * (x - ks[j])

    def to_dict(self) -> dict[str, list]:
        return {"knots": [_plain(k) for k in self.knots], "values": [float(v) for v in self.values]}

    @staticmethod
    def from_dict(d: Any, where: str) -> Curve:
        knots = as_increasing(get_field(d, "knots", where), f"{where}.knots", integer=False)
        raw = get_field(d, "values", where)
        if not isinstance(raw, list | tuple) or len(raw) != len(knots):
            raise ConfigError(f"{where}.values: expected {len(knots)} numbers (one per knot)")
        values = tuple(as_float(v, f"{where}.values[{i}]") for i, v in enumerate(raw))
        return Curve(knots, values)


def executed_tokens(buckets: Sequence[int], num_tokens: Array | int) -> Array:
    """The forward size a step of B tokens actually executes: the smallest bucket >= B (the graph
    tier it is padded to and replays), or B itself past the last bucket (eager fallback, STYLE §2.8)
    or when the engine has no buckets."""
    b = np.asarray(num_tokens, np.int64)
    if not buckets:
        return b
    arr = np.asarray(buckets, np.int64)
    idx = np.searchsorted(arr, b, side="left")
    return np.where(idx < arr.size, arr[np.minimum(idx, arr.size - 1)], b)


@dataclass(frozen=True, slots=True)
class TableModel:
    """The 1-D SPS table (upstream's `SpsCostTable`): step seconds measured at each executed bucket.

    Lookup **ceils** B to the bucket the step executes. Upstream floors to the probe at or below
    B, pricing a step that replays the next graph tier up at the lower tier's speed, which pulls
    the argmax to the top of every plateau (sglang_dspark.md §4, deviation 2: B=47 priced as
    SPS(24) while the step replays the 48-token graph)."""

    buckets: tuple[int, ...]
    seconds: tuple[float, ...]
    kind: ClassVar[str] = "table"

    def base_seconds(self, num_reqs: Array | int, executed: Array, ctx: Array | int) -> Array:
        return Curve(self.buckets, self.seconds)(executed)

    def base_scalar(self, num_reqs: int, executed: int, ctx: float) -> float:
        """`base_seconds` of one step, in Python floats (the planner's per-step path)."""
        return Curve(self.buckets, self.seconds)._at(float(executed))

    def to_params(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "seconds": [float(s) for s in self.seconds]}

    @staticmethod
    def from_params(p: Any, where: str) -> TableModel:
        buckets = as_increasing(get_field(p, "buckets", where), f"{where}.buckets", integer=True)
        raw = get_field(p, "seconds", where)
        if not isinstance(raw, list | tuple) or len(raw) != len(buckets):
            raise ConfigError(f"{where}.seconds: expected {len(buckets)} numbers (one per bucket)")
        secs = tuple(as_float(s, f"{where}.seconds[{i}]") for i, s in enumerate(raw))
        if min(secs) <= 0.0:
            raise ConfigError(f"{where}.seconds: every step time must be > 0")
        return TableModel(buckets, secs)


@dataclass(frozen=True, slots=True)
class AdditiveModel:
    """Upstream's 2-D form with context terms: T = bias + α(R) + θ(B_exec) + κ·ctx
    + κ_q·ctx·(B_exec − R)/R (DESIGN §4). ctx counts KV tokens attended by the whole batch
    (StepRecord.kv_tokens); the κ_q term prices the extra query tokens of a verify step: each
    of a request's B/R tokens attends its context, so a KV token costs more the more drafts its
    request verifies. Served CPU engine (s49_final, forward vs KV tokens with one intercept per
    (R, B) shape): 0.69 µs a KV token at one token per request (no-spec, 47,562 steps), 1.16 at
    four (fixed:3), 1.39 at eight (verify-all); one κ fitted over the start-up grid's mix read
    1.08-1.10, which priced a plain R = 64 step at 12 k KV tokens ~5 ms (20 %) above its time."""

    bias_s: float
    alpha: Curve  # seconds vs R
    theta: Curve  # seconds vs executed B
    kappa_s: float = 0.0  # seconds per KV token attended
    buckets: tuple[int, ...] = ()  # graph tiers; () = the engine runs exactly B tokens
    kappa_q_s: float = 0.0  # seconds per KV token per extra query token of its request
    kind: ClassVar[str] = "additive"

    def base_seconds(self, num_reqs: Array | int, executed: Array, ctx: Array | int) -> Array:
        c = ctx if _is_scalar(ctx) else np.asarray(ctx, np.float64)
        t = self.bias_s + self.alpha(num_reqs) + self.theta(executed) + self.kappa_s * c
        if self.kappa_q_s:
            r = np.maximum(np.asarray(num_reqs, np.float64), 1.0)
            t = t + self.kappa_q_s * c * np.maximum(np.asarray(executed, np.float64) - r, 0.0) / r
        return t

    def base_scalar(self, num_reqs: int, executed: int, ctx: float) -> float:
        """`base_seconds` of one step, in Python floats: the same sum in the same order, without
        the numpy scalars that cost the planner's per-step path more than the arithmetic."""
        a, t = self.alpha._at(float(num_reqs)), self.theta._at(float(executed))
        s = self.bias_s + a + t + self.kappa_s * ctx
        if self.kappa_q_s:
            r = max(float(num_reqs), 1.0)
            s += self.kappa_q_s * ctx * max(float(executed) - r, 0.0) / r
        return s

    def to_params(self) -> dict[str, Any]:
        return {
            "bias_s": float(self.bias_s),
            "alpha": self.alpha.to_dict(),
            "theta": self.theta.to_dict(),
            "kappa_s": float(self.kappa_s),
            "kappa_q_s": float(self.kappa_q_s),
            "buckets": list(self.buckets),
        }

    @staticmethod
    def from_params(p: Any, where: str) -> AdditiveModel:
        bias = as_float(get_field(p, "bias_s", where), f"{where}.bias_s")
        if bias <= 0.0:
            raise ConfigError(f"{where}.bias_s: must be > 0 (the step time at the smallest R, B)")
        raw_buckets = get_field(p, "buckets", where, [])
        return AdditiveModel(
            bias_s=bias,
            alpha=Curve.from_dict(get_field(p, "alpha", where), f"{where}.alpha"),
            theta=Curve.from_dict(get_field(p, "theta", where), f"{where}.theta"),
            kappa_s=as_float(get_field(p, "kappa_s", where, 0.0), f"{where}.kappa_s"),
            buckets=as_increasing(raw_buckets, f"{where}.buckets", integer=True, allow_empty=True),
            kappa_q_s=as_float(get_field(p, "kappa_q_s", where, 0.0), f"{where}.kappa_q_s"),
        )


# ---- expert parallelism ----------------------------------------------------------------------


def rank_shares(popularity: Sequence[float], num_ranks: int) -> Array:
    """Share of routed (token, expert) pairs landing on each EP rank (DESIGN §4); experts sit on
    ranks in contiguous blocks of E / num_ranks, as in DeepEP and SGLang's EP MoE."""
    p = np.asarray(popularity, np.float64)
    if p.size % num_ranks or np.any(p < 0) or not np.isfinite(p).all() or p.sum() <= 0:
        raise ValueError(
            "popularity: need E >= 0 finite weights, E divisible by num_ranks, sum > 0"
        )
    return (p / p.sum()).reshape(num_ranks, -1).sum(axis=1)


def _exact_max_load(live: Array, n: int) -> float:
    """E[max] of Multinomial(n, live), exact: P(max <= m) = n! [x^n] Π_j Σ_{i<=m} (P_j x)^i / i!."""
    i = np.arange(n + 1)
    log_ifact = np.array([math.lgamma(v + 1.0) for v in i])
    coef = np.exp(i * np.log(live)[:, None] - log_ifact)  # [ranks, n + 1]
    scale = math.exp(math.lgamma(n + 1.0))
    first = -(-n // live.size)  # some rank holds at least ceil(n / ranks): P(max < first) = 0
    total = float(first)
    for m in range(first, n):
        poly = np.zeros(n + 1)
        poly[0] = 1.0
        for c in coef:
            poly = np.convolve(poly, c[: m + 1])[: n + 1]
        p_le = poly[n] * scale
        total += 1.0 - p_le
        if p_le > 1.0 - 1e-12:
            break
    return total


def _binomial_max_load(live: Array, n: int, logfact: Array) -> float:
    """E[max_j L_j] with L_j ~ Binomial(n, P_j) taken independent across ranks: P(max <= m) =
    Π_j F_j(m) on the window where it moves (mean ± 8 sd); P(max > m) is 1 below it, 0 above."""
    mean, sd = n * live, np.sqrt(n * live * (1.0 - live))
    lo = max(0, math.floor(np.max(mean - _SPAN * sd)))
    hi = min(n, math.ceil(np.max(mean + _SPAN * sd)) + 1)
    m = np.arange(lo, hi + 1)
    logp, logq = np.log(live)[:, None], np.log1p(-live)[:, None]
    logpmf = logfact[n] - logfact[m] - logfact[n - m] + m * logp + (n - m) * logq
    tail = np.cumsum(np.exp(logpmf)[:, ::-1], axis=1)[:, ::-1]  # [:, i] = P(L_j >= m_i)
    p_max_le = np.prod(1.0 - tail[:, 1:], axis=0)  # P(max <= m) for m = lo..hi-1
    return lo + float(np.sum(1.0 - p_max_le))


@lru_cache(maxsize=32)
def _cached_shares(popularity: tuple[float, ...], num_ranks: int) -> tuple[float, ...]:
    return tuple(rank_shares(popularity, num_ranks).tolist())


@lru_cache(maxsize=32)
def _max_load_table(shares: tuple[float, ...], top_k: int, size: int) -> Array:
    """E[max rank load] for B = 0..size-1 tokens, read-only (see expected_max_rank_loads)."""
    p = np.asarray(shares, np.float64)
    tokens = np.arange(size, dtype=np.float64)
    if p.max() >= 1.0 - 1e-12:  # everything lands on one rank: the load is B·k
        out = tokens * top_k
    else:
        live = p[p > 0.0]  # an empty rank carries no load and never holds the max
        logfact = np.concatenate(([0.0], np.cumsum(np.log(np.arange(1, (size - 1) * top_k + 1)))))
        # Exact at every B up to 64, then on a coarser grid, linear in between: past a few dozen
        # tokens E[max] ≈ B·k·P_max + c·sqrt(B) bends so little that the gap is < 0.1 pair.
        anchors = np.unique(np.r_[1:65, 64:256:8, 256:size:32, size - 1])
        anchors = anchors[(anchors >= 1) & (anchors < size)]
        vals = [
            _exact_max_load(live, b * top_k)
            if b * top_k <= _EXACT_PAIRS
            else _binomial_max_load(live, b * top_k, logfact)
            for b in anchors.tolist()
        ]
        out = np.interp(tokens, np.r_[0, anchors], np.r_[0.0, vals])
        # The true E[max] never falls as B grows; the switch to the (slightly low) binomial form
        # above _EXACT_PAIRS can dip by ~1%, which would hand the planner a fake SPS bump.
        out = np.maximum.accumulate(out)
    out.setflags(write=False)
    return out


def expected_max_rank_loads(
    popularity: Sequence[float], num_ranks: int, top_k: int, max_tokens: int
) -> Array:
    """[max_tokens + 1] expected routed pairs on the busiest EP rank for B = 0..max_tokens tokens
    (DESIGN §4). Balls into bins with unequal probabilities: B·top_k pairs, each landing on expert e
    with probability popularity[e] (its measured share of routed pairs); experts sit on ranks in
    contiguous blocks, so rank loads are Multinomial(B·k, rank shares). E[max] is exact up to
    _EXACT_PAIRS pairs, then takes the binomial rank loads as independent (< 1.5% low there).
    Real routing picks k *distinct* experts per token, so the model errs high at tiny B: ~2-6% at
    B = 1 for balanced popularity, up to ~13% under strong skew, < 4% from B = 8 and < 1.5% from
    B = 64 (tests compare with a Monte Carlo of top-k routing). Cached per (shares, top_k, size)."""
    shares = _cached_shares(tuple(popularity), num_ranks)
    size = max(_TABLE_MIN, 1 << max_tokens.bit_length())  # one table serves every B below it
    return _max_load_table(shares, top_k, size)[: max_tokens + 1]


def expected_max_rank_load(
    popularity: Sequence[float], num_ranks: int, top_k: int, num_tokens: int
) -> float:
    """E[max per-rank load] for one B; see `expected_max_rank_loads`."""
    return float(expected_max_rank_loads(popularity, num_ranks, top_k, num_tokens)[num_tokens])


@dataclass(frozen=True, slots=True)
class ExpertParallelTerm:
    """The MoE share of a step under EP (DESIGN §4): θ_moe(E[max rank load(B)]) + a2a(B). Every MoE
    layer waits for its most loaded rank, so expert compute and the receive side of dispatch/combine
    are priced at the busiest rank's expected load; a2a(B) holds the per-step latency floor and any
    volume that scales with all B tokens."""

    num_experts: int
    top_k: int
    ep_size: int
    load: Curve  # MoE seconds per step vs the busiest rank's routed pairs per MoE layer
    a2a_base_s: float = 0.0
    a2a_per_token_s: float = 0.0
    popularity: tuple[float, ...] = ()  # routed share per expert; () = uniform

    def max_loads(self, max_tokens: int) -> Array:
        pop = self.popularity or (1.0,) * self.num_experts
        return expected_max_rank_loads(pop, self.ep_size, self.top_k, max_tokens)

    def seconds(self, executed: Array) -> Array:
        b = np.asarray(executed, np.int64)
        loads = self.max_loads(int(b.max(initial=0)))[b]
        a2a = np.where(b > 0, self.a2a_base_s + self.a2a_per_token_s * b, 0.0)
        return self.load(loads) + a2a

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "ep_size": self.ep_size,
            "load": self.load.to_dict(),
            "a2a_base_s": float(self.a2a_base_s),
            "a2a_per_token_s": float(self.a2a_per_token_s),
        }
        if self.popularity:
            out["popularity"] = [float(p) for p in self.popularity]
        return out

    @staticmethod
    def from_dict(d: Any, where: str) -> ExpertParallelTerm:
        num_experts = as_int(get_field(d, "num_experts", where), f"{where}.num_experts", 1)
        top_k = as_int(get_field(d, "top_k", where), f"{where}.top_k", 1)
        ep_size = as_int(get_field(d, "ep_size", where), f"{where}.ep_size", 1)
        if top_k > num_experts or num_experts % ep_size:
            raise ConfigError(
                f"{where}.ep_size: need top_k <= num_experts and num_experts divisible by ep_size"
                f" (got E={num_experts}, top_k={top_k}, ep_size={ep_size})"
            )
        raw = get_field(d, "popularity", where, [])
        if not isinstance(raw, list | tuple) or (raw and len(raw) != num_experts):
            raise ConfigError(f"{where}.popularity: expected {num_experts} numbers or none")
        pop = tuple(as_float(p, f"{where}.popularity[{i}]") for i, p in enumerate(raw))
        if pop and sum(pop) <= 0.0:
            raise ConfigError(f"{where}.popularity: must not be all zero")
        return ExpertParallelTerm(
            num_experts=num_experts,
            top_k=top_k,
            ep_size=ep_size,
            load=Curve.from_dict(get_field(d, "load", where), f"{where}.load"),
            a2a_base_s=as_float(get_field(d, "a2a_base_s", where, 0.0), f"{where}.a2a_base_s"),
            a2a_per_token_s=as_float(
                get_field(d, "a2a_per_token_s", where, 0.0), f"{where}.a2a_per_token_s"
            ),
            popularity=pop,
        )


def _scale_from_dict(d: Any, where: str) -> Curve:
    curve = Curve.from_dict(d, where)
    if min(curve.values) <= 0.0:
        raise ConfigError(f"{where}.values: every scale factor must be > 0")
    return curve


# ---- the model value -----------------------------------------------------------------------

FORMS: dict[str, type[TableModel] | type[AdditiveModel]] = {
    "table": TableModel,
    "additive": AdditiveModel,
}


DRAFT_MODES = ("never", "always", "when_verifying")


@dataclass(frozen=True, slots=True)
class CapacityModel:
    """T(R, B, ctx) = scale(B_exec) · (form(R, B_exec, ctx) + moe(B_exec)) + host(R) + draft(R),
    B_exec the bucket, draft(R) only on steps that ran the drafter.

    An immutable value (STYLE §3): updates build a new one with version + 1, which every rank swaps
    in at one step boundary. `scale` is the live estimator's multiplicative correction (flat outside
    its knots); `moe` the EP term for MoE targets; `draft` the drafter's seconds per step vs R (on a
    GPU a few percent of a forward, on a CPU a large share of it: a step that verifies nothing can
    skip the drafter, so the lagged planner must weigh it). `host` is the engine's own work per
    step outside the forward (scheduling, batch building, sampling, bookkeeping) vs R: a profile
    timed forwards alone has none; the live estimator learns it from steps that time their
    forward, and then `draft` is everything a drafting step adds on top of a plain one."""

    form: TableModel | AdditiveModel
    moe: ExpertParallelTerm | None = None
    scale: Curve | None = None
    version: int = 0
    draft: Curve | None = None
    host: Curve | None = None

    @property
    def uses_context(self) -> bool:
        """Whether step times depend on the attended context (an additive form with κ != 0)."""
        return isinstance(self.form, AdditiveModel) and self.form.kappa_s != 0.0

    def step_seconds(
        self, num_reqs: Array | int, num_tokens: Array | int, ctx: Array | int = 0
    ) -> Array:
        """Target forward seconds (without the drafter)."""
        if _is_scalar(num_reqs) and _is_scalar(num_tokens) and _is_scalar(ctx):
            return np.float64(self._scalar_seconds(int(num_reqs), int(num_tokens), float(ctx)))
        ex = executed_tokens(self.form.buckets, num_tokens)
        t = self.form.base_seconds(num_reqs, ex, ctx)
        if self.moe is not None:
            t = t + self.moe.seconds(ex)
        if self.scale is not None:
            t = t * np.interp(ex, self.scale.knots, self.scale.values)
        return t

    def _scalar_seconds(self, num_reqs: int, num_tokens: int, ctx: float) -> float:
        """step_seconds for one (R, B, ctx) without arrays: the planner prices a step or two
        every engine step, where numpy's per-call overhead was most of the cost."""
        bk = self.form.buckets
        i = bisect.bisect_left(bk, num_tokens)
        ex = bk[i] if i < len(bk) else num_tokens
        t = self.form.base_scalar(num_reqs, ex, ctx)
        if self.moe is not None:
            t += float(self.moe.seconds(np.int64(ex)))
        if self.scale is not None:  # flat outside the knots, as np.interp
            ks, vs = self.scale.knots, self.scale.values
            t *= vs[0] if ex <= ks[0] else vs[-1] if ex >= ks[-1] else self.scale._at(ex)
        return t

    def draft_seconds(self, num_reqs: Array | int) -> Array:
        """Drafter seconds of a step drafting for R requests; 0 when the model has no draft term."""
        if _is_scalar(num_reqs):
            return np.float64(0.0 if self.draft is None else self.draft._at(float(num_reqs)))
        r = np.asarray(num_reqs, np.float64)
        return np.zeros_like(r) if self.draft is None else self.draft(r)

    def host_seconds(self, num_reqs: Array | int) -> Array:
        """The engine's host seconds per step for R requests; 0 when the model has no host term."""
        if _is_scalar(num_reqs):
            return np.float64(0.0 if self.host is None else self.host._at(float(num_reqs)))
        r = np.asarray(num_reqs, np.float64)
        return np.zeros_like(r) if self.host is None else self.host(r)

    def predict(
        self,
        num_reqs: int,
        num_tokens: int,
        ctx: int = 0,
        drafted: bool = False,
        draft_rows: int | None = None,
    ) -> float:
        """Seconds of one step: a forward of B = num_tokens tokens for R requests (DESIGN §4),
        the host's work, and the drafter when this step ran it (`drafted`: on all R rows;
        `draft_rows`: on that many)."""
        t = float(self.step_seconds(num_reqs, num_tokens, ctx)) + float(self.host_seconds(num_reqs))
        rows = num_reqs if drafted else draft_rows
        return t + float(self.draft_seconds(rows)) if rows else t

    def sps_array(
        self, num_reqs: int, max_tokens: int, ctx: int = 0, draft: str = "never"
    ) -> Array:
        """sps[B] = 1 / T(R, B, ctx) for B = 1..max_tokens, ceiled to the executed bucket: the SPS
        contract of `algo.verify_budget` (paper §3.2.2 SPS(B)); sps[0] is unused and 0.

        `draft` says which steps pay the drafter: "never" (price forwards only), "always" (it ran
        before the plan, as in Algorithm 1: a sunk cost every B pays) or "when_verifying" (the
        plan comes first and B = R skips the drafter, as the lagged schedule does)."""
        if draft not in DRAFT_MODES:
            raise ValueError(f"draft must be one of {DRAFT_MODES}, got {draft!r}")
        t = self.step_seconds(num_reqs, np.arange(max_tokens + 1), ctx)
        t = t + float(self.host_seconds(num_reqs))
        if draft != "never" and self.draft is not None:
            d = float(self.draft_seconds(num_reqs))
            t = t + d
            if draft == "when_verifying" and num_reqs <= max_tokens:
                t[num_reqs] -= d
        sps = 1.0 / t
        sps[0] = 0.0
        return sps

    def theta(
        self,
        num_reqs: int,
        expected_tokens: Array | float,
        num_tokens: Array | int,
        ctx: int = 0,
    ) -> Array:
        """Θ = τ · SPS(B) = τ / T(R, B, ctx), expected tokens/s of a step (paper §3.2.2, Alg. 1)."""
        t = self.step_seconds(num_reqs, num_tokens, ctx) + self.host_seconds(num_reqs)
        return np.asarray(expected_tokens, np.float64) / t

    def to_dict(self) -> dict[str, Any]:
        params = self.form.to_params()
        if self.moe is not None:
            params["moe"] = self.moe.to_dict()
        if self.scale is not None:
            params["scale"] = self.scale.to_dict()
        if self.draft is not None:
            params["draft"] = self.draft.to_dict()
        if self.host is not None:
            params["host"] = self.host.to_dict()
        return {"kind": self.form.kind, "version": self.version, "params": params}

    @staticmethod
    def from_dict(d: Any, where: str = "model") -> CapacityModel:
        kind = get_field(d, "kind", where)
        if kind not in FORMS:
            raise ConfigError(f"{where}.kind: expected one of {sorted(FORMS)}, got {kind!r}")
        params = get_field(d, "params", where)
        form = FORMS[kind].from_params(params, f"{where}.params")
        moe = get_field(params, "moe", f"{where}.params", None)
        scale = get_field(params, "scale", f"{where}.params", None)
        draft = get_field(params, "draft", f"{where}.params", None)
        host = get_field(params, "host", f"{where}.params", None)
        extra = set(params) - {*form.to_params(), "moe", "scale", "draft", "host"}
        if extra:
            raise ConfigError(f"{where}.params: unknown field(s) {sorted(extra)}")
        return CapacityModel(
            form=form,
            moe=None if moe is None else ExpertParallelTerm.from_dict(moe, f"{where}.params.moe"),
            scale=None if scale is None else _scale_from_dict(scale, f"{where}.params.scale"),
            version=as_int(get_field(d, "version", where, 0), f"{where}.version"),
            draft=None if draft is None else Curve.from_dict(draft, f"{where}.params.draft"),
            host=None if host is None else Curve.from_dict(host, f"{where}.params.host"),
        )
