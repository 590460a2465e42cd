"""Discrete-event model of a DSpark decode worker (PD or colocated) for `bench.simulate`.

Step time comes from an engine profile's CapacityModel (+ drafter / host overhead terms); verify
lengths from the engine's own VerifyPlanner and the algo/ policies; acceptance from round traces.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sglang.algo.capacity import CapacityModel, Curve
from dspark_sglang.algo.survival import survival
from dspark_sglang.algo.verify_budget import (
    assign_top_k,
    lagged_global_k,
    oracle,
    parse_schedule_mode,
)
from dspark_sglang.engine.planner import VerifyPlanner

# DSpark conditional acceptance per draft position, approximate readings of the paper's Fig. 2
# (Qwen3-4B target; §4.3.1 text: DSpark starts at 0.93 on Math and stays high and stable). With
# gamma 7 they give accept lengths 6.3 / 5.6 / 3.6, against Table 1's 6.21 (GSM8K), 5.26-5.43
# (code) and 3.13-3.70 (chat).
PAPER_ACCEPTANCE = {
    "math": (0.93, 0.93, 0.93, 0.93, 0.92, 0.92, 0.92),
    "code": (0.90, 0.89, 0.89, 0.89, 0.88, 0.88, 0.88),
    "chat": (0.76, 0.75, 0.74, 0.74, 0.74, 0.74, 0.74),
}
SPEC_FREE = "no-spec"
SHRINK = "shrink"  # policy suffix @shrink: LagShrink applied to the lagged K


# -- acceptance / confidence traces ----------------------------------------------------------
@dataclass(frozen=True)
class Trajectory:
    """Successive verify rounds of one request: calibrated conditional confidences c[t, k] and
    the number of drafts the target would accept had all gamma been verified."""

    conf: np.ndarray  # [rounds, gamma] in (0, 1)
    accepted: np.ndarray  # [rounds] in 0..gamma


@dataclass(frozen=True)
class TraceBank:
    gamma: int
    trajectories: tuple[Trajectory, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise ValueError("a trace bank needs at least one trajectory")
        for t in self.trajectories:
            if t.conf.ndim != 2 or t.conf.shape[1] != self.gamma or len(t.conf) == 0:
                raise ValueError(f"trajectory confidences must be [rounds>0, {self.gamma}]")
            if t.accepted.shape != (len(t.conf),):
                raise ValueError("one accepted length per round")

    def conditional_acceptance(self) -> list[float]:
        """Paper Fig. 2 metric: P(draft k accepted | drafts < k accepted), pooled over rounds."""
        n = np.concatenate([t.accepted for t in self.trajectories])
        return [
            float((n >= k).sum() / max((n >= k - 1).sum(), 1)) for k in range(1, self.gamma + 1)
        ]

    def accept_length(self) -> float:
        """Mean committed tokens per round under verify-all (accepted + bonus)."""
        return float(np.mean(np.concatenate([t.accepted for t in self.trajectories])) + 1.0)

    def confidence_quality(self) -> list[dict[str, float]]:
        """Per position over the rounds at risk (earlier drafts accepted): ROC-AUC and ECE
        (10 bins) of the confidence against acceptance."""
        conf = np.concatenate([t.conf for t in self.trajectories])
        n = np.concatenate([t.accepted for t in self.trajectories])
        out = []
        for k in range(self.gamma):
            risk = n >= k
            c, y = conf[risk, k], (n[risk] > k).astype(float)
            out.append({"auc": _auc(c, y), "ece": _ece(c, y), "rounds": int(risk.sum())})
        return out

    def to_jsonl(self, path: Path, meta: dict[str, Any] | None = None) -> None:
        head = {"kind": "dspark-rounds", "gamma": self.gamma, "source": self.source}
        lines = [json.dumps(head | (meta or {}))]
        for t in self.trajectories:
            lines.append(
                json.dumps(
                    {
                        "conf": np.round(t.conf, 6).tolist(),
                        "accepted": t.accepted.astype(int).tolist(),
                    }
                )
            )
        path.write_text("\n".join(lines) + "\n")

    @staticmethod
    def from_jsonl(path: Path) -> TraceBank:
        rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        if not rows or rows[0].get("kind") != "dspark-rounds":
            raise ValueError(f"{path}: not a dspark-rounds trace (first line is its header)")
        gamma = int(rows[0]["gamma"])
        trajs = tuple(
            Trajectory(np.asarray(r["conf"], np.float64), np.asarray(r["accepted"], np.int64))
            for r in rows[1:]
            if r["accepted"]
        )
        return TraceBank(gamma, trajs, str(rows[0].get("source", path)))


def _auc(score: np.ndarray, y: np.ndarray) -> float:
    """ROC-AUC by the rank-sum statistic, ties at their average rank."""
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if not n_pos or not n_neg:
        return float("nan")
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    start = np.concatenate(([0], np.cumsum(counts)[:-1]))
    ranks = (start + (counts + 1) / 2.0)[inverse]
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _ece(conf: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    if conf.size == 0:
        return float("nan")
    idx = np.minimum((conf * bins).astype(int), bins - 1)
    err = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            err += m.sum() * abs(conf[m].mean() - y[m].mean())
    return float(err / conf.size)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _logit(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(np.asarray(p, np.float64), 1e-9, 1 - 1e-9)
    return np.log(p) - np.log1p(-p)


@dataclass(frozen=True)
class SyntheticSpec:
    """Synthetic rounds: logit q[t, k] = b_k + s_t + pos_noise·ε; the confidence head sees
    sigmoid(b_k + s_t), not ε. s_t = scale·(sqrt(w)·u_request + sqrt(1-w)·z_t), z an AR(1) with
    coefficient rho. b_k is fitted so the pooled conditional acceptance equals `rates`."""

    rates: tuple[float, ...]
    scale: float = 1.0
    request_weight: float = 0.5
    rho: float = 0.8
    pos_noise: float = 0.7


def synthetic_bank(
    spec: SyntheticSpec,
    gamma: int,
    rng: np.random.Generator,
    num_trajectories: int = 256,
    rounds: int = 256,
    iters: int = 30,
) -> TraceBank:
    rates = np.asarray((*spec.rates, *[spec.rates[-1]] * gamma)[:gamma], np.float64)
    shape = (num_trajectories, rounds)
    u = rng.standard_normal(num_trajectories)[:, None]
    z = np.empty(shape)
    z[:, 0] = rng.standard_normal(num_trajectories)
    eps = rng.standard_normal(shape)
    for t in range(1, rounds):
        z[:, t] = spec.rho * z[:, t - 1] + math.sqrt(1 - spec.rho**2) * eps[:, t]
    w = spec.request_weight
    s = spec.scale * (math.sqrt(w) * u + math.sqrt(1 - w) * z)  # [traj, rounds]
    noise = spec.pos_noise * rng.standard_normal((*shape, gamma))
    draws = rng.random((*shape, gamma))
    b = _logit(rates).copy()

    def realise(bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        known = bias[None, None, :] + s[..., None]
        hit = draws < _sigmoid(known + noise)
        return known, np.cumprod(hit, axis=2).sum(axis=2)

    for _ in range(iters):  # common random numbers: a deterministic fixed-point on b
        _, n = realise(b)
        for k in range(gamma):
            at_risk = max(int((n >= k).sum()), 1)
            emp = np.clip((n >= k + 1).sum() / at_risk, 1e-4, 1 - 1e-4)
            b[k] += float(_logit(rates[k]) - _logit(emp))
    known, n = realise(b)
    conf = _sigmoid(known)
    trajs = tuple(Trajectory(conf[i], n[i].astype(np.int64)) for i in range(num_trajectories))
    return TraceBank(gamma, trajs, f"synthetic{tuple(round(x, 3) for x in rates)}")


# -- cost model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Linear:
    """a + b·x seconds."""

    a: float = 0.0
    b: float = 0.0

    def __call__(self, x: float) -> float:
        return self.a + self.b * x

    @staticmethod
    def parse(text: str) -> Linear:
        parts = [float(x) for x in text.split(",")]
        if len(parts) not in (1, 2) or min(parts) < 0:
            raise ValueError(f"expected A[,B] seconds >= 0, got {text!r}")
        return Linear(*parts)


def _product(a: Curve, b: Curve) -> Curve:
    """a(x) · b(x) at the union of their knots (linear in between), each flat outside its own
    knots as the live scale reads them."""
    ks = sorted({*a.knots, *b.knots})
    return Curve(
        tuple(ks),
        tuple(float(np.interp(k, a.knots, a.values) * np.interp(k, b.knots, b.values)) for k in ks),
    )


@dataclass(frozen=True)
class CostModel:
    """Step seconds = target forward T(R, B, ctx) from the profile + host overhead(R) every step
    + drafter(R_draft) on steps that draft + prefill(tokens) on steps with prompt tokens (the
    profile CLI times decode/verify forwards of the target only)."""

    capacity: CapacityModel
    overhead: Linear = Linear()
    draft: Linear = Linear()
    prefill: Linear = Linear()  # extra seconds (may be < 0) of a forward carrying prompt tokens

    def step_seconds(
        self, num_reqs: int, num_tokens: int, ctx: int, num_drafting: int, prefill_tokens: int = 0
    ) -> float:
        t = self.capacity.predict(num_reqs, num_tokens, ctx) + self.overhead(num_reqs)
        if num_drafting:
            t += self.draft(num_drafting)
        if prefill_tokens:
            # The excess may be negative (a prompt token needs no logits, a verify token does),
            # but a prompt chunk never makes the step cheaper than the step without it.
            rest = max(num_tokens - prefill_tokens, 1)
            floor = t - self.capacity.predict(num_reqs, num_tokens, ctx)
            floor += self.capacity.predict(num_reqs, rest, ctx)
            t = max(t + self.prefill(prefill_tokens), floor)
        return t

    def slowed(self, factor: float, forward: Curve | None = None) -> CostModel:
        """Every term × `factor`: the same engine on a host running at 1 / factor of the speed
        the terms were measured at (validate's host speed index). `forward`: the target
        forward's factor by batch tokens instead (flat outside its knots, as the live scale); a
        slow spell of this host slowed a B = 1 forward 1.4x more than B >= 4 ones."""
        if factor <= 0 or (forward is not None and min(forward.values) <= 0):
            raise ValueError(f"speed factor must be > 0, got {factor} / {forward}")
        cap = self.capacity
        by = forward if forward is not None else Curve((1.0,), (factor,))
        cap = replace(cap, scale=by if cap.scale is None else _product(cap.scale, by))
        if cap.host is not None:
            cap = replace(
                cap, host=Curve(cap.host.knots, tuple(v * factor for v in cap.host.values))
            )
        if cap.draft is not None:
            cap = replace(
                cap, draft=Curve(cap.draft.knots, tuple(v * factor for v in cap.draft.values))
            )

        def times(f: Linear) -> Linear:
            return Linear(f.a * factor, f.b * factor)

        return CostModel(cap, times(self.overhead), times(self.draft), times(self.prefill))

    def prefill_seconds(self, prompt_len: int) -> float:
        """One prompt prefilled alone (the PD prefill side)."""
        alone = self.capacity.predict(1, prompt_len, prompt_len)
        return max(alone + self.prefill(prompt_len), self.capacity.predict(1, 1, prompt_len))

    def planning_model(self) -> CapacityModel:
        """What the engine's live estimator converges to: the profile with the per-step host
        overhead as the model's host term and the drafter as its draft term (the engine times
        its forward, so it learns the two apart)."""
        model = self.capacity
        if self.draft.a or self.draft.b:
            model = replace(
                model, draft=Curve((1.0, 4096.0), (self.draft(1.0), self.draft(4096.0)))
            )
        if self.overhead.a or self.overhead.b:
            model = replace(
                model, host=Curve((1.0, 4096.0), (self.overhead(1.0), self.overhead(4096.0)))
            )
        return model


def with_ep_size(model: CapacityModel, ep: int) -> CapacityModel:
    """The same profile at another EP degree: experts re-partitioned over `ep` ranks (the
    busiest rank's expected load changes); the per-rank cost curve is kept as profiled."""
    if model.moe is None:
        raise ValueError("the profile has no MoE term; --ep-size needs one")
    if model.moe.num_experts % ep:
        raise ValueError(f"{model.moe.num_experts} experts do not split over {ep} ranks")
    return replace(model, moe=replace(model.moe, ep_size=ep))


# -- policies --------------------------------------------------------------------------------
class Policy:
    """One verify-length rule. plan() sees this step's confidences; only the oracle reads the
    realised accepted lengths."""

    name = "policy"
    speculative = True
    ran_drafter = True  # False after a plan() that skipped the drafter (engine lagged K = 0)
    drafted_rows: int | None = None  # rows the drafter ran on in the last plan(); None = all

    def plan(
        self,
        ids: list[int],
        conf: np.ndarray,
        accepted: np.ndarray,
        max_len: np.ndarray,
        ctx: int,
    ) -> np.ndarray:
        raise NotImplementedError

    def observe(self, lengths: np.ndarray, accepted: np.ndarray, ids: list[int]) -> None:
        pass


class NoSpec(Policy):
    name = SPEC_FREE
    speculative = False

    def plan(
        self,
        ids: list[int],
        conf: np.ndarray,
        accepted: np.ndarray,
        max_len: np.ndarray,
        ctx: int,
    ) -> np.ndarray:
        return np.zeros(len(ids), np.int64)


class ServingPolicy(Policy):
    """A `--schedule-mode` exactly as the engine runs it: its VerifyPlanner (survival history,
    acceptance prior for fresh requests), overlap off so the lag is exactly L steps."""

    def __init__(
        self,
        mode: str,
        gamma: int,
        capacity: CapacityModel,
        min_user_tps: float,
        selective: bool = True,
        lag_shrink: bool = False,
    ) -> None:
        self.name = mode
        m = parse_schedule_mode(mode)
        needs = m.name in ("sync", "lagged")
        self.planner = VerifyPlanner(
            m,
            gamma,
            capacity if needs else None,
            None,
            False,
            min_user_tps,
            False,
            selective,
            lag_shrink=lag_shrink,
        )

    def plan(
        self,
        ids: list[int],
        conf: np.ndarray,
        accepted: np.ndarray,
        max_len: np.ndarray,
        ctx: int,
    ) -> np.ndarray:
        k = None
        self.ran_drafter, self.drafted_rows = True, None
        if self.planner.plans_before_drafting:  # as LLMEngine._draft: K first, then drafts
            k = self.planner.budget(ids, max_len, ctx)
            if k == 0 and not self.planner.should_probe():
                self.ran_drafter = False
                return self.planner.skip(ids, max_len, ctx).lengths
            # a probe drafts a few rows only, a selective K > 0 step the rows K admits
            if k == 0:
                keep = self.planner.probe_rows(len(ids))
            else:
                keep = self.planner.draft_rows(ids, k, max_len)
            if keep is not None and keep.size < len(ids):
                self.drafted_rows = int(keep.size)
                sub_ctx = round(ctx * keep.size / len(ids))  # the subset's share of the context
                sub = self.planner.plan(
                    [ids[i] for i in keep],
                    _logit(conf[keep]),
                    max_len[keep],
                    sub_ctx,
                    k,
                    (ids, max_len, ctx),
                ).lengths
                lens = np.zeros(len(ids), np.int64)
                lens[keep] = sub
                return lens
        return self.planner.plan(ids, _logit(conf), max_len, ctx, k).lengths

    def observe(self, lengths: np.ndarray, accepted: np.ndarray, ids: list[int]) -> None:
        self.planner.observe_acceptance(lengths, accepted, ids)


class _SpsPolicy(Policy):
    def __init__(self, name: str, gamma: int, capacity: CapacityModel) -> None:
        self.name, self.gamma, self.capacity = name, gamma, capacity

    def sps(self, r: int, ctx: int) -> np.ndarray:
        return self.capacity.sps_array(r, r * (self.gamma + 1), ctx)


class Retrospective(_SpsPolicy):
    """Lag 0: the unconstrained global K on this step's own survival (paper App. A's biased
    scheduler; in a simulator with exogenous acceptance only its throughput is meaningful)."""

    def plan(
        self,
        ids: list[int],
        conf: np.ndarray,
        accepted: np.ndarray,
        max_len: np.ndarray,
        ctx: int,
    ) -> np.ndarray:
        surv = survival(conf)
        k = lagged_global_k(surv, self.sps(len(ids), ctx), max_len=max_len)
        return assign_top_k(surv, k, max_len=max_len)


class Oracle(_SpsPolicy):
    """Clairvoyant bound (algo.verify_budget.oracle): knows each round's accepted length."""

    def plan(
        self,
        ids: list[int],
        conf: np.ndarray,
        accepted: np.ndarray,
        max_len: np.ndarray,
        ctx: int,
    ) -> np.ndarray:
        return oracle(accepted, self.gamma, self.sps(len(ids), ctx), max_len=max_len)


class Frozen(Policy):
    """Freeze-verification-length ablation: a constant budget of `per_req` drafts per request
    (K = round(per_req·R) each step). ranked=False spreads it evenly (draft quality alone);
    ranked=True admits the top-K by live survival (confidence allocation, no load adaptation)."""

    def __init__(self, per_req: float, ranked: bool) -> None:
        self.per_req, self.ranked = per_req, ranked
        self.name = f"frozen-{'topk' if ranked else 'uniform'}:{per_req:.2f}"

    def plan(
        self,
        ids: list[int],
        conf: np.ndarray,
        accepted: np.ndarray,
        max_len: np.ndarray,
        ctx: int,
    ) -> np.ndarray:
        k = round(self.per_req * len(ids))
        surv = survival(conf) if self.ranked else np.ones_like(conf)
        return assign_top_k(surv, k, max_len=max_len)


def make_policy(
    name: str, gamma: int, capacity: CapacityModel, min_user_tps: float = 0.0
) -> Policy:
    """no-spec | oracle | lagged:0 | frozen-uniform:X | frozen-topk:X | any --schedule-mode;
    MODE@shrink: that mode with LagShrink applied to its lagged K (--enable-lag-shrink)."""
    if name == SPEC_FREE:
        return NoSpec()
    if name == "oracle":
        return Oracle(name, gamma, capacity)
    if name == "lagged:0":
        return Retrospective(name, gamma, capacity)
    if name.startswith("frozen-"):
        kind, _, x = name.partition(":")
        return Frozen(float(x), ranked=kind == "frozen-topk")
    mode, _, variant = name.partition("@")
    if variant not in ("", SHRINK):
        raise ValueError(f"policy {name!r}: unknown variant {variant!r} (known: {SHRINK})")
    policy = ServingPolicy(mode, gamma, capacity, min_user_tps, lag_shrink=variant == SHRINK)
    policy.name = name
    return policy


# -- the simulation --------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Request lengths: explicit lists (cycled) or uniform in [len·ratio, len]; each request
    replays a random trajectory from a random round, or (pinned) trajectory i from round 0."""

    input_len: int = 1024
    output_len: int = 256
    range_ratio: float = 0.5
    prompt_lens: tuple[int, ...] = ()
    output_lens: tuple[int, ...] = ()
    pinned: bool = False  # request i replays trajectory i (from its first round): same prompts

    def lengths(self, i: int, rng: np.random.Generator) -> tuple[int, int]:
        if self.prompt_lens:
            n = len(self.prompt_lens)
            return self.prompt_lens[i % n], self.output_lens[i % len(self.output_lens)]
        lo_in = max(1, int(self.input_len * self.range_ratio))
        lo_out = max(2, int(self.output_len * self.range_ratio))
        p = int(rng.integers(lo_in, self.input_len + 1))
        return p, int(rng.integers(lo_out, self.output_len + 1))


@dataclass(frozen=True)
class SimConfig:
    concurrency: int  # closed loop: users, each sends its next request when one finishes
    num_requests: int
    mode: str = "pd"  # pd: prompts prefilled elsewhere; colocated: prefill rows in the step
    request_rate: float = math.inf  # finite: open-loop Poisson arrivals (concurrency = users cap)
    max_running: int | None = None  # decode worker's running cap (default: concurrency)
    chunked_prefill: int = 512
    prefill_workers: int = 0  # pd: 0 = prefill never queues (only adds its latency to TTFT)
    handoff_s: float = 0.0
    warmup_completions: int | None = None  # window starts after this many (default: concurrency)
    planner_all_rows: bool = False  # True: the planner also counts rows that verify nothing
    seed: int = 0


@dataclass
class _Req:
    rid: int
    arrival: float
    prompt_len: int
    output_len: int
    traj: int
    cursor: int
    ready: float = 0.0
    first: float = math.nan
    done: float = math.nan
    generated: int = 0
    prefill_left: int = 0


@dataclass
class SimResult:
    policy: str
    concurrency: int
    output_throughput: float  # tok/s over the steady window
    mean_tps_per_user: float
    median_tps_per_user: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    accept_length: float  # committed tokens per verify round
    verify_tokens_per_request: float  # mean 1 + l over drafting rows (Fig. 8 budget)
    mean_verify_budget_k: float  # mean K = sum l per step
    mean_step_ms: float
    mean_running: float
    steps: int
    completed: int
    window_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        return d | self.extra


def simulate(
    cost: CostModel,
    policy: Policy,
    bank: TraceBank,
    workload: Workload,
    cfg: SimConfig,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> SimResult:
    """Run one (policy, load) point to `cfg.num_requests` completions; deterministic per seed."""
    rng = np.random.default_rng(cfg.seed)
    gamma = bank.gamma
    max_running = cfg.max_running or cfg.concurrency
    open_loop = math.isfinite(cfg.request_rate)
    reqs: list[_Req] = []
    events: list[tuple[float, int]] = []  # (ready time at the decode worker, rid)
    prefill_free = [0.0] * max(cfg.prefill_workers, 0)
    first_tokens: list[float] = []  # pd: first tokens come from the prefill side

    def new_request(t: float) -> None:
        i = len(reqs)
        p, o = workload.lengths(i, rng)
        if workload.pinned:
            tj, cur = i % len(bank.trajectories), 0
        else:
            tj = int(rng.integers(len(bank.trajectories)))
            cur = int(rng.integers(len(bank.trajectories[tj].accepted)))
        r = _Req(i, t, p, max(o, 1), tj, cur)
        if cfg.mode == "pd":  # prefill elsewhere: first token at handoff
            dur = cost.prefill_seconds(p)
            start = t
            if prefill_free:
                w = int(np.argmin(prefill_free))
                start = max(t, prefill_free[w])
                prefill_free[w] = start + dur
            r.first = start + dur
            r.generated = 1
            first_tokens.append(r.first)
            r.ready = r.first + cfg.handoff_s
        else:
            r.ready, r.prefill_left = t, p
        reqs.append(r)
        heapq.heappush(events, (r.ready, i))

    if open_loop:
        t = 0.0
        for _ in range(cfg.num_requests):
            new_request(t)
            t += float(rng.exponential(1.0 / cfg.request_rate))
    else:
        for _ in range(min(cfg.concurrency, cfg.num_requests)):
            new_request(0.0)

    now, running, waiting = 0.0, [], []
    completions: list[float] = []
    steps: list[tuple[float, float, int, int, int, int, int]] = []  # end, dt, tok, R, Rd, K, B
    rounds = committed_total = 0
    while len(completions) < cfg.num_requests:
        while events and events[0][0] <= now + 1e-12:
            waiting.append(reqs[heapq.heappop(events)[1]])
        while waiting and len(running) < max_running:
            running.append(waiting.pop(0))
        if not running:
            if not events:
                break
            now = events[0][0]
            continue
        # Rows of this step: running decoders (anchor + drafts) and prefill chunks.
        decoding = [r for r in running if r.prefill_left == 0]
        prefill = [r for r in running if r.prefill_left > 0]
        caps = [min(gamma, r.output_len - r.generated - 1) for r in decoding]
        drafting = [r for r, c in zip(decoding, caps, strict=True) if c > 0]
        lens = np.zeros(0, np.int64)
        acc_full = np.zeros(0, np.int64)
        if policy.speculative and drafting:
            # The engine plans over the drafting rows only (caps > 0); planner_all_rows also
            # shows it the decode rows that verify nothing, so B = R + K counts every row.
            rows = decoding if cfg.planner_all_rows else drafting
            cap_of = np.array(caps if cfg.planner_all_rows else [c for c in caps if c > 0])
            conf = np.stack([bank.trajectories[r.traj].conf[r.cursor] for r in rows])
            acc_full = np.array([bank.trajectories[r.traj].accepted[r.cursor] for r in rows])
            ctx = sum(r.prompt_len + r.generated for r in rows)
            plan = policy.plan([r.rid for r in rows], conf, acc_full, cap_of.astype(np.int64), ctx)
            keep = cap_of > 0
            lens, acc_full = np.asarray(plan, np.int64)[keep], acc_full[keep]
        ell = {r.rid: int(x) for r, x in zip(drafting, lens, strict=False)}  # empty: no-spec
        chunks = {r.rid: min(r.prefill_left, cfg.chunked_prefill) for r in prefill}
        num_tokens = sum(1 + ell.get(r.rid, 0) for r in decoding) + sum(chunks.values())
        kv = sum(r.prompt_len + r.generated + ell.get(r.rid, 0) for r in decoding)
        kv += sum(r.prompt_len - r.prefill_left + chunks[r.rid] for r in prefill)
        n_draft = len(drafting) if policy.speculative else 0
        if not policy.ran_drafter:
            n_draft = 0  # the engine's lagged K = 0: a plain decode step, drafter not run
        elif policy.drafted_rows is not None:
            n_draft = policy.drafted_rows  # a lagged probe drafts a few rows
        dt = cost.step_seconds(len(running), num_tokens, kv, n_draft, sum(chunks.values()))
        now += dt
        emitted = 0
        acc_real = np.minimum(acc_full, lens) if len(lens) else lens
        row = {r.rid: i for i, r in enumerate(drafting)} if len(lens) else {}
        for r in decoding:
            i = row.get(r.rid)
            k = min((int(acc_real[i]) if i is not None else 0) + 1, r.output_len - r.generated)
            if i is not None:
                rounds += 1
                committed_total += k
                r.cursor = (r.cursor + 1) % len(bank.trajectories[r.traj].accepted)
            r.generated += k
            emitted += k
        for r in prefill:
            r.prefill_left -= chunks[r.rid]
            if r.prefill_left == 0:
                r.first, r.generated = now, 1
                emitted += 1
        if policy.speculative and len(lens):
            policy.observe(lens, acc_real, [r.rid for r in drafting])
        k_sum = int(lens.sum()) if len(lens) else 0
        steps.append((now, dt, emitted, len(running), len(drafting), k_sum, num_tokens))
        if on_step is not None:
            on_step({"t": now, "dt": dt, "R": len(running), "B": num_tokens, "K": k_sum})
        still = []
        for r in running:
            if r.prefill_left == 0 and r.generated >= r.output_len:
                r.done = now
                completions.append(now)
                if not open_loop and len(reqs) < cfg.num_requests:
                    new_request(now)
            else:
                still.append(r)
        running = still
    return _summarize(
        policy.name, cfg, reqs, completions, steps, rounds, committed_total, first_tokens
    )


def _summarize(
    name: str,
    cfg: SimConfig,
    reqs: list[_Req],
    completions: list[float],
    steps: list[tuple[float, float, int, int, int, int, int]],
    rounds: int,
    committed: int,
    first_tokens: list[float],
) -> SimResult:
    warm = cfg.concurrency if cfg.warmup_completions is None else cfg.warmup_completions
    done = sorted(completions)
    t0 = done[min(warm, len(done)) - 1] if warm > 0 and done else 0.0
    t1 = max(r.arrival for r in reqs)
    if t1 <= t0:  # too few requests for a steady window: use the whole run
        t0, t1 = 0.0, done[-1] if done else 1.0
    arr = np.array(steps, np.float64) if steps else np.zeros((0, 7))
    end, dt = arr[:, 0], arr[:, 1]
    in_win = (end > t0) & (end <= t1)  # a step's tokens count at its end
    tokens = float(arr[in_win, 2].sum())
    tokens += sum(1 for t in first_tokens if t0 < t <= t1)
    fin = [r for r in reqs if not math.isnan(r.done)]
    steady = [r for r in fin if r.arrival >= t0 and r.done <= t1] or fin
    tps = [
        (r.generated - 1) / (r.done - r.first)
        for r in steady
        if r.generated > 1 and r.done > r.first
    ]
    tpot = [(r.done - r.first) / (r.generated - 1) for r in steady if r.generated > 1]
    drafting = arr[in_win, 4]
    budget = (
        float(((drafting + arr[in_win, 5]) / np.maximum(drafting, 1))[drafting > 0].mean())
        if (drafting > 0).any()
        else 1.0
    )
    return SimResult(
        policy=name,
        concurrency=cfg.concurrency,
        output_throughput=tokens / (t1 - t0),
        mean_tps_per_user=float(np.mean(tps)) if tps else 0.0,
        median_tps_per_user=float(np.median(tps)) if tps else 0.0,
        mean_ttft_ms=1e3 * float(np.mean([r.first - r.arrival for r in fin])) if fin else 0.0,
        mean_tpot_ms=1e3 * float(np.mean(tpot)) if tpot else 0.0,
        accept_length=committed / rounds if rounds else 1.0,
        verify_tokens_per_request=budget,
        mean_verify_budget_k=float(arr[in_win, 5].mean()) if in_win.any() else 0.0,
        mean_step_ms=1e3 * float(dt[in_win].mean()) if in_win.any() else 0.0,
        mean_running=float(arr[in_win, 3].mean()) if in_win.any() else 0.0,
        steps=len(steps),
        completed=len(fin),
        window_s=t1 - t0,
    )


def run_point(
    cost: CostModel,
    policy_name: str,
    bank: TraceBank,
    workload: Workload,
    cfg: SimConfig,
    min_user_tps: float = 0.0,
) -> SimResult:
    """A fresh policy (the planner keeps state) on one load point."""
    policy = make_policy(policy_name, bank.gamma, cost.planning_model(), min_user_tps)
    return simulate(cost, policy, bank, workload, cfg)


def grid(
    cost: CostModel,
    policies: Sequence[str],
    bank: TraceBank,
    workload: Workload,
    concurrencies: Sequence[int],
    make_cfg: Callable[[int], SimConfig],
    progress: Callable[[str], None] | None = None,
) -> list[SimResult]:
    out = []
    for c in concurrencies:
        for p in policies:
            res = run_point(cost, p, bank, workload, make_cfg(c))
            if progress is not None:
                progress(
                    f"c={c:<4d} {p:<14s} {res.output_throughput:10.1f} tok/s  "
                    f"{res.mean_tps_per_user:8.1f} tok/s/user  budget "
                    f"{res.verify_tokens_per_request:4.2f}"
                )
            out.append(res)
    return out
