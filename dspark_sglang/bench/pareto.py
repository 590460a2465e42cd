"""Throughput vs per-user tok/s frontiers (paper Fig. 7), matched-throughput speed-ups, SLA
anchors, and the Fig. 7 / Fig. 8 plots shared by `bench.sweep` and `bench.simulate`."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

Point = tuple[float, float]  # (per-user tok/s, output throughput tok/s)


def frontier(points: Iterable[Point]) -> list[Point]:
    """The Pareto frontier (no other point has both more tok/s/user and more throughput),
    sorted by per-user tok/s ascending, so throughput is descending along it."""
    pts = sorted({(float(u), float(t)) for u, t in points}, key=lambda p: (-p[0], -p[1]))
    out: list[Point] = []
    best = -np.inf
    for u, t in pts:  # from the fastest user speed down: keep strict throughput improvements
        if t > best:
            out.append((u, t))
            best = t
    return out[::-1]


def tps_at_throughput(front: Sequence[Point], throughput: float) -> float | None:
    """Per-user tok/s the frontier offers at a given throughput (linear between its points);
    None outside its throughput range."""
    if not front:
        return None
    thr = np.array([t for _, t in front])[::-1]  # ascending
    tps = np.array([u for u, _ in front])[::-1]
    if throughput < thr[0] - 1e-9 or throughput > thr[-1] + 1e-9:
        return None
    return float(np.interp(throughput, thr, tps))


def throughput_at_sla(front: Sequence[Point], min_tps: float) -> float | None:
    """Most throughput along the frontier with per-user tok/s >= min_tps (interpolated at the
    crossing); None when no point meets the SLA."""
    if not front:
        return None
    tps = np.array([u for u, _ in front])
    thr = np.array([t for _, t in front])
    if tps.max() < min_tps:
        return None
    if tps.min() >= min_tps:
        return float(thr.max())
    return float(np.interp(min_tps, tps, thr))


def matched_speedups(base: Sequence[Point], other: Sequence[Point]) -> list[dict[str, float]]:
    """At each throughput of the base frontier that the other frontier also reaches: the
    per-user tok/s of both and their ratio (the paper's "at matched throughput")."""
    out = []
    for u, t in base:
        v = tps_at_throughput(other, t)
        if v is not None and u > 0:
            out.append({"throughput": t, "base_tps": u, "tps": v, "speedup": v / u})
    return out


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys and not isinstance(r[k], list | dict)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(
    path: Path,
    series: Mapping[str, Sequence[Point]],
    title: str,
    anchors: Sequence[float] = (),
    throughput_label: str = "output throughput (tok/s)",
) -> None:
    """Paper Fig. 7: throughput against per-user tok/s, points and their frontier."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in series.items():
        if not pts:
            continue
        (line,) = ax.plot(*zip(*frontier(pts), strict=True), "-", lw=1.5, label=name)
        ax.plot(*zip(*pts, strict=True), "o", ms=4, color=line.get_color(), alpha=0.6)
    for a in anchors:
        ax.axvline(a, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("per-user generation speed (tok/s/user)")
    ax.set_ylabel(throughput_label)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_load(
    path: Path,
    rows: Sequence[Mapping[str, Any]],
    policies: Sequence[str],
    title: str,
    x: str = "concurrency",
    throughput: str = "output_throughput",
    budget: str = "verify_tokens_per_request",
) -> None:
    """Paper Fig. 8: throughput (top) and verify tokens per request per step (bottom) vs load."""
    plt = _plt()
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for p in policies:
        pts = sorted((r[x], r[throughput], r.get(budget)) for r in rows if r["policy"] == p)
        if not pts:
            continue
        xs = [q[0] for q in pts]
        a.plot(xs, [q[1] for q in pts], "o-", ms=3, label=p)
        if any(q[2] is not None for q in pts):
            b.plot(xs, [np.nan if q[2] is None else q[2] for q in pts], "o-", ms=3, label=p)
    a.set_ylabel("output throughput (tok/s)")
    b.set_ylabel("verify tokens / request / step")
    b.set_xlabel("concurrent requests")
    a.set_xscale("log", base=2)
    a.set_title(title)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
