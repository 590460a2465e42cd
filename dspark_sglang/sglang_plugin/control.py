"""The plugin's control surface (docs/sglang.md §3): its settings (environment variables, read once
per process), the extra `/set_internal_state` keys, the `/server_info` block and the Prometheus
series. Knows no SGLang names: hooks.py passes in SGLang's rejection exception."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dspark_sglang.config import ConfigError

if TYPE_CHECKING:
    from dspark_sglang.sglang_plugin.adapt import BudgetPlanner
    from dspark_sglang.sglang_plugin.live_model import LiveModel
    from dspark_sglang.types import StepRecord

ENV_PREFIX = "DSPARK_SGLANG_"
KEY_RELOAD = "dspark_profile_reload"  # 1: every rank swaps to the profile rank 0 re-read
KEY_FREEZE = "dspark_live_freeze"  # 1 freeze / 0 unfreeze the live capacity model
KEY_MIN_TPS = "dspark_min_user_tps"  # per-request tokens/s floor; 0 = off


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """DSPARK_SGLANG_* settings. SGLang's own flags stay untouched, so every generated command
    still parses with SGLang's ServerArgs with or without the plugin installed."""

    profile: str | None = None  # engine_profiles YAML or SGLang SPS JSON; None = SGLang's table
    live: bool = True  # refit the capacity model from measured step times
    min_user_tps: float = 0.0  # SLA floor (DESIGN §5); 0 = off
    on_mismatch: str = "exit"  # exit | skip: what register() does on another sglang version
    publish_every: int = 32  # accepted step records between live model versions

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> PluginConfig:
        e = os.environ if env is None else env
        get = lambda k, d: e.get(ENV_PREFIX + k, d)
        try:
            cfg = PluginConfig(
                profile=get("PROFILE", "") or None,
                live=get("LIVE", "1") not in ("0", "false", "no", "off"),
                min_user_tps=float(get("MIN_USER_TPS", "0")),
                on_mismatch=get("ON_MISMATCH", "exit"),
                publish_every=int(get("PUBLISH_EVERY", "32")),
            )
        except ValueError as err:
            raise ConfigError(f"{ENV_PREFIX}*: {err}") from None
        if not (cfg.min_user_tps >= 0.0 and math.isfinite(cfg.min_user_tps)):
            raise ConfigError(f"{ENV_PREFIX}MIN_USER_TPS must be >= 0, got {cfg.min_user_tps}")
        if cfg.on_mismatch not in ("exit", "skip"):
            raise ConfigError(f"{ENV_PREFIX}ON_MISMATCH must be exit or skip")
        if cfg.publish_every < 1:
            raise ConfigError(f"{ENV_PREFIX}PUBLISH_EVERY must be >= 1")
        return cfg


@dataclass(frozen=True, slots=True)
class Handler:
    """Duck-typed like SGLang's internal-state handler: validate raises, apply returns overrides."""

    validate: Any
    apply: Any


def update_handlers(planner: BudgetPlanner, rejected: type[Exception]) -> dict[str, Handler]:
    """/set_internal_state keys. Every TP rank runs these on the same broadcast request at the same
    loop point, so each either applies on all ranks or is refused on all (K stays rank-equal)."""

    def reload_ok(key: str, value: Any) -> None:
        if value != 1:
            raise rejected(f"{key}: send 1 to swap to {ENV_PREFIX}PROFILE as rank 0 reads it now")
        staged = planner.staged_profile
        if staged is None or isinstance(staged, str):
            raise rejected(f"{key}: {staged or 'no profile was staged by rank 0'}")

    def freeze_ok(key: str, value: Any) -> None:
        if value not in (0, 1):
            raise rejected(f"{key}: send 1 to freeze the live capacity model, 0 to unfreeze")

    def tps_ok(key: str, value: Any) -> None:
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise rejected(f"{key}: expected a number >= 0 (tokens/s; 0 = off)")

    return {
        KEY_RELOAD: Handler(reload_ok, lambda k, v: planner.apply_staged_profile()),
        KEY_FREEZE: Handler(freeze_ok, lambda k, v: planner.live.set_frozen(bool(v))),
        KEY_MIN_TPS: Handler(tps_ok, lambda k, v: planner.set_min_user_tps(float(v))),
    }


class Metrics:
    """Our Prometheus series, named like the reference engine's (DESIGN §8) so one dashboard reads
    both engines. SGLang's /metrics collects them in multiprocess mode, so they exist only when
    `--enable-metrics` has set PROMETHEUS_MULTIPROC_DIR; only the planning leader writes them."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        g = lambda n, d: Gauge(n, d, multiprocess_mode="mostrecent")
        self.k = g("dspark_verify_budget_k", "Drafts admitted this step (lagged K)")
        self.predicted = g("dspark_predicted_step_seconds", "Capacity model's step time")
        self.measured = g("dspark_step_seconds", "Measured host step interval")
        self.mape = g("dspark_capacity_mape", "Rolling step-time MAPE (fraction)")
        self.version = g("dspark_capacity_version", "Capacity model version in use")
        self.frozen = g("dspark_capacity_frozen", "1 while the live model is frozen")
        self.fallbacks = Counter(
            "dspark_schedule_fallbacks", "Steps planned without our policy", ["reason"]
        )
        self.drift = Counter("dspark_capacity_drift_events", "Live model drift alarms")

    def record(self, rec: StepRecord, live: LiveModel) -> None:
        self.k.set(rec.verify_budget_k)
        self.measured.set(rec.step_seconds)
        self.predicted.set(live.last_predicted)
        self.mape.set(live.mape)
        self.version.set(live.model.version)
        self.frozen.set(float(live.frozen))

    @staticmethod
    def maybe() -> Metrics | None:
        global _METRICS
        if _METRICS is None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            _METRICS = Metrics()  # one registration per process
        return _METRICS


_METRICS: Metrics | None = None
