"""bench.step_kinds: time by step kind, and what each kind lost against the best steady one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from dspark_sglang.bench import step_kinds, steps
from dspark_sglang.bench.step_kinds import MIN_KIND_STEPS, kind_rows, step_kind
from dspark_sglang.types import StepRecord

_ENC = msgspec.json.Encoder()


def st(r: int, b: int, secs: float, accepted: int = 0, **kw: object) -> steps._Step:
    return steps._Step(
        num_reqs=r, num_tokens=b, num_prefill_tokens=0, num_decode_reqs=r, kv_tokens=100 * r,
        step_seconds=secs, num_accepted=accepted, **kw,
    )  # fmt: skip


D = {"draft_seconds": 0.005}  # a drafting step (num_draft_reqs 0: every row, as the engine's)


def test_a_step_is_the_first_kind_it_qualifies_for() -> None:
    """Probe before explore before resumed: an exploration step whose drafter also projected a
    backlog is an exploration; full needs every row drafted and B = R x the log's most a row."""
    assert step_kind(st(4, 4, 0.01), 8) == "plain"
    assert step_kind(st(4, 32, 0.02, **D), 8) == "full"
    assert step_kind(st(4, 30, 0.02, **D), 8) == "trimmed"  # a K below every draft
    assert step_kind(st(4, 32, 0.02, num_draft_reqs=2, **D), 8) == "trimmed"  # selective
    assert step_kind(st(4, 32, 0.02, num_draft_reqs=4, **D), 8) == "full"
    assert step_kind(st(4, 32, 0.02, draft_resumed=True, **D), 8) == "resumed"
    assert step_kind(st(4, 32, 0.02, explored=True, draft_resumed=True, **D), 8) == "explore"
    assert step_kind(st(4, 8, 0.02, probe=True, explored=True, **D), 8) == "probe"


def test_lost_seconds_are_against_the_best_steady_rate_at_the_same_r() -> None:
    """R = 4: plain steps make 400 tok/s, full drafting steps 600 (the reference), exploration
    300 and a probe 200; each kind's lost seconds are its seconds less its tokens at 600 tok/s.
    R = 3 has too few steady steps of its own: its exploration step reads the 3-4 bin's rate."""
    n = MIN_KIND_STEPS
    log = [st(4, 4, 0.01)] * n  # 4 tokens in 10 ms
    log += [st(4, 32, 0.02, accepted=8, **D)] * n  # 12 tokens in 20 ms
    log += [st(4, 32, 0.04, accepted=8, explored=True, **D)] * 2  # 12 in 40 ms
    log += [st(4, 8, 0.02, probe=True, **D)]  # 4 in 20 ms
    log += [st(3, 24, 0.03, accepted=6, explored=True, **D)]  # 9 in 30 ms
    rows = kind_rows("lagged", log)
    by = {(r.r_lo, r.kind): r for r in rows}
    ref = 600.0
    assert by[(3, "full")].lost_seconds == pytest.approx(0.0, abs=1e-12)
    assert by[(3, "plain")].lost_seconds == pytest.approx(n * (0.01 - 4 / ref))
    assert by[(3, "plain")].tok_per_s == pytest.approx(400.0)
    assert by[(3, "explore")].steps == 3
    assert by[(3, "explore")].lost_seconds == pytest.approx(2 * (0.04 - 12 / ref) + 0.03 - 9 / ref)
    assert by[(3, "probe")].lost_seconds == pytest.approx(0.02 - 4 / ref)
    total = n * 0.01 + n * 0.02 + 2 * 0.04 + 0.02 + 0.03
    assert by[(3, "full")].time_share == pytest.approx(n * 0.02 / total)
    assert by[(3, "probe")].lost_share == pytest.approx((0.02 - 4 / ref) / total)
    every = {r.kind: r for r in rows if r.r_hi == 0}  # the same steps over every R
    assert every["explore"].lost_seconds == pytest.approx(by[(3, "explore")].lost_seconds)
    assert [r.kind for r in rows if r.r_hi == 4] == ["plain", "full", "probe", "explore"]


def test_a_bin_without_a_steady_reference_reads_nan_and_one_kind_reads_nothing() -> None:
    few = [st(8, 64, 0.04, accepted=20, **D)] * (MIN_KIND_STEPS - 1)
    few.append(st(8, 64, 0.08, accepted=20, explored=True, **D))
    rows = kind_rows("lagged", few)
    assert rows and all(math.isnan(r.lost_seconds) for r in rows)
    assert all(r.steps > 0 and math.isfinite(r.tok_per_s) for r in rows)
    assert kind_rows("no-spec", [st(8, 8, 0.02)] * 30) == []  # plain only: nothing to split
    assert kind_rows("lagged", []) == []


def test_cli_prints_the_kinds_and_writes_them_to_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def rec(b: int, secs: float, **kw: object) -> StepRecord:
        return StepRecord(0, 4, b, 0, 4, 400, secs, **kw)

    recs = [rec(4, 0.01)] * 20 + [rec(32, 0.02, num_accepted=8, draft_seconds=0.005)] * 20
    recs.append(rec(32, 0.04, num_accepted=8, draft_seconds=0.005, explored=True))
    log = tmp_path / "s" / "lagged" / "decode0.steps.jsonl"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"".join(_ENC.encode(r) + b"\n" for r in recs))
    out = tmp_path / "r.json"
    assert steps.main([str(tmp_path / "s"), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "time by step kind" in table and "explore" in table
    kinds = json.loads(out.read_text())["kinds"]
    explore = [k for k in kinds if k["kind"] == "explore" and k["r_hi"] == 4]
    assert explore and explore[0]["lost_seconds"] == pytest.approx(0.04 - 12 / 600)
    # --min-kind-steps hides a bin's rare kinds, never the every-R rows
    assert steps.main([str(tmp_path / "s"), "--json", str(out), "--min-kind-steps", "2"]) == 0
    kinds = json.loads(out.read_text())["kinds"]
    assert [k["r_hi"] for k in kinds if k["kind"] == "explore"] == [0]
    with pytest.raises(SystemExit):
        steps.main([str(tmp_path / "s"), "--min-kind-steps", "0"])
    assert "--min-kind-steps" in capsys.readouterr().err
    step_kinds.print_kinds([])  # nothing to print: prints nothing
    assert capsys.readouterr().out == ""
