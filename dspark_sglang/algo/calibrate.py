"""Confidence calibration from round records: ECE / AUROC / Brier and STS fitting (paper §3.2.1).

Pure numpy: arrays in, numbers out; no I/O, no engine. Conventions follow deepspec_spec.md §4.4:
position k of a round is scored when it was verified (k < l); its prediction is the prefix survival
prod_{i<=k} sigmoid(logit_i / T_i) and its label is 1 iff drafts 0..k were all accepted (n > k).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ECE_BINS = 20
DEFAULT_GRID = np.exp(np.linspace(np.log(0.25), np.log(8.0), 61))


def ece(pred: np.ndarray, label: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error over equal-width bins, weighted by bin count."""
    if pred.size == 0:
        return 0.0
    idx = np.minimum((pred * bins).astype(np.int64), bins - 1)
    count = np.bincount(idx, minlength=bins)
    gap = np.abs(np.bincount(idx, pred, bins) - np.bincount(idx, label, bins))
    return float(gap.sum() / count.sum())


def auroc(pred: np.ndarray, label: np.ndarray) -> float:
    """Probability a positive outranks a negative (ties count one half); nan if one class."""
    pos, neg = pred[label > 0.5], pred[label <= 0.5]
    if pos.size == 0 or neg.size == 0:
        return float("nan")
    allv = np.concatenate([pos, neg])
    order = np.argsort(allv, kind="stable")
    ranks = np.empty(allv.size)
    sorted_v = allv[order]
    # average ranks over ties
    _, first, counts = np.unique(sorted_v, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[: pos.size].sum() - pos.size * (pos.size + 1) / 2) / (pos.size * neg.size))


def brier(pred: np.ndarray, label: np.ndarray) -> float:
    return float(np.mean((pred - label) ** 2)) if pred.size else 0.0


def survival(conf_logits: np.ndarray, temperatures: np.ndarray | None = None) -> np.ndarray:
    """[N, g] logits -> prefix survival prod_{i<=k} sigmoid(logit_i / T_i)."""
    t = np.ones(conf_logits.shape[1]) if temperatures is None else np.asarray(temperatures)
    return np.cumprod(1.0 / (1.0 + np.exp(-conf_logits / t[None, :])), axis=1)


def scored(
    surv: np.ndarray, verify_lens: np.ndarray, num_accepted: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """(pred, label) at position k (0-based) over the rounds that verified it."""
    rows = verify_lens > k
    return surv[rows, k], (num_accepted[rows] > k).astype(np.float64)


@dataclass(frozen=True)
class PositionMetrics:
    count: int
    ece: float
    auroc: float
    brier: float
    mean_pred: float
    mean_label: float


def position_metrics(
    conf_logits: np.ndarray,
    verify_lens: np.ndarray,
    num_accepted: np.ndarray,
    temperatures: np.ndarray | None = None,
) -> list[PositionMetrics]:
    surv = survival(conf_logits, temperatures)
    out = []
    for k in range(conf_logits.shape[1]):
        p, y = scored(surv, verify_lens, num_accepted, k)
        out.append(
            PositionMetrics(
                count=int(p.size),
                ece=ece(p, y),
                auroc=auroc(p, y),
                brier=brier(p, y),
                mean_pred=float(p.mean()) if p.size else float("nan"),
                mean_label=float(y.mean()) if y.size else float("nan"),
            )
        )
    return out


def fit_sts(
    conf_logits: np.ndarray,
    verify_lens: np.ndarray,
    num_accepted: np.ndarray,
    grid: np.ndarray = DEFAULT_GRID,
) -> np.ndarray:
    """Sequential Temperature Scaling (paper §3.2.1): for k = 1..g in order, pick T_k from `grid`
    minimising the ECE of the cumulative product at k, with T_1..T_{k-1} fixed. Temperatures keep
    each position's ranking (monotone), so only calibration changes. Positions never verified keep
    T = 1."""
    g = conf_logits.shape[1]
    temps = np.ones(g)
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))
    prefix = np.ones(conf_logits.shape[0])
    for k in range(g):
        rows = verify_lens > k
        if rows.any():
            y = (num_accepted[rows] > k).astype(np.float64)
            errs = [ece(prefix[rows] * sig(conf_logits[rows, k] / t), y) for t in grid]
            temps[k] = float(grid[int(np.argmin(errs))])
        prefix = prefix * sig(conf_logits[:, k] / temps[k])
    return temps
