"""Weighted monotone (isotonic) least squares: the capacity fits smooth step times in B and R with
it, the survival calibration its map from predicted to realised survival. Pure numpy + stdlib."""

from __future__ import annotations

import numpy as np

Array = np.ndarray


def isotonic(y: Array, weights: Array | None = None) -> Array:
    """Weighted least-squares non-decreasing fit (pool adjacent violators): the monotone smoothing
    in B of DESIGN §4."""
    w_in = np.ones(len(y)) if weights is None else np.asarray(weights, np.float64)
    vals: list[float] = []
    wts: list[float] = []
    lens: list[int] = []
    for yi, wi in zip(np.asarray(y, np.float64).tolist(), w_in.tolist(), strict=True):
        vals.append(yi)
        wts.append(wi)
        lens.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v2, w2, n2 = vals.pop(), wts.pop(), lens.pop()
            v1, w1, n1 = vals.pop(), wts.pop(), lens.pop()
            vals.append((v1 * w1 + v2 * w2) / (w1 + w2))
            wts.append(w1 + w2)
            lens.append(n1 + n2)
    return np.repeat(np.asarray(vals), lens)
