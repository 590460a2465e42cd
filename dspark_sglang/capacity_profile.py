"""engine_profiles/*.yaml (DESIGN §4): load, validate and save engine profiles, fit one from the
`python -m dspark_sglang.profile` report, derive the analytic DeepSeek-V4-like MoE profiles.
Imports config, algo and yaml (safe_load only); never engine, models or a device."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from dspark_sglang.algo.capacity import (
    AdditiveModel,
    CapacityModel,
    Curve,
    ExpertParallelTerm,
    as_increasing,
    as_int,
    get_field,
)
from dspark_sglang.algo.capacity_fit import fit_additive, fit_table
from dspark_sglang.config import ConfigError

ENGINES = ("reference", "sglang")
PROVENANCE_KINDS = ("measured", "analytic")
TOP_KEYS = (
    "name",
    "engine",
    "hardware",
    "target",
    "drafter",
    "parallelism",
    "gamma",
    "buckets",
    "model",
    "provenance",
)
HEADER = "# Engine capacity profile: schema and derivations in docs/capacity.md (DESIGN §4).\n"


@dataclass(frozen=True, slots=True)
class Parallelism:
    tp: int = 1
    ep: int = 1
    dp: int = 1


@dataclass(frozen=True, slots=True)
class Provenance:
    kind: str  # "measured" | "analytic"
    command: str  # what produced the file
    date: str  # ISO date or datetime
    version: str  # the tool that wrote it
    notes: str = ""  # for analytic: which public numbers it derives from


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One (engine, hardware, target, drafter, parallelism) capacity profile."""

    name: str
    engine: str
    hardware: str
    target: str  # the target model served
    drafter: str | None
    parallelism: Parallelism
    gamma: int
    buckets: tuple[int, ...]  # executed verify-token buckets (graph tiers); () = exact B
    model: CapacityModel
    provenance: Provenance


def _text(d: Any, key: str, where: str = "", *, optional: bool = False) -> str | None:
    x = get_field(d, key, where, None if optional else ...)
    if x is None and optional:
        return None
    if not isinstance(x, str) or not x.strip():
        raise ConfigError(
            f"{where + '.' if where else ''}{key}: expected a non-empty string, got {x!r}"
        )
    return x


def _choice(d: Any, key: str, options: tuple[str, ...], where: str = "") -> str:
    x = get_field(d, key, where)
    if x not in options:
        raise ConfigError(
            f"{where + '.' if where else ''}{key}: expected one of {list(options)}, got {x!r}"
        )
    return x


def _date(x: Any) -> str | None:
    if isinstance(x, dt.date):  # YAML reads a bare 2026-01-31 as a date
        return x.isoformat()
    try:
        return x if isinstance(x, str) and dt.datetime.fromisoformat(x) else None
    except ValueError:
        return None


def profile_from_dict(d: Any) -> EngineProfile:
    """Validate a profile mapping; a ConfigError names the offending field by its dotted path."""
    if not isinstance(d, dict):
        raise ConfigError(f"profile: expected a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - set(TOP_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown field (expected {', '.join(TOP_KEYS)})")
    par = get_field(d, "parallelism", "")
    parallelism = Parallelism(
        *(
            as_int(get_field(par, k, "parallelism"), f"parallelism.{k}", 1)
            for k in ("tp", "ep", "dp")
        )
    )
    raw_buckets = get_field(d, "buckets", "")
    buckets = as_increasing(raw_buckets, "buckets", integer=True, allow_empty=True)
    model_d = get_field(d, "model", "")
    params = get_field(model_d, "params", "model")
    if isinstance(params, dict) and "buckets" not in params:
        # The profile's buckets are the executed tiers; the model inherits them unless it says so.
        model_d = {**model_d, "params": {**params, "buckets": list(buckets)}}
    model = CapacityModel.from_dict(model_d, "model")
    if model.form.buckets != buckets:
        raise ConfigError(f"model.params.buckets: {list(model.form.buckets)} != buckets")
    if model.moe is not None and model.moe.ep_size != parallelism.ep:
        raise ConfigError(
            f"model.params.moe.ep_size: {model.moe.ep_size} != parallelism.ep {parallelism.ep}"
        )
    prov = get_field(d, "provenance", "")
    date = _date(get_field(prov, "date", "provenance"))
    if date is None:
        raise ConfigError(f"provenance.date: expected an ISO date, got {prov['date']!r}")
    notes = get_field(prov, "notes", "provenance", "")
    if not isinstance(notes, str):
        raise ConfigError(f"provenance.notes: expected a string, got {notes!r}")
    return EngineProfile(
        name=_text(d, "name"),
        engine=_choice(d, "engine", ENGINES),
        hardware=_text(d, "hardware"),
        target=_text(d, "target"),
        drafter=_text(d, "drafter", optional=True),
        parallelism=parallelism,
        gamma=as_int(get_field(d, "gamma", ""), "gamma", 1),
        buckets=buckets,
        model=model,
        provenance=Provenance(
            kind=_choice(prov, "kind", PROVENANCE_KINDS, "provenance"),
            command=_text(prov, "command", "provenance"),
            date=date,
            version=_text(prov, "version", "provenance"),
            notes=notes,
        ),
    )


def profile_to_dict(p: EngineProfile) -> dict[str, Any]:
    return {
        "name": p.name,
        "engine": p.engine,
        "hardware": p.hardware,
        "target": p.target,
        "drafter": p.drafter,
        "parallelism": {"tp": p.parallelism.tp, "ep": p.parallelism.ep, "dp": p.parallelism.dp},
        "gamma": p.gamma,
        "buckets": list(p.buckets),
        "model": p.model.to_dict(),
        "provenance": {
            "kind": p.provenance.kind,
            "command": p.provenance.command,
            "date": p.provenance.date,
            "version": p.provenance.version,
            "notes": p.provenance.notes,
        },
    }


def load_profile(path: str | Path) -> EngineProfile:
    """Read and validate one YAML profile; errors read `<path>: <field>: <problem>`."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read profile: {e}") from None
    try:
        return profile_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


class _Dumper(yaml.SafeDumper):
    """Block mappings, inline lists: a curve reads as two lines of numbers."""


_Dumper.add_representer(
    list, lambda d, x: d.represent_sequence("tag:yaml.org,2002:seq", x, flow_style=True)
)


def save_profile(profile: EngineProfile | dict[str, Any], path: str | Path) -> None:
    """Validate, then write YAML (lists of numbers inline; floats round-trip exactly)."""
    p = profile if isinstance(profile, EngineProfile) else profile_from_dict(profile)
    text = yaml.dump(profile_to_dict(p), Dumper=_Dumper, sort_keys=False, width=100)
    Path(path).write_text(HEADER + text)


def tool_version() -> str:
    try:
        return f"dspark_sglang {version('dspark-sglang')}"
    except PackageNotFoundError:
        return "dspark_sglang (not installed)"


# ---- measured: from `python -m dspark_sglang.profile --json` ---------------------------------


def _crossovers(hw: dict[str, Any]) -> str:
    """`--cpu-gemm auto`'s measured choice, for the provenance notes."""
    cross = hw.get("cpu_gemm_crossovers")
    if not isinstance(cross, dict) or not cross:
        return ""
    onednn = [
        f"{shape} at {span[0]}-{span[1]} rows" if span[1] is not None else f"{shape} from {span[0]}"
        for shape, span in cross.items()
        if isinstance(span, list | tuple) and len(span) == 2
    ]
    return "; oneDNN " + (", ".join(onednn) if onednn else "for none") + ", MKL otherwise"


def profile_from_report(
    report: dict[str, Any],
    *,
    name: str,
    gamma: int,
    engine: str = "reference",
    target: str | None = None,
    drafter: str | None = None,
    kind: str = "additive",
    buckets: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Fit a profile dict from the profile CLI's JSON report (its `points` hold R, B,
    tokens_per_req, per-request ctx and median_s). ctx becomes KV tokens attended by the batch,
    R·(ctx + tokens_per_req), as in StepRecord.kv_tokens. `buckets` default to the report's
    `row_tiers` (the token counts the profiled engine executes at; none: exact B). The result is
    validated."""
    if buckets is None:
        raw = (report.get("row_tiers") or []) if isinstance(report, dict) else []
        buckets = as_increasing(raw, "report.row_tiers", integer=True, allow_empty=True)
    points = get_field(report, "points", "report")
    if not isinstance(points, list) or not points:
        raise ConfigError("report.points: expected a non-empty list of timing points")
    cols = {
        k: np.asarray([get_field(p, k, "report.points[]") for p in points], np.float64)
        for k in ("R", "B", "tokens_per_req", "ctx", "median_s")
    }
    kv = cols["R"] * (cols["ctx"] + cols["tokens_per_req"])
    if kind == "additive":
        form = fit_additive(cols["R"], cols["B"], kv, cols["median_s"], buckets=buckets)
    elif kind == "table":
        grid = buckets or tuple(int(b) for b in np.unique(cols["B"]))
        form, buckets = fit_table(cols["B"], cols["median_s"], grid), grid
    else:
        raise ConfigError(f"kind: expected 'additive' or 'table', got {kind!r}")
    draft = None
    draft_points = report.get("draft_points") or []
    if draft_points:  # the drafter's seconds per R (never falling as R grows)
        r = np.asarray([get_field(p, "R", "report.draft_points[]") for p in draft_points], float)
        t = np.asarray([get_field(p, "median_s", "report.draft_points[]") for p in draft_points])
        order = np.argsort(r)
        draft = Curve(tuple(r[order].tolist()), tuple(np.maximum.accumulate(t[order]).tolist()))
    hw = report.get("hardware", {})
    hardware = f"{hw.get('cpu', 'unknown cpu')} x{hw.get('num_threads', '?')} threads"
    if hw.get("gpu"):
        hardware = f"{hw['gpu']} ({hardware})"
    out = {
        "name": name,
        "engine": engine,
        "hardware": hardware,
        "target": target or report.get("model", "unknown"),
        "drafter": drafter,
        "parallelism": {"tp": 1, "ep": 1, "dp": 1},
        "gamma": gamma,
        "buckets": list(buckets),
        "model": CapacityModel(form, draft=draft).to_dict(),
        "provenance": {
            "kind": "measured",
            "command": report.get("command", "python -m dspark_sglang.profile"),
            "date": report.get("date", dt.date.today().isoformat()),
            "version": tool_version(),
            "notes": f"{len(points)} points, {len(draft_points)} drafter points, dtype "
            f"{report.get('dtype')}"
            + (f", drafter {report['draft_dtype']}" if "draft_dtype" in report else "")
            + f", device {report.get('device')}"
            + (f" ({hw['cpu_gemm']} fp32 products{_crossovers(hw)})" if "cpu_gemm" in hw else "")
            + f", torch {report.get('torch')}; "
            f"fit_{kind} in algo/capacity_fit",
        },
    }
    return profile_to_dict(profile_from_dict(out))


def live_profile(
    model: CapacityModel,
    *,
    name: str,
    hardware: str,
    target: str,
    drafter: str | None,
    ep: int,
    gamma: int,
    command: str,
    notes: str,
) -> dict[str, Any]:
    """A running engine's capacity model, as its live estimator last published it, as a
    validated profile dict (GET /capacity?format=profile). `--capacity-profile` starts an engine
    from it: the live scale, drafter and host terms included, which that engine's estimator keeps
    and corrects on top of (LiveEstimator: a prior that already carries a scale)."""
    out = {
        "name": name,
        "engine": "reference",
        "hardware": hardware,
        "target": target,
        "drafter": drafter,
        "parallelism": {"tp": 1, "ep": ep, "dp": 1},
        "gamma": gamma,
        "buckets": list(model.form.buckets),
        "model": model.to_dict(),
        "provenance": {
            "kind": "measured",
            "command": command,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "version": tool_version(),
            "notes": notes,
        },
    }
    return profile_to_dict(profile_from_dict(out))


# ---- analytic: DeepSeek-V4-like MoE on H200 (derivation in docs/capacity.md) -----------------

# Public numbers. H200 SXM datasheet: HBM3e 4.8 TB/s; dense FP8 tensor 1979 TFLOPS (3958 is with
# 2:4 sparsity); NVLink 4 900 GB/s bidirectional = 450 GB/s per direction. ConnectX-7 NDR IB:
# 400 Gb/s = 50 GB/s per direction, one NIC per GPU.
H200 = {"hbm_Bps": 4.8e12, "fp8_flops": 1979e12, "nvlink_Bps": 450e9, "ib_Bps": 50e9}
# Shape: the public DeepSeek-V3 config.json (the latest DeepSeek MoE whose full shape is public;
# V4's drafter also uses 256 routed experts, peers.md §0). FP8 weights, BF16 MLA latent KV cache.
DSV3 = {
    "layers": 61,
    "dense_layers": 3,
    "hidden": 7168,
    "dense_inter": 18432,
    "moe_inter": 2048,
    "experts": 256,
    "top_k": 8,
    "shared": 1,
    "heads": 128,
    "q_lora": 1536,
    "kv_lora": 512,
    "rope": 64,
    "nope": 128,
    "v_head": 128,
    "vocab": 129280,
}
# Assumptions, not public numbers: achieved fractions of peak, and a per dispatch-or-combine floor
# (kernel launch + signalling). docs/capacity.md checks the result against DeepEP's published
# low-latency timings.
EFFICIENCY = {"hbm": 0.7, "flops": 0.6, "link": 0.7}
A2A_LATENCY_S = {"nvlink": 10e-6, "ib": 25e-6}
ANALYTIC_SETUPS = {
    # EP8: one 8xH200 node, TP8 attention, experts over NVLink. EP32: four nodes, TP8 attention
    # in each (DP4), experts over IB; 24 of 32 ranks are on other nodes.
    8: {"tp": 8, "dp": 1, "link": "nvlink", "remote": 7 / 8, "max_tokens": 1024},
    32: {"tp": 8, "dp": 4, "link": "ib", "remote": 24 / 32, "max_tokens": 2048},
}
ANALYTIC_DATE = "2026-11-30"  # when the derivation was last revised
# Verify-token graph tiers (an SGLang-like capture ladder; an assumption of the analytic profiles).
GRAPH_TIERS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
GRAPH_TIERS = (*GRAPH_TIERS, 640, 768, 896, 1024, 1536, 2048)


def analytic_terms(ep: int) -> dict[str, float]:
    """The derived per-step quantities of docs/capacity.md for one setup (seconds, bytes)."""
    m, s, eff = DSV3, ANALYTIC_SETUPS[ep], EFFICIENCY
    h = m["hidden"]
    attn = (
        h * m["q_lora"]
        + m["q_lora"] * m["heads"] * (m["nope"] + m["rope"])
        + h * (m["kv_lora"] + m["rope"])
        + m["kv_lora"] * m["heads"] * (m["nope"] + m["v_head"])
        + m["heads"] * m["v_head"] * h
    )
    moe_layers = m["layers"] - m["dense_layers"]
    expert = 3 * h * m["moe_inter"]
    dense = (
        m["layers"] * attn
        + m["dense_layers"] * 3 * h * m["dense_inter"]
        + moe_layers * m["shared"] * expert
        + m["vocab"] * h
    )
    link_Bps = H200["nvlink_Bps"] if s["link"] == "nvlink" else H200["ib_Bps"]
    return {
        "dense_params": float(dense),
        "expert_params": float(expert),
        "moe_layers": float(moe_layers),
        "experts_per_rank": m["experts"] / ep,
        "bias_s": dense / s["tp"] / (eff["hbm"] * H200["hbm_Bps"]),
        "dense_s_per_token": 2 * dense / s["tp"] / s["dp"] / (eff["flops"] * H200["fp8_flops"]),
        "kappa_s": m["layers"]
        * (m["kv_lora"] + m["rope"])
        * 2
        / s["dp"]
        / (eff["hbm"] * H200["hbm_Bps"]),
        "expert_read_s": expert / (eff["hbm"] * H200["hbm_Bps"]),
        "expert_s_per_pair": 2 * expert / (eff["flops"] * H200["fp8_flops"]),
        "link_s_per_pair": h * (1 + 2) * s["remote"] / (eff["link"] * link_Bps),
        "a2a_base_s": moe_layers * 2 * A2A_LATENCY_S[s["link"]],
    }


def analytic_profile(ep: int) -> EngineProfile:
    """Roofline profile of a DeepSeek-V4-like target on H200 at EP8 or EP32 (docs/capacity.md)."""
    s, t = ANALYTIC_SETUPS[ep], analytic_terms(ep)
    buckets = tuple(b for b in GRAPH_TIERS if b <= s["max_tokens"])
    b = np.asarray(buckets, np.float64)
    # Dense part: max(weight stream, compute); bias is the stream, θ the compute excess over it.
    theta = np.maximum(0.0, b * t["dense_s_per_token"] - t["bias_s"])
    # MoE on the busiest rank with load L pairs per layer: max(read the experts it touches,
    # compute L pairs) + receive L pairs over the link, times the MoE layers.
    loads = np.concatenate(([0.0], 2.0 ** np.arange(15)))
    e_r = t["experts_per_rank"]
    touched = e_r * (1.0 - (1.0 - 1.0 / e_r) ** loads)
    per_layer = np.maximum(touched * t["expert_read_s"], loads * t["expert_s_per_pair"])
    moe_s = t["moe_layers"] * (per_layer + loads * t["link_s_per_pair"])
    model = CapacityModel(
        form=AdditiveModel(
            bias_s=t["bias_s"],
            alpha=Curve((1.0,), (0.0,)),
            theta=Curve(tuple(b.tolist()), tuple(theta.tolist())),
            kappa_s=t["kappa_s"],
            buckets=buckets,
        ),
        moe=ExpertParallelTerm(
            num_experts=DSV3["experts"],
            top_k=DSV3["top_k"],
            ep_size=ep,
            load=Curve(tuple(loads.tolist()), tuple(moe_s.tolist())),
            a2a_base_s=t["a2a_base_s"],
        ),
    )
    nodes = ep // 8
    return EngineProfile(
        name=f"dsv4-like-h200-ep{ep}",
        engine="sglang",
        hardware=f"{nodes}x8 H200 SXM (141 GB HBM3e)" + (", CX7 400G IB" if nodes > 1 else ""),
        target="DeepSeek-V4-like MoE (DeepSeek-V3 public shape: 61 layers, 256 experts top-8)",
        drafter="DSpark (gamma 5, as the DSV4-Flash-0731 drafter block)",
        parallelism=Parallelism(tp=s["tp"], ep=ep, dp=s["dp"]),
        gamma=5,
        buckets=buckets,
        model=model,
        provenance=Provenance(
            kind="analytic",
            command=f"python -c 'from dspark_sglang.capacity_profile import *; "
            f'save_profile(analytic_profile({ep}), "engine_profiles/dsv4-like-h200-ep{ep}.yaml")\'',
            date=ANALYTIC_DATE,
            version=tool_version(),
            notes="Roofline from public numbers: H200 HBM3e 4.8 TB/s, FP8 1979 dense TFLOPS, "
            "NVLink 450 GB/s per direction, CX7 IB 50 GB/s per direction; DeepSeek-V3 config "
            "shape. Assumed: 70% of HBM and link peak, 60% of FLOPs, a2a floor "
            f"{A2A_LATENCY_S[s['link']] * 1e6:.0f} us per dispatch or combine, uniform expert "
            "popularity (the live estimator replaces it). See docs/capacity.md.",
        ),
    )
