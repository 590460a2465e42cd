"""Calibration metrics and STS fitting on synthetic rounds with known temperatures."""

from __future__ import annotations

import numpy as np

from dspark_sglang.algo.calibrate import auroc, brier, ece, fit_sts, position_metrics, survival


def synthetic_rounds(true_t: np.ndarray, n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Confidence logits whose *true* conditional acceptance is sigmoid(logit / true_t[k])."""
    rng = np.random.default_rng(seed)
    g = len(true_t)
    logits = rng.normal(0.5, 2.0, size=(n, g))
    p_cond = 1.0 / (1.0 + np.exp(-logits / true_t[None, :]))
    ok = rng.random((n, g)) < p_cond
    num_accepted = np.cumprod(ok, axis=1).sum(axis=1)
    return logits, np.full(n, g), num_accepted


def test_ece_auroc_brier_on_known_inputs() -> None:
    pred = np.array([0.1, 0.1, 0.9, 0.9])
    label = np.array([0.0, 0.0, 1.0, 1.0])
    assert abs(ece(pred, label) - 0.1) < 1e-12
    assert auroc(pred, label) == 1.0
    assert abs(brier(pred, label) - 0.01) < 1e-12
    assert auroc(np.array([0.5, 0.5]), np.array([1.0, 0.0])) == 0.5  # ties count one half
    assert abs(ece(np.array([0.3, 0.3]), np.array([1.0, 0.0])) - 0.2) < 1e-12


def test_sts_recovers_known_temperatures() -> None:
    true_t = np.array([2.0, 0.5, 1.0, 3.0])
    logits, lens, acc = synthetic_rounds(true_t, 60_000)
    temps = fit_sts(logits, lens, acc)
    assert np.allclose(temps, true_t, rtol=0.12), temps
    raw = position_metrics(logits, lens, acc)
    fitted = position_metrics(logits, lens, acc, temps)
    assert all(f.ece < 0.015 for f in fitted)
    assert max(r.ece for r in raw) > 3 * max(f.ece for f in fitted)
    # T_1 is monotone, so position 1's ranking is untouched; later cumulative products mix
    # several temperatures and may reorder a little.
    assert abs(raw[0].auroc - fitted[0].auroc) < 1e-12
    assert all(abs(r.auroc - f.auroc) < 0.05 for r, f in zip(raw, fitted, strict=True))


def test_only_verified_positions_are_scored() -> None:
    logits = np.zeros((3, 2))
    lens = np.array([0, 1, 2])
    acc = np.array([0, 1, 1])
    m = position_metrics(logits, lens, acc)
    assert [x.count for x in m] == [2, 1]
    assert survival(logits)[0].tolist() == [0.5, 0.25]
