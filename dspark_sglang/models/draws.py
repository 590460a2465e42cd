"""Token draws by inverse transform, one uniform per draw (the drafter's and the sampler's);
imports nothing from the package.

The same rule as `algo.acceptance.inverse_cdf` (the verifier's bonus draw), kept here because
`models` may import only `config`; tests/unit/models/test_draws.py holds the two to the same
tokens. It replaced the exponential race (argmax p / E, E ~ Exp(1)), which needs V noise draws per
token: on the project's CPU (Zen 4, torch 2.14.1, one thread) `Tensor.exponential_` took 19 ns an
element, so a 64-request drafting pass at T = 1 spent 35 ms on the noise of its [7, 4096] blocks,
more than the rest of the drafter (docs/engine.md "Sampling and reproducibility").
"""

from __future__ import annotations

import torch


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, V] unnormalised probabilities, [N] U[0, 1) -> [N] int64: the first token whose
    cumulative mass exceeds u times the row's. float64 sums (exact to ~1e-13 of a token's
    probability); a token of mass 0 is never drawn (its cumulative mass equals its
    predecessor's, and u < 1 keeps the draw below the row's total)."""
    cdf = probs.double().cumsum(dim=-1)
    x = u.double() * cdf[:, -1]
    idx = torch.searchsorted(cdf, x[:, None], right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)
