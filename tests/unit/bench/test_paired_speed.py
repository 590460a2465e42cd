"""bench.paired_speed: identical-shape times compared cell by cell (bench.steps --cells)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import msgspec
import pytest

from dspark_sglang.bench import paired_speed, steps
from dspark_sglang.types import StepRecord

_ENC = msgspec.json.Encoder()


def _cell_steps(t0: float, fwd: float, draft: float, n: int = 6) -> list[StepRecord]:
    """n drafting R = 2 steps at B = 16 (and n plain ones at B = 2) from unix time t0."""
    out = []
    for i in range(n):
        for b, d in ((16, draft), (2, 0.0)):
            out.append(
                StepRecord(
                    step=i,
                    num_reqs=2,
                    num_tokens=b,
                    num_prefill_tokens=0,
                    num_decode_reqs=2,
                    kv_tokens=400,
                    step_seconds=fwd + d + 0.001,
                    forward_seconds=fwd,
                    draft_seconds=d,
                    num_draft_reqs=2 if d else 0,
                    started_at=t0 + len(out) * 0.02,
                )
            )
    return out


def _cells_and_logs(
    slow_pass: int, spell: float
) -> tuple[list[dict[str, object]], dict[str, list[StepRecord]]]:
    """Two passes at c = 2, each with a verify-all cell and, 5 s later, a lagged one. Lagged's
    forward and drafter take 1.05x verify-all's in both passes; in `slow_pass` the host ran
    `spell` times slower during lagged's cell only (a slow spell seconds long)."""
    cells, logs = [], {"verify-all": [], "lagged": []}
    for k in range(2):
        for j, policy in enumerate(("verify-all", "lagged")):
            t0 = 100.0 * k + 5.0 * j
            f = 0.008 * (1.05 if policy == "lagged" else 1.0)
            f *= spell if (k == slow_pass and policy == "lagged") else 1.0
            logs[policy] += _cell_steps(t0, f, f / 2)
            cells.append({"policy": policy, "concurrency": 2, "pass": k,
                          "cell_start": t0, "cell_end": t0 + 1.0})  # fmt: skip
    return cells, logs


def _read(logs: dict[str, list[StepRecord]], tmp: Path) -> dict[str, list]:
    out = {}
    for policy, recs in logs.items():
        path = tmp / policy / "decode0.steps.jsonl"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"".join(_ENC.encode(r) + b"\n" for r in recs))
        out[policy] = steps.read_steps(path)
    return out


def test_pairs_cells_of_one_pass_and_c_and_reads_each_pairs_ratio(tmp_path: Path) -> None:
    """Equal host in both passes: every pair reads 1.05, forward and drafter, with no spread.
    The plain B = 2 steps are a shape of their own; R = 2 is its own bin and 'all'."""
    cells, logs = _cells_and_logs(slow_pass=-1, spell=1.0)
    rows = paired_speed.paired_rows(_read(logs, tmp_path), cells, "verify-all")
    assert [(r.policy, r.r_lo, r.r_hi) for r in rows] == [("lagged", 2, 2), ("lagged", 0, 0)]
    for r in rows:
        assert r.forward_pairs == 2 and r.drafter_pairs == 2
        assert r.forward_ratio == pytest.approx(1.05) and r.drafter_ratio == pytest.approx(1.05)
        assert r.forward_lo == pytest.approx(1.05) and r.forward_hi == pytest.approx(1.05)


def test_a_slow_spell_in_one_cell_widens_the_interval_instead_of_hiding(tmp_path: Path) -> None:
    """A spell 1.5x slow over lagged's cell of one pass: the pairs read 1.05 and 1.575, the
    geometric mean sits between, and the 90 % interval spans both (two pairs: wide)."""
    cells, logs = _cells_and_logs(slow_pass=1, spell=1.5)
    (r, _) = paired_speed.paired_rows(_read(logs, tmp_path), cells, "verify-all")
    assert r.forward_ratio == pytest.approx(math.sqrt(1.05 * 1.575))
    assert r.forward_lo < 1.05 and r.forward_hi > 1.575


def test_a_cell_without_its_partner_or_too_few_steps_counts_no_pair_nor_unstamped_steps(
    tmp_path: Path,
) -> None:
    cells, logs = _cells_and_logs(slow_pass=-1, spell=1.0)
    cells = [c for c in cells if not (c["policy"] == "verify-all" and c["pass"] == 1)]
    logs["lagged"] += _cell_steps(500.0, 0.009, 0.004, n=paired_speed.MIN_CELL_STEPS - 1)
    logs["lagged"].insert(0, dataclasses.replace(logs["lagged"][0], started_at=math.nan))
    cells.append({"policy": "lagged", "concurrency": 2, "pass": 2,
                  "cell_start": 500.0, "cell_end": 501.0})  # fmt: skip
    cells.append({"policy": "verify-all", "concurrency": 2, "pass": 2,
                  "cell_start": 600.0, "cell_end": 601.0})  # fmt: skip
    (r, _) = paired_speed.paired_rows(_read(logs, tmp_path), cells, "verify-all")
    assert r.forward_pairs == 1 and r.forward_ratio == pytest.approx(1.05)
    assert math.isnan(r.forward_lo)  # one pair: no interval


def test_steps_cli_with_cells_prints_and_writes_the_paired_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cells, logs = _cells_and_logs(slow_pass=-1, spell=1.0)
    for policy, recs in logs.items():
        path = tmp_path / "logs" / policy / "decode0.steps.jsonl"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"".join(_ENC.encode(r) + b"\n" for r in recs))
    sweep = tmp_path / "sweep.jsonl"
    sweep.write_text("".join(json.dumps(c) + "\n" for c in cells))
    out = tmp_path / "rep.json"
    argv = [str(tmp_path / "logs"), "--cells", str(sweep), "--json", str(out)]
    assert steps.main(argv) == 0
    assert "paired cell by cell" in capsys.readouterr().out
    paired = json.loads(out.read_text())["speed_paired"]
    assert paired[0]["forward_pairs"] == 2
    assert paired[0]["forward_ratio"] == pytest.approx(1.05)
    with pytest.raises(SystemExit):
        steps.main([str(tmp_path / "logs"), "--cells", str(tmp_path / "none.jsonl")])
    assert "--cells" in capsys.readouterr().err
