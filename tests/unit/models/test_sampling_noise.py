from __future__ import annotations

import math

import torch

from dspark_sglang.models.sampling_noise import exponentials_


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_draws_follow_exp1() -> None:
    e = exponentials_(torch.empty(200_000), _gen(3)).double()
    assert bool((e > 0).all())
    n = e.numel()
    # mean and variance of Exp(1) are 1: 5 standard errors
    assert abs(e.mean().item() - 1.0) < 5 * (1.0 / math.sqrt(n))
    assert abs(e.var().item() - 1.0) < 5 * math.sqrt(8.0 / n)
    # Kolmogorov-Smirnov distance to 1 - exp(-x); 1.95 / sqrt(n) is the 0.1 % critical value
    x, _ = torch.sort(e)
    cdf = 1.0 - torch.exp(-x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = torch.maximum(i / n - cdf, cdf - (i - 1) / n).max().item()
    assert d < 1.95 / math.sqrt(n)


def test_one_uniform_per_element_and_seeded() -> None:
    a, b = _gen(11), _gen(11)
    first = exponentials_(torch.empty(7, 33), a)
    assert torch.equal(first, exponentials_(torch.empty(7, 33), b))
    ref = _gen(11)
    torch.empty(7 * 33).uniform_(generator=ref)
    assert torch.equal(a.get_state(), ref.get_state())  # the stream advanced by exactly 231 draws
    assert not torch.equal(first, exponentials_(torch.empty(7, 33), a))


def test_race_draws_from_p() -> None:
    # argmax(p / E) over many rows reproduces p: what the sampler and the drafter rely on
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    e = exponentials_(torch.empty(n, p.numel()), _gen(7))
    tok = torch.where(p > 0, p / e, -1.0).argmax(dim=-1)
    counts = torch.bincount(tok, minlength=p.numel()).double()
    assert counts[-1] == 0
    expected = p[:-1].double() * n
    chi2 = ((counts[:-1] - expected) ** 2 / expected).sum().item()
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001
