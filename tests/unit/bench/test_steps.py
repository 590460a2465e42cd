"""bench.steps: the per-R decode step report read from `--step-log` files."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import msgspec
import pytest

from dspark_sglang.bench import steps
from dspark_sglang.engine.engine import LLM
from dspark_sglang.types import SamplingParams, StepRecord
from tests.conftest import write_model_pair

_ENC = msgspec.json.Encoder()  # what serve/worker.py writes a step log with


def _rec(r: int, b: int, step: float, **kw: object) -> StepRecord:
    return StepRecord(
        step=0,
        num_reqs=r,
        num_tokens=b,
        num_prefill_tokens=kw.pop("prefill", 0),
        num_decode_reqs=r,
        kv_tokens=100 * r,
        step_seconds=step,
        **kw,
    )


def _write(path: Path, recs: list[StepRecord]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(_ENC.encode(r) + b"\n" for r in recs))
    return path


def test_r_bins_end_at_powers_of_two() -> None:
    got = {r: steps.r_bin_bounds(r) for r in (1, 2, 3, 4, 5, 8, 9, 64, 65)}
    assert got == {
        1: (1, 1),
        2: (2, 2),
        3: (3, 4),
        4: (3, 4),
        5: (5, 8),
        8: (5, 8),
        9: (9, 16),
        64: (33, 64),
        65: (65, 128),
    }


def test_rates_and_medians_of_a_written_log(tmp_path: Path) -> None:
    recs = [  # plain, unpriced; the planner's and the context queue's parts of the host time
        _rec(1, 1, 0.003, forward_seconds=0.0025, plan_seconds=1e-4 * i, context_seconds=2e-5)
        for i in range(4)
    ]
    recs += [  # drafting: 1 + 3 accepted tokens each, priced 10 % high
        _rec(
            1,
            8,
            0.010,
            forward_seconds=0.004,
            draft_seconds=0.005,
            num_draft_reqs=1,
            num_accepted=3,
            predicted_seconds=0.011,
            planned_tokens=5.0,  # 4 emitted: the lagged survival promised 1 more
            plain_theta=400.0 + 100.0 * i,  # planned Θ 5 / 0.011 = 454.5 over 400, then 500
            pinned=i == 1,  # the second one's K was pinned
        )
        for i in range(2)
    ]
    recs.append(_rec(1, 40, 0.050, prefill=39))  # a prompt chunk: not a decode step
    recs += [_rec(3, 3, 0.006), _rec(4, 4, 0.008)]  # forward not timed (NaN -> null)
    log = _write(tmp_path / "lagged" / "decode0.steps.jsonl", recs)
    assert b"null" in log.read_bytes()
    one, three = steps.summarize("lagged", steps.read_steps(log))
    assert (one.r_lo, one.r_hi, one.steps) == (1, 1, 6)
    assert one.drafting_share == pytest.approx(2 / 6)
    assert one.pinned_share == pytest.approx(1 / 6)
    assert one.mean_tokens_in_forward == pytest.approx((4 * 1 + 2 * 8) / 6)
    assert one.tokens_per_step == pytest.approx((4 + 2 * 4) / 6)
    assert one.tok_per_s == pytest.approx(12 / (4 * 0.003 + 2 * 0.010))
    assert one.step_ms == pytest.approx(3.0)
    assert one.forward_ms == pytest.approx(2.5)
    assert one.drafter_ms == pytest.approx(5.0)
    assert one.host_ms == pytest.approx(0.5)  # 4 x 0.5 and 2 x 1.0
    assert one.plan_ms == pytest.approx(0.15)  # 0, 0.1, 0.2, 0.3 ms; the drafting ones untimed
    assert one.context_ms == pytest.approx(0.02)
    assert one.predicted_over_measured == pytest.approx(1.1)
    assert one.realised_over_planned == pytest.approx(8 / 10)  # the plain steps planned nothing
    assert one.planned_over_plain == pytest.approx((5 / 0.011 / 400 + 5 / 0.011 / 500) / 2)
    assert (three.r_lo, three.r_hi, three.steps) == (3, 4, 2)
    assert three.tok_per_s == pytest.approx(7 / 0.014)
    for nan in (
        three.forward_ms,
        three.drafter_ms,
        three.host_ms,
        three.plan_ms,
        three.context_ms,
        three.predicted_over_measured,
        three.realised_over_planned,
        three.planned_over_plain,
    ):
        assert math.isnan(nan)


def test_gaps_between_steps_of_the_same_requests_and_adoptions(tmp_path: Path) -> None:
    """The gap after a decode step counts when the next record decodes the same requests (its
    context is this one's plus what this one emitted), with the adoptions it carries taken out
    and reported apart; a request swap (a wait for a handoff), a prefill step and unstamped
    records give no gap."""
    t = 1000.0
    recs: list[StepRecord] = []

    def add(r: int, b: int, ctx: int, step: float, gap: float, **kw: object) -> None:
        nonlocal t
        recs.append(
            StepRecord(
                step=len(recs),
                num_reqs=r,
                num_tokens=b,
                num_prefill_tokens=kw.pop("prefill", 0),
                num_decode_reqs=r,
                kv_tokens=ctx + b,
                step_seconds=step,
                started_at=t,
                **kw,
            )
        )
        t += step + gap

    # two requests, drafting: 2 anchors + 3 accepted emitted a step, contexts 100 + 5 each step
    add(2, 8, 100, 0.010, 0.0006, num_accepted=3)
    add(2, 8, 105, 0.010, 0.0021, num_accepted=3)  # an adoption of 1.5 ms rides in this gap
    add(2, 8, 110, 0.010, 0.0300, num_accepted=3, adopt_seconds=0.0015)
    # a request left and another joined after 30 ms (context 40 less, not 5 more): no gap
    add(2, 8, 75, 0.010, 0.0004, num_accepted=3)
    add(2, 40, 80, 0.030, 0.0005, prefill=32)  # a prefill step follows: no gap either
    add(2, 8, 112, 0.010, 0.0, num_accepted=3)  # the log's last record: no gap
    log = _write(tmp_path / "lagged" / "decode0.steps.jsonl", recs)
    (two,) = steps.summarize("lagged", steps.read_steps(log))
    assert two.steps == 5
    assert two.gap_ms == pytest.approx((0.6 + (2.1 - 1.5)) / 2)
    assert two.adopt_ms == pytest.approx(1.5 / 5)
    unstamped = [dataclasses.replace(r, started_at=math.nan) for r in recs]
    (two,) = steps.summarize("lagged", steps.read_steps(_write(tmp_path / "u.jsonl", unstamped)))
    assert math.isnan(two.gap_ms)
    assert two.adopt_ms == pytest.approx(1.5 / 5)


def test_cli_reads_a_sweep_folder_and_writes_csv_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for policy, step in (("no-spec", 0.004), ("lagged", 0.003)):
        _write(tmp_path / "s" / policy / "decode0.steps.jsonl", [_rec(2, 2, step)] * 25)
    _write(tmp_path / "s" / "lagged" / "prefill0.steps.jsonl", [_rec(2, 2, 1.0)] * 25)
    out_csv, out_json = tmp_path / "r.csv", tmp_path / "r.json"
    assert steps.main([str(tmp_path / "s"), "--csv", str(out_csv), "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "lagged" in table and "no-spec" in table
    report = json.loads(out_json.read_text())
    assert report["command"].startswith("python -m dspark_sglang.bench.steps")
    rates = {r["policy"]: r["tok_per_s"] for r in report["rows"]}
    assert rates == pytest.approx({"no-spec": 500.0, "lagged": 2 / 0.003})
    assert report["rows"][0]["forward_ms"] is None  # NaN goes out as null
    assert out_csv.read_text().count("\n") == 3  # header + two rows
    # one policy's folder on its own, and the bins below --min-steps hidden
    assert steps.main([str(tmp_path / "s" / "lagged"), "--min-steps", "26"]) == 0
    assert "lagged" not in capsys.readouterr().out.split("\n", 1)[1]


def test_cli_errors_name_the_folder_or_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        steps.main([str(tmp_path / "missing")])
    assert e.value.code == 2 and "not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        steps.main([str(tmp_path / "empty")])
    assert "no decode0.steps.jsonl" in capsys.readouterr().err
    log = _write(tmp_path / "bad" / "decode0.steps.jsonl", [_rec(1, 1, 0.003)])
    log.write_bytes(log.read_bytes() + b"{not json\n")
    assert steps.main([str(tmp_path / "bad")]) == 2
    assert "decode0.steps.jsonl:2" in capsys.readouterr().err


def test_an_engines_records_read_back_token_for_token(tmp_path: Path) -> None:
    """The records of a real drafting engine, written as the serving worker writes them: one
    request's decode steps emitted every output token but the one its prompt step sampled."""
    target, drafter = write_model_pair(tmp_path / "pair")
    llm = LLM(
        str(target),
        draft_model=str(drafter),
        schedule_mode="fixed:2",
        max_running_requests=1,
        num_blocks=256,
    )
    recs: list[StepRecord] = []
    llm.on_step = recs.append
    sp = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    (out,) = llm.generate(["hello world"], sp)
    llm.close()
    log = _write(tmp_path / "run" / "decode0.steps.jsonl", recs)
    (row,) = steps.summarize("fixed:2", steps.read_steps(log))
    assert row.steps == sum(1 for r in recs if r.num_prefill_tokens == 0)
    assert row.tokens_per_step * row.steps == pytest.approx(len(out.output_ids) - 1)
    assert row.drafting_share > 0.0  # the test drafter is random: it drafts, few are accepted


def test_speed_at_identical_shapes_over_the_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Shapes both logs ran MIN_SHAPE_STEPS times compare; the rest (too few, or one log only)
    do not, nor do drafter runs that were resumed or drafted a few rows."""
    n = steps.MIN_SHAPE_STEPS

    def log(scale: float) -> list[StepRecord]:
        recs = []
        for r, b, fwd, drafter in (
            (1, 8, 0.006, 0.004),
            (2, 16, 0.008, 0.005),
            (8, 64, 0.02, 0.01),
        ):
            recs += [_rec(r, b, 0.02, forward_seconds=fwd * scale, draft_seconds=drafter * scale,
                          num_draft_reqs=r) for _ in range(n)]  # fmt: skip
        return recs

    slow = log(1.1) + [_rec(1, 4, 0.02, forward_seconds=1.0)] * n  # a shape the reference lacks
    slow += [_rec(1, 8, 0.02, forward_seconds=0.0066, draft_seconds=1.0, num_draft_reqs=1,
                  draft_resumed=True)] * (2 * n)  # fmt: skip
    slow += [_rec(2, 16, 0.02, forward_seconds=0.0088, draft_seconds=1.0,
                  num_draft_reqs=1)] * (2 * n)  # a probe of one row of two  # fmt: skip
    ref = log(1.0)[:-1]  # R = 8: one step short of counting
    _write(tmp_path / "s" / "verify-all" / "decode0.steps.jsonl", ref)
    _write(tmp_path / "s" / "lagged" / "decode0.steps.jsonl", slow)
    rows = steps.speed_rows(
        {"verify-all": [_to_step(r) for r in ref], "lagged": [_to_step(r) for r in slow]},
        "verify-all",
    )
    every = next(r for r in rows if r.r_hi == 0)
    assert (every.shapes, every.draft_sizes) == (2, 2)
    assert every.forward_ratio == pytest.approx(1.1) and every.drafter_ratio == pytest.approx(1.1)
    one = next(r for r in rows if r.r_hi == 1)
    assert one.shapes == 1 and one.forward_ratio == pytest.approx(1.1)
    out_json = tmp_path / "r.json"
    assert steps.main([str(tmp_path / "s"), "--json", str(out_json)]) == 0
    assert "time at identical shapes over verify-all's" in capsys.readouterr().out
    speed = json.loads(out_json.read_text())["speed"]
    assert {r["policy"] for r in speed} == {"lagged"}
    assert steps.main([str(tmp_path / "s"), "--speed-reference", "lagged"]) == 0
    assert "over lagged's" in capsys.readouterr().out


def _to_step(rec: StepRecord) -> steps._Step:
    return msgspec.json.decode(_ENC.encode(rec), type=steps._Step)


def test_trim_rows_pair_trimmed_drafting_steps_with_full_ones_nearby() -> None:
    """A trimmed drafting step (B < R x the most tokens a row) pairs with a full one at its R
    within TRIM_WINDOW steps; the row gives the measured and the predicted step ratio. Probes,
    resumed drafter runs, plain steps, other R and pairs too far apart do not count."""

    def st(r: int, b: int, secs: float, pred: float | None, **kw: object) -> steps._Step:
        return steps._Step(
            num_reqs=r, num_tokens=b, num_prefill_tokens=0, num_decode_reqs=r, kv_tokens=100,
            step_seconds=secs, predicted_seconds=pred, **kw,
        )  # fmt: skip

    d = {"draft_seconds": 0.01, "num_draft_reqs": 8}
    log = [
        st(8, 64, 0.040, 0.040, **d),  # full
        st(8, 52, 0.041, 0.036, **d),  # trimmed: ran longer, the model expected 10 % less
        st(8, 8, 0.015, 0.015),  # plain
        st(8, 40, 0.030, 0.030, probe=True, **d),
        st(8, 44, 0.050, 0.030, draft_resumed=True, **d),
        st(4, 20, 0.020, 0.020, **{**d, "num_draft_reqs": 4}),  # another R, no full step
    ]
    log += [st(8, 8, 0.015, 0.015)] * steps.TRIM_WINDOW
    log.append(st(8, 48, 0.020, 0.020, **d))  # trimmed, too far from the full step
    rows = steps.trim_rows("lagged", log)
    assert [(r.r_lo, r.r_hi, r.pairs) for r in rows] == [(5, 8, 1), (0, 0, 1)]
    assert rows[0].tokens_share == pytest.approx(52 / 64)
    assert rows[0].measured == pytest.approx(0.041 / 0.040)
    assert rows[0].predicted == pytest.approx(0.036 / 0.040)
    assert steps.trim_rows("verify-all", log[:1]) == []  # no trimmed step
    assert steps.trim_rows("no-spec", [st(8, 8, 0.015, None)]) == []
    unpriced = [st(8, 64, 0.04, None, **d), st(8, 52, 0.04, None, **d)]
    assert steps.trim_rows("verify-all", unpriced) == []  # rows capped at their end, no model
