import json
import math
from pathlib import Path

import numpy as np
import pytest

from dspark_sglang.bench import host_speed
from dspark_sglang.bench.host_speed import MIN_CELL_STEPS, MIN_SHAPE_STEPS

SHAPES = [(1, 1), (1, 8), (2, 16), (4, 32)]


def _base(r: int, b: int) -> float:
    return 0.004 + 0.0001 * b + 0.0005 * r


def _write_run(
    tmp: Path,
    level: dict[str, float],
    host: np.ndarray,
    rng: np.random.Generator,
    steps_per_cell: int = 40,
) -> list[dict]:
    """Cells of `level`'s policies, pass after pass, one after another in time; cell (k, p) ran
    on a host `host[k, i]` times slower, and policy p's forwards are level[p] times the base.
    Returns the sweep's records, throughput = 100 / (level x host)."""
    raw, t = [], 1_000_000.0
    logs: dict[str, list[str]] = {p: [] for p in level}
    for k in range(host.shape[0]):
        for i, p in enumerate(level):
            start = t
            for _ in range(steps_per_cell):
                r, b = SHAPES[rng.integers(len(SHAPES))]
                fwd = _base(r, b) * level[p] * host[k, i] * math.exp(rng.normal(0, 0.02))
                rec = {
                    "num_reqs": r,
                    "num_tokens": b,
                    "num_prefill_tokens": 0,
                    "num_decode_reqs": r,
                    "step_seconds": fwd * 1.5,
                    "forward_seconds": fwd,
                    "started_at": t,
                }
                logs[p].append(json.dumps(rec))
                t += fwd * 1.5
            # a prefill step and an unstamped one: neither is a clock
            logs[p].append(json.dumps({**rec, "num_prefill_tokens": 7, "forward_seconds": 9.0}))
            logs[p].append(json.dumps({**rec, "started_at": None, "forward_seconds": 9.0}))
            raw.append(
                {
                    "policy": p,
                    "concurrency": 4,
                    "pass": k,
                    "output_throughput": 100.0 / (level[p] * host[k, i]),
                    "cell_start": start,
                    "cell_end": t,
                }
            )
            t += 5.0
    for p, lines in logs.items():
        (tmp / p).mkdir()
        (tmp / p / "decode0.steps.jsonl").write_text("\n".join(lines) + "\n")
    return raw


def test_each_cell_is_scaled_by_its_host_speed_and_a_policys_own_level_stays(tmp_path):
    rng = np.random.default_rng(0)
    level = {"a": 1.0, "b": 1.25}  # b's forwards are slower in every cell: the policy's own
    host = rng.uniform(0.8, 1.4, size=(8, 2))
    raw = _write_run(tmp_path, level, host, rng)
    out = host_speed.adjust(raw, tmp_path, list(level))
    assert [r["policy"] for r in out] == [r["policy"] for r in raw]  # copies, in order
    assert "host_speed_factor" not in raw[0]
    for p_i, p in enumerate(level):
        cells = [r for r in out if r["policy"] == p]
        f = np.array([r["host_speed_factor"] for r in cells])
        # relative to the deployment's own usual speed: proportional to the host's slowness
        np.testing.assert_allclose(
            f / np.median(f), host[:, p_i] / np.median(host[:, p_i]), rtol=0.03
        )
        adj = np.array([r["host_adjusted_output_throughput"] for r in cells])
        assert np.std(np.log(adj)) < 0.03 < np.std(np.log([r["output_throughput"] for r in cells]))
        assert all(r["host_speed_steps"] >= MIN_CELL_STEPS for r in cells)
    # b / a after scaling: the policies' own ratio (1 / 1.25), not the host's, and not undone
    a = np.median([r["host_adjusted_output_throughput"] for r in out if r["policy"] == "a"])
    b = np.median([r["host_adjusted_output_throughput"] for r in out if r["policy"] == "b"])
    assert b / a == pytest.approx(
        (1 / 1.25) * np.median(host[:, 0]) / np.median(host[:, 1]), rel=0.05
    )
    spread_before = host_speed.log_spread(raw, "output_throughput", "a", "b")
    spread_after = host_speed.log_spread(out, "host_adjusted_output_throughput", "a", "b")
    assert spread_after < 0.3 * spread_before


def test_rare_shapes_unstamped_steps_and_windowless_cells_give_no_factor(tmp_path):
    rng = np.random.default_rng(1)
    raw = _write_run(tmp_path, {"a": 1.0}, np.ones((2, 1)), rng, steps_per_cell=MIN_CELL_STEPS)
    steps = host_speed.read_forwards(tmp_path / "a")
    assert len(steps) == 2 * MIN_CELL_STEPS  # the prefill and the unstamped step are not clocks
    assert np.all(np.diff(steps[:, 0]) >= 0)
    ref = host_speed.reference(steps)
    counts = {s: int(np.sum((steps[:, 1] == s[0]) & (steps[:, 2] == s[1]))) for s in SHAPES}
    assert set(ref) == {s for s, n in counts.items() if n >= MIN_SHAPE_STEPS}
    # a cell with fewer steps at reference shapes than MIN_CELL_STEPS has no factor
    out = host_speed.adjust(raw, tmp_path, ["a"])
    assert all(r["host_speed_factor"] is None for r in out)
    assert all(r["host_adjusted_output_throughput"] is None for r in out)
    # nor does a record without a window, or a policy without a log
    raw2 = [{**raw[0], "cell_start": None}, {**raw[0], "policy": "zz"}]
    assert all(r["host_speed_factor"] is None for r in host_speed.adjust(raw2, tmp_path, ["a"]))


def test_log_spread_removes_each_concurrencys_mean_and_needs_pairs():
    raw = [
        {"policy": p, "concurrency": c, "pass": k, "x": v}
        for c, base in ((1, 1.0), (8, 3.0))
        for k, e in enumerate((0.1, -0.1, 0.0))
        for p, v in (("a", base * math.exp(e)), ("b", base))
    ]
    # deviations 0.1, -0.1, 0 around each c's mean (0), 2 dof per c
    assert host_speed.log_spread(raw, "x", "a", "b") == pytest.approx(math.sqrt(0.04 / 4))
    assert host_speed.log_spread(raw[:4], "x", "a", "b") is None


def test_the_reference_is_the_deployments_own_cells_at_the_same_concurrency(tmp_path):
    """One shape runs 1.3x slower at c = 32 than at c = 8 in every pass (longer contexts, which
    (R, B) leaves out): that is the load's, not the host's, and no c = 32 cell reads slow."""
    rng = np.random.default_rng(2)
    raw = _write_run(tmp_path, {"a": 1.0}, np.ones((6, 1)), rng)
    logs = tmp_path / "a" / "decode0.steps.jsonl"
    lines = logs.read_text().splitlines()
    slow = [r for r in raw if r["pass"] % 2]  # odd passes become c = 32 cells, 1.3x slower
    out_lines = []
    for line in lines:
        rec = json.loads(line)
        t = rec["started_at"]
        if t is not None and any(c["cell_start"] <= t <= c["cell_end"] for c in slow):
            rec["forward_seconds"] *= 1.3
        out_lines.append(json.dumps(rec))
    logs.write_text("\n".join(out_lines) + "\n")
    for r in slow:
        r["concurrency"] = 32
    out = host_speed.adjust(raw, tmp_path, ["a"])
    factors = [r["host_speed_factor"] for r in out]
    assert all(f == pytest.approx(1.0, abs=0.03) for f in factors)
