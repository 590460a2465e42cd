"""bench.simulate / bench.des: determinism, closed forms on trivial profiles, Pareto helpers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dspark_sglang.algo.capacity import AdditiveModel, CapacityModel, Curve
from dspark_sglang.bench import simulate
from dspark_sglang.bench.des import (
    PAPER_ACCEPTANCE,
    CostModel,
    Linear,
    SimConfig,
    SyntheticSpec,
    TraceBank,
    Trajectory,
    Workload,
    run_point,
    synthetic_bank,
)
from dspark_sglang.bench.pareto import (
    frontier,
    matched_speedups,
    throughput_at_sla,
    tps_at_throughput,
)

STEP = 0.01  # seconds: the trivial profile's constant step time


def flat(step: float = STEP) -> CapacityModel:
    one = Curve((1.0,), (0.0,))
    return CapacityModel(AdditiveModel(bias_s=step, alpha=one, theta=one))


def bernoulli_bank(p: float, gamma: int, seed: int = 0, rounds: int = 4000) -> TraceBank:
    """i.i.d. per-position acceptance p; confidences equal to p (no information)."""
    rng = np.random.default_rng(seed)
    hits = rng.random((8, rounds, gamma)) < p
    acc = np.cumprod(hits, axis=2).sum(axis=2)
    return TraceBank(
        gamma, tuple(Trajectory(np.full((rounds, gamma), p), a) for a in acc), "bernoulli"
    )


def test_closed_form_no_spec_and_deterministic_acceptance() -> None:
    """Constant step T; PD: the prefill side takes T(1, prompt) = T and emits the first token;
    c users in a closed loop. A request of M tokens cycles in T + (M-1)/k·T when every decode
    step commits k tokens: no-spec k = 1, verify-all with every draft accepted k = γ+1."""
    gamma, c, rounds = 4, 8, 10
    m = 1 + rounds * (gamma + 1)
    sure = TraceBank(gamma, (Trajectory(np.ones((3, gamma)), np.full(3, gamma)),))
    wl = Workload(prompt_lens=(16,), output_lens=(m,))
    cfg = SimConfig(c, 5 * c, seed=1)
    cost = CostModel(flat())
    ns = run_point(cost, "no-spec", sure, wl, cfg)
    assert ns.output_throughput == pytest.approx(c * m / (STEP * m), rel=1e-9)
    assert ns.mean_tps_per_user == pytest.approx(1 / STEP, rel=1e-9)
    assert ns.accept_length == 1.0
    va = run_point(cost, "verify-all", sure, wl, cfg)
    assert va.output_throughput == pytest.approx(c * m / (STEP * (1 + rounds)), rel=1e-9)
    assert va.mean_tps_per_user == pytest.approx((gamma + 1) / STEP, rel=1e-9)
    assert va.accept_length == pytest.approx(gamma + 1)
    assert va.verify_tokens_per_request == pytest.approx(gamma + 1)
    assert va.mean_step_ms == pytest.approx(STEP * 1e3)
    assert va.mean_ttft_ms == pytest.approx(STEP * 1e3)
    mtp = run_point(cost, "mtp1", sure, wl, cfg)  # k = 2: (M-1)/2 = 25 steps
    assert mtp.output_throughput == pytest.approx(c * m / (STEP * (1 + (m - 1) / 2)), rel=1e-9)


def test_closed_form_bernoulli_acceptance() -> None:
    """i.i.d. acceptance p: E[tokens per round] = 1 + p + ... + p^γ (drafter costs 0)."""
    gamma, p, c = 5, 0.8, 16
    bank = bernoulli_bank(p, gamma)
    expect = 1 + sum(p**k for k in range(1, gamma + 1))
    wl = Workload(prompt_lens=(32,), output_lens=(2000,))
    res = run_point(CostModel(flat()), "verify-all", bank, wl, SimConfig(c, 3 * c, seed=2))
    assert res.accept_length == pytest.approx(expect, rel=0.02)
    assert res.output_throughput == pytest.approx(c * expect / STEP, rel=0.03)


def test_closed_form_overhead_and_little() -> None:
    """Step = T + a + b·R + drafter: per-user rate and Little's law (c = req/s · E2E)."""
    gamma, c, rounds = 3, 4, 20
    m = 1 + rounds * (gamma + 1)
    sure = TraceBank(gamma, (Trajectory(np.ones((2, gamma)), np.full(2, gamma)),))
    wl = Workload(prompt_lens=(8,), output_lens=(m,))
    cost = CostModel(flat(), overhead=Linear(0.002, 0.001), draft=Linear(0.003, 0.0005))
    step = STEP + 0.002 + 0.001 * c + 0.003 + 0.0005 * c
    res = run_point(cost, "verify-all", sure, wl, SimConfig(c, 6 * c))
    assert res.mean_step_ms == pytest.approx(step * 1e3)
    e2e = STEP + rounds * step  # prefill T, then the decode rounds
    assert res.output_throughput == pytest.approx(c * m / e2e, rel=1e-9)
    assert res.mean_tps_per_user == pytest.approx((m - 1) / (rounds * step), rel=1e-9)
    assert (res.output_throughput / m) * e2e == pytest.approx(c, rel=1e-9)


@pytest.mark.parametrize("form", ["additive", "table"])
def test_the_simulated_planner_prices_steps_as_the_simulator_charges_them(form: str) -> None:
    """The lagged planner inside the simulator plans with what the engine's estimator converges
    to; it must charge a plain and a drafting step exactly what CostModel charges."""
    from dspark_sglang.algo.capacity import TableModel

    base = flat() if form == "additive" else CapacityModel(TableModel((1, 64), (0.01, 0.02)))
    cost = CostModel(base, overhead=Linear(0.002, 0.0001), draft=Linear(0.003, 0.0005))
    plan = cost.planning_model()
    for r, b, ctx in [(1, 1, 100), (4, 20, 900), (32, 32, 9000), (64, 300, 20000)]:
        assert plan.predict(r, b, ctx) == pytest.approx(cost.step_seconds(r, b, ctx, 0))
        drafted = plan.predict(r, b, ctx, drafted=True)
        assert drafted == pytest.approx(cost.step_seconds(r, b, ctx, r))


def test_prompt_tokens_may_cost_less_than_verify_tokens_but_never_below_the_rest() -> None:
    """A signed prefill excess prices prompt tokens below the verify tokens the profile holds
    (they need no logits), floored at the step without the prompt chunk."""
    from dspark_sglang.algo.capacity import TableModel

    base = CapacityModel(TableModel((1, 4, 104, 204), (0.01, 0.01, 0.02, 0.03)))
    cost = CostModel(base, prefill=Linear(0.0, -0.00005))
    assert cost.step_seconds(4, 104, 500, 0, 100) == pytest.approx(0.02 - 0.005)
    assert cost.step_seconds(4, 204, 500, 0, 200) == pytest.approx(0.03 - 0.01)
    steep = CostModel(base, prefill=Linear(0.0, -0.001))
    assert steep.step_seconds(4, 104, 500, 0, 100) == pytest.approx(0.01)  # the 4 decode rows
    assert steep.prefill_seconds(100) == pytest.approx(0.01)  # T(1, 1): never below one row
    assert CostModel(base).step_seconds(4, 104, 500, 0, 100) == pytest.approx(0.02)
    x = np.array([10.0, 20.0, 40.0])
    assert simulate.fit_linear(x, 0.001 - 0.0001 * x, signed=True).b == pytest.approx(-0.0001)
    assert simulate.fit_linear(x, 0.001 - 0.0001 * x).b == 0.0


def test_a_slowed_cost_model_charges_every_term_by_the_speed_factor() -> None:
    """validate's host speed index: a host at half the speed doubles every step, plain,
    drafting, prompt-bearing (the floor included) and planned, and the live scale it carries
    already is kept under the factor."""
    from dspark_sglang.algo.capacity import TableModel

    base = CapacityModel(
        TableModel((1, 4, 104, 204), (0.01, 0.012, 0.02, 0.03)),
        scale=Curve((1.0, 64.0), (1.1, 1.4)),
    )
    cost = CostModel(base, Linear(0.002, 0.0001), Linear(0.003, 0.0005), Linear(0.0, -0.00005))
    slow = cost.slowed(2.0)
    for r, b, ctx, drafting, prompt in [
        (1, 1, 100, 0, 0),
        (4, 4, 900, 4, 0),
        (4, 104, 500, 0, 100),
    ]:
        assert slow.step_seconds(r, b, ctx, drafting, prompt) == pytest.approx(
            2.0 * cost.step_seconds(r, b, ctx, drafting, prompt)
        )
    steep = CostModel(base, prefill=Linear(0.0, -0.001))  # floored at the 4 decode rows
    assert steep.slowed(3.0).step_seconds(4, 104, 500, 0, 100) == pytest.approx(
        3.0 * steep.step_seconds(4, 104, 500, 0, 100)
    )
    plan, slow_plan = cost.planning_model(), slow.planning_model()
    assert slow_plan.predict(4, 32, 900, drafted=True) == pytest.approx(
        2.0 * plan.predict(4, 32, 900, drafted=True)
    )
    assert cost.slowed(1.0).step_seconds(4, 4, 900, 4) == pytest.approx(
        cost.step_seconds(4, 4, 900, 4)
    )
    with pytest.raises(ValueError, match="speed factor"):
        cost.slowed(0.0)


def test_a_forward_speed_by_batch_slows_each_forward_by_its_own_factor() -> None:
    """validate's per-batch index: the target forward at B tokens is charged the index at B
    (flat outside its knots, times the live scale it carries), the host work the scalar."""
    from dspark_sglang.algo.capacity import TableModel

    # a table row at each B tested, so each forward runs at its own B (no bucket above it); the
    # B tested are knots of either curve, where their product is exact (linear in between)
    table = TableModel((1, 8, 32, 200), (0.01, 0.012, 0.02, 0.03))
    base = CapacityModel(table, scale=Curve((1.0, 64.0), (1.1, 1.4)))
    cost = CostModel(base, Linear(0.002, 0.0001), Linear(0.003, 0.0005))
    by_batch = Curve((1.0, 8.0, 32.0), (3.0, 2.0, 2.5))
    slow = cost.slowed(2.0, by_batch)
    bare = CostModel(CapacityModel(table))
    for r, b, ctx, drafting in [(1, 1, 100, 0), (1, 8, 100, 1), (4, 32, 900, 4), (8, 200, 900, 0)]:
        live = float(np.interp(b, (1.0, 64.0), (1.1, 1.4)))
        fwd = (
            bare.step_seconds(r, b, ctx, 0)
            * live
            * float(np.interp(b, by_batch.knots, by_batch.values))
        )
        host = 2.0 * (cost.overhead(r) + (cost.draft(drafting) if drafting else 0.0))
        assert slow.step_seconds(r, b, ctx, drafting) == pytest.approx(fwd + host)
    flat = Curve((1.0,), (2.0,))  # a flat index is the scalar one
    for b in (1, 20, 200):
        assert cost.slowed(2.0, flat).step_seconds(4, b, 900, 4) == pytest.approx(
            cost.slowed(2.0).step_seconds(4, b, 900, 4)
        )
    with pytest.raises(ValueError, match="speed factor"):
        cost.slowed(2.0, Curve((1.0, 8.0), (1.0, 0.0)))


def test_simulator_is_deterministic_with_a_seed() -> None:
    bank = synthetic_bank(SyntheticSpec(PAPER_ACCEPTANCE["code"]), 5, np.random.default_rng(0),
                          num_trajectories=32, rounds=64)  # fmt: skip
    cost = CostModel(flat())
    wl = Workload(256, 64, 0.5)
    runs = [run_point(cost, "lagged", bank, wl, SimConfig(4, 12, seed=s)) for s in (7, 7, 8)]
    assert runs[0].row() == runs[1].row()
    assert runs[0].row() != runs[2].row()
    bank2 = synthetic_bank(SyntheticSpec(PAPER_ACCEPTANCE["code"]), 5, np.random.default_rng(0),
                           num_trajectories=32, rounds=64)  # fmt: skip
    assert all(
        np.array_equal(a.conf, b.conf) and np.array_equal(a.accepted, b.accepted)
        for a, b in zip(bank.trajectories, bank2.trajectories, strict=True)
    )


def test_synthetic_bank_matches_paper_rates() -> None:
    rates = PAPER_ACCEPTANCE["chat"]
    bank = synthetic_bank(SyntheticSpec(rates), 5, np.random.default_rng(1), 128, 128)
    assert np.allclose(bank.conditional_acceptance(), rates[:5], atol=0.01)
    q = bank.confidence_quality()
    assert all(0.6 < x["auc"] < 0.95 and x["ece"] < 0.05 for x in q)


def test_oracle_bounds_policies_and_trace_roundtrip(tmp_path: Path) -> None:
    bank = synthetic_bank(SyntheticSpec(PAPER_ACCEPTANCE["math"]), 4, np.random.default_rng(2),
                          num_trajectories=16, rounds=64)  # fmt: skip
    f = tmp_path / "t.jsonl"
    bank.to_jsonl(f, {"note": "x"})
    back = TraceBank.from_jsonl(f)
    assert back.gamma == 4 and len(back.trajectories) == 16
    assert np.allclose(back.trajectories[3].conf, bank.trajectories[3].conf, atol=1e-6)
    # Step time rising with B: the oracle (knows every accepted length) is an upper bound.
    theta = Curve((1.0, 64.0), (0.0, 0.02))
    cap = CapacityModel(AdditiveModel(0.01, Curve((1.0,), (0.0,)), theta))
    wl = Workload(128, 64, 0.5)
    thr = {
        p: run_point(CostModel(cap), p, bank, wl, SimConfig(8, 24, seed=3)).output_throughput
        for p in ("oracle", "lagged", "sync", "verify-all", "no-spec")
    }
    assert thr["oracle"] >= max(thr.values()) * 0.999


def test_pareto_helpers() -> None:
    pts = [(100, 10), (80, 30), (90, 5), (50, 60), (40, 55), (20, 80)]
    f = frontier(pts)
    assert f == [(20.0, 80.0), (50.0, 60.0), (80.0, 30.0), (100.0, 10.0)]
    assert tps_at_throughput(f, 45) == pytest.approx(65.0)
    assert tps_at_throughput(f, 100) is None
    assert throughput_at_sla(f, 65) == pytest.approx(45.0)
    assert throughput_at_sla(f, 10) == 80.0 and throughput_at_sla(f, 120) is None
    base = [(10.0, 40.0), (20.0, 20.0)]
    m = matched_speedups(base, f)
    assert [x["speedup"] for x in m] == pytest.approx([70 / 10, 90 / 20])


def test_run_cli_writes_tables_and_plots(tmp_path: Path) -> None:
    argv = ["run", "--profile", "ep8", "--concurrency", "1,8", "--policies",
            "no-spec,mtp1,sync,lagged,oracle", "--lags", "0,2", "--output-len", "32",
            "--input-len", "128", "--min-requests", "6", "--out-dir", str(tmp_path),
            "--name", "t", "--json"]  # fmt: skip
    assert simulate.main(argv) == 0
    summary = json.loads((tmp_path / "t.json").read_text())
    for name in ("t.csv", "t_lag.csv", "t_ablation.csv", "t_pareto.png", "t_load.png"):
        assert (tmp_path / name).stat().st_size > 0
    lags = {(r["concurrency"], r["lag"]) for r in summary["lag_table"]}
    assert lags == {(1, 0), (1, 2), (8, 0), (8, 2)}
    assert {"lagged_vs_sync_min", "fig8_budget_shrinks_with_load"} <= set(summary["goals"])
    assert all(r["draft_quality_gain"] > 0 for r in summary["ablation"])


def test_lagged_skips_a_drafter_that_cannot_pay_and_matches_no_spec() -> None:
    """A drafter costing 5 steps per step: lagged plans K = 0 every step and runs it only on its
    sparse, backing-off probes, so it runs within a few % of no-spec; verify-all pays the drafter
    every step. A free drafter is used."""
    gamma, c = 4, 8
    bank = bernoulli_bank(0.6, gamma)
    wl = Workload(prompt_lens=(16,), output_lens=(200,))
    cfg = SimConfig(c, 4 * c, seed=2)
    costly = CostModel(flat(), draft=Linear(5 * STEP))
    ns = run_point(costly, "no-spec", bank, wl, cfg)
    lag = run_point(costly, "lagged", bank, wl, cfg)
    va = run_point(costly, "verify-all", bank, wl, cfg)
    assert 0.9 * ns.output_throughput < lag.output_throughput < ns.output_throughput
    assert lag.accept_length < 1.2  # only the sparse probes verify
    assert va.output_throughput < 0.5 * ns.output_throughput
    free = run_point(CostModel(flat()), "lagged", bank, wl, cfg)
    assert free.output_throughput > 1.5 * ns.output_throughput


def test_validate_cli_calibrates_and_compares_on_the_bundled_pair(tmp_path: Path) -> None:
    """`simulate record` then `simulate validate` end to end at toy sizes: every validated
    (policy, c) gets a real and a simulated throughput, and the calibration reports the forward
    speed per batch size and each policy's host overhead."""
    profile = Path(__file__).parents[3] / "engine_profiles" / "cpu-tiny-moe.yaml"
    trace, out = tmp_path / "rounds.jsonl", tmp_path / "validation.json"
    args = ["--num-prompts", "4", "--output-len", "12"]
    assert simulate.main(["record", *args, "--batch", "4", "--out", str(trace)]) == 0
    loads = ["--concurrency", "1,2", "--calibrate-at", "1,3", "--requests-per-user", "1"]
    loads += ["--repeats", "2"]
    val = ["validate", "--profile", str(profile), "--trace", str(trace), *args, *loads]
    assert simulate.main([*val, "--min-requests", "2", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    got = {(r["policy"], r["concurrency"]) for r in rep["rows"]}
    assert got == {(p, c) for p in ("no-spec", "lagged") for c in (1, 2)}
    for r in rep["rows"]:
        assert r["real_throughput"] > 0 and r["sim_throughput"] > 0
        assert r["within_10pct"] == (abs(r["error"]) <= 0.10)
        assert r["sim_throughput_unindexed"] > 0
        # Two interleaved runs per load; the row compares their medians.
        assert r["repeats"] == len(r["runs"]) == 2
        # A run's host speed is its B = 1 forward over the profile's (how far this host is from
        # the profile's is the host's business: 5.7x on a slow shared one), the row's their median
        for run in r["runs"]:
            speeds = run["host_speed_by_batch"]
            assert all(np.isfinite(speeds)) and min(speeds) > 0
            assert run["host_speed"] == speeds[0]
        assert r["host_speed"] == pytest.approx(
            float(np.median([x["host_speed"] for x in r["runs"]]))
        )
        real = [x["real_throughput"] for x in r["runs"]]
        assert r["real_throughput"] == pytest.approx(float(np.median(real)))
        paired = [x["sim_throughput"] / x["real_throughput"] - 1 for x in r["runs"]]
        assert r["error"] == pytest.approx(float(np.median(paired)))
    # The index is timed around every calibration run: 2 loads x (no-spec, lagged, verify-all).
    assert rep["speed_index"] and len(rep["calibration_host_speed"]) == 6
    for r in rep["rows"]:  # the index by batch tokens, at every speed point, around each run
        for run in r["runs"]:
            assert len(run["host_speed_by_batch"]) == len(simulate.SPEED_POINTS)
    off = tmp_path / "off.json"
    no_index = [*val, "--min-requests", "2", "--no-speed-index", "--repeats", "1"]
    assert simulate.main([*no_index, "--out", str(off)]) == 0
    rep = json.loads(off.read_text())
    assert not rep["speed_index"] and set(rep["calibration_host_speed"]) == {1.0}
    for r in rep["rows"]:  # without the index both predictions are the calibration's
        assert r["host_speed"] == 1.0
        assert r["sim_throughput_unindexed"] == pytest.approx(r["sim_throughput"])
    drift = rep["calibration_forward_vs_profile_by_batch"]
    assert drift and all(np.isfinite(v) and v > 0 for v in drift.values())
    assert {"overhead", "overhead_lagged", "draft", "prefill"} <= set(rep)


def test_validate_rejects_zero_repeats_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        simulate.main(["validate", "--profile", "p.yaml", "--trace", "t.jsonl", "--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err


def test_a_shrink_variant_runs_lagged_with_lag_shrink() -> None:
    from dspark_sglang.bench.des import ServingPolicy, make_policy

    pol = make_policy("lagged@shrink", 4, flat())
    assert isinstance(pol, ServingPolicy) and pol.name == "lagged@shrink"
    assert pol.planner.state()["lag_shrink_applied"] is True
    assert make_policy("lagged", 4, flat()).planner.state()["lag_shrink_applied"] is False
    with pytest.raises(ValueError, match="unknown variant"):
        make_policy("lagged@nope", 4, flat())
