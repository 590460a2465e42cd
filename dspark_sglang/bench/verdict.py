"""`python -m dspark_sglang.bench.verdict`: how far a sweep's goal verdict can be trusted.

Issue 9's goal reads one sweep: at every c, lagged's median throughput over passes >= the best
rival's median x 0.97. On a noisy host that test fails a policy that ties the best rival often
(the best of several noisy medians is biased upwards), so this module fits the host's noise to
the sweep's own per-pass records and reports, per c, a 90 % interval for lagged / best rival and
the chance that the verdict passes for a lagged that ties the best rival and for one as fast as
measured. Pure numpy over per-pass records (the sweep's JSONL); imports nothing from the engine.

Model: log throughput of policy p in pass n = mu_p + delta_n + eps, eps ~ N(0, sigma^2) i.i.d.
The pass effect delta_n is the host's drift, which interleaving makes common to every policy of
a pass; sigma is what is left, pooled over concurrencies (the residual of the two-way fit).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

THRESHOLD = 0.97  # the goal: lagged >= best rival - 3 %
DRAWS = 20000
MAX_PASSES = 64  # the largest pass count passes_needed tries


@dataclass(frozen=True, slots=True)
class Table:
    """One concurrency's complete per-pass log throughputs: y[p, n] for policies x passes."""

    concurrency: int
    policies: tuple[str, ...]
    passes: tuple[int, ...]
    y: np.ndarray  # [P, N] natural log of tok/s


@dataclass(frozen=True, slots=True)
class Noise:
    """Residual sd of the two-way fit, pooled over tables, and its degrees of freedom."""

    sigma: float
    dof: int


@dataclass(frozen=True, slots=True)
class CellVerdict:
    concurrency: int
    passes: int
    best_rival: str
    # the sweep's verdict, median(lagged) / max over rivals of median(rival); medians of log
    # tok/s, so with an even pass count the middle two are averaged geometrically
    ratio: float
    paired_ratio: float  # exp(mu_lagged - mu_best) from the two-way fit
    paired_ratio_lo: float  # 90 % interval (t over the pooled sigma's dof)
    paired_ratio_hi: float
    log_se: float  # standard error of log(paired_ratio)
    p_pass_if_tie: float  # P(verdict passes) when lagged's true mean is the best rival's
    p_pass_if_as_measured: float  # P(verdict passes) at the fitted means (a re-run)
    # The rival with the best median is the one the noise favoured most, so paired_ratio leans
    # low when rivals are close. The goal's "lagged >= every rival - 3 %" is a statement about
    # the smallest of lagged / rival over the rivals: its 90 % interval from Bonferroni intervals
    # of every pair (each pair's difference is unbiased; the bound holds whenever all do).
    best_ratio_lo: float = math.nan
    best_ratio_hi: float = math.nan
    # log(lagged / rival) from the two-way fit, every rival (same se: log_se)
    rival_log_ratios: dict[str, float] = field(default_factory=dict)


def _every(policy: str) -> bool:
    return True


def tables(
    raw: Sequence[dict[str, Any]],
    key: str = "output_throughput",
    keep: Callable[[str], bool] = _every,
) -> list[Table]:
    """Per c, a complete table: the kept policies measured (> 0) in the most passes, over the
    passes they all share; a policy missing a pass is left out of that c."""
    by: dict[int, dict[str, dict[int, float]]] = {}
    for r in raw:
        v = r.get(key)
        if v is None or not v > 0 or not keep(r["policy"]):
            continue
        by.setdefault(r["concurrency"], {}).setdefault(r["policy"], {})[r.get("pass", 0)] = v
    out = []
    for c, per in sorted(by.items()):
        most = max(len(v) for v in per.values())
        pols = sorted(p for p, v in per.items() if len(v) == most)
        passes = sorted(set.intersection(*(set(per[p]) for p in pols)))
        if len(passes) < 1:
            continue
        y = np.log(np.array([[per[p][n] for n in passes] for p in pols], dtype=float))
        out.append(Table(c, tuple(pols), tuple(passes), y))
    return out


def fit(t: Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two-way additive fit: policy means mu [P], pass effects delta [N] (summing to 0), and
    residuals [P, N]."""
    grand = float(t.y.mean())
    mu = t.y.mean(axis=1)
    delta = t.y.mean(axis=0) - grand
    resid = t.y - mu[:, None] - delta[None, :]
    return mu, delta, resid


def pooled_noise(ts: Sequence[Table]) -> Noise | None:
    """sigma from every table's residuals: sum of squares over (P - 1)(N - 1) dof per table.
    None when no table has two policies and two passes."""
    ss, dof = 0.0, 0
    for t in ts:
        p, n = t.y.shape
        if p >= 2 and n >= 2:
            ss += float((fit(t)[2] ** 2).sum())
            dof += (p - 1) * (n - 1)
    if dof == 0:
        return None
    return Noise(math.sqrt(ss / dof), dof)


def pass_rate(
    mu_lagged: float,
    mu_rivals: np.ndarray,
    passes: int,
    sigma: float,
    rng: np.random.Generator,
    draws: int = DRAWS,
    threshold: float = THRESHOLD,
) -> float:
    """P(median over `passes` of lagged >= threshold x the best rival's median) when each pass
    adds N(0, sigma^2) to every log throughput (the pass effect is common to all policies and
    cancels in the ratio)."""
    if passes < 1 or mu_rivals.size == 0:
        return math.nan
    z = rng.standard_normal((draws, 1 + mu_rivals.size, passes)) * sigma
    med = np.median(z, axis=2)
    lag = mu_lagged + med[:, 0]
    best = (mu_rivals[None, :] + med[:, 1:]).max(axis=1)
    return float(np.mean(lag - best >= math.log(threshold)))


def _t_quantiles(dof: int, q: Sequence[float], rng: np.random.Generator) -> np.ndarray:
    """Student-t quantiles by simulation (numpy has no t quantile function)."""
    z = rng.standard_normal(DRAWS * 5)
    s = np.sqrt(rng.chisquare(dof, DRAWS * 5) / dof)
    return np.quantile(z / s, q)


def assess(
    ts: Sequence[Table],
    rivals: Callable[[str], bool],
    lagged: str = "lagged",
    seed: int = 0,
    threshold: float = THRESHOLD,
) -> tuple[Noise | None, list[CellVerdict]]:
    """Per c holding lagged and a rival: the sweep's ratio, the paired ratio to the best rival
    with a 90 % interval, and the verdict's pass rates if lagged ties that rival / is as fast as
    measured, all under the pooled noise."""
    noise = pooled_noise(ts)
    rng = np.random.default_rng(seed)
    out: list[CellVerdict] = []
    if noise is None:
        return None, out
    tq = _t_quantiles(noise.dof, (0.05, 0.95), rng)
    for t in ts:
        if lagged not in t.policies:
            continue
        riv = [i for i, p in enumerate(t.policies) if rivals(p)]
        if not riv:
            continue
        li = t.policies.index(lagged)
        n = t.y.shape[1]
        med = np.median(t.y, axis=1)
        bi = max(riv, key=lambda i: med[i])
        mu = fit(t)[0]
        d = float(mu[li] - mu[bi])
        se = noise.sigma * math.sqrt(2.0 / n)
        dr = {t.policies[i]: float(mu[li] - mu[i]) for i in riv}
        bq = _t_quantiles(noise.dof, (0.05 / len(riv), 1.0 - 0.05 / len(riv)), rng)
        out.append(
            CellVerdict(
                concurrency=t.concurrency,
                passes=n,
                best_rival=t.policies[bi],
                ratio=float(math.exp(med[li] - med[bi])),
                paired_ratio=math.exp(d),
                paired_ratio_lo=math.exp(d + tq[0] * se),
                paired_ratio_hi=math.exp(d + tq[1] * se),
                log_se=se,
                p_pass_if_tie=pass_rate(
                    float(mu[riv].max()), mu[riv], n, noise.sigma, rng, threshold=threshold
                ),
                p_pass_if_as_measured=pass_rate(
                    float(mu[li]), mu[riv], n, noise.sigma, rng, threshold=threshold
                ),
                best_ratio_lo=math.exp(min(dr.values()) + bq[0] * se),
                best_ratio_hi=math.exp(min(dr.values()) + bq[1] * se),
                rival_log_ratios=dr,
            )
        )
    return noise, out


def passes_needed(
    ts: Sequence[Table],
    rivals: Callable[[str], bool],
    sigma: float,
    target: float = 0.8,
    seed: int = 0,
    threshold: float = THRESHOLD,
) -> int | None:
    """The fewest passes at which a lagged tying the best rival at every c passes the verdict
    at every c with probability >= target (cells independent), under noise sigma and the
    rivals' fitted means; None if MAX_PASSES do not suffice."""
    rng = np.random.default_rng(seed)
    means = []
    for t in ts:
        riv = [i for i, p in enumerate(t.policies) if rivals(p)]
        if riv:
            mu = fit(t)[0][riv]
            means.append(mu)
    if not means:
        return None
    n = 1
    while n <= MAX_PASSES:
        p = math.prod(
            pass_rate(float(m.max()), m, n, sigma, rng, draws=4000, threshold=threshold)
            for m in means
        )
        if p >= target:
            return n
        n = n + 1 if n < 8 else n * 2
    return None


def summary(
    raw: Sequence[dict[str, Any]],
    rivals: Callable[[str], bool],
    key: str = "output_throughput",
    keep: Callable[[str], bool] = _every,
    seed: int = 0,
) -> dict[str, Any]:
    """The verdict's noise report as plain data (the sweep's summary JSON, this module's CLI)."""
    ts = tables(raw, key, keep)
    noise, cells = assess(ts, rivals, seed=seed)
    if noise is None:
        return {}
    p_tie = math.prod(c.p_pass_if_tie for c in cells) if cells else math.nan
    p_meas = math.prod(c.p_pass_if_as_measured for c in cells) if cells else math.nan
    return {
        "key": key,
        "model": "log tok/s = policy + pass + N(0, sigma^2)",
        "sigma": noise.sigma,
        "dof": noise.dof,
        "per_concurrency": [asdict(c) for c in cells],
        "p_every_c_if_tie": p_tie,
        "p_every_c_if_as_measured": p_meas,
        "passes_for_tie_every_c_80pct": passes_needed(ts, rivals, noise.sigma, seed=seed),
    }


def pooled(reports: Sequence[dict[str, Any]], seed: int = 0) -> dict[int, dict[str, Any]]:
    """Per c and rival, the mean of log(lagged / rival) over several sweeps' reports, each run
    weighted by its passes (each pair's paired difference is unbiased, so pooling shrinks its
    error); then the rival lagged trails most, its ratio with a 90 % t interval, and a 90 %
    interval for the smallest lagged / rival over every rival (Bonferroni over the rivals).
    Pooling each run's own best rival instead keeps that choice's upward bias however many runs
    are pooled.

    One noise for every run: sigma^2 averaged over the runs' residual dof. Weighting each run
    by its own sigma instead let a two-pass run of two policies (one dof) whose residual came
    out small by chance outweigh the rest fifty-fold with a fourfold narrower interval (session
    68: c = 64 runs at 0.786, 1.085 and 0.944 pooled to 1.076 [1.054, 1.099]). Pool runs of one
    host: the shared sigma assumes one noise."""
    runs = [r for r in reports if r.get("dof")]
    dof = sum(int(r["dof"]) for r in runs)
    if dof == 0:
        return {}
    sigma = math.sqrt(sum(int(r["dof"]) * float(r["sigma"]) ** 2 for r in runs) / dof)
    acc: dict[int, dict[str, list[tuple[float, int]]]] = {}
    for rep in runs:
        for c in rep.get("per_concurrency", ()):
            per = acc.setdefault(c["concurrency"], {})
            for rival, x in c.get("rival_log_ratios", {}).items():
                per.setdefault(rival, []).append((x, int(c["passes"])))
    rng = np.random.default_rng(seed)
    t = float(_t_quantiles(dof, (0.95,), rng)[0])
    out: dict[int, dict[str, Any]] = {}
    for c, per in sorted(acc.items()):
        est = {}
        for rival, xs in per.items():
            n = sum(k for _, k in xs)  # the paired difference's variance is 2 sigma^2 / passes
            d = sum(k * x for x, k in xs) / n
            est[rival] = (d, sigma * math.sqrt(2.0 / n), len(xs))
        tb = float(_t_quantiles(dof, (1.0 - 0.05 / len(est),), rng)[0])
        rival, (d, se, count) = min(est.items(), key=lambda kv: kv[1][0])
        out[c] = {
            "runs": count,
            "rival": rival,
            "ratio": math.exp(d),
            "lo": math.exp(d - t * se),
            "hi": math.exp(d + t * se),
            "best_lo": math.exp(min(x - tb * s for x, s, _ in est.values())),
            "best_hi": math.exp(min(x + tb * s for x, s, _ in est.values())),
            "sigma": sigma,
            "dof": dof,
            "per_rival": {
                r: {"runs": k, "ratio": math.exp(x), "lo": math.exp(x - t * s)}
                | {"hi": math.exp(x + t * s)}
                for r, (x, s, k) in sorted(est.items())
            },
        }
    return out


def print_summary(s: dict[str, Any], title: str = "") -> None:
    if not s:
        print(f"{title}: too few passes or policies to fit the noise")
        return
    print(
        f"{title} noise sd {s['sigma']:.3f} (log tok/s per pass and policy, {s['dof']} dof); "
        "lagged / best rival, 90 % interval, 90 % interval of the smallest lagged / rival, "
        "P(verdict passes | tie), P(... | as measured):"
    )
    for c in s["per_concurrency"]:
        print(
            f"  c={c['concurrency']:<3d} {c['best_rival']:<10s} ratio {c['ratio']:.3f}  paired "
            f"{c['paired_ratio']:.3f} [{c['paired_ratio_lo']:.3f}, {c['paired_ratio_hi']:.3f}]  "
            f"every rival [{c['best_ratio_lo']:.3f}, {c['best_ratio_hi']:.3f}]  "
            f"tie {c['p_pass_if_tie']:.2f}  measured {c['p_pass_if_as_measured']:.2f}"
        )
    need = s["passes_for_tie_every_c_80pct"]
    print(
        f"  every c: P(pass | tie) {s['p_every_c_if_tie']:.3f}, P(pass | as measured) "
        f"{s['p_every_c_if_as_measured']:.3f}; passes for a tie to pass every c with 80 %: "
        f"{need if need is not None else f'> {MAX_PASSES}'}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    from dspark_sglang.bench.sweep import is_rival  # the goal's rivals are the sweep's rule

    ap = argparse.ArgumentParser(prog="python -m dspark_sglang.bench.verdict", description=__doc__)
    ap.add_argument("jsonl", nargs="+", type=Path, help="a sweep's per-pass records (NAME.jsonl)")
    ap.add_argument("--key", default="output_throughput", help="e.g. steady_output_throughput")
    ap.add_argument("--json", type=Path, help="write the reports as JSON here")
    ap.add_argument(
        "--pool",
        action="store_true",
        help="also pool lagged / every rival per c over every file given (weighted by passes, one "
        "noise pooled over the files: runs of one host)",
    )
    args = ap.parse_args(argv)
    reports = {}
    for path in args.jsonl:
        if not path.is_file():
            print(f"error: no such file: {path}", file=sys.stderr)
            return 2
        try:
            raw = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        except json.JSONDecodeError as e:
            print(f"error: {path}: not JSON lines ({e})", file=sys.stderr)
            return 2
        s = summary(raw, is_rival, args.key)
        print_summary(s, str(path.name))
        reports[str(path)] = s
    if args.pool:
        pool = pooled([r for r in reports.values() if r])
        first = next(iter(pool.values()), None)
        noise = f", noise sd {first['sigma']:.3f} over {first['dof']} dof" if first else ""
        print(
            f"pooled over {len(args.jsonl)} files{noise}, per rival: lagged / the rival it trails "
            "most (90 % interval), and the 90 % interval of the smallest lagged / rival"
        )
        for c, x in pool.items():
            print(
                f"  c={c:<3d} {x['rival']:<10s} {x['ratio']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}]"
                f"  every rival [{x['best_lo']:.3f}, {x['best_hi']:.3f}]  ({x['runs']} runs)"
            )
        reports["pooled"] = {str(c): x for c, x in pool.items()}
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
