"""Move capacity profiles and STS calibrations between our formats and SGLang 0.5.23's
(docs/sglang.md §5): engine_profiles YAML <-> SPS JSON (1-D `SpsCostTable` and additive
`SpsAdditiveCostTable`), our sts.json <-> SGLang's STS JSON. Plain dicts and files; imports config,
algo and capacity_profile, never sglang or torch, so operators convert without either installed.

Pricing, not layout, is what must survive: SGLang floors B to its probes and interpolates the
additive form on the raw M = R + K, we ceil B to the graph tier it replays. Written tables place
their probes so SGLang's own lookup returns our price for every integer B up to the largest tier.
Each file we write also embeds its source under the key "dspark" (SGLang ignores unknown keys);
reading it back returns that source exactly when the numbers still match it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from dspark_sglang.algo.capacity import (
    AdditiveModel,
    CapacityModel,
    Curve,
    TableModel,
)
from dspark_sglang.capacity_profile import (
    EngineProfile,
    Parallelism,
    Provenance,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
    tool_version,
)
from dspark_sglang.config import ConfigError

READINGS = ("probes", "floor")


def _int_probe(x: float, where: str) -> int:
    if not float(x).is_integer():
        raise ConfigError(f"{where}: SGLang needs integer probes, got {x}")
    return int(x)


def _diag_reqs(tokens: np.ndarray, gamma: int) -> np.ndarray:
    """R on SGLang's profiling diagonal (every request verifies γ+1 tokens) for B tokens."""
    return np.maximum(1, np.round(tokens / (gamma + 1))).astype(np.int64)


def _tier_probes(buckets: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(probe M, tier priced there): each tier b_i is held flat on [b_{i-1} + 1, b_i], so
    interpolation between probes never leaves a plateau on integer M."""
    probes, tiers, prev = [], [], 0
    for b in buckets:
        for m in sorted({prev + 1, b}):
            probes.append(m)
            tiers.append(b)
        prev = b
    return probes, tiers


def _drop_flat_tail(xs: list, ys: list) -> tuple[list, list]:
    """SGLang clamps past the last probe, so a trailing knot equal to the one before is noise."""
    while len(xs) > 1 and ys[-1] == ys[-2]:
        xs, ys = xs[:-1], ys[:-1]
    return xs, ys


def profile_to_sps(profile: EngineProfile, *, kind: str = "auto", ctx: int = 0) -> dict[str, Any]:
    """An SGLang SPS JSON dict pricing like `profile.model` at KV context `ctx` (SGLang's table
    has no context term). kind: "auto" keeps the form (table -> 1-D, additive -> additive),
    "table" writes the 1-D table along SGLang's profiling diagonal R = B / (γ + 1)."""
    m, gamma = profile.model, profile.gamma
    if kind not in ("auto", "table"):
        raise ConfigError(f"kind: expected 'auto' or 'table', got {kind!r}")
    meta = {"source": profile_to_dict(profile), "ctx": ctx, "kind": kind}
    buckets = m.form.buckets
    if isinstance(m.form, TableModel) or kind == "table":
        grid = buckets or tuple(int(v) for v in m.form.theta.knots)  # type: ignore[union-attr]
        b = np.asarray(grid, np.int64)
        secs = m.step_seconds(_diag_reqs(b, gamma), b, ctx)
        return {
            # Floor lookup with a probe at b_{i-1} + 1 prices (b_{i-1}, b_i] at tier b_i.
            "sample_batch_tokens": [1, *(int(v) + 1 for v in b[:-1])],
            "sample_steps_per_sec": [float(1.0 / s) for s in secs],
            "max_batch_tokens": int(b[-1]),
            "dspark": meta,
        }
    form = m.form
    if buckets:
        probes, tiers = _tier_probes(buckets)
    else:
        probes = [_int_probe(k, "model.params.theta.knots") for k in form.theta.knots]
        tiers = probes
    mm = np.asarray(probes, np.int64)
    reqs = _diag_reqs(mm, gamma)
    bias = float(form.bias_s + form.kappa_s * ctx)
    # θ'(M) = T(R_d, M) - bias' - α(R_d): exact for every R unless a live `scale` multiplies α.
    theta = m.step_seconds(reqs, np.asarray(tiers), ctx) - bias - form.alpha(reqs)
    r_knots = [_int_probe(k, "model.params.alpha.knots") for k in form.alpha.knots]
    r_max = int(buckets[-1]) if buckets else int(mm[-1])
    if r_max > r_knots[-1] and len(r_knots) > 1:  # our α keeps its last slope; SGLang clamps
        r_knots.append(r_max)
    alpha = [float(v) for v in form.alpha(np.asarray(r_knots, np.float64))]
    r_knots, alpha = _drop_flat_tail(r_knots, alpha)
    m_list, t_list = _drop_flat_tail([int(v) for v in mm], [float(v) for v in theta])
    return {
        "bias_seconds": bias,
        "bs_probes": r_knots,
        "alpha_seconds": alpha,
        "m_probes": m_list,
        "theta_seconds": t_list,
        "dspark": meta,
    }


def _flat_right(knots: list[float], values: list[float]) -> Curve:
    """A Curve that, like SGLang's `_interp_clamped`, stays flat past its last knot."""
    if len(knots) > 1 and values[-1] != values[-2]:
        knots, values = [*knots, knots[-1] + 1.0], [*values, values[-1]]
    return Curve(tuple(float(k) for k in knots), tuple(float(v) for v in values))


def sps_to_model(data: dict[str, Any], *, reading: str = "probes") -> CapacityModel:
    """A CapacityModel from SGLang SPS JSON. The additive form prices as SGLang does; for the
    1-D table, reading="floor" reproduces SGLang's floor lookup; "probes" reads each probe as a
    measured forward of that many tokens, priced for B up to it (our ceil-bucket pricing)."""
    if reading not in READINGS:
        raise ConfigError(f"reading: expected one of {list(READINGS)}, got {reading!r}")
    if "bias_seconds" in data:
        # SGLang's OLS dummies may go negative; shifting both curves to >= 0 into the bias keeps
        # every T(R, M) and satisfies our non-negative curves.
        a, t = list(data["alpha_seconds"]), list(data["theta_seconds"])
        a_min, t_min = min(a), min(t)
        form = AdditiveModel(
            bias_s=float(data["bias_seconds"]) + a_min + t_min,
            alpha=_flat_right(list(data["bs_probes"]), [v - a_min for v in a]),
            theta=_flat_right(list(data["m_probes"]), [v - t_min for v in t]),
        )
        return CapacityModel.from_dict(CapacityModel(form).to_dict(), "sps")  # validates
    probes = [int(p) for p in data["sample_batch_tokens"]]
    secs = [1.0 / float(s) for s in data["sample_steps_per_sec"]]
    if reading == "floor":
        buckets = [p - 1 for p in probes[1:]] + [int(data["max_batch_tokens"])]
    else:
        buckets = probes
    return CapacityModel.from_dict(
        {"kind": "table", "params": {"buckets": buckets, "seconds": secs}}, "sps"
    )


def sps_to_profile(
    data: dict[str, Any],
    *,
    reading: str = "probes",
    name: str | None = None,
    gamma: int | None = None,
    hardware: str = "unknown",
    target: str = "unknown",
    parallelism: Parallelism | None = None,
    command: str = "python -m dspark_sglang.sglang_convert sps-to-profile",
) -> EngineProfile:
    """An engine profile from SGLang SPS JSON: the embedded source if the numbers still match it,
    else a conversion (`sps_to_model`) labelled with the given fields."""
    meta = data.get("dspark")
    if isinstance(meta, dict) and "source" in meta:
        src = profile_from_dict(meta["source"])
        again = profile_to_sps(src, kind=meta.get("kind", "auto"), ctx=meta.get("ctx", 0))
        strip = lambda d: {k: v for k, v in d.items() if k != "dspark"}
        if strip(again) == strip(data):
            return src
    if gamma is None:
        raise ConfigError("gamma: SGLang's SPS JSON does not record γ; pass --gamma")
    model = sps_to_model(data, reading=reading)
    return EngineProfile(
        name=name or "from-sglang-sps",
        engine="sglang",
        hardware=hardware,
        target=target,
        drafter=None,
        parallelism=parallelism or Parallelism(),
        gamma=gamma,
        buckets=model.form.buckets,
        model=model,
        provenance=Provenance(
            kind="measured",
            command=command,
            date=dt.date.today().isoformat(),
            version=tool_version(),
            notes=f"converted from SGLang SPS JSON ({reading} reading of the 1-D probes)"
            if "bias_seconds" not in data
            else "converted from SGLang additive SPS JSON",
        ),
    )


def rebase_buckets(model: CapacityModel, tiers: tuple[int, ...]) -> CapacityModel:
    """The same model priced at another engine's graph tiers: the additive form keeps its curves
    and ceils to `tiers`; the table is re-sampled at them (linear between its measured buckets)."""
    if not tiers or tuple(tiers) == model.form.buckets:
        return model
    if isinstance(model.form, AdditiveModel):
        return replace(model, form=replace(model.form, buckets=tuple(tiers)))
    secs = Curve(model.form.buckets, model.form.seconds)(np.asarray(tiers, np.float64))
    return replace(model, form=TableModel(tuple(int(v) for v in tiers), tuple(secs.tolist())))


def read_capacity_model(path: str) -> CapacityModel:
    """Our profile YAML, or SGLang SPS JSON read as measured probes (`sps_to_model`)."""
    if path.endswith(".json"):
        return sps_to_model(json.loads(Path(path).read_text()))
    return load_profile(path).model


def sps_for_sglang(path: str) -> dict[str, Any]:
    """The SPS JSON dict SGLang should load for a profile (ours converted, SGLang's as is)."""
    data = json.loads(Path(path).read_text()) if path.endswith(".json") else None
    data = data or profile_to_sps(load_profile(path))
    return {k: v for k, v in data.items() if k != "dspark"}


# ---- STS -----------------------------------------------------------------------------------


def _temperatures(d: Any, where: str) -> list[float]:
    t = d.get("temperatures") if isinstance(d, dict) else None
    ok = isinstance(t, list) and t and all(isinstance(x, int | float) for x in t)
    if not ok or not all(math.isfinite(x) and x > 0 for x in t):
        raise ConfigError(f"{where}.temperatures: expected a non-empty list of positive numbers")
    return [float(x) for x in t]


def sts_to_sglang(ours: dict[str, Any]) -> dict[str, Any]:
    """Our sts.json (`python -m dspark_sglang.calibrate`) -> SGLang's DSparkStsCalibration JSON."""
    return {
        "temperatures": _temperatures(ours, "sts"),
        "dataset": str(ours.get("dataset", "")),
        "num_samples": int(ours.get("rounds", 0)),
        "ece_before": [float(x) for x in ours.get("ece_before", [])],
        "ece_after": [float(x) for x in ours.get("ece_after", [])],
        "dspark": {"source": ours},
    }


def sts_from_sglang(theirs: dict[str, Any], *, source: str = "") -> dict[str, Any]:
    """SGLang's STS JSON -> our sts.json; the embedded source when its temperatures still match."""
    temps = _temperatures(theirs, "sts")
    src = (theirs.get("dspark") or {}).get("source")
    if isinstance(src, dict) and src.get("temperatures") == temps:
        return src
    return {
        "temperatures": temps,
        "rounds": int(theirs.get("num_samples", 0)),
        "ece_before": [float(x) for x in theirs.get("ece_before", [])],
        "ece_after": [float(x) for x in theirs.get("ece_after", [])],
        "dataset": str(theirs.get("dataset", "")),
        "command": f"python -m dspark_sglang.sglang_convert sts-from-sglang {source}".strip(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


# ---- CLI -----------------------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_sglang.sglang_convert", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("profile-to-sps", help="engine_profiles YAML -> SGLang SPS JSON")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--kind", choices=("auto", "table"), default="auto")
    p.add_argument("--ctx", type=int, default=0, help="KV tokens to fold into the bias")
    p = sub.add_parser("sps-to-profile", help="SGLang SPS JSON -> engine_profiles YAML")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--reading", choices=READINGS, default="probes")
    p.add_argument("--gamma", type=int)
    p.add_argument("--name")
    p.add_argument("--hardware", default="unknown")
    p.add_argument("--target", default="unknown")
    for name, help_ in (("sts-to-sglang", "our sts.json -> SGLang"), ("sts-from-sglang", "back")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("src")
        p.add_argument("dst")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "profile-to-sps":
            out = profile_to_sps(load_profile(args.src), kind=args.kind, ctx=args.ctx)
        elif args.cmd == "sps-to-profile":
            prof = sps_to_profile(
                _read_json(args.src),
                reading=args.reading,
                name=args.name,
                gamma=args.gamma,
                hardware=args.hardware,
                target=args.target,
            )
            save_profile(prof, args.dst)
            return 0
        elif args.cmd == "sts-to-sglang":
            out = sts_to_sglang(_read_json(args.src))
        else:
            out = sts_from_sglang(_read_json(args.src), source=args.src)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(args.dst).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
