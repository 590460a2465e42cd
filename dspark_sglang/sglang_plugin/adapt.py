"""SGLang's planner state <-> our policy (docs/sglang.md §2). `BudgetPlanner` is engine/planner.py's
lagged path for one scheduler process: lagged survival (fresh requests from the acceptance prior)
-> `lagged_global_k` priced by the ceil-bucket capacity model -> SGLang's `VerifyBudgetDecision`.
SGLang's GPU top-K then ranks the live survival exactly like `assign_top_k`. Knows no SGLang dotted
path: hooks.py hands in SGLang's classes and the rank's facts."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dspark_sglang.algo.capacity import CapacityModel
from dspark_sglang.algo.survival import AcceptancePrior, survival
from dspark_sglang.algo.verify_budget import assign_top_k, expected_throughput, lagged_global_k
from dspark_sglang.sglang_convert import rebase_buckets
from dspark_sglang.sglang_plugin.control import Metrics, PluginConfig
from dspark_sglang.sglang_plugin.live_model import LiveModel, ModelUpdate, StagedProfile
from dspark_sglang.types import StepRecord

log = logging.getLogger("dspark_sglang.sglang_plugin")
MAX_STEP_SECONDS = 1.0  # a longer host interval spans an idle gap, not a step


@dataclass(frozen=True, slots=True)
class Decision:
    budget: int  # SGLang's K: drafts admitted above the per-request floor
    seconds: float  # predicted step time of B = R·floor + budget (+ R anchor rows)
    theta: float  # predicted tokens/s on the lagged survival
    version: int


def load_model(cfg: PluginConfig, sglang_table: dict[str, Any] | None) -> CapacityModel:
    """The prior: DSPARK_SGLANG_PROFILE, else the table SGLang loaded from its own flag."""
    from dspark_sglang.sglang_convert import read_capacity_model, sps_to_model

    if cfg.profile:
        return read_capacity_model(cfg.profile)
    table = sglang_table or {}
    if len(set(table.get("sample_steps_per_sec", ()))) == 1:
        log.warning("dspark: flat SPS table; K = verify-all until the live model learns")
    return sps_to_model(table)


class BudgetPlanner:
    """Our state for one scheduler process. Every TP rank of an attention group holds an equal
    copy: it changes only through inputs that are equal there (lagged confidences, accepted
    lengths, broadcast model updates and /set_internal_state requests)."""

    def __init__(
        self,
        cfg: PluginConfig,
        schedule_cfg: Any,  # SGLang's DSparkScheduleConfig
        model: CapacityModel,
        *,
        leader: bool,
        tiers: tuple[int, ...] = (),
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
    ) -> None:
        self.cfg, self.gamma = cfg, int(schedule_cfg.gamma)
        self.floor = max(int(schedule_cfg.min_verify_len), 1) - 1  # forced drafts per request
        self.max_len = min(int(schedule_cfg.resolved_max_verify_len()) - 1, self.gamma)
        self.eps = float(schedule_cfg.survival_eps)
        self.min_user_tps = cfg.min_user_tps
        self.leader, self.tiers = leader, tiers  # SGLang's captured verify graph sizes
        model = rebase_buckets(model, tiers)  # price what this engine replays
        self.live = LiveModel(model, leader=leader, live=cfg.live, publish_every=cfg.publish_every)
        self.prior = AcceptancePrior.uniform(self.gamma)
        self.staged_profile: CapacityModel | str | None = None
        self.ctx = 0  # KV tokens of the batch being planned (sum of seq_lens)
        self.last: Decision | None = None
        self.steps = self.k_sum = 0
        self.fallbacks: dict[str, int] = {}
        self._clock, self._metrics = clock, metrics
        self._stamp: float | None = None

    # ---- planning (scheduler thread, before each decode launch) --------------------------------

    def note_batch(self, kv_tokens: int) -> None:
        self.ctx = int(kv_tokens)

    def budget(self, lagged_conf: np.ndarray, known: np.ndarray) -> Decision:
        """K from confidences published `lag` steps ago (paper §5.2); rows not `known` (fresh or
        reused slots) take the acceptance prior instead of SGLang's survival = 1."""
        r = lagged_conf.shape[0]
        surv = survival(lagged_conf)
        surv[~known] = self.prior.survival
        surv[surv < self.eps] = 0.0  # SGLang's top-K never admits these
        model = self.live.model
        sps = model.sps_array(r, r * (self.gamma + 1), self.ctx)
        min_len = self.floor or None
        k = lagged_global_k(
            surv, sps, min_len=min_len, max_len=self.max_len, min_user_tps=self.min_user_tps
        )
        lens = assign_top_k(surv, k, min_len=min_len, max_len=self.max_len)
        b = r + int(lens.sum())
        self.last = Decision(
            budget=max(0, k - r * self.floor),
            seconds=model.predict(r, b, self.ctx),
            theta=expected_throughput(surv, lens, sps),
            version=model.version,
        )
        self.steps += 1
        self.k_sum += self.last.budget
        return self.last

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if self._metrics is not None:
            self._metrics.fallbacks.labels(reason).inc()

    # ---- observation ---------------------------------------------------------------------------

    def reset_clock(self) -> None:
        self._stamp = None

    def observe_step(self, bs: int, budget: int | None, graph_tokens: int | None) -> None:
        """After each verify step: the host interval since the previous one is this step's time
        (the SPS profiler's measure), at the size SGLang executed; only the leader keeps it."""
        now, prev = self._clock(), self._stamp
        self._stamp = now
        if budget is None or graph_tokens is None:  # uniform full-width verify this step
            self.fallback("verify_all" if budget is None else "graph_grid")
        seconds = math.inf if prev is None else now - prev
        if not self.leader or not 0.0 < seconds <= MAX_STEP_SECONDS:
            return
        tokens = graph_tokens or bs * (self.max_len + 1)
        rec = StepRecord(
            step=self.steps,
            num_reqs=bs,
            num_tokens=tokens,
            num_prefill_tokens=0,
            num_decode_reqs=bs,
            kv_tokens=self.ctx + tokens,
            step_seconds=seconds,
            verify_budget_k=-1 if budget is None else budget,
            capacity_version=self.live.model.version,
        )
        self.live.observe(rec)
        if self._metrics is not None:
            self._metrics.record(rec, self.live)

    def observe_acceptance(self, verify_rows: np.ndarray | None, accepted: np.ndarray) -> None:
        """Realised acceptance -> the fresh-request prior. verify_rows are SGLang's per-request
        verify lengths including the anchor row (None: every draft was verified)."""
        acc = np.asarray(accepted, np.int64)
        if acc.size == 0:
            return
        lens = (
            np.full(acc.size, self.max_len, np.int64)
            if verify_rows is None
            else np.clip(np.asarray(verify_rows, np.int64)[: acc.size] - 1, 0, self.gamma)
        )
        self.prior = self.prior.observe(lens, np.clip(acc, 0, lens))

    # ---- control (every rank, same loop point) -------------------------------------------------

    def receive(self, msg: ModelUpdate | StagedProfile) -> None:
        if isinstance(msg, ModelUpdate):
            self.live.apply(msg)
        else:
            self.staged_profile = msg.model if msg.model is not None else msg.error

    def stage_profile(self) -> StagedProfile:
        """Leader: read DSPARK_SGLANG_PROFILE now, for broadcast with the reload request."""
        from dspark_sglang.sglang_convert import read_capacity_model

        if not self.cfg.profile:
            return StagedProfile(None, "DSPARK_SGLANG_PROFILE is not set on this server")
        try:
            return StagedProfile(read_capacity_model(self.cfg.profile))
        except Exception as e:  # any unreadable file must refuse on every rank alike
            return StagedProfile(None, f"cannot load {self.cfg.profile}: {e}")

    def apply_staged_profile(self) -> None:
        model, self.staged_profile = self.staged_profile, None
        if isinstance(model, CapacityModel):
            self.live.reset(rebase_buckets(model, self.tiers))
            log.info("dspark: capacity profile reloaded from %s", self.cfg.profile)

    def set_min_user_tps(self, value: float) -> None:
        self.min_user_tps = value

    def snapshot(self) -> dict[str, Any]:
        """The /server_info block: what K is, what the model predicts, how well it does."""
        live, k = self.live, None if self.last is None else self.last.budget
        num = lambda x: round(float(x), 6) if x is not None and math.isfinite(x) else None
        return dict(
            active=True, leader=self.leader, profile=self.cfg.profile, frozen=live.frozen,
            capacity_version=live.model.version, capacity_kind=live.model.form.kind,
            tiers=list(live.model.form.buckets), min_user_tps=self.min_user_tps,
            planned_steps=self.steps, k_last=k, k_mean=num(self.k_sum / max(self.steps, 1)),
            predicted_step_ms=num(live.last_predicted * 1e3),
            measured_step_ms=num(live.last_measured * 1e3), mape=num(live.mape),
            drift_events=live.drift_events, fallbacks=dict(self.fallbacks),
            prior_rates=[round(x, 4) for x in self.prior.rates],
        )  # fmt: skip


def make_planner_class(
    base: type, decision_cls: type, attach: Callable[[Any], BudgetPlanner]
) -> type:
    """A subclass of SGLang's HostConfidenceBudgetPlanner whose budget is ours. It keeps SGLang's
    lag/carry ring and generation check (which confidences are `lag` steps old and whose)."""

    class DsparkBudgetPlanner(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.dspark = attach(self)

        def compute_budget(
            self,
            *,
            confidence: torch.Tensor,
            generation: torch.Tensor,
            current_generation: torch.Tensor,
            req_pool_indices_cpu: torch.Tensor,
        ) -> int:
            conf, gen = self._shift_to_lag(
                confidence=confidence,
                generation=generation,
                req_pool_indices_cpu=req_pool_indices_cpu,
            )
            cur = current_generation.to(torch.int64)
            known = ((cur >= 1) & (gen.to(torch.int64) == cur)).numpy()
            if self.forced_budget_frac is not None:  # the SPS profiler's pinned K
                self.dspark.fallback("forced_budget_frac")
                full = conf[:, : self.cfg.resolved_max_verify_len()].numel()
                self.last_decision = decision_cls(
                    budget=max(0, int(self.forced_budget_frac * full))
                )
                return self.last_decision.budget
            d = self.dspark.budget(conf.to(torch.float64).numpy(), known)
            self.last_decision = decision_cls(
                budget=d.budget, predicted_step_seconds=d.seconds, predicted_theta=d.theta
            )
            return d.budget

    DsparkBudgetPlanner.__init__.__wrapped__ = base.__init__  # type: ignore[attr-defined]
    return DsparkBudgetPlanner
