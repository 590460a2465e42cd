"""serve/worker.py without a running worker: what the heartbeat carries."""

from __future__ import annotations

import dataclasses

import pytest


def test_the_capacity_model_is_sent_once_per_version_and_again_after_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WorkerLink._capacity: a decode worker sends its planner's model when the version changes
    and again every CAPACITY_RESEND_S (a restarted router has none otherwise); prefill never."""
    from types import SimpleNamespace

    from dspark_sglang.algo.capacity import CapacityModel, TableModel
    from dspark_sglang.config import Config, ModelConfig
    from dspark_sglang.serve import worker as w

    clock = [100.0]
    monkeypatch.setattr(w.time, "monotonic", lambda: clock[0])
    planner = SimpleNamespace(
        capacity=CapacityModel(TableModel((1, 8), (0.01, 0.03))),
        estimator=None,
        state=lambda: {"probe_every": 8},
    )
    engine = SimpleNamespace(planner=planner, runner=SimpleNamespace(device="cpu"), gamma=4)
    link = SimpleNamespace(
        engine=engine,
        role="decode",
        name="decode0",
        _capacity_sent=(-1, 0.0),
        full_cfg=Config(ModelConfig("m")),
    )
    sent = lambda: w.WorkerLink._capacity(link)
    first = sent()
    assert first is not None and first["version"] == 0 and first["mape"] == -1.0
    assert first["profile"]["model"] == planner.capacity.to_dict()
    assert first["planner"] == {"probe_every": 8}  # what the planner learned rides along
    clock[0] += 1.0
    assert sent() is None  # same version, soon after
    planner.capacity = dataclasses.replace(planner.capacity, version=1)
    assert sent()["version"] == 1
    clock[0] += w.CAPACITY_RESEND_S
    assert sent()["version"] == 1  # unchanged, but resent
    link.role = "prefill"
    clock[0] += w.CAPACITY_RESEND_S
    assert sent() is None
