"""What both workers share: the engine, the inbox, the link to the router, heartbeats.

A worker's state stays in its own loop; this file only moves messages and reports load.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import msgspec
import torch

from dspark_sglang.capacity_profile import live_profile
from dspark_sglang.config import Config, ConfigError
from dspark_sglang.engine.engine import LLMEngine
from dspark_sglang.engine.speculative import SpecStats
from dspark_sglang.hostinfo import cpu_model
from dspark_sglang.serve import messages as m
from dspark_sglang.serve.transport import Receiver, Security, Sender
from dspark_sglang.types import StepRecord

log = logging.getLogger(__name__)
MAX_DRAIN = 256  # messages handled between two engine steps
PARENT_ENV = "DSPARK_PARENT_PID"  # set by launch: exit when that process is gone
# The capacity model goes out again at least this often when it has not changed: a restarted
# router has none until then (an idle decode worker publishes no new version).
CAPACITY_RESEND_S = 10.0


class Refused(SystemExit):
    pass


class WorkerLink:
    def __init__(self, cfg: Config, role: str, index: int) -> None:
        addrs = cfg.serve.prefill_addrs if role == "prefill" else cfg.serve.decode_addrs
        if not 0 <= index < len(addrs):
            raise ConfigError(f"--worker-index {index} out of range: {len(addrs)} {role} addresses")
        self.name, self.role = f"{role}{index}", role
        self.cfg, self.full_cfg = cfg.serve, cfg
        self.sec = Security(cfg.serve)
        self.records: list[StepRecord] = []  # since the last heartbeat
        self._step_log = _open_step_log(cfg.serve.step_log_dir, self.name)
        self.engine = LLMEngine(cfg, on_step=self._on_step)
        self.inbox = Receiver(addrs[index], self.sec)
        self.router = Sender(cfg.serve.api_addr, self.sec)
        self.boot = secrets.randbits(62)
        self._beats = 0
        self.hand = self._handshake(cfg)
        self._next_beat = 0.0
        self._capacity_sent = (-1, 0.0)  # (version, monotonic time) last sent to the router
        self._parent = int(os.environ.get(PARENT_ENV, "0"))
        log.info("%s serving on %s", self.name, addrs[index])

    def _handshake(self, cfg: Config) -> m.Handshake:
        runner = self.engine.runner
        d = runner.drafter.cfg if runner.drafter is not None else None
        return m.Handshake(
            version=m.PROTOCOL_VERSION,
            model_id=m.model_id(cfg.model.path, cfg.serve.served_model_name),
            num_layers=runner.arch.num_hidden_layers,
            num_kv_heads=runner.arch.num_key_value_heads,
            head_dim=runner.arch.head_dim,
            page_size=runner.page_size,
            dtype=cfg.model.dtype,
            draft_taps=tuple(d.target_layer_ids) if d else (),
            draft_hidden=d.hidden_size if d else 0,
            gamma=self.engine.gamma if d else 0,
        )

    def _on_step(self, rec: StepRecord) -> None:
        self.records.append(rec)
        if self._step_log is not None:
            self._step_log.write(_ENC.encode(rec) + b"\n")

    def poll(self, busy: bool) -> Iterator[tuple[m.Message, list]]:
        """Messages now; when idle, wait for one until the next heartbeat is due."""
        wait = 0 if busy else max(0, int((self._next_beat - time.monotonic()) * 1000))
        for _ in range(MAX_DRAIN):
            frames = self.inbox.recv(wait)
            if frames is None:
                return
            wait = 0
            try:
                msg, tensors = m.decode(frames)
            except m.BadMessage as e:
                log.warning("%s dropped a malformed message: %s", self.name, e)
                continue
            if isinstance(msg, m.Refuse):
                raise Refused(f"{self.name} refused by the router: {msg.reason}")
            yield msg, tensors

    def send(self, deltas: list[m.Delta]) -> None:
        if deltas and not self.router.send(m.encode(m.Deltas(self.name, deltas))):
            log.warning("%s: router unreachable, %d deltas dropped", self.name, len(deltas))

    def beat(self, waiting: int) -> None:
        now = time.monotonic()
        if now < self._next_beat:
            return
        if self._parent and os.getppid() != self._parent:
            raise SystemExit(f"{self.name}: launcher {self._parent} is gone")
        self._next_beat = now + self.cfg.heartbeat_interval_s
        e, recs = self.engine, self.records
        st = e.stats.as_dict()
        self._beats += 1
        hb = m.Heartbeat(
            worker=self.name,
            boot=self.boot,
            hand=self.hand,
            running=len(e.scheduler.running),
            waiting=waiting + len(e.scheduler.waiting),
            free_blocks=e.pool.num_free_blocks,
            total_blocks=e.pool.num_blocks,
            tau=st["tau"],
            verify_tokens_per_step=st["verify_tokens_per_step"],
            acceptance=[-1.0 if a is None else a for a in st["conditional_acceptance"]],
            capacity=self._capacity(),
            beats=self._beats,
            counts=_counts(e.stats),
            **_step_summary(recs),
        )
        recs.clear()
        self.router.send(m.encode(hb))
        if self._step_log is not None:  # whole lines at least every heartbeat, for tail -f
            self._step_log.flush()

    def _capacity(self) -> dict[str, Any] | None:
        """The planner's capacity model for GET /capacity, once per published version and at
        least every CAPACITY_RESEND_S (none without a capacity-driven schedule). Built at a beat,
        not at each publish: validating the profile takes a fraction of a millisecond the step
        loop need not pay 32 records apart."""
        planner = self.engine.planner if self.role == "decode" else None
        model = planner.capacity if planner is not None else None
        version, at = self._capacity_sent
        now = time.monotonic()
        if model is None or (model.version == version and now - at < CAPACITY_RESEND_S):
            return None
        self._capacity_sent = (model.version, now)
        est, cfg = planner.estimator, self.full_cfg
        mape = est.mape if est is not None else math.nan
        source = "live estimator" if est is not None else "profile (live updates off)"
        notes = (
            f"{self.name}'s capacity model, version {model.version}, as its {source} published it "
            f"after {est.num_observed if est is not None else 0} steps"
        )
        runner = self.engine.runner
        hardware = f"{runner.device} ({cpu_model()}, {torch.get_num_threads()} threads)"
        if runner.device.startswith("cuda"):
            hardware = f"{torch.cuda.get_device_name(runner.device)} ({hardware})"
        profile = live_profile(
            model,
            name=f"live-{self.name}",
            hardware=hardware,
            target=cfg.model.path,
            drafter=cfg.draft.path,
            ep=cfg.parallel.ep_size,
            gamma=self.engine.gamma,
            command=shlex.join(sys.argv),
            notes=notes,
        )
        return {
            "version": model.version,
            "observed": est.num_observed if est is not None else 0,
            "drift_events": est.drift_events if est is not None else 0,
            "mape": mape if math.isfinite(mape) else -1.0,
            "profile": profile,
            "planner": planner.state(),
        }


_ENC = msgspec.json.Encoder()


def _open_step_log(folder: str | None, name: str) -> IO[bytes] | None:
    """DIR/<worker>.steps.jsonl in append mode (restarts add to it), or None."""
    if folder is None:
        return None
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        return (path / f"{name}.steps.jsonl").open("ab")
    except OSError as e:
        raise ConfigError(f"--step-log {folder}: {e}") from e


def _counts(st: SpecStats) -> m.SpecCounts:
    return m.SpecCounts(
        rounds=st.rounds,
        committed=st.accept_length_sum,
        verified=st.verified,
        accepted=st.accepted,
        verify_tokens=st.verify_tokens,
        steps=st.steps,
        at_risk=list(st.at_risk),
        passed=list(st.passed),
    )


def _step_summary(recs: list[StepRecord]) -> dict[str, Any]:
    """Means over the heartbeat interval of what DESIGN §8 plots per step (0 / -1: no data)."""
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    pred = [
        (r.predicted_seconds, r.step_seconds) for r in recs if math.isfinite(r.predicted_seconds)
    ]
    return dict(
        step_seconds=mean([r.step_seconds for r in recs]),
        predicted_step_seconds=mean([p for p, _ in pred]),
        capacity_mape=mean([abs(p - s) / s for p, s in pred if s > 0]) if pred else -1.0,
        verify_budget_k=mean([r.verify_budget_k for r in recs if r.verify_budget_k >= 0]),
        fallbacks=dict(Counter(r.fallback for r in recs if r.fallback)),
    )
