"""Profile YAML <-> SGLang SPS JSON and sts.json <-> SGLang STS JSON: SGLang's own loaders read what
we write and price it like our model; both directions round-trip."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

from dspark_sglang.capacity_profile import load_profile, profile_to_dict
from dspark_sglang.sglang_convert import (
    main,
    profile_to_sps,
    rebase_buckets,
    sps_to_model,
    sps_to_profile,
    sts_from_sglang,
    sts_to_sglang,
)
from tests.sglang.conftest import GAMMA, TIERS, make_profile

ROOT = Path(__file__).resolve().parents[2]
EP8 = ROOT / "engine_profiles" / "dsv4-like-h200-ep8.yaml"


def sglang_table(data: dict) -> object:
    from sglang.srt.speculative.dspark_components.dspark_sps import load_sps_table_from_path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "sps.json"
        path.write_text(json.dumps(data))
        return load_sps_table_from_path(str(path))  # SGLang's loader, unknown keys ignored


def test_table_profile_prices_identically_under_sglangs_floor_lookup() -> None:
    prof = make_profile()
    table = sglang_table(profile_to_sps(prof))
    for b in range(1, TIERS[-1] + 1):
        assert 1.0 / table.lookup(b) == pytest.approx(prof.model.predict(1, b), rel=1e-12)
    assert sps_to_profile(profile_to_sps(prof)) == prof  # embedded source, exact


def test_additive_ep_profile_prices_identically_under_sglangs_interpolation() -> None:
    prof = load_profile(EP8)
    for ctx in (0, 50_000):
        data = profile_to_sps(prof, ctx=ctx)
        table = sglang_table(data)
        for r in (1, 7, 64, 200):
            b = np.arange(r, 1025)
            ours = prof.model.step_seconds(r, b, ctx)
            theirs = [table.step_time(num_reqs=r, budget=int(x) - r) for x in b]
            np.testing.assert_allclose(theirs, ours, rtol=1e-12)
    assert sps_to_profile(data) == prof
    one_d = sglang_table(profile_to_sps(prof, kind="table"))  # SGLang's diagonal 1-D table
    assert 1.0 / one_d.lookup(48) == pytest.approx(prof.model.predict(8, 48), rel=1e-12)


def test_sglang_tables_round_trip_through_our_profile() -> None:
    """A profiler-style table (OLS dummies may be negative) -> ours -> SGLang prices the same."""
    theirs = {
        "bias_seconds": 0.012,
        "bs_probes": [1, 8, 32],
        "alpha_seconds": [0.0, -0.0004, 0.002],
        "m_probes": [8, 64, 256, 512],
        "theta_seconds": [-0.001, 0.0, 0.004, 0.011],
    }
    prof = sps_to_profile(theirs, gamma=GAMMA)
    back = profile_to_sps(prof)
    a, b = sglang_table(theirs), sglang_table(back)
    for r in (1, 5, 8, 20, 32, 40):
        for m in range(r, 700, 7):
            want = a.step_time(num_reqs=r, budget=m - r)
            assert b.step_time(num_reqs=r, budget=m - r) == pytest.approx(want, rel=1e-12)
            assert prof.model.predict(r, m) == pytest.approx(want, rel=1e-12)
    one_d = {"sample_batch_tokens": [8, 16, 32], "sample_steps_per_sec": [90.0, 80.0, 50.0]}
    one_d["max_batch_tokens"] = 48
    floor = sps_to_profile(one_d, gamma=GAMMA, reading="floor")
    again = profile_to_sps(floor)
    for b_ in range(1, 49):
        assert sglang_table(again).lookup(b_) == pytest.approx(sglang_table(one_d).lookup(b_))
    assert again["sample_batch_tokens"][1:] == one_d["sample_batch_tokens"][1:]


def test_probes_reading_is_ceil_bucket_pricing() -> None:
    """Each probe measured a forward of that size: B = 9..16 replays the 16 graph, priced there
    (SGLang's floor lookup would price it at SPS(8), sglang_dspark.md §4 deviation 2)."""
    m = sps_to_model(
        {"sample_batch_tokens": [8, 16, 32], "sample_steps_per_sec": [100, 50, 25]}
        | {"max_batch_tokens": 32}
    )
    assert [m.predict(1, b) for b in (8, 9, 16, 17)] == [0.01, 0.02, 0.02, 0.04]


def test_rebase_to_sglangs_captured_tiers() -> None:
    prof = load_profile(EP8)
    tiers = (8, 16, 32, 64, 128, 256, 512)
    add = rebase_buckets(prof.model, tiers)
    assert add.form.buckets == tiers and add.predict(4, 40) == prof.model.predict(4, 64)
    tab = rebase_buckets(make_profile().model, (4, 12, 32))  # a 12 graph: between 8 and 16
    assert tab.predict(1, 10) == pytest.approx((0.011 + 0.012) / 2)


def test_sts_round_trips_and_sglang_loads_it(tmp_path: Path) -> None:
    from sglang.srt.speculative.dspark_components.dspark_sts import (
        load_sts_calibration_from_path,
    )

    ours = {
        "temperatures": [0.8, 1.1, 1.4, 2.0],
        "rounds": 900,
        "ece_before": [0.1] * 4,
        "ece_after": [0.02] * 4,
        "auroc_before": [0.7] * 4,
        "auroc_after": [0.7] * 4,
        "command": "python -m dspark_sglang.calibrate",
        "date": "2026-11-30T00:00:00+00:00",
        "dataset": "heldout",
    }
    path = tmp_path / "sts_sglang.json"
    path.write_text(json.dumps(sts_to_sglang(ours)))
    cal = load_sts_calibration_from_path(str(path))
    assert cal.temperatures == ours["temperatures"] and cal.num_samples == 900
    assert sts_from_sglang(json.loads(path.read_text())) == ours
    theirs = json.loads(cal.to_json())  # SGLang's own writer drops our "dspark" key
    mine = sts_from_sglang(theirs)
    assert mine["temperatures"] == ours["temperatures"] and mine["rounds"] == 900
    assert json.loads(cal.__class__.from_json(json.dumps(sts_to_sglang(mine))).to_json()) == theirs


def test_cli_round_trip(tmp_path: Path) -> None:
    sps, yml = tmp_path / "sps.json", tmp_path / "back.yaml"
    assert main(["profile-to-sps", str(EP8), str(sps)]) == 0
    assert main(["sps-to-profile", str(sps), str(yml)]) == 0
    assert profile_to_dict(load_profile(yml)) == profile_to_dict(load_profile(EP8))
    data = json.loads(sps.read_text())
    del data["dspark"]
    sps.write_text(json.dumps(data))
    assert main(["sps-to-profile", str(sps), str(yml)]) == 2  # γ unknown without our key
    assert main(["sps-to-profile", str(sps), str(yml), "--gamma", "5", "--name", "x"]) == 0
    assert load_profile(yml).model.predict(8, 40) == pytest.approx(
        load_profile(EP8).model.predict(8, 40), rel=1e-12
    )
