"""The planner host-time benchmark drives VerifyPlanner like the engine and reports by phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_sglang.bench import planner

PROFILE = str(Path(__file__).parents[3] / "engine_profiles" / "cpu-tiny-moe.yaml")
PHASES = ("budget", "rows", "skip", "plan", "observe")


def test_json_reports_each_mode_and_batch_by_phase(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--steps", "60", "--reqs", "1,4", "--gamma", "5", "--profile", PROFILE]
    assert planner.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert {(r["mode"], r["R"]) for r in rows} == {
        (m, r) for m in ("lagged", "sync", "verify-all") for r in (1, 4)
    }
    for r in rows:
        phases = [r[f"{p}_us"] for p in PHASES]
        assert min(phases) >= 0 and r["mean_us"] > 0
        assert sum(phases) == pytest.approx(r["mean_us"], abs=0.3)  # phases add up (rounding)
        if r["mode"] == "verify-all":  # drafts and verifies everything, never plans ahead
            assert r["drafting_steps"] == 60 and r["verify_tokens_per_step"] == 5 * r["R"]
            assert r["budget_us"] == r["rows_us"] == r["skip_us"] == 0
        if r["mode"] == "lagged":  # its K is planned before drafting, every step
            assert r["budget_us"] > 0
            assert r["drafting_steps"] < 60 or r["skip_us"] == 0
        else:
            assert r["pinned_steps"] == 0  # only lagged pins its K
    assert planner.main([*argv, "--modes", "lagged", "--replan-every", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["pinned_steps"] for r in rows] == [0, 0]  # a search every step


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--reqs", "0"], "--reqs"),
        (["--reqs", "a,b"], "--reqs"),
        (["--modes", "often"], "--modes"),
        (["--modes", ","], "--modes"),
        (["--profile", "/nonexistent.yaml"], "--profile"),
        (["--steps", "0"], "--steps"),
        (["--evict-mb", "-1"], "--evict-mb"),
        (["--replan-every", "0"], "--replan-every"),
    ],
)
def test_bad_flags_are_errors_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        planner.main(["--profile", PROFILE, *argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_evict_runs_where_the_engine_runs_torch_and_leaves_the_decisions_alone(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--evict-mb puts a matrix product where the drafter and the forward run (one before each
    plan, one after each plan or skip), outside the timed phases: the same decisions as warm."""
    base = ["--json", "--steps", "40", "--reqs", "1,8", "--modes", "lagged,verify-all"]
    base += ["--profile", PROFILE, "--seed", "3"]
    assert planner.main(base) == 0
    warm = json.loads(capsys.readouterr().out)
    calls = []
    real = planner.Evictor.__call__
    monkeypatch.setattr(planner.Evictor, "__call__", lambda self: calls.append(1) or real(self))
    assert planner.main([*base, "--evict-mb", "1"]) == 0
    cold = json.loads(capsys.readouterr().out)
    assert cold["meta"]["evict_mb"] == 1 and warm["meta"]["evict_mb"] == 0
    keys = ("mode", "R", "drafting_steps", "verify_tokens_per_step")
    assert [[r[k] for k in keys] for r in cold["results"]] == [
        [r[k] for k in keys] for r in warm["results"]
    ]
    # every step runs the forward once; a drafting step runs the drafter too
    assert len(calls) == sum(r["steps"] + r["drafting_steps"] for r in cold["results"])
