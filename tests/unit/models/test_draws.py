from __future__ import annotations

import pytest
import torch

from dspark_sglang.algo.acceptance import inverse_cdf as verifier_inverse_cdf
from dspark_sglang.models.draws import inverse_cdf


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_draws_follow_the_distribution() -> None:
    p = torch.tensor([0.0, 0.5, 0.3, 0.0, 0.15, 0.05, 0.0])
    n = 60_000
    tok = inverse_cdf(p.expand(n, -1), torch.rand(n, generator=_gen(7)))
    counts = torch.bincount(tok, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0  # leading, inner and trailing zeros alike
    expected = p[p > 0].double() * n
    chi2 = ((counts[p > 0] - expected) ** 2 / expected).sum().item()
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_unnormalised_rows_and_the_ends_of_u() -> None:
    p = torch.tensor(
        [[0.0, 2.0, 0.0, 6.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0]]
    )
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    for u, want in (
        (0.0, [1, 0, 4]),
        (0.2499, [1, 0, 4]),
        (0.25, [3, 0, 4]),
        (below_one, [3, 0, 4]),
    ):
        assert inverse_cdf(p, torch.full((3,), float(u))).tolist() == want


@pytest.mark.parametrize("seed", range(5))
def test_the_drafters_and_the_verifiers_draws_agree(seed: int) -> None:
    g = _gen(seed)
    probs = torch.softmax(torch.randn(64, 4096, generator=g) * 3, -1)
    probs[:, ::7] = 0.0  # holes of zero mass
    u = torch.rand(64, generator=g)
    assert torch.equal(inverse_cdf(probs, u), verifier_inverse_cdf(probs, u))
