"""The capacity model every rank plans with, and how it changes (DESIGN §4, STYLE §3): the planning
leader turns measured steps into new versions (algo.capacity_fit.LiveEstimator); a version travels
to every rank inside SGLang's own request broadcast and is swapped in at one loop point there.
No SGLang names, no clock, no I/O."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from dspark_sglang.algo.capacity import CapacityModel
from dspark_sglang.algo.capacity_fit import EstimatorConfig, LiveEstimator
from dspark_sglang.types import StepRecord


@dataclass(frozen=True, slots=True)
class ModelUpdate:
    """A new live version from the leader. Rides `recv_requests(local_reqs=...)` (pickled by
    SGLang's broadcast) so TP ranks receive the same object in the same iteration."""

    seq: int  # leader's counter: a copy sent twice (a skipped or deferred receive) applies once
    model: CapacityModel


@dataclass(frozen=True, slots=True)
class StagedProfile:
    """What rank 0 read from DSPARK_SGLANG_PROFILE when a reload request arrived: the model, or
    why it could not be read. Broadcast next to the request, so every rank decides alike."""

    model: CapacityModel | None
    error: str = ""


class LiveModel:
    """The model in use on this rank plus, on the leader, the estimator that refits it."""

    def __init__(
        self, prior: CapacityModel, *, leader: bool, live: bool, publish_every: int = 32
    ) -> None:
        self.model = prior
        self.frozen = False
        self.leader = leader
        self._live = live
        self._est_cfg = EstimatorConfig(publish_every=publish_every)
        self._estimator = LiveEstimator(prior, self._est_cfg) if leader and live else None
        self._pending: ModelUpdate | None = None
        self._seq = 0  # last seq the leader issued
        self.applied_seq = 0  # last seq applied here (equal on every rank)
        self._ape: deque[float] = deque(maxlen=100)
        self.last_measured = math.nan
        self.last_predicted = math.nan

    @property
    def mape(self) -> float:
        """Rolling |predicted - measured| / measured of the model in use (DESIGN §8)."""
        return float(np.mean(self._ape)) if self._ape else math.nan

    @property
    def drift_events(self) -> int:
        return self._estimator.drift_events if self._estimator is not None else 0

    def observe(self, rec: StepRecord) -> None:
        """Leader only: score the model in use, feed the estimator, queue what it publishes."""
        predicted = self.model.predict(rec.num_reqs, rec.num_tokens, rec.kv_tokens)
        self.last_measured, self.last_predicted = rec.step_seconds, predicted
        self._ape.append(abs(predicted - rec.step_seconds) / rec.step_seconds)
        if self._estimator is None or self.frozen:
            return
        new = self._estimator.observe(rec)
        if new is not None:
            self._seq += 1
            self._pending = ModelUpdate(self._seq, new)

    def outgoing(self) -> ModelUpdate | None:
        """The update to broadcast this iteration; kept until it has been applied here."""
        return self._pending

    def apply(self, update: ModelUpdate) -> None:
        """Every rank, at the same loop point: swap to the broadcast version."""
        if update.seq <= self.applied_seq:
            return
        self.model, self.applied_seq = update.model, update.seq
        self._seq = max(self._seq, update.seq)
        if self._pending is not None and self._pending.seq <= update.seq:
            self._pending = None

    def reset(self, model: CapacityModel) -> None:
        """A pushed profile replaces the model and restarts the estimator from it."""
        self.model, self._pending = model, None
        self._ape.clear()
        if self._estimator is not None:
            self._estimator = LiveEstimator(model, self._est_cfg)

    def set_frozen(self, frozen: bool) -> None:
        self.frozen = frozen
        if frozen:
            self._pending = None
