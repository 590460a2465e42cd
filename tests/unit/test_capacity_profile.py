"""engine_profiles/: schema validation naming the field, YAML round trip, the shipped analytic
profiles (regenerable, labelled, sane), and the measured path from the profile CLI's JSON."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from dspark_sglang.algo.capacity import Curve, expected_max_rank_load
from dspark_sglang.capacity_profile import (
    DSV3,
    analytic_profile,
    analytic_terms,
    load_profile,
    profile_from_dict,
    profile_from_report,
    profile_to_dict,
    save_profile,
)
from dspark_sglang.config import ConfigError

PROFILES = Path(__file__).resolve().parents[2] / "engine_profiles"


def measured_dict() -> dict[str, Any]:
    """A small valid measured profile with a table model, a live scale and no MoE term."""
    return {
        "name": "cpu-test",
        "engine": "reference",
        "hardware": "x86_64 x2 threads",
        "target": "synthetic:tiny-moe",
        "drafter": None,
        "parallelism": {"tp": 1, "ep": 1, "dp": 1},
        "gamma": 4,
        "buckets": [1, 2, 4, 8],
        "model": {
            "kind": "table",
            "version": 3,
            "params": {
                "seconds": [0.004, 0.005, 0.007, 0.011],
                "scale": {"knots": [1, 8], "values": [1.0, 1.2]},
            },
        },
        "provenance": {
            "kind": "measured",
            "command": "python -m dspark_sglang.profile --quick",
            "date": "2026-11-30",
            "version": "dspark_sglang 0.1.0",
            "notes": "",
        },
    }


def test_yaml_round_trip(tmp_path: Path) -> None:
    for p in (profile_from_dict(measured_dict()), analytic_profile(32)):
        path = tmp_path / f"{p.name}.yaml"
        save_profile(p, path)
        assert load_profile(path) == p
        assert yaml.safe_load(path.read_text()) == profile_to_dict(p)
    # The table inherits the profile's buckets and predicts with its live scale.
    m = profile_from_dict(measured_dict()).model
    assert m.form.buckets == (1, 2, 4, 8) and m.version == 3
    assert m.predict(1, 3) == pytest.approx(0.007 * (1.0 + 0.2 * 3 / 7))


def _set(d: dict[str, Any], path: str, value: object) -> None:
    keys = path.split(".")
    for k in keys[:-1]:
        d = d[k]
    if value is KeyError:
        del d[keys[-1]]
    else:
        d[keys[-1]] = value


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("name", KeyError, "name: missing"),
        ("name", "", "name:"),
        ("engine", "vllm", "engine:"),
        ("hardware", 8, "hardware:"),
        ("drafter", 3, "drafter:"),
        ("parallelism.ep", "eight", "parallelism.ep:"),
        ("parallelism.tp", 0, "parallelism.tp:"),
        ("parallelism", [1, 1, 1], "parallelism:"),
        ("gamma", 0, "gamma:"),
        ("buckets", [4, 2], "buckets:"),
        ("modle", {}, "modle: unknown field"),
        ("model.kind", "curve", "model.kind:"),
        ("model.params.seconds", [0.1, 0.2], "model.params.seconds:"),
        ("model.params.buckets", [1, 2, 4, 16], "model.params.buckets:"),
        ("model.params.scale.values", [1.0, -1.0], "model.params.scale.values"),
        ("provenance.kind", "guess", "provenance.kind:"),
        ("provenance.command", KeyError, "provenance.command: missing"),
        ("provenance.date", "last tuesday", "provenance.date:"),
        ("provenance.notes", ["x"], "provenance.notes:"),
    ],
)
def test_schema_errors_name_the_field(path: str, value: object, field: str) -> None:
    d = measured_dict()
    _set(d, path, value)
    with pytest.raises(ConfigError) as e:
        profile_from_dict(d)
    assert str(e.value).startswith(field), str(e.value)


def test_moe_ep_size_must_match_parallelism() -> None:
    d = profile_to_dict(analytic_profile(8))
    d["parallelism"]["ep"] = 16
    with pytest.raises(ConfigError, match=r"^model\.params\.moe\.ep_size: 8 != parallelism\.ep"):
        profile_from_dict(d)


def test_load_profile_prefixes_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    d = measured_dict()
    d["gamma"] = "four"
    bad.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match=r"bad\.yaml: gamma: expected an integer"):
        load_profile(bad)
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read profile"):
        load_profile(bad)
    bad.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_profile(bad)


# ---- the shipped analytic profiles ----------------------------------------------------------


@pytest.mark.parametrize("ep", [8, 32])
def test_shipped_analytic_profiles_are_regenerable_and_labelled(ep: int) -> None:
    p = load_profile(PROFILES / f"dsv4-like-h200-ep{ep}.yaml")
    assert p.provenance.kind == "analytic"
    for public in ("4.8 TB/s", "1979", "450 GB/s", "50 GB/s", "docs/capacity.md"):
        assert public in p.provenance.notes
    assert p.model == analytic_profile(ep).model, "regenerate with provenance.command"
    assert p.parallelism.ep == ep and p.model.moe is not None and p.model.moe.ep_size == ep
    assert p.buckets == p.model.form.buckets


def test_analytic_profiles_are_sane() -> None:
    ep8, ep32 = analytic_profile(8).model, analytic_profile(32).model
    for m in (ep8, ep32):
        sps = m.sps_array(64, 1024, 64 * 2048)
        assert np.all(np.diff(sps[1:]) <= 0) and np.all(sps[1:] > 0)
        assert 1e-3 < m.predict(1, 1) < 0.02 and m.predict(256, 1024, 10**6) < 0.2
    # EP8 reads ~82 GB of routed experts per GPU per step once every expert is touched.
    t8 = analytic_terms(8)
    per_gpu = t8["experts_per_rank"] * t8["expert_params"] * t8["moe_layers"]
    assert 80e9 < per_gpu < 84e9
    assert ep8.predict(1, 1024) > 0.8 * per_gpu / 4.8e12  # HBM bound, at 70% efficiency
    # Imbalance bites harder at EP32 (8 experts per rank, receive over IB).
    w = 1.0 / np.arange(1, 257) ** 1.0
    skew = tuple(np.random.default_rng(0).permutation(w / w.sum()).tolist())
    gaps = []
    for m in (ep8, ep32):
        hot = replace(m, moe=replace(m.moe, popularity=skew))
        gaps.append(hot.predict(64, 512) / m.predict(64, 512))
    assert 1.0 < gaps[0] < gaps[1], gaps


def test_ep32_link_model_is_near_deepep_published_timings() -> None:
    """DeepEP's legacy low-latency table (H800 + CX7 400G, 128 tokens per rank, hidden 7168,
    top-8, FP8 dispatch, BF16 combine): EP32 dispatch 155 us + combine 273 us = 428 us per
    layer. Our per-layer model at the same load lands within 40% and errs high (it is 29%)."""
    t = analytic_terms(32)
    load = expected_max_rank_load((1.0,) * 256, 32, 8, 128 * 32)  # busiest rank's pairs
    ours = t["a2a_base_s"] / t["moe_layers"] + load * t["link_s_per_pair"]
    assert 428e-6 <= ours <= 1.4 * 428e-6, ours
    assert DSV3["hidden"] == 7168 and DSV3["top_k"] == 8


# ---- measured: from `python -m dspark_sglang.profile` ----------------------------------------


def synthetic_report() -> dict[str, Any]:
    """A profile report whose points follow T = 2 ms + 30 us·R + 100 us·B + 5 ns·KV tokens."""
    pts = []
    for kind, r, tpr in [("decode", b, 1) for b in (1, 2, 4, 8, 16, 32)] + [
        ("verify", r, 1 + lv) for r in (1, 4, 16) for lv in (0, 3, 7)
    ]:
        for ctx in (64, 512):
            b = r * tpr
            t = 2e-3 + 30e-6 * r + 100e-6 * b + 5e-9 * r * (ctx + tpr)
            pts.append(
                {
                    "kind": kind,
                    "R": r,
                    "B": b,
                    "tokens_per_req": tpr,
                    "ctx": ctx,
                    "median_s": t,
                    "p10_s": t,
                    "p90_s": t,
                    "repeats": 5,
                }
            )
    return {
        "tool": "dspark_sglang.profile",
        "model": "synthetic:tiny-moe",
        "dtype": "float32",
        "device": "cpu",
        "torch": "2.x",
        "hardware": {"cpu": "x86_64", "num_threads": 2},
        "date": "2026-11-30T07:00:00+00:00",
        "command": "python -m dspark_sglang.profile --json",
        "points": pts,
    }


def test_profile_from_report_fits_the_points(tmp_path: Path) -> None:
    report = synthetic_report()
    d = profile_from_report(report, name="cpu-synthetic", gamma=4)
    assert d["provenance"]["kind"] == "measured" and d["provenance"]["date"] == report["date"]
    assert d["hardware"] == "x86_64 x2 threads" and d["target"] == "synthetic:tiny-moe"
    save_profile(d, tmp_path / "cpu.yaml")
    m = load_profile(tmp_path / "cpu.yaml").model
    assert m.form.kappa_s == pytest.approx(5e-9, rel=0.05)
    for p in report["points"]:
        kv = p["R"] * (p["ctx"] + p["tokens_per_req"])
        assert m.predict(p["R"], p["B"], kv) == pytest.approx(p["median_s"], rel=0.02)
    table = profile_from_report(report, name="cpu-table", gamma=4, kind="table")
    assert table["model"]["kind"] == "table"
    assert table["buckets"] == sorted({p["B"] for p in report["points"]})
    with pytest.raises(ConfigError, match="kind"):
        profile_from_report(report, name="x", gamma=4, kind="cubic")


def test_the_notes_say_what_cpu_gemm_auto_chose() -> None:
    report = synthetic_report()
    report["hardware"] |= {
        "cpu_gemm": "auto",
        "cpu_gemm_crossovers": {"256x4096": [2, 63], "256x256": None, "64x4096": [4, None]},
    }
    notes = profile_from_report(report, name="x", gamma=4)["provenance"]["notes"]
    want = "(auto fp32 products; oneDNN 256x4096 at 2-63 rows, 64x4096 from 4, MKL otherwise)"
    assert want in notes
    report["hardware"]["cpu_gemm_crossovers"] = {"256x256": None}
    notes = profile_from_report(report, name="x", gamma=4)["provenance"]["notes"]
    assert "(auto fp32 products; oneDNN for none, MKL otherwise)" in notes


def test_profile_cli_json_feeds_a_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real CLI's --json output is accepted as is (the `--write-profile` path)."""
    from dspark_sglang.profile import main

    argv = [
        "--quick",
        "--json",
        "--batch-sizes",
        "1,4",
        "--verify-lens",
        "0,3",
        "--num-reqs",
        "2",
        "--context-len",
        "16",
        "--repeats",
        "2",
        "--warmup",
        "1",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    d = profile_from_report(copy.deepcopy(report), name="cpu-quick", gamma=4)
    save_profile(d, tmp_path / "cpu.yaml")
    m = load_profile(tmp_path / "cpu.yaml").model
    assert isinstance(m.form.theta, Curve) and m.predict(1, 1) > 0
    # A smooth fit of a few noisy points: within a factor 2 of every measured median.
    for p in report["points"]:
        kv = p["R"] * (p["ctx"] + p["tokens_per_req"])
        assert 0.5 < m.predict(p["R"], p["B"], kv) / p["median_s"] < 2.0


def test_a_live_model_saves_as_a_profile_an_engine_starts_from(tmp_path: Path) -> None:
    """GET /capacity?format=profile: a live model (its scale, drafter and host terms) saved as a
    profile loads back equal, and an estimator started from it prices steps as the live one."""
    from dspark_sglang.algo.capacity_fit import LiveEstimator
    from dspark_sglang.capacity_profile import live_profile
    from dspark_sglang.types import StepRecord

    prior = profile_from_dict(measured_dict()).model
    prior = replace(prior, scale=None, draft=Curve((1.0, 8.0), (0.001, 0.004)))
    est = LiveEstimator(prior)
    rng = np.random.default_rng(2)
    for t in range(200):  # 1.3x slower than the prior, a drafter 2x its price, host work
        r = int(rng.choice([1, 2, 4]))
        fwd = 1.3 * float(prior.predict(r, 2 * r, 0))
        d = 2 * float(prior.draft_seconds(r)) if t % 2 else 0.0  # every other step drafts
        y = fwd + 0.0005 + d
        rec = StepRecord(t, r, 2 * r, 0, r, 0, y, draft_seconds=d / 4, forward_seconds=fwd)
        est.observe(rec)
    live = est.model
    assert live.version > 0 and live.scale is not None and live.host is not None
    d = live_profile(
        live,
        name="live-decode0",
        hardware="cpu (x86_64, 1 threads)",
        target="synthetic:tiny-moe",
        drafter="drafters/dspark",
        ep=1,
        gamma=4,
        command="python -m dspark_sglang.launch_server --role decode",
        notes="test",
    )
    assert d["provenance"]["kind"] == "measured" and d["model"]["version"] == live.version
    save_profile(d, tmp_path / "live.yaml")
    loaded = load_profile(tmp_path / "live.yaml").model
    assert loaded == live
    again = LiveEstimator(loaded).model
    for r, b in ((1, 1), (2, 6), (4, 8)):
        assert again.predict(r, b, 0, drafted=True) == pytest.approx(
            live.predict(r, b, 0, drafted=True)
        )
    with pytest.raises(ConfigError, match=r"parallelism\.ep"):
        live_profile(
            live,
            name="x",
            hardware="h",
            target="t",
            drafter=None,
            ep=0,
            gamma=4,
            command="c",
            notes="",
        )
